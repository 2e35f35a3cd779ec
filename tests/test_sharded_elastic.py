"""Sharded refits that go on without a lost consumer (``ElasticShardedSession``, ``refit.on_consumer_loss=continue``)
over real gloo groups: two producers and two replicas of two tensor-parallel consumers, with delta rounds; a consumer
SIGKILLed mid-way through a delta round (the head of a replica chain: the next replica is re-planned to take its
slices from the producers), the others finish every round bit for bit the producers' tensors sliced (the cut round
again, dense, then delta rounds), and the consumer restarted with the run's token and id joins at a round boundary
with a dense round, exact, then delta rounds; a producer SIGKILLed mid-round stops every rank in one line within the
deadline budget.

Every rank is a spawned process (tests/mp_utils.py: started together, OS-assigned port); the restarted consumer is
one more process, released by an event the producer sets, never by a sleep.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed.tensor  # from_tensors imports it: seconds under load, here in start-up
from mp_utils import RankFailure, deadline_budget, gloo_spec, run_ranks
from test_sharded_session import K, M, _model, _rule, _shards  # the same trainer and engine

from refit_app.common.errors import RefitError
from refit_app.protocol.sharded import allocate, expected_of, tp_needs
from refit_app.protocol.sharded_elastic import ElasticShardedSession

TIMEOUT_S = 6.0
TOKEN = "sharded-elastic-test-token-0123456789"
D = 2
WORLD = K + M * D
CHAINS = [[K + r * M + c for r in range(D)] for c in range(M)]
ROUNDS = 5
KILLED = K  # replica 0's tensor-parallel rank 0: the head of a chain
KILLED_IN = 2
RESTARTED_AT = 4
BUFFER = 64
"""Bytes a buffer: every tensor goes in several pieces, so a kill after the first lands mid-round."""
EVENT_WAIT_S = 120.0
"""A hang limit for the events between processes, not a deadline under test."""


def _spec(rank: int, port: int):
    return gloo_spec(rank, WORLD, port, timeout_s=TIMEOUT_S, token=TOKEN, run_id="sharded-elastic")


class _Work:
    def __init__(self, work, killed_at) -> None:
        self._work, self._killed_at = work, killed_at

    def wait(self, *args):
        done = self._work.wait(*args)
        self._killed_at.value = time.monotonic()  # system-wide: comparable across the processes
        os.kill(os.getpid(), signal.SIGKILL)
        return done


class _DieAfterFirst:
    """A generation's process group whose first send or receive, once completed, SIGKILLs this process."""

    def __init__(self, pg, killed_at) -> None:
        self._pg, self._killed_at = pg, killed_at

    def send(self, tensors, dst, tag):
        return _Work(self._pg.send(tensors, dst, tag), self._killed_at)

    def recv(self, tensors, src, tag):
        return _Work(self._pg.recv(tensors, src, tag), self._killed_at)


def _dies_in(rank: int, killed_at):
    return lambda pg, k: _DieAfterFirst(pg, killed_at) if k == KILLED_IN else pg


def _consume(session: ElasticShardedSession, rank: int) -> list[dict]:
    expects = expected_of(_model(1).items())
    needs = {n.name: n.box for n in tp_needs(expects, rank, (rank - K) % M, M, _rule)}
    slices = allocate(expects, [n for n in tp_needs(expects, rank, (rank - K) % M, M, _rule)])
    rounds = []
    while session.receive(slices) is not None:
        k = session.rounds
        exact = all(
            torch.equal(slices[name].tensor, full[tuple(slice(a, b) for a, b in needs[name])])
            for name, full in _model(k).items()
        )
        rounds.append(
            {
                "round": k,
                "members": session.members,
                "exact": exact,
                "at": time.monotonic(),
                "delta": session.delta_round,
            }
        )
    return rounds


