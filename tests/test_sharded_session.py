"""Sharded sessions over real gloo groups: the layouts and the plan agreed once, then rounds until the producers
close the session, each round's slices bit for bit the producers' tensors sliced (plain and delta rounds); and the
ways a round cannot start, each stopping every rank in one line before the round's data: a producer that ends the
session while another sends, and a consumer that leaves while the producers send."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mp_utils import init_gloo, run_ranks

from refit_app.common.errors import PeerError
from refit_app.core.reshard.plan import Layout, Shard
from refit_app.protocol.sharded import (
    COLUMN,
    ROW,
    WHOLE,
    Declared,
    ShardedSession,
    agree,
    allocate,
    expected_of,
    from_tensors,
    tp_needs,
)

TIMEOUT_S = 30.0
K, M = 2, 2
ROUNDS = 3


def _model(k: int) -> dict[str, torch.Tensor]:
    """Round ``k``'s whole tensors: seeded, then from round 2 a few elements changed each round."""
    g = torch.Generator().manual_seed(0)
    model = {
        "up": torch.randn(9, 6, generator=g),
        "down": torch.randn(5, 9, generator=g),
        "norm": torch.randn(9, generator=g),
    }
    for r in range(2, k + 1):
        for t in model.values():
            t.view(-1)[r % t.numel()] += 1.0
    return model


def _rule(name: str):
    return {"up": COLUMN, "down": ROW}.get(name, WHOLE)


def _shards(k: int, rank: int) -> tuple[list, dict]:
    """Producer ``rank``'s rows of every tensor of round ``k`` (``torch.chunk``'s split over the K producers)."""
    layout = Layout.one_dim(tuple(range(K)), Shard(0))
    return from_tensors(
        ((name, Declared(t.chunk(K)[rank].clone(), tuple(t.shape), layout)) for name, t in _model(k).items()),
        rank=rank,
    )


def _rank(rank: int, world_size: int, port: int, delta: bool, fault: str | None) -> list:
    init_gloo(rank, world_size, port, timeout_s=TIMEOUT_S)
    pg = dist.group.WORLD
    try:
        if rank < K:
            specs, shards = _shards(1, rank)
            session = ShardedSession(pg, rank, agree(pg, rank, specs=specs, delta=delta), producer=True)
            sent = []
            try:
                for k in range(1, ROUNDS + 1):
                    if fault == "producer_ends" and k == 2 and rank == 1:
                        session.close()  # producer 1 stops while producer 0 sends round 2
                        return sent
                    for name, held in _shards(k, rank)[1].items():
                        shards[name].tensor.copy_(held.tensor)  # the trainer's step, in place
                    sent.append(session.send(shards))
                session.close()
            except PeerError as e:
                return [*sent, str(e)]
            return sent
        expects = expected_of(_model(1).items())
        needs = tp_needs(expects, rank, rank - K, M, _rule)
        session = ShardedSession(pg, rank, agree(pg, rank, needs=needs, expects=expects, delta=delta), producer=False)
        slices = allocate(expects, needs)
        rounds = []
        try:
            while True:
                if fault == "consumer_leaves" and len(rounds) == 1 and rank == K:
                    session.close()
                    return rounds
                if session.receive(slices) is None:
                    break
                rounds.append({n: h.tensor.numpy().copy() for n, h in slices.items()})  # pickles
        except PeerError as e:
            return [*rounds, str(e)]
        assert session.receive(slices) is None  # over for good
        return rounds
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("delta", [False, True])
def test_a_session_takes_rounds_until_the_producers_close_it_each_exact(delta):
    results = run_ranks(_rank, K + M, delta, None, timeout=120)
    assert [len(r) for r in results] == [ROUNDS] * (K + M)
    for c in range(M):
        needs = {n.name: n.box for n in tp_needs(expected_of(_model(1).items()), K + c, c, M, _rule)}
        for k, got in enumerate(results[K + c], 1):
            for name, full in _model(k).items():
                want = full[tuple(slice(a, b) for a, b in needs[name])]
                assert torch.equal(torch.from_numpy(got[name]), want), (c, k, name)
    if delta:  # the later rounds carried only their changes
        assert all(r[1] < r[0] for r in results[:K]), results[:K]


def test_a_producer_that_ends_while_another_sends_stops_every_rank_in_one_line():
    results = run_ranks(_rank, K + M, False, "producer_ends", timeout=120)
    said = "producer 1 ended the session at round 2 while producer 0 sent it"
    for r in range(K + M):  # round 1, then the one line on every rank (producer 1's close says it too)
        assert len(results[r]) == 2 and results[r][-1] == said, results[r]


def test_a_consumer_that_leaves_stops_the_producers_and_the_other_consumers_in_one_line():
    results = run_ranks(_rank, K + M, False, "consumer_leaves", timeout=120)
    said = f"consumer {K} left the session before round 2"
    assert len(results[K]) == 1  # it took round 1, then left
    for r in (0, 1, K + 1):
        assert results[r][-1] == said, results[r]
