"""The handshake, the checksum trailer and the final all-ranks status, over real gloo groups.

As in test_groups, the multi-process scenarios share one spawned run (every rank plays them in order, each
on its own port) and the tests assert on what each rank recorded.
"""

from __future__ import annotations

import pytest
import torch
from mp_utils import gloo_spec

from refit_app.common.errors import HandshakeError, PeerError, SinkError
from refit_app.core.meta import TensorMeta
from refit_app.protocol.handshake import (
    accept_manifest,
    ack,
    check_settings,
    finish,
    recv_checksums,
    recv_manifest,
    send_checksums,
    send_manifest,
)
from refit_app.protocol.manifest import Manifest
from refit_app.transport.groups import connect

MiB = 1 << 20
TIMEOUT_S = 10.0


def _manifest(**overrides) -> Manifest:
    fields = dict(
        tensors=[
            TensorMeta("embed.weight", (16, 8), torch.bfloat16, "model-00001-of-00002.safetensors"),
            TensorMeta("layers.0.scale", (), torch.float32, "model-00002-of-00002.safetensors"),
            TensorMeta("layers.0.mask", (0, 3), torch.bool),
        ],
        buffer_size_bytes=64 * MiB,
        use_legacy_packing=False,
        checksums=True,
        metadata={"format": "pt"},
        source="synthetic:tiny",
    )
    fields.update(overrides)
    return Manifest(**fields)


class _FutureManifest(Manifest):
    """What a newer producer would send."""

    def to_bytes(self) -> bytes:
        return b'{"version": 99}'


def _connect(rank: int, port: int):
    return connect(gloo_spec(rank, SCENARIO_RANKS, port, timeout_s=TIMEOUT_S))


# --- scenarios ---------------------------------------------------------------------------------------------


def _round_trip(rank: int, port: int):
    crcs = [0, 1, 0xFFFFFFFF]
    with _connect(rank, port) as rg:
        if rank == 0:
            send_manifest(rg, _manifest())
            send_checksums(rg, crcs)
            send_checksums(rg, [])
            received, trailer, empty = _manifest(), crcs, []
        elif rank == 1:
            # The step-by-step consumer path, with explicit settings that agree with the producer's.
            received = recv_manifest(rg)
            check_settings(received, buffer_size_bytes=64 * MiB, use_legacy_packing=False)
            ack(rg, None)
            trailer, empty = recv_checksums(rg, 3), recv_checksums(rg, 0)
        else:
            received = accept_manifest(rg)  # settings left unset: adopt the producer's
            trailer, empty = recv_checksums(rg, 3), recv_checksums(rg, 0)
        finish(rg, None)
        return received.to_bytes(), trailer, empty


def _settings_mismatch(rank: int, port: int):
    with _connect(rank, port) as rg:
        if rank == 0:
            send_manifest(rg, _manifest())
        elif rank == 1:
            accept_manifest(rg)
        else:
            accept_manifest(rg, buffer_size_bytes=32 * MiB, use_legacy_packing=True)
        return "accepted"


def _unreadable_manifest(rank: int, port: int):
    with _connect(rank, port) as rg:
        if rank == 0:
            send_manifest(rg, _FutureManifest(tensors=[], buffer_size_bytes=MiB, use_legacy_packing=False))
        else:
            accept_manifest(rg)
        return "accepted"


def _consumer_fails_after_handshake(rank: int, port: int):
    with _connect(rank, port) as rg:
        if rank == 0:
            send_manifest(rg, _manifest())
        else:
            accept_manifest(rg)
        if rank == 2:
            reason = "sink.path '/ro/out' is not writable"
            finish(rg, reason)
            raise SinkError(reason)
        finish(rg, None)
        return "finished"


SCENARIOS = {
    "round_trip": _round_trip,
    "settings_mismatch": _settings_mismatch,
    "unreadable_manifest": _unreadable_manifest,
    "consumer_fails_after_handshake": _consumer_fails_after_handshake,
}
"""Played once on SCENARIO_RANKS ranks by the ``played`` fixture (conftest.py)."""
SCENARIO_RANKS = 3


def test_manifest_and_checksums_reach_every_consumer(played):
    for rank in range(3):
        manifest_bytes, trailer, empty = played[rank]["round_trip"]
        assert Manifest.from_bytes(manifest_bytes) == _manifest()
        assert trailer == [0, 1, 0xFFFFFFFF]
        assert empty == []


def test_settings_mismatch_stops_every_rank_naming_both_values(played):
    expected = (
        "refit.buffer_size_bytes differs: producer 64 MiB (67108864), this consumer 32 MiB (33554432); "
        "refit.use_legacy_packing differs: producer false, this consumer true; "
        "leave them unset on consumers to adopt the producer's"
    )
    assert str(played[2]["settings_mismatch"]) == expected
    for rank in (0, 1):  # the producer and the consumer that agreed stop too, with the reason
        error = played[rank]["settings_mismatch"]
        assert isinstance(error, HandshakeError), (rank, error)
        assert str(error) == f"rank 2 failed: {expected}"


def test_unreadable_manifest_stops_the_producer_too(played):
    for rank in range(3):
        error = played[rank]["unreadable_manifest"]
        assert isinstance(error, HandshakeError), (rank, error)
        assert "manifest version 99 from the producer" in str(error)


def test_a_consumer_failing_after_the_handshake_fails_every_rank(played):
    for rank in (0, 1):
        error = played[rank]["consumer_fails_after_handshake"]
        assert isinstance(error, PeerError), (rank, error)
        assert str(error) == "rank 2 failed: sink.path '/ro/out' is not writable"
    own = played[2]["consumer_fails_after_handshake"]
    assert isinstance(own, SinkError) and str(own) == "sink.path '/ro/out' is not writable", own


# --- settings checks without processes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "buffer_size_bytes, use_legacy_packing", [(None, None), (64 * MiB, None), (None, False), (64 * MiB, False)]
)
def test_unset_or_agreeing_settings_pass(buffer_size_bytes, use_legacy_packing):
    check_settings(_manifest(), buffer_size_bytes=buffer_size_bytes, use_legacy_packing=use_legacy_packing)


def test_buffer_size_mismatch_names_both_values():
    with pytest.raises(HandshakeError) as info:
        check_settings(_manifest(), buffer_size_bytes=32 * MiB, use_legacy_packing=None)
    assert str(info.value) == (
        "refit.buffer_size_bytes differs: producer 64 MiB (67108864), this consumer 32 MiB (33554432); "
        "leave it unset on consumers to adopt the producer's"
    )


def test_packing_mismatch_names_both_values():
    with pytest.raises(HandshakeError, match=r"refit\.use_legacy_packing differs: producer true, this consumer false"):
        check_settings(_manifest(use_legacy_packing=True), buffer_size_bytes=None, use_legacy_packing=False)


def test_odd_buffer_sizes_still_show_exact_bytes():
    with pytest.raises(HandshakeError, match=r"producer 1.5 MiB \(1572864\), this consumer 1000 B \(1000\)"):
        check_settings(_manifest(buffer_size_bytes=3 * MiB // 2), buffer_size_bytes=1000, use_legacy_packing=None)