def _loss_and_restart(rank: int, world_size: int, port: int, restart, killed_at) -> object:
    expects = expected_of(_model(1).items())
    if rank < K:
        specs, shards = _shards(1, rank)
        with ElasticShardedSession(
            _spec(rank, port), producers=K, specs=specs, chains=CHAINS, buffer_size_bytes=BUFFER, delta=True
        ) as s:
            sent = []
            for k in range(1, ROUNDS + 1):
                if k == RESTARTED_AT and rank == 0:
                    restart.set()
                    assert s.wait_for_joiners([KILLED], EVENT_WAIT_S), "the restarted consumer never asked to join"
                for name, held in _shards(k, rank)[1].items():
                    shards[name].tensor.copy_(held.tensor)  # the trainer's step, in place
                s.send(shards)
                deltas = s.generation.session.deltas
                changed = (deltas.changed_elements, deltas.total_elements)
                sent.append({"round": k, "members": s.members, "delta": s.delta_round, "changed": changed})
            return sent
    as_rank = rank if rank < WORLD else KILLED  # the last process is the killed consumer, restarted
    if rank == WORLD:
        assert restart.wait(EVENT_WAIT_S)
    needs = tp_needs(expects, as_rank, (as_rank - K) % M, M, _rule)
    wire = _dies_in(rank, killed_at) if rank == KILLED else None
    with ElasticShardedSession(
        _spec(as_rank, port),
        producers=K,
        needs=needs,
        expects=expects,
        chains=CHAINS,
        buffer_size_bytes=None,
        delta=None,  # the producers'
        wire=wire,
    ) as s:
        return _consume(s, as_rank)


def test_a_consumer_lost_mid_delta_round_leaves_the_others_exact_every_round_and_rejoins_densely():
    restart = mp.get_context("spawn").Event()
    killed_at = mp.get_context("spawn").Value("d", 0.0)
    results = run_ranks(_loss_and_restart, WORLD + 1, restart, killed_at, timeout=150, return_exceptions=True)
    assert isinstance(results[KILLED], RankFailure) and results[KILLED].exc_type == "Died", results
    everyone, without = list(range(K, WORLD)), [r for r in range(K, WORLD) if r != KILLED]
    # Every generation starts with a dense round: the first, the cut round again, the round the restarted joined at.
    dense = {1, KILLED_IN, RESTARTED_AT}
    kinds = [k not in dense for k in range(1, ROUNDS + 1)]
    for p in range(K):  # the producers sent every round once, to those there
        assert [r["round"] for r in results[p]] == list(range(1, ROUNDS + 1)), results[p]
        assert [r["members"] for r in results[p]] == [
            everyone if k < KILLED_IN or k >= RESTARTED_AT else without for k in range(1, ROUNDS + 1)
        ], results[p]
        assert [r["delta"] for r in results[p]] == kinds, results[p]
        assert all(r["changed"][0] == r["changed"][1] for r in results[p] if not r["delta"]), results[p]
    for k in range(2, ROUNDS + 1):  # a dense round sends every element; a delta round one changed a tensor, of 3
        if k not in dense:
            assert sum(results[p][k - 1]["changed"][0] for p in range(K)) == 3, [results[p] for p in range(K)]
    for c in without:  # every round, once, exact: round 2 was cut and came again without the killed one
        assert [(r["round"], r["exact"]) for r in results[c]] == [(k, True) for k in range(1, ROUNDS + 1)], results[c]
        assert [r["delta"] for r in results[c]] == kinds, results[c]
    redone = next(r for r in results[KILLED + M] if r["round"] == KILLED_IN)  # the chain's next replica
    assert redone["members"] == without
    assert redone["at"] - killed_at.value < deadline_budget(TIMEOUT_S), redone["at"] - killed_at.value
    restarted = results[WORLD]
    assert [(r["round"], r["exact"]) for r in restarted] == [(k, True) for k in range(RESTARTED_AT, ROUNDS + 1)]
    assert [r["delta"] for r in restarted] == kinds[RESTARTED_AT - 1 :]
    assert restarted[0]["members"] == everyone


