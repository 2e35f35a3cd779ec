"""Elastic refit groups on Ray (``on_consumer_loss="continue"``): an engine actor killed by ``ray.kill(actor,
no_restart=False)`` in the middle of round 3 is left out, Ray restarts it, and it rejoins with a dense round (at
round 5 at the latest); the
other engines verify every round. And ``role=ray refit.on_consumer_loss=continue``: a consumer's actor that dies
mid-transfer is restarted by Ray and run again, rejoining the run, one producer's or a sharded refit's. Both ask a
lost actor back through :class:`refit_app.integrations.ray.restarts.ActorRestarts`, tested on its own here too.

A local Ray cluster for the module, as tests/test_ray.py does; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_utils import assert_ok, load_metrics, run_dir
from conditions import needs_ray
from ray_utils import assert_all_cpus_back, local_cluster

pytestmark = [pytest.mark.ray, needs_ray]

CLUSTER_CPUS = 4
ROUNDS = 8
KILLED_IN = 3
BACK_AT = 5
TIMEOUT_S = 6.0
RESTART_S = 120.0
"""group.timeout_s where a test waits for Ray to restart an actor within the producer's wait for the members to ask
again (a new worker process imports torch: over 30 s on two busy cores); a hang limit, not a deadline under test."""
WAIT_S = 240.0
"""A hang limit on each wait here (actors' start-up on two loaded cores included); only a hang nears it."""


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[object]:
    # The actors' classes live in this module: the workers import it from here.
    with local_cluster(CLUSTER_CPUS, pythonpath=str(Path(__file__).resolve().parent)) as ray:
        yield ray


def _weights(k: int):
    import torch

    out = []
    for i in range(4):
        t = torch.randn(65536, generator=torch.Generator().manual_seed(i))
        t[:: 5 + i] += k  # a few elements change per round: delta rounds pay
        out.append((f"layer{i}.weight", t))
    return out


class Trainer:
    def __init__(self) -> None:
        self.k = 0

    def step(self, k: int) -> None:
        self.k = k

    def weights(self):
        return _weights(self.k)


class Engine:
    """Keeps a copy of what it received; in round ``stall_in`` it says so (a file) at its first batch and stalls
    there until it is killed."""

    def __init__(self, stall_in: int | None, stall_file: str, fail_in: int | None = None) -> None:
        import ray

        self.got = {}
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.stall_in = None if self.restarted else stall_in
        self.stall_file = stall_file
        self.fail_in = fail_in

    def load(self, batch, k: int) -> None:
        if k == self.stall_in:
            Path(self.stall_file).write_text("stalled")
            time.sleep(WAIT_S)  # killed before this ends, or stalled for good
        if k == self.fail_in:
            raise RuntimeError(f"this engine cannot load round {k}")
        self.loaded_by = k  # whose load the round went to: a rejoiner's must be the refit's own
        for name, t in batch:
            self.got[name] = t.clone()

    def matches(self, k: int) -> bool:
        import torch

        expected = dict(_weights(k))
        same = self.got.keys() == expected.keys() and all(torch.equal(self.got[n], expected[n]) for n in expected)
        return same and getattr(self, "loaded_by", None) == k


def test_an_engine_killed_mid_transfer_is_restarted_by_ray_and_rejoins_with_a_dense_round(ray_cluster, tmp_path):
    ray = ray_cluster
    from refit_app.integrations.ray import RayRefitGroup

    stall = tmp_path / "stalled"
    trainer = ray.remote(num_cpus=0.5)(Trainer).remote()
    engines = [
        ray.remote(num_cpus=0.5, max_restarts=1)(Engine).remote(KILLED_IN if k == 3 else None, str(stall))
        for k in (1, 2, 3)
    ]

    def kill_when_stalled() -> None:
        _kill_when(ray, stall, engines[2])  # engine 3, inside round 3

    try:
        rounds = _refit_rounds(ray, RayRefitGroup, trainer, engines, kill_when_stalled)
        restarted = ray.get(engines[2].__ray_call__.remote(lambda e: e.restarted), timeout=WAIT_S)
    finally:
        for actor in [trainer, *engines]:
            ray.kill(actor, no_restart=True)
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    # Engine 3 is back in the redone round 3 where Ray restarted it within the producer's wait for the members to
    # ask again (group.timeout_s), else at a later boundary, at 5 at the latest (the loop waits for it there).
    back = next(r["round"] for r in rounds if r["round"] >= KILLED_IN and 3 in r["members"])
    assert back in (KILLED_IN, KILLED_IN + 1, BACK_AT), rounds
    expected_members = [[1, 2] if KILLED_IN <= k < back else [1, 2, 3] for k in range(1, ROUNDS + 1)]
    assert [r["members"] for r in rounds] == expected_members, rounds
    assert [r["took_part"] for r in rounds] == expected_members, rounds
    assert all(all(r["verified"]) and all(r["matches"]) for r in rounds), rounds
    # Every generation starts dense: the first round, the round redone (without engine 3, or with it back), and
    # engine 3's first one back.
    dense = [r["round"] for r in rounds if not any(r["delta"])]
    assert dense == sorted({1, KILLED_IN, back}), rounds
    assert restarted is True
    _all_cpus_back(ray)


def _refit_rounds(ray, RayRefitGroup, trainer, engines, kill_when_stalled) -> list[dict]:
    rounds = []
    with _connect(ray, RayRefitGroup, trainer, engines) as group:
        for k in range(1, ROUNDS + 1):
            ray.get(trainer.step.remote(k), timeout=WAIT_S)
            killer = None
            if k == KILLED_IN:
                killer = threading.Thread(target=kill_when_stalled, daemon=True)
                killer.start()
            if k == BACK_AT and 3 not in group.members:
                assert group.await_restarts(WAIT_S) == [3], "engine 3's actor did not come back"
            sent, *received = group.refit("weights", lambda actor, batch, k=k: actor.load(batch, k))
            if killer is not None:
                killer.join(WAIT_S)
            took_part = [r for r, got in enumerate(received, 1) if got is not None]
            matches = ray.get([engines[r - 1].matches.remote(k) for r in took_part], timeout=WAIT_S)
            rounds.append(
                {
                    "round": sent.round,
                    "members": sent.members,
                    "took_part": took_part,
                    "verified": [received[r - 1].verified for r in took_part],
                    "matches": matches,
                    "delta": [received[r - 1].delta for r in took_part],
                }
            )
    return rounds


def _connect(ray, RayRefitGroup, trainer, engines, timeout_s: float = TIMEOUT_S):
    return RayRefitGroup.connect(
        trainer,
        engines,
        backend="gloo",
        timeout_s=timeout_s,
        call_timeout_s=WAIT_S,
        on_consumer_loss="continue",
        producer_options={"buffer_size_bytes": 65536, "delta": "on"},
        consumer_options={"verify": True, "mirror": True},
    )


def _refit(ray, group, trainer, k: int) -> list:
    ray.get(trainer.step.remote(k), timeout=WAIT_S)
    return group.refit("weights", lambda actor, batch, k=k: actor.load(batch, k))


def test_a_lone_engine_restarted_by_ray_takes_part_in_the_round_it_was_lost_in(ray_cluster, tmp_path):
    """The driver asks a lost actor to join while the producer still waits for it to ask again: a lone engine
    that Ray restarts in time is not 'every consumer lost'."""
    ray = ray_cluster
    from refit_app.integrations.ray import RayRefitGroup

    stall = tmp_path / "stalled"
    trainer = ray.remote(num_cpus=0.5)(Trainer).remote()
    engine = ray.remote(num_cpus=0.5, max_restarts=1)(Engine).remote(2, str(stall))
    killer = threading.Thread(target=_kill_when, args=(ray, stall, engine), daemon=True)
    killer.start()
    try:
        # The producer waits up to group.timeout_s for the lost engine to ask again: time for Ray to restart it
        # (a new worker process) on two busy cores.
        with _connect(ray, RayRefitGroup, trainer, [engine], timeout_s=RESTART_S) as group:
            rounds = [_refit(ray, group, trainer, k) for k in (1, 2, 3)]
            matches = ray.get(engine.matches.remote(3), timeout=WAIT_S)
    finally:
        killer.join(WAIT_S)
        for actor in (trainer, engine):
            ray.kill(actor, no_restart=True)
    assert [sent.members for sent, _ in rounds] == [[1], [1], [1]]
    assert all(got is not None and got.verified for _, got in rounds), rounds
    # The round it rejoined in is dense (a new generation), the next one a delta round again.
    assert [got.delta for _, got in rounds] == [False, False, True] and matches


def _kill_when(ray, stall: Path, actor) -> None:
    deadline = time.monotonic() + WAIT_S
    while not stall.exists() and time.monotonic() < deadline:  # the signal: the engine is inside the round
        time.sleep(0.05)
    ray.kill(actor, no_restart=False)


def test_a_stalled_engine_is_left_out_without_holding_the_refit_and_engines_can_join_again(ray_cluster, tmp_path):
    """An engine stalled in its load is left out once the producer has sent the round to the others, not after
    call_timeout_s; one whose load fails stays out; after the producer is lost, close() leaves every engine
    ready for a new group of the same name."""
    ray = ray_cluster
    from refit_app.integrations.ray import RayRefitGroup
    from refit_app.integrations.ray.calls import RayCallError

    trainer = ray.remote(num_cpus=0.5)(Trainer).remote()
    engines = [
        ray.remote(num_cpus=0.5)(Engine).remote(None, str(tmp_path / "unused"), fail_in=2),
        ray.remote(num_cpus=0.5)(Engine).remote(2, str(tmp_path / "stalled")),
        ray.remote(num_cpus=0.5)(Engine).remote(None, str(tmp_path / "unused")),
    ]
    trainer2 = ray.remote(num_cpus=0.5)(Trainer).remote()
    try:
        group = _connect(ray, RayRefitGroup, trainer, engines)
        _refit(ray, group, trainer, 1)
        start = time.monotonic()
        sent, *got = _refit(ray, group, trainer, 2)
        took = time.monotonic() - start
        assert sent.members == [3] and [g is not None for g in got] == [False, False, True], (sent, got)
        # The stall is found at the round's deadline and the redone round waits one more for the members to ask:
        # about 2 x group.timeout_s, where holding the refit for the stalled call would take call_timeout_s.
        assert took < WAIT_S / 2, took
        assert _refit(ray, group, trainer, 3)[0].members == [3]
        ray.kill(trainer, no_restart=True)
        with pytest.raises(RayCallError, match="producer"):
            group.refit("weights", lambda actor, batch: actor.load(batch, 4))
        with contextlib.suppress(RayCallError):
            group.close()  # the producer's leave fails: it is dead
        # The engine that failed and the one still stalled left their sessions (or will, once unstuck): the live
        # ones join a new group of the same name.
        with _connect(ray, RayRefitGroup, trainer2, [engines[0], engines[2]]) as again:
            sent, *got = _refit(ray, again, trainer2, 5)
        assert sent.members == [1, 2] and all(g.verified for g in got)
        assert ray.get([engines[0].matches.remote(5), engines[2].matches.remote(5)], timeout=WAIT_S) == [True, True]
    finally:
        for actor in (trainer, trainer2, *engines):
            ray.kill(actor, no_restart=True)
    _all_cpus_back(ray)


class Pinger:
    def ping(self) -> bool:
        import ray

        return ray.get_runtime_context().was_current_actor_reconstructed

    def die(self) -> None:
        os._exit(1)


def test_actor_restarts_asks_back_the_moment_ray_restarts_an_actor_and_gives_up_after_max_restarts(ray_cluster):
    """The restart path RayRefitGroup and role=ray share: a call sent the moment Ray begins a restart answers once
    the actor is back (not "temporarily unavailable"); an actor dead for good answers with its death; a rank is
    asked back at most max_restarts times."""
    ray = ray_cluster
    from refit_app.integrations.ray.calls import DIED
    from refit_app.integrations.ray.restarts import ActorRestarts

    # Actor 1 comes back once; actor 2 never. Each dies inside a call, so the call's error says its process is gone:
    # ray.kill returns before the actor dies, and a call sent after it could still reach the old process.
    actors = [ray.remote(num_cpus=0.5, max_restarts=n)(Pinger).remote() for n in (1, 0)]
    try:
        assert ray.get([a.ping.remote() for a in actors], timeout=WAIT_S) == [False, False]
        restarts = ActorRestarts(["consumer 1", "consumer 2"], max_restarts=1)
        for actor in actors:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.die.remote(), timeout=WAIT_S)
        assert restarts.ask_back(0, actors[0].ping) and restarts.ask_back(1, actors[1].ping)
        assert not restarts.ask_back(0, actors[0].ping), "a rank asked back past max_restarts"
        assert restarts.ranks == [0, 1] and restarts.counts == [1, 1]
        answered = dict(restarts.answered(WAIT_S))
        assert answered[0].ok and answered[0].value is True, answered[0]
        assert not answered[1].ok and answered[1].exc_type == DIED, answered[1]
        assert answered[1].error.startswith("consumer 2's actor died"), answered[1]
        assert restarts.ranks == [] and restarts.answered() == []
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
    _all_cpus_back(ray)


