"""What producer and consumers say to each other over a connected group: the manifest of tensors and settings,
the handshake that checks it, per-tensor checksums and their verification, and sessions that run many refits
(rounds) over one group.

Rooms: :mod:`refit_app.protocol.delta` (delta rounds: only the changed elements, a package; start at its
``__init__``) and :mod:`refit_app.protocol.elastic` (sessions that go on when consumers come and go). A new
transfer mode goes in a room of its own here, used by the sessions (:mod:`~refit_app.protocol.producer_session`,
:mod:`~refit_app.protocol.consumer_session`).

Imports only :mod:`refit_app.common`, :mod:`refit_app.core`, :mod:`refit_app.packed_tensor` and
:mod:`refit_app.transport`.
"""

from typing import Any

_EXPORTS = {
    "ProducerSession": "refit_app.protocol.session",
    "ConsumerSession": "refit_app.protocol.session",
    "Round": "refit_app.protocol.session",
    "Manifest": "refit_app.protocol.manifest",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