def _producer_lost(rank: int, world_size: int, port: int, killed_at) -> object:
    expects = expected_of(_model(1).items())
    try:
        if rank < K:
            specs, shards = _shards(1, rank)
            wire = _dies_in(rank, killed_at) if rank == 1 else None
            with ElasticShardedSession(
                _spec(rank, port), producers=K, specs=specs, buffer_size_bytes=BUFFER, wire=wire
            ) as s:
                for _ in range(ROUNDS):
                    s.send(shards)
            return "completed"
        needs = tp_needs(expects, rank, rank - K, M, _rule)
        with ElasticShardedSession(
            _spec(rank, port), producers=K, needs=needs, expects=expects, buffer_size_bytes=None
        ) as s:
            slices = allocate(expects, needs)
            while s.receive(slices) is not None:
                pass
        return "completed"
    except RefitError as e:
        return (str(e), time.monotonic())


def test_a_lost_producer_stops_every_rank_in_one_line_within_the_deadline():
    killed_at = mp.get_context("spawn").Value("d", 0.0)
    results = run_ranks(_producer_lost, K + M, killed_at, timeout=120, return_exceptions=True)
    assert isinstance(results[1], RankFailure) and results[1].exc_type == "Died", results[1]
    for r in (0, *range(K, K + M)):
        said, at = results[r]
        assert "\n" not in said and "lost producer rank 1" in said, (r, said)
        assert "its shards exist nowhere else" in said, (r, said)
        assert at - killed_at.value < deadline_budget(TIMEOUT_S), (r, at - killed_at.value)


def test_a_generation_renumbers_the_layouts_and_replans_a_chain_through_a_lost_rank():
    from refit_app.core.reshard.plan import Layout, Need, Shard, plan
    from refit_app.protocol.sharded_elastic import renumbered

    specs, _ = _shards(1, 0)
    expects = expected_of(_model(1).items())
    # Ranks 0-1 produce; 2, 4, 6 are three replicas of tensor-parallel rank 0 (a chain), 3, 5, 7 of rank 1. Rank 4,
    # the middle of the first chain, and rank 3, the head of the second, are lost.
    chains = [[2, 4, 6], [3, 5, 7]]
    ranks = [0, 1, 2, 5, 6, 7]
    needs = [n for r in ranks[2:] for n in tp_needs(expects, r, (r - K) % M, M, _rule)]
    out_specs, out_needs, out_chains = renumbered(ranks, specs, needs, chains)
    assert out_chains == [[2, 4], [3, 5]]  # 6 now after 2; 5 heads the second chain, 7 after it
    assert all(s.layout == Layout.one_dim((0, 1), Shard(0)) for s in out_specs)
    assert [n for n in out_needs if n.rank == 4] == [Need(4, n.name, n.box) for n in needs if n.rank == 6]
    transfers = plan(out_specs, out_needs, chains=out_chains)
    relayed = {(t.src, t.dst) for t in transfers if t.relayed}
    direct = {t.dst for t in transfers if not t.relayed}
    assert relayed == {(2, 4), (3, 5)} and direct == {2, 3}  # each chain's head from the producers, then relayed


JOINS_AT = 3


def _joiner_disagrees(rank: int, world_size: int, port: int, restart) -> object:
    """Ranks 0..K+M-1, but the last consumer starts only once producer 0 is at round JOINS_AT, with another buffer
    size than the producers'."""
    expects = expected_of(_model(1).items())
    if rank < K:
        specs, shards = _shards(1, rank)
        with ElasticShardedSession(
            gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S, token=TOKEN, run_id="sharded-elastic-late"),
            producers=K,
            specs=specs,
            buffer_size_bytes=BUFFER,
            delta=True,
        ) as s:
            sent = []
            for k in range(1, ROUNDS + 1):
                if k == JOINS_AT and rank == 0:
                    restart.set()
                    assert s.wait_for_joiners([world_size - 1], EVENT_WAIT_S), "the late consumer never asked"
                for name, held in _shards(k, rank)[1].items():
                    shards[name].tensor.copy_(held.tensor)
                s.send(shards)
                sent.append((k, s.members))
            return sent
    late = rank == world_size - 1
    if late:
        assert restart.wait(EVENT_WAIT_S)
    needs = tp_needs(expects, rank, (rank - K) % M, M, _rule)
    try:
        with ElasticShardedSession(
            gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S, token=TOKEN, run_id="sharded-elastic-late"),
            producers=K,
            needs=needs,
            expects=expects,
            buffer_size_bytes=2 * BUFFER if late else None,
            delta=None,
        ) as s:
            return _consume(s, rank)
    except RefitError as e:
        return str(e)