def test_role_ray_with_continue_runs_a_restarted_consumer_again(ray_cluster, cli, tmp_path):
    address = ray_cluster.get_runtime_context().gcs_address
    result = cli(
        f"ray.address={address}",
        "role=ray",
        "group.world_size=4",
        "refit.rounds=6",
        "refit.on_consumer_loss=continue",
        # After the loss the producer waits up to group.timeout_s for the members to ask to go on: time for Ray to
        # restart the lost consumer's actor (a new worker process that imports torch: tens of seconds on two busy
        # cores), which then takes part in the redone round. Not a deadline under test: a hang limit.
        f"group.timeout_s={RESTART_S:g}",
        "ray.cpus_per_rank=0.5",
        "refit.debug.die_in_round=3",
        "refit.debug.die_rank=2",
        "refit.delta=on",
        timeout_s=WAIT_S + 2 * RESTART_S,
    )
    assert_ok(result)
    assert "consumer 2: its actor died" in result.stdout + result.stderr, result.describe()
    metrics = load_metrics(run_dir(tmp_path, "ray"))
    assert metrics["status"] == "ok" and metrics["rounds_done"] == 6
    members = [r["members"] for r in metrics["rounds"]]
    # Rank 2 is back in the redone round 3: Ray restarted it within the producer's wait for the members.
    assert members == [[1, 2, 3]] * 6, members
    consumers = {c["rank"]: c for c in metrics["consumers"]}
    assert all(consumers[r]["status"] == "ok" and consumers[r]["verified"] for r in (1, 2, 3)), consumers
    assert [consumers[r]["restarts"] for r in (1, 2, 3)] == [0, 1, 0]
    back = [r["round"] for r in consumers[2]["rounds"]]
    assert back == list(range(KILLED_IN, 7)), back
    # Every generation starts dense: the survivors' and the restarted one's round 3 alike; deltas resume after.
    assert [r["delta"] for r in consumers[2]["rounds"]] == [False, True, True, True]
    assert [r["delta"] for r in consumers[1]["rounds"]] == [False, True, False, True, True, True]
    assert [r["round"] for r in consumers[1]["rounds"]] == list(range(1, 7))
    assert all(r["verified"] for c in consumers.values() for r in c["rounds"])
    _all_cpus_back(ray_cluster)


