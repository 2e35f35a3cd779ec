"""Checksums computed while the data moves: the producer hashes each chunk's tensors once the chunk's broadcast has
started, a verifying consumer hashes each batch while the next chunk is received. Every round is still checked bit
for bit, over real gloo groups, and a corrupted tensor in a later round is named with that round."""

from __future__ import annotations

import pytest
import torch
from mp_utils import RankFailure, gloo_spec, run_ranks
from tensor_utils import tensor_checksum

from refit_app.common.errors import VerificationError
from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.groups import connect

TIMEOUT_S = 30.0
BUFFER = 4096
"""Small buffers: several chunks per round, each hashed while the next one moves."""
ROUNDS = 4
BAD_ROUND = 3


def _weights(round_index: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(round_index)
    return [
        ("embed", torch.randn(64, 32, generator=g)),  # 8 KiB: a chunk of its own, first in the round
        ("norm", torch.randn(32, generator=g).to(torch.bfloat16)),
        ("proj", torch.randn(40, 40, generator=g).t()),  # strided: hashed from its row-major bytes
        ("empty", torch.empty(0, 3)),  # a chunk that does not travel
        ("head", torch.randn(3000, generator=g)),
    ]


def _corrupt_in_bad_round(rank: int, world_size: int, port: int, names: list[str], backend: str = "gloo") -> list:
    """Consumers flip one byte of each tensor in ``names`` as it arrives in round BAD_ROUND (after the transport,
    before the verifier hashes it: what a reused buffer or a bad copy would do; over gloo, whose received tensors
    are the consumer's own memory)."""
    with connect(gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S, backend=backend)) as rg:
        if rank == 0:
            sent = []
            with ProducerSession(rg, buffer_size_bytes=BUFFER) as session:
                for k in range(1, ROUNDS + 1):
                    named = _weights(k)
                    r = session.send(named)
                    sent.append((r.checksums, [tensor_checksum(t, session.checksum_algorithm) for _, t in named]))
            return sent
        session = ConsumerSession(rg, verify=True)
        verified = []

        def consume(batch: list[tuple[str, torch.Tensor]]) -> None:
            if session.rounds + 1 != BAD_ROUND:
                return
            for name, t in batch:
                if name in names:
                    t.view(-1).view(torch.uint8)[0] ^= 0x01

        while (r := session.receive(consume)) is not None:
            verified.append((r.round, r.verified))
        return verified


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_producer_checksums_are_each_tensors_in_order_every_round(backend):
    producer, consumer = run_ranks(_corrupt_in_bad_round, 2, [], backend, timeout=120)
    assert consumer == [(k, True) for k in range(1, ROUNDS + 1)]
    assert len(producer) == ROUNDS
    for sent, expected in producer:
        assert sent == expected


def test_a_corrupted_tensor_in_a_later_round_is_named_with_the_round_on_every_rank():
    outcomes = run_ranks(_corrupt_in_bad_round, 3, ["proj", "embed"], timeout=120, return_exceptions=True)
    for outcome in outcomes:
        assert isinstance(outcome, RankFailure), outcome
    for consumer in outcomes[1:]:
        # Both consumers found it themselves (a peer's report would be a PeerError); manifest order, first first.
        assert consumer.exc_type == VerificationError.__name__, consumer
        assert (
            f"round {BAD_ROUND}: verification failed: 2 of 5 tensor(s) differ from what the producer sent: "
            "'embed', 'proj'" in consumer.message
        ), consumer
    producer = outcomes[0]
    assert producer.exc_type == "PeerError"
    assert f"failed: round {BAD_ROUND}: verification failed" in producer.message, producer