def test_a_consumer_that_joins_with_other_settings_is_dropped_in_one_line_and_the_others_go_on():
    """A restarted consumer whose settings differ (here its buffer size) cannot agree the plan with the others: it
    is dropped in one line naming the difference, and the producers and the other consumers go on without it, every
    round exact (not the run's end for everyone)."""
    restart = mp.get_context("spawn").Event()
    late = K + M - 1
    results = run_ranks(_joiner_disagrees, K + M, restart, timeout=150, return_exceptions=True)
    said = results[late]
    assert isinstance(said, str) and "\n" not in said, said
    assert "disagree on buffer_size_bytes" in said and "dropped" in said, said
    for p in range(K):
        assert [k for k, _ in results[p]] == list(range(1, ROUNDS + 1)), results[p]
        assert all(members == [K] for _, members in results[p]), results[p]
    assert [(r["round"], r["exact"]) for r in results[K]] == [(k, True) for k in range(1, ROUNDS + 1)], results[K]


def _trainer(rank: int, world_size: int, port: int, killed_at) -> object:
    """Producers that are a trainer: their own process group over the run's store, set up before the first plan
    (an all-reduce over it every round), and an extra each round; consumers that know no tensors of their own."""
    import torch.distributed as dist

    if rank < K:

        def specs(store):
            dist.init_process_group("gloo", store=store, rank=rank, world_size=K, timeout=timedelta(seconds=TIMEOUT_S))
            return _shards(1, rank)[0]

        try:
            with ElasticShardedSession(
                _spec(rank, port),
                producers=K,
                specs=specs,
                chains=CHAINS,
                buffer_size_bytes=BUFFER,
                extras=True,
                context={"config": "the trainer's"},
            ) as s:
                sent = []
                for k in range(1, ROUNDS + 1):
                    step = torch.tensor([float(k)])
                    dist.all_reduce(step)  # the trainer's own group: untouched by the generations

                    def extra(asks, k=k):  # what the consumers of the generation that sends round k asked with
                        return {"from": rank, "round": k, "asked": {r: a["me"] for r, a in asks.items() if a}}

                    s.send(_shards(k, rank)[1], extra=extra)
                    sent.append((k, s.members, step.item()))
                return sent
        finally:
            dist.destroy_process_group()
    wire = _dies_in(rank, killed_at) if rank == KILLED else None

    def needs(expects):
        return tp_needs(expects, rank, (rank - K) % M, M, _rule)

    with ElasticShardedSession(
        _spec(rank, port),
        producers=K,
        needs=needs,
        expects=None,
        chains=CHAINS,
        buffer_size_bytes=None,
        extras=True,
        wire=wire,
        ask={"me": rank},
    ) as s:
        assert s.context == {"config": "the trainer's"}, s.context
        slices = allocate(s.expects, s.needs)
        got = []
        while s.receive(slices) is not None:
            k = s.rounds
            exact = all(
                torch.equal(slices[n].tensor, full[tuple(slice(a, b) for a, b in slices[n].box)])
                for n, full in _model(k).items()
            )
            got.append((k, exact, s.extras))
        return s.expects, got


