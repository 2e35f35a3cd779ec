"""What producer and consumers agree on before tensors move, and how they agree that a refit finished.

Sequence, over one :class:`~refit_app.transport.groups.RefitGroup`::

    producer                                  consumer
    send_manifest(rg, m)  --- length, bytes --> recv_manifest(rg)
                                                accept_manifest(rg, ...)  (check, prepare)
        gather "handshake" <--- report -------- ack(rg, error)
    ... packed broadcast of the data ...
    send_checksums(rg, crcs) --- trailer -----> recv_checksums(rg, n)
    finish(rg, error)      <--- "done" ------> finish(rg, error)

A consumer that rejects the manifest makes every rank stop before any tensor moves, each naming the setting
and both values; ``finish`` makes sure no rank reports success for a refit that did not fully happen. With
``group.token`` the manifest and each checksum trailer carry the run's signature (:mod:`refit_app.transport.auth`),
which a
consumer checks before it believes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from refit_app.common.errors import HandshakeError, RefitError
from refit_app.common.sizes import format_size
from refit_app.protocol.manifest import Manifest
from refit_app.transport.auth import MAC_BYTES
from refit_app.transport.groups import RefitGroup
from refit_app.transport.spec import PRODUCER_RANK

logger = logging.getLogger(__name__)

MAX_MANIFEST_BYTES = 1 << 30
"""A length beyond this is not a manifest: the peer is not a refit_app producer or the stream is out of step."""

HANDSHAKE = "handshake"
DONE = "done"
_MANIFEST = "manifest"
_CHECKSUMS = "checksums"
"""What the run's key signs the manifest and each checksum trailer as (:meth:`refit_app.transport.auth.RunAuth.mac`)."""


def send_manifest(rg: RefitGroup, manifest: Manifest) -> None:
    """Producer: send the manifest to every consumer and wait until all of them accepted it."""
    # Signed with the run's key (nothing without a token): only this run's producer can make a consumer prepare.
    data = manifest.to_bytes()
    data += rg.control.auth.mac(_MANIFEST, data)
    length = torch.tensor([len(data)], dtype=torch.int64, device=rg.group.device)
    rg.group.broadcast(length, PRODUCER_RANK)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(rg.group.device)
    rg.group.broadcast(payload, PRODUCER_RANK)
    rg.control.report(HANDSHAKE, None)
    rg.control.gather(HANDSHAKE, error_type=HandshakeError)
    logger.info(
        "rank %d: %d consumer(s) accepted the manifest (%d tensors, %d bytes)",
        rg.rank,
        rg.world_size - 1,
        len(manifest.tensors),
        manifest.total_bytes,
    )


def recv_manifest(rg: RefitGroup) -> Manifest:
    """Consumer: receive the producer's manifest.

    A manifest this consumer cannot read is reported to every rank here (and raised), so the caller
    must not ``ack`` after an exception from this function.
    """
    length = torch.empty(1, dtype=torch.int64, device=rg.group.device)
    rg.group.broadcast(length, PRODUCER_RANK)
    n = int(length.item())
    if not 0 < n <= MAX_MANIFEST_BYTES:
        error = HandshakeError(
            f"the producer announced a manifest of {n} bytes (expected 1..{MAX_MANIFEST_BYTES}); "
            "is the process at group.host/group.port a refit_app producer of the same version?"
        )
        rg.control.report(HANDSHAKE, str(error))
        raise error
    payload = torch.empty(n, dtype=torch.uint8, device=rg.group.device)
    rg.group.broadcast(payload, PRODUCER_RANK)
    data = payload.cpu().numpy().tobytes()
    try:
        if rg.control.auth.signed:
            data, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
            if len(mac) < MAC_BYTES or not rg.control.auth.check_mac(_MANIFEST, data, mac):
                raise HandshakeError("the producer's manifest is not signed with this run's key; refusing it")
        return Manifest.from_bytes(data)
    except HandshakeError as e:
        rg.control.report(HANDSHAKE, str(e))
        raise