def test_role_ray_with_continue_runs_a_sharded_refits_restarted_consumer_again(ray_cluster, cli, tmp_path):
    address = ray_cluster.get_runtime_context().gcs_address
    # Two producers, two tensor-parallel consumers; consumer 2 dies mid-way through delta round 3 (as above: the
    # producers wait up to group.timeout_s for the members, time for Ray to restart its actor).
    result = cli(f"ray.address={address}", "role=ray", "group.producers=2", "group.tp_size=2", "refit.rounds=5",
                 "refit.on_consumer_loss=continue", f"group.timeout_s={RESTART_S:g}", "ray.cpus_per_rank=0.5",
                 "refit.debug.die_in_round=3", "refit.debug.die_rank=2", "refit.delta=on", "source.update=training",
                 timeout_s=WAIT_S + 2 * RESTART_S)  # fmt: skip
    assert_ok(result)
    assert "consumer 2: its actor died" in result.stdout + result.stderr, result.describe()
    metrics = load_metrics(run_dir(tmp_path, "ray"))
    assert metrics["status"] == "ok" and metrics["verified"] is True, metrics
    assert [r["members"] for r in metrics["rounds"]] == [[2, 3]] * 5, metrics["rounds"]
    consumers = {c["rank"]: c for c in metrics["consumers"]}
    assert [consumers[r]["restarts"] for r in (2, 3)] == [1, 0], consumers
    assert [p.get("restarts") for p in metrics["producers"]] == [None, None], metrics["producers"]
    # The restarted consumer from the cut round on; every generation starts dense, each slice verified bit for bit.
    assert [(r["round"], r["delta"]) for r in consumers[2]["rounds"]] == [(3, False), (4, True), (5, True)]
    assert [r["delta"] for r in consumers[3]["rounds"]] == [False, True, False, True, True]
    assert all(r["verified"] for c in consumers.values() for r in c["rounds"])
    _all_cpus_back(ray_cluster)


def _all_cpus_back(ray) -> None:
    assert_all_cpus_back(ray, CLUSTER_CPUS)