def test_a_trainers_producers_keep_their_own_group_and_consumers_take_their_tensors_and_extras():
    """Producers that train set up their own process group over the run's store before the first plan, and it
    outlives the generation a consumer was lost in; consumers that know no tensors take producer 0's from the plan
    record, and every round's extras (a trainer's keyed sums, in the application) reach them from every producer:
    the cut round's again, made anew for what the consumers of its generation asked with; producer 0's context
    reaches every consumer."""
    killed_at = mp.get_context("spawn").Value("d", 0.0)
    results = run_ranks(_trainer, WORLD, killed_at, timeout=150, return_exceptions=True)
    assert isinstance(results[KILLED], RankFailure) and results[KILLED].exc_type == "Died", results
    without = [r for r in range(K, WORLD) if r != KILLED]
    for p in range(K):
        assert [(k, step) for k, _, step in results[p]] == [(k, float(K * k)) for k in range(1, ROUNDS + 1)]
        assert [members for _, members, _ in results[p]][KILLED_IN - 1 :] == [without] * (ROUNDS - KILLED_IN + 1)
    for c in without:
        expects, got = results[c]
        assert expects == expected_of(_model(1).items())
        assert [(k, exact) for k, exact, _ in got] == [(k, True) for k in range(1, ROUNDS + 1)], got
        for k, _, extras in got:
            # The cut round's extras are made again, for the generation without the lost consumer.
            asked = {r: r for r in (without if k >= KILLED_IN else range(K, WORLD))}
            assert extras == {p: {"from": p, "round": k, "asked": asked} for p in range(K)}, (k, extras)


def _finishing(rank: int, world_size: int, port: int, dies: str, dead) -> object:
    # Consumers that asked to finish together tell each other a value once the producers ended the session. With
    # ``dies="posted"`` consumer K + 1 is SIGKILLed once its value is posted; consumer K posts its own after that, and
    # finds every value there, one of a dead process.
    expects = expected_of(_model(1).items())
    spec = gloo_spec(rank, K + M, port, timeout_s=TIMEOUT_S, token=TOKEN, run_id="sharded-finish")
    if rank < K:
        specs, shards = _shards(1, rank)
        with ElasticShardedSession(spec, producers=K, specs=specs, buffer_size_bytes=BUFFER) as s:
            for _ in range(2):
                s.send(shards)
            finishers = s.finishers
        return {"finishers": finishers}
    needs = tp_needs(expects, rank, rank - K, M, _rule)
    with ElasticShardedSession(
        spec, producers=K, needs=needs, expects=expects, buffer_size_bytes=None, ask={"finish": True}
    ) as s:
        slices = allocate(expects, needs)
        while s.receive(slices) is not None:
            pass
        if rank == K + 1 and dies == "posted":
            wait = s._await_all

            def await_all(store, what, finishers, failed):
                if what == "value":  # its own is posted: die waiting for the other's
                    dead.set()
                    os.kill(os.getpid(), signal.SIGKILL)
                return wait(store, what, finishers, failed)

            s._await_all = await_all
        if rank == K and dies == "posted":
            assert dead.wait(EVENT_WAIT_S), "consumer K + 1 never posted its value"
        started = time.monotonic()
        try:
            return {"said": s.finish({"rank": rank, "rounds": s.rounds})}
        except RefitError as e:
            return {"error": str(e), "waited": time.monotonic() - started}


def test_consumers_that_finish_together_hear_each_other_and_none_goes_on_past_one_lost_after_the_last_round():
    dead = mp.get_context("spawn").Event()
    every = run_ranks(_finishing, K + M, "", dead, timeout=120)
    values = {K + i: {"rank": K + i, "rounds": 2} for i in range(M)}
    assert [every[c]["said"] for c in range(K, K + M)] == [values] * M
    assert all(every[p]["finishers"] == list(range(K, K + M)) for p in range(K))
    # Consumer K + 1 dies once its value is posted, waiting for K's: K then finds every value there, and still never
    # returns them (a saver would publish on them): it names the lost one, in one line, within one deadline.
    lost = run_ranks(_finishing, K + M, "posted", dead, timeout=120, return_exceptions=True)
    assert isinstance(lost[K + 1], RankFailure) and lost[K + 1].exc_type == "Died", lost[K + 1]
    survivor = lost[K]
    said = "of the last generation did not confirm it had every finisher's value within group.timeout_s"
    assert "said" not in survivor and f"consumer rank {K + 1} {said}" in survivor["error"], survivor
    assert TIMEOUT_S - 0.5 < survivor["waited"] < deadline_budget(TIMEOUT_S), survivor
    # Producer 0 waited for the finishers (at most three deadlines), then ended: every producer returned.
    assert all("finishers" in lost[p] for p in range(K)), lost[:K]
