"""The run's store as a collective backend sees it: gloo sets itself up through the store, so where the run has a key
(``group.token``) every value it writes there is signed and every value it reads is checked (see
:class:`SignedStore`). The rendezvous (:mod:`refit_app.transport.rendezvous`) has already checked each rank in;
this guards what the backend does on the same store afterwards."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from refit_app.transport.auth import MAC_BYTES, RunAuth


class SignedStore(dist.Store):
    """The run's store as a collective backend sees it, every value signed with the run's key.

    Gloo publishes each rank's listening address in the store and connects to what it reads there; a client that
    lists the store could overwrite one and have the producer connect to it instead. Here a value that does not
    check fails the backend's set-up (a denial of service at worst, never a stranger in the group). Gloo uses
    ``set``, ``get`` and ``wait``; the rest passes through.
    """

    def __init__(self, store: dist.Store, auth: RunAuth) -> None:
        super().__init__()
        self._store = store
        self._auth = auth

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._store.set(key, data + self._auth.mac("store:" + key, data))

    def get(self, key: str) -> bytes:
        raw = self._store.get(key)
        data, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
        if len(raw) < MAC_BYTES or not self._auth.check_mac("store:" + key, data, mac):
            raise RuntimeError(
                f"the backend's set-up record {key!r} is not signed with this run's key: a client that is not one "
                "of this run's ranks overwrote it"
            )
        return data

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)


def backend_store(store: dist.Store, auth: RunAuth, backend: str) -> dist.Store:
    """The store ``backend`` sets itself up through: gloo's records signed where the run has a key."""
    return SignedStore(store, auth) if auth.signed and backend == "gloo" else store
