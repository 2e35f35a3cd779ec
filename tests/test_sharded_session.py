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


def _model(k: int, change: str = "few", scale: int = 1) -> dict[str, torch.Tensor]:
    """Round ``k``'s whole tensors (``scale`` times the sides): seeded, then from round 2 ``few``: one element of
    each tensor changed a round, ``all``: every one."""
    g = torch.Generator().manual_seed(0)
    model = {
        "up": torch.randn(9 * scale, 6 * scale, generator=g),
        "down": torch.randn(5 * scale, 9 * scale, generator=g),
        "norm": torch.randn(9 * scale, generator=g),
    }
    for r in range(2, k + 1):
        for t in model.values():
            if change == "all":
                t.add_(1.0)
            else:
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


AUTO_ROUNDS = 4


def _auto_model(k: int, change: str) -> dict[str, torch.Tensor]:
    """Tensors large enough that one changed element takes a small share of their bytes as a delta record."""
    return _model(k, change, scale=10)


def _auto_rank(rank: int, world_size: int, port: int, change: str) -> list:
    """Every round's kind and reason as this rank's session saw them, with a consumer's slices."""
    init_gloo(rank, world_size, port, timeout_s=TIMEOUT_S)
    pg = dist.group.WORLD
    layout = Layout.one_dim(tuple(range(K)), Shard(0))
    expects = expected_of(_auto_model(1, change).items())
    try:
        if rank < K:
            shards = {
                name: Declared(t.chunk(K)[rank].clone(), tuple(t.shape), layout)
                for name, t in _auto_model(1, change).items()
            }
            specs, held = from_tensors(shards.items(), rank=rank)
            session = ShardedSession(pg, rank, agree(pg, rank, specs=specs, delta="auto"), producer=True)
            seen = []
            for k in range(1, AUTO_ROUNDS + 1):
                for name, t in _auto_model(k, change).items():
                    held[name].tensor.copy_(t.chunk(K)[rank])  # the trainer's step, in place
                sent = session.send(held)
                seen.append((session.auto.last, session.auto.reason, sent))
            session.close()
            return seen
        needs = tp_needs(expects, rank, rank - K, M, _rule)
        session = ShardedSession(pg, rank, agree(pg, rank, needs=needs, expects=expects, delta="auto"), producer=False)
        slices = allocate(expects, needs)
        seen = []
        while session.receive(slices) is not None:
            seen.append(
                (session.auto.last, session.auto.reason, {n: h.tensor.numpy().copy() for n, h in slices.items()})
            )
        return seen
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("change", ["few", "all"])
def test_auto_sends_delta_rounds_where_few_elements_change_and_plain_ones_where_all_do(change):
    results = run_ranks(_auto_rank, K + M, change, timeout=120)
    kinds = [[kind for kind, _, _ in r] for r in results]
    reasons = [[why for _, why, _ in r] for r in results]
    assert all(k == kinds[0] for k in kinds) and all(r == reasons[0] for r in reasons), (kinds, reasons)  # one choice
    # The first round fills the producers' snapshots; the second is a delta round (no measure says otherwise yet).
    assert kinds[0][:2] == ["keep", "delta"], reasons[0]
    if change == "all":
        # Its changes took the whole dense bytes: plain rounds from then on, sent as without deltas, and estimated
        # from the producers' samples to take as much.
        assert kinds[0][2:] == ["plain"] * (AUTO_ROUNDS - 2), reasons[0]
        assert all("of the dense bytes" in why for why in reasons[0][2:]), reasons[0]
    else:
        # Its changes took a few percent: a warm dense round to time it against, then by the times measured.
        assert kinds[0][2] == "keep" and kinds[0][3] in ("delta", "plain"), reasons[0]
        sent = [s for _, _, s in results[0]]
        assert sent[1] < sent[0] / 10, sent  # the delta round: only the changes went
    for c in range(M):
        needs = {n.name: n.box for n in tp_needs(expected_of(_auto_model(1, change).items()), K + c, c, M, _rule)}
        for k, (_, _, got) in enumerate(results[K + c], 1):
            for name, full in _auto_model(k, change).items():
                want = full[tuple(slice(a, b) for a, b in needs[name])]
                assert torch.equal(torch.from_numpy(got[name]), want), (c, k, name, kinds[0][k - 1])


def test_every_rank_chooses_alike_from_the_gathered_facts_and_tries_deltas_again_where_plain_rounds_are_slower():
    from refit_app.protocol.delta.auto import AgreedAuto

    ranks = [AgreedAuto() for _ in range(3)]  # two producers and a consumer, fed the same gathered facts

    def play(seconds: float, **measured: int) -> tuple[str, str]:
        """A round: every rank decides from every rank's facts, then takes ``seconds`` (the consumer the longest:
        the round's time is its slowest rank's); the producers measured half of ``measured`` each."""
        rows = [a.facts() for a in ranks]
        chosen = {(a.decide(rows), a.reason) for a in ranks}
        assert len(chosen) == 1, chosen
        for i, a in enumerate(ranks):
            producer = i < 2
            a.done(
                seconds if not producer else seconds / 2,
                **({k: v // 2 for k, v in measured.items()} if producer else {}),
            )
        return chosen.pop()

    delta = {"changes": 200, "dense": 20000, "changed": 20, "elements": 2000}
    assert play(0.5)[0] == "keep"  # the first round, cold: no reference
    assert play(0.2, **delta)[0] == "delta"
    assert play(0.15) == ("keep", "a warm dense round into the snapshot, to time the delta rounds against")
    assert play(0.2, **delta) == ("delta", "deltas pay: the changes took 1.0% of the dense bytes")
    # That delta round took longer than the warm dense round: plain rounds, which here take longer still.
    assert play(0.9) == ("plain", "deltas did not pay: a delta round took 0.2 s, a dense one 0.15 s")
    kind, why = play(0.15)
    assert (kind, why) == (
        "keep",
        "trying deltas again (a plain round took 0.9 s, the last delta round 0.2 s): a dense round into the "
        "snapshot first",
    )
    assert play(0.2, **delta)[0] == "delta"  # faster than the plain round: it stays on deltas
    assert play(0.2, **delta)[0] == "delta"
