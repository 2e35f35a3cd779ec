"""The checksum algorithm over real gloo groups: named in the manifest, refused at the handshake by a consumer that
cannot compute it, and carried bit for bit in the int64 trailer (a 64-bit hash uses the sign bit)."""

from __future__ import annotations

import sys

import torch
from conditions import needs_xxhash
from mp_utils import RankFailure, gloo_spec, run_ranks
from tensor_utils import tensor_checksum

from refit_app.protocol.checksum import available_algorithms
from refit_app.protocol.handshake import recv_checksums, send_checksums
from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.groups import connect

TIMEOUT_S = 30.0
BUFFER = 4096
WIDE = [0, 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 0x8000_0000_DEAD_BEEF]
"""Checksums on both sides of every sign boundary of the int64 trailer."""


def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("w", torch.randn(64, 32, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16))]


def _trailer(rank: int, world_size: int, port: int) -> list[int]:
    with connect(gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            send_checksums(rg, WIDE)
            return WIDE
        return recv_checksums(rg, len(WIDE))


def test_trailer_carries_unsigned_64_bit_checksums_exactly():
    for received in run_ranks(_trailer, 2, timeout=60):
        assert received == WIDE


def _every_algorithm(rank: int, world_size: int, port: int) -> list:
    """One session per algorithm this host has, one after another over one group; consumers verify."""
    out = []
    with connect(gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S)) as rg:
        for algorithm in available_algorithms():
            if rank == 0:
                with ProducerSession(rg, buffer_size_bytes=BUFFER, checksum_algorithm=algorithm) as session:
                    r = session.send(_weights())
                out.append((session.manifest.checksum_algorithm, r.checksums))
                continue
            session = ConsumerSession(rg, verify=True)
            r = session.receive(lambda batch: None)
            assert session.receive(lambda batch: None) is None
            out.append((session.manifest.checksum_algorithm, r.verified, r.checksums))
    return out


def test_every_installed_algorithm_verifies_end_to_end():
    producer, consumer = run_ranks(_every_algorithm, 2, timeout=120)
    assert [a for a, _ in producer] == available_algorithms()
    assert len(consumer) == len(producer), consumer
    for (algorithm, sent), (named, verified, received) in zip(producer, consumer):
        assert named == algorithm and verified is True
        assert sent == received == [tensor_checksum(t, algorithm) for _, t in _weights()]


def _consumer_lacks_xxhash(rank: int, world_size: int, port: int) -> None:
    with connect(gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            with ProducerSession(rg, buffer_size_bytes=BUFFER, checksum_algorithm="xxh3_64") as session:
                session.send(_weights())
            return
        sys.modules["xxhash"] = None  # as on a host without the package: importing it raises ImportError
        session = ConsumerSession(rg, verify=True)
        session.receive(lambda batch: None)


@needs_xxhash
def test_a_consumer_without_the_producers_algorithm_refuses_at_the_handshake():
    outcomes = run_ranks(_consumer_lacks_xxhash, 2, timeout=60, return_exceptions=True)
    for outcome in outcomes:
        assert isinstance(outcome, RankFailure), outcome
        assert "checksums with xxh3_64, which this host cannot compute: pip install xxhash" in outcome.message, outcome


def test_checksum_all_equals_each_buffers_own_checksum_on_two_threads():
    # A list large enough for two threads, with buffers of one piece, of several and of none, so that the split
    # between the threads falls inside a large buffer's pieces.
    from refit_app.protocol.checksum import PIECE_BYTES, checksum_all, checksum_function

    g = torch.Generator().manual_seed(0)
    sizes = (0, 17, 3 << 20, PIECE_BYTES + 1, 4 * PIECE_BYTES + 3, 5)
    buffers = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy() for n in sizes]
    for name in available_algorithms():
        want = [checksum_function(name)(b) for b in buffers]
        assert checksum_all(name, buffers) == want, name
        assert checksum_all(name, buffers[:3]) == want[:3], name  # under the two-thread size: one thread