def check_settings(
    manifest: Manifest, *, buffer_size_bytes: int | None, use_legacy_packing: bool | None, rounds: int | None = None
) -> None:
    """Refuse explicit consumer settings that disagree with the producer's; ``None`` adopts the producer's.

    Both sides must cut the stream into the same chunks, so a mismatch would corrupt or hang the transfer; a
    consumer that expects another number of rounds than the producer sends would be silently overruled. All
    disagreeing settings are listed at once.
    """
    differences = []
    if buffer_size_bytes is not None and buffer_size_bytes != manifest.buffer_size_bytes:
        differences.append(
            "refit.buffer_size_bytes differs: producer "
            f"{format_size(manifest.buffer_size_bytes)} ({manifest.buffer_size_bytes}), "
            f"this consumer {format_size(buffer_size_bytes)} ({buffer_size_bytes})"
        )
    if use_legacy_packing is not None and use_legacy_packing != manifest.use_legacy_packing:
        differences.append(
            "refit.use_legacy_packing differs: producer "
            f"{str(manifest.use_legacy_packing).lower()}, this consumer {str(use_legacy_packing).lower()}"
        )
    if rounds is not None and rounds != manifest.rounds:
        sent = "open-ended (its session sets no number of rounds)" if manifest.rounds is None else manifest.rounds
        differences.append(f"refit.rounds differs: producer {sent}, this consumer {rounds}")
    if differences:
        pronoun = "it" if len(differences) == 1 else "them"
        raise HandshakeError("; ".join(differences) + f"; leave {pronoun} unset on consumers to adopt the producer's")


def ack(rg: RefitGroup, error: str | None) -> None:
    """Consumer: report whether it accepts the manifest; with ``error=None`` wait until every rank did.

    With an error this only reports it (the caller raises its own exception): the producer and the other
    consumers then stop with this reason.
    """
    rg.control.report(HANDSHAKE, error)
    if error is None:
        rg.control.gather(HANDSHAKE, error_type=HandshakeError)


def accept_manifest(
    rg: RefitGroup,
    *,
    buffer_size_bytes: int | None = None,
    use_legacy_packing: bool | None = None,
    rounds: int | None = None,
    prepare: Callable[[Manifest], None] | None = None,
) -> Manifest:
    """Consumer: receive, check and acknowledge the manifest in one call.

    ``prepare`` (a sink's ``begin``, say) runs on the accepted manifest before the acknowledgement: whatever it
    raises is reported to every rank as this consumer's refusal, so nobody starts a transfer that cannot land.
    """
    manifest = recv_manifest(rg)
    try:
        check_settings(
            manifest, buffer_size_bytes=buffer_size_bytes, use_legacy_packing=use_legacy_packing, rounds=rounds
        )
        if prepare is not None:
            prepare(manifest)
    except RefitError as e:
        ack(rg, str(e))
        raise
    ack(rg, None)
    return manifest


def send_checksums(rg: RefitGroup, checksums: list[int]) -> None:
    """Producer: send one checksum per tensor after the data, in manifest order.

    Checksums are unsigned 64-bit (xxh3_64 uses the top bit), the trailer is int64 (what every backend
    broadcasts): the bits travel reinterpreted, never converted, so a value of 2**63 or more survives.
    """
    if checksums:
        words = np.array(checksums, dtype=np.uint64).view(np.int64)
        mac = rg.control.auth.mac(_CHECKSUMS, words.tobytes())
        if mac:
            words = np.concatenate([words, np.frombuffer(mac, dtype=np.int64)])
        rg.group.broadcast(torch.from_numpy(words).to(rg.group.device), PRODUCER_RANK)


def recv_checksums(rg: RefitGroup, n: int) -> list[int]:
    """Consumer: receive the ``n`` checksums the producer sends after the data, as unsigned integers."""
    if n == 0:
        return []
    auth = rg.control.auth
    trailer = torch.empty(n + (MAC_BYTES // 8 if auth.signed else 0), dtype=torch.int64, device=rg.group.device)
    rg.group.broadcast(trailer, PRODUCER_RANK)
    words = trailer.cpu().numpy()
    if auth.signed and not auth.check_mac(_CHECKSUMS, words[:n].tobytes(), words[n:].tobytes()):
        raise HandshakeError("the producer's checksums are not signed with this run's key; refusing them")
    return words[:n].view(np.uint64).tolist()


def finish(rg: RefitGroup, error: str | None) -> None:
    """Every rank: report how the refit ended here; with ``error=None`` wait for all and raise on any failure.

    Call it on every rank, from success and failure paths alike. With an error it only reports (the caller
    raises its own exception); without one it raises :class:`~refit_app.common.errors.PeerError` carrying the
    failing rank's reason, so no rank reports success for a refit that did not fully happen.
    """
    rg.control.report(DONE, error)
    if error is None:
        rg.control.gather(DONE)
