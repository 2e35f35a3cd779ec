"""Elastic sessions (``refit.on_consumer_loss=continue``) over real gloo groups: a consumer SIGKILLed mid-transfer is
dropped and the others go on, a restarted one rejoins with a dense round, a stranger never gets in, and a lost
producer (or every consumer lost) ends the rest in one line within the deadline.

Every rank is a spawned process (tests/mp_utils.py: started together, OS-assigned port); readiness is signalled
through multiprocessing events, never slept for.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cli_utils import COVER_STARTUP, assert_ok, local_metrics
from config_utils import refused, settings
from mp_utils import RankFailure, deadline_budget, gloo_spec, run_ranks

from refit_app.app import rank_harness
from refit_app.app.local import NO_ROUND, combine_outcomes
from refit_app.app.metrics import summary_line
from refit_app.app.rank_harness import RankOutcome
from refit_app.common.errors import ConfigError, PeerError, RefitError
from refit_app.protocol.elastic import ElasticConsumerSession, ElasticProducerSession
from refit_app.protocol.session import ConsumerSessionLike, ProducerSessionLike

TIMEOUT_S = 6.0
TOKEN = "elastic-test-token-0123456789abcdef"
RUN_ID = "elastic-test"
ROUNDS = 8
KILLED_IN = 3
RESTARTED_AT = 5
EVENT_WAIT_S = 120.0
"""A hang limit for the events between processes (each is set once a round is done), not a deadline under test."""


TABLE: list[tuple[str, str, float, str]] = []
"""Rows for docs/failures.md's table of continue's cases: case, what each rank does, seconds, since what."""


def _record(case: str, outcome: str, seconds: float, since: str) -> None:
    TABLE.append((case, outcome, seconds, since))


@pytest.fixture(scope="module", autouse=True)
def _write_table() -> Iterator[None]:
    """``REFIT_ELASTIC_TABLE=path.md`` writes the cases this run measured as a table (docs/failures.md's)."""
    yield
    path = os.environ.get("REFIT_ELASTIC_TABLE")
    if path and TABLE:
        rows = [
            f"| {case} | {outcome.replace('|', '/')} | {seconds:.1f} ({since}) |"
            for case, outcome, seconds, since in TABLE
        ]
        header = ["| case | what the ranks do | s |", "| --- | --- | --- |"]
        Path(path).write_text("\n".join(header + rows) + "\n")


def _model(k: int) -> list[tuple[str, torch.Tensor]]:
    """Round ``k``'s weights: the same for every rank; a few elements change per round, so delta rounds pay."""
    out = []
    for i in range(6):
        t = torch.randn(16384, generator=torch.Generator().manual_seed(i))
        t[:: 3 + i] += k
        out.append((f"layer{i}.weight", t))
    return out


def _spec(rank: int, port: int, **fields):
    fields.setdefault("token", TOKEN)
    fields.setdefault("run_id", RUN_ID)
    return gloo_spec(rank, 4, port, timeout_s=TIMEOUT_S, **fields)


def _receive_all(session: ElasticConsumerSession, die_in: int | None = None, killed_at=None) -> list[dict]:
    """Every round until the end, each checked against the expected weights; SIGKILL this process mid-transfer
    (at its first batch, of several) of round ``die_in``."""
    got: dict[str, torch.Tensor] = {}
    batches = [0]

    def load(batch):
        batches[0] += 1
        if die_in is not None and session.session.rounds + 1 == die_in and batches[0] >= 1:
            killed_at.value = time.monotonic()  # system-wide: comparable across the processes
            os.kill(os.getpid(), signal.SIGKILL)
        for name, t in batch:
            got[name] = t.clone()

    rounds = []
    while (r := session.receive(load)) is not None:
        batches[0] = 0
        expected = dict(_model(r.round))
        rounds.append(
            {
                "round": r.round,
                "members": r.members,
                "verified": r.verified,
                "delta": r.delta,
                "matches": got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in expected),
                "at": time.monotonic(),
            }
        )
    return rounds


def _killed_and_restarted(rank: int, world_size: int, port: int, restart, stranger_done, killed_at) -> object:
    if rank == 0:
        with ElasticProducerSession(_spec(0, port), buffer_size_bytes=16384, delta="on") as s:
            assert isinstance(s, ProducerSessionLike)
            rounds = []
            for k in range(1, ROUNDS + 1):
                if k == RESTARTED_AT:
                    restart.set()
                    # The stranger's tries come first (it must find rank 3 free), then rank 3's restart.
                    assert stranger_done.wait(EVENT_WAIT_S)
                    assert s.wait_for_joiners([3], EVENT_WAIT_S), "the restarted consumer never asked to join"
                r = s.send(_model(k))
                rounds.append({"round": r.round, "members": r.members, "delta": r.delta})
            return rounds
    if rank in (1, 2, 3):
        with ElasticConsumerSession(_spec(rank, port), verify=True, mirror=True) as s:
            assert isinstance(s, ConsumerSessionLike)
            return _receive_all(s, die_in=KILLED_IN if rank == 3 else None, killed_at=killed_at)
    assert restart.wait(EVENT_WAIT_S)
    if rank == 5:  # a stranger: another token, then the run's token with another run id
        refused = []
        for fields in ({"token": "not-the-run-token-0123456789abcdef"}, {"run_id": "another-run"}):
            start = time.monotonic()
            try:
                ElasticConsumerSession(_spec(3, port, **fields), verify=True)
                refused.append(("admitted", 0.0))
            except RefitError as e:
                refused.append((f"{type(e).__name__}: {e}", time.monotonic() - start))
        stranger_done.set()
        return refused
    start = time.monotonic()
    with ElasticConsumerSession(_spec(3, port), verify=True, mirror=True) as s:  # rank 3, restarted
        return start, _receive_all(s)


def test_consumer_killed_mid_transfer_then_restarted():
    ctx = mp.get_context(rank_harness.START_METHOD)
    restart, stranger_done, killed_at = ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
    producer, c1, c2, killed, restarted, stranger = run_ranks(
        _killed_and_restarted, 6, restart, stranger_done, killed_at, timeout=240.0, return_exceptions=True
    )
    assert isinstance(killed, RankFailure) and killed.exc_type == "Died", killed
    for result in (producer, c1, c2, restarted, stranger):
        assert not isinstance(result, RankFailure), f"{result}\n{getattr(result, 'traceback', '')}"
    restarted_at, restarted = restarted
    everyone, without = [1, 2, 3], [1, 2]
    expected_members = {k: without if KILLED_IN <= k < RESTARTED_AT else everyone for k in range(1, ROUNDS + 1)}
    assert [r["round"] for r in producer] == list(range(1, ROUNDS + 1))
    assert {r["round"]: r["members"] for r in producer} == expected_members
    # A generation's first round is dense: the cut round (3) and the one the restarted consumer joins at (5).
    assert [r["round"] for r in producer if not r["delta"]] == [1, KILLED_IN, RESTARTED_AT]
    for survivor in (c1, c2):
        assert [r["round"] for r in survivor] == list(range(1, ROUNDS + 1))
        assert all(r["verified"] and r["matches"] for r in survivor), survivor
        assert {r["round"]: r["members"] for r in survivor} == expected_members
    assert [r["round"] for r in restarted] == list(range(RESTARTED_AT, ROUNDS + 1))
    assert all(r["verified"] and r["matches"] for r in restarted), restarted
    assert not restarted[0]["delta"] and restarted[1]["delta"], restarted
    (token_refusal, token_s), (run_refusal, run_s) = stranger
    assert token_refusal.startswith("ConfigError") and "does not check with this consumer's group.token" in (
        token_refusal
    )
    assert run_refusal.startswith("ConfigError") and "belongs to run" in run_refusal
    redone = max(next(r["at"] for r in c if r["round"] == KILLED_IN) for c in (c1, c2))
    _record(
        "SIGKILL consumer 3 of 3 mid-transfer (round 3)",
        "producer and consumers 1, 2: round 3 again without it, dense, then on; every round verified",
        redone - killed_at.value,
        "since the kill, to the survivors' round 3",
    )
    _record(
        "consumer 3 restarted by hand (the run's token and id)",
        "it joins at the next round boundary, its first round dense and verified",
        restarted[0]["at"] - restarted_at,
        "since its start, to its first round",
    )
    _record("a consumer with another token", f"it: {token_refusal.split(': ', 1)[1]}", token_s, "since its start")
    _record("a consumer with another group.run_id", f"it: {run_refusal.split(': ', 1)[1]}", run_s, "since its start")


def _late_consumer(rank: int, world_size: int, port: int, last_round_done, stats) -> object:
    spec = gloo_spec(rank, 3, port, timeout_s=TIMEOUT_S, token=TOKEN, run_id=RUN_ID)
    if rank == 0:
        with ElasticProducerSession(spec) as s:
            assert s.members == [1]  # rank 2 is started only after the last round
            for k in range(1, 3):
                s.send(_model(k))
            last_round_done.set()
            # Rank 2's request is in the producer's store: it asked after the last round, before the end.
            assert s.wait_for_joiners([2], EVENT_WAIT_S), "the late consumer never asked to join"
        return s.rounds
    if rank == 1:
        with ElasticConsumerSession(spec) as s:
            return [r.round for r in iter(lambda: s.receive(lambda batch: None), None)]
    assert last_round_done.wait(EVENT_WAIT_S)
    start = time.monotonic()
    with ElasticConsumerSession(spec) as s:
        got = [r.round for r in iter(lambda: s.receive(lambda batch: None), None)]
        stats["late"] = time.monotonic() - start
        return s.closed, got


def test_a_consumer_that_asks_after_the_last_round_ends_with_no_rounds():
    ctx = mp.get_context(rank_harness.START_METHOD)
    stats = mp.Manager().dict()
    producer, on_time, late = run_ranks(_late_consumer, 3, ctx.Event(), stats, timeout=120.0)
    assert producer == 2 and on_time == [1, 2]
    assert late == (True, []), late
    _record(
        "a consumer asks to join after the producer's last round",
        "late consumer: its session ends at once with no rounds, without an error",
        stats["late"],
        "since its request",
    )


def _rank_taken(rank: int, world_size: int, port: int, holder_in, impostor_done, stats) -> object:
    spec = gloo_spec(rank if rank < 2 else 1, 2, port, timeout_s=TIMEOUT_S, token=TOKEN, run_id=RUN_ID)
    if rank == 0:
        rounds = 0
        with ElasticProducerSession(spec) as s:
            # Rounds go on until the second claimant of rank 1 has its answer: a request is read and refused at a
            # round boundary. Bounded: a refusal never comes only if the producer never reads the request.
            while not impostor_done.is_set() and rounds < 500:
                s.send(_model(rounds + 1))
                rounds += 1
                impostor_done.wait(0.05)
            return rounds, s.members
    if rank == 1:
        with ElasticConsumerSession(spec, verify=True) as s:
            got = []
            while (r := s.receive(lambda batch: None)) is not None:
                got.append((r.round, r.members, r.verified))
                holder_in.set()
            return got
    assert holder_in.wait(EVENT_WAIT_S)  # rank 1 is held: it has received a round
    start = time.monotonic()
    try:
        ElasticConsumerSession(spec)  # the run's token and id, and a rank a live consumer holds
        return "admitted"
    except RefitError as e:
        stats["refused"] = time.monotonic() - start
        return type(e).__name__, str(e)
    finally:
        impostor_done.set()


def test_a_second_process_asking_for_a_live_consumers_rank_is_refused():
    ctx = mp.get_context(rank_harness.START_METHOD)
    stats = mp.Manager().dict()
    (rounds, members), holder, impostor = run_ranks(_rank_taken, 3, ctx.Event(), ctx.Event(), stats, timeout=120.0)
    assert rounds < 500 and members == [1]
    assert [r[0] for r in holder] == list(range(1, rounds + 1))
    assert all(m == [1] and verified for _, m, verified in holder), holder
    kind, message = impostor
    assert kind == "ConfigError" and "\n" not in message, impostor
    assert message.startswith("group.rank=1 is held by a live consumer of this run"), message
    _record(
        "a second process asks for a live consumer's rank (run's token and id)",
        f"it: {message}; the holder and the producer go on",
        stats["refused"],
        "since its request",
    )


def _producer_killed(rank: int, world_size: int, port: int, killed_at) -> object:
    spec = gloo_spec(rank, 3, port, timeout_s=TIMEOUT_S, token=TOKEN)
    if rank == 0:
        chunks = [0]

        def on_chunk(nbytes, ntensors):
            chunks[0] += 1
            if chunks[0] == 8:  # round 2 (6 chunks a round), mid-transfer
                killed_at.value = time.monotonic()
                os.kill(os.getpid(), signal.SIGKILL)

        with ElasticProducerSession(spec, buffer_size_bytes=65536, on_chunk=on_chunk) as s:
            for k in range(1, 4):
                s.send(_model(k))
        return None
    try:
        with ElasticConsumerSession(spec) as s:
            while s.receive(lambda batch: None) is not None:
                pass
        return "no error"
    except RefitError as e:
        return type(e).__name__, str(e), time.monotonic()


def test_producer_killed_consumers_exit_in_one_line():
    killed_at = mp.get_context(rank_harness.START_METHOD).Value("d", 0.0)
    _, *consumers = run_ranks(_producer_killed, 3, killed_at, timeout=120.0, return_exceptions=True)
    for outcome in consumers:
        assert isinstance(outcome, tuple), outcome
        kind, message, ended = outcome
        assert kind == "PeerError" and "\n" not in message and "producer" in message, message
        assert ended - killed_at.value < deadline_budget(TIMEOUT_S), (ended - killed_at.value, message)
    _record(
        "SIGKILL producer mid-transfer (1+2)",
        f"each consumer: {consumers[0][1]}",
        max(ended for _, _, ended in consumers) - killed_at.value,
        "since the kill",
    )


def _all_lost(rank: int, world_size: int, port: int, killed_at) -> object:
    spec = gloo_spec(rank, 2, port, timeout_s=TIMEOUT_S, token=TOKEN)
    if rank == 1:
        with ElasticConsumerSession(spec) as s:
            while (r := s.receive(lambda batch: None)) is not None:
                if r.round == 1:
                    killed_at.value = time.monotonic()
                    os.kill(os.getpid(), signal.SIGKILL)
        return None
    try:
        with ElasticProducerSession(spec) as s:
            for k in range(1, 4):
                s.send(_model(k))
    except PeerError as e:
        return str(e), time.monotonic()
    return "no error"


def test_every_consumer_lost_producer_says_so_in_one_line():
    killed_at = mp.get_context(rank_harness.START_METHOD).Value("d", 0.0)
    producer, consumer = run_ranks(_all_lost, 2, killed_at, timeout=120.0, return_exceptions=True)
    assert isinstance(consumer, RankFailure) and consumer.exc_type == "Died"
    assert isinstance(producer, tuple), producer
    message, ended = producer
    assert "\n" not in message and message.startswith("round 2: every consumer was lost (rank 1: "), message
    assert ended - killed_at.value < 2 * deadline_budget(TIMEOUT_S), (ended - killed_at.value, message)
    _record("SIGKILL the only consumer (1+1)", f"producer: {message}", ended - killed_at.value, "since the kill")


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"token": None}, "needs group.token"),
        ({"topology": "chain"}, "needs group.topology=tree"),
    ],
)
def test_continue_refuses_what_it_cannot_run_on(fields, expected):
    with pytest.raises(ConfigError, match=expected):
        ElasticProducerSession(_spec(0, 1, **fields))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["refit.on_consumer_loss=maybe"], "refit.on_consumer_loss='maybe' is invalid: choose one of fail, continue"),
        (
            ["role=local", "group.topology=chain", "refit.on_consumer_loss=continue"],
            "refit.on_consumer_loss=continue needs group.topology=tree",
        ),
        (
            ["role=producer", "group.token=null", "refit.on_consumer_loss=continue"],
            "refit.on_consumer_loss=continue needs group.token",
        ),
        (
            ["role=ray", "refit.on_consumer_loss=continue", "group.backend=shm"],
            "refit.on_consumer_loss=continue runs on gloo only",
        ),
        (
            ["role=ray", "ray.max_restarts=2"],
            "a restarted consumer can rejoin only with refit.on_consumer_loss=continue",
        ),
        (["role=ray", "refit.on_consumer_loss=continue", "ray.max_restarts=-1"], "ray.max_restarts=-1 is invalid"),
    ],
)
def test_config_refuses_continue_where_it_cannot_run(overrides, message):
    assert message in refused(*overrides)


def test_config_continue_is_off_by_default():
    assert settings().refit.on_consumer_loss == "fail"
    assert settings("role=local", "refit.on_consumer_loss=continue").refit.elastic


def test_local_run_lists_the_members_of_every_round(cli, tmp_path):
    result = cli(
        "role=local",
        "role.num_consumers=2",
        "refit.rounds=3",
        "refit.delta=on",
        "refit.on_consumer_loss=continue",
        "sink=verify",
        COVER_STARTUP,
    )
    assert_ok(result)
    metrics = local_metrics(tmp_path)
    assert metrics["status"] == "ok" and metrics["verified"] is True
    assert [r["members"] for r in metrics["rounds"]] == [[1, 2]] * 3
    for consumer in metrics["consumers"]:
        assert [r["members"] for r in consumer["rounds"]] == [[1, 2]] * 3
        assert [r["delta"] for r in consumer["rounds"]] == [False, True, True]


def test_a_consumer_that_received_no_round_counts_as_lost_and_is_not_verified():
    """A consumer restarted too late for the last round (role=ray, role=local) delivered nothing: the run is ok (the
    producer completed every round), but that consumer is lost, not verified, and the summary says so."""
    s = settings("role=local", "role.num_consumers=2", "refit.on_consumer_loss=continue")
    rounds = [{"round": 1, "members": [1, 2], "verified": True}]
    outcomes = [
        RankOutcome(0, True, {"role": "producer", "rank": 0, "status": "ok", "bytes": 8, "rounds": rounds}),
        RankOutcome(1, True, {"role": "consumer", "rank": 1, "status": "ok", "verified": True, "rounds": rounds}),
        RankOutcome(2, True, {"role": "consumer", "rank": 2, "status": "ok", "verified": None, "rounds": []}),
    ]
    combined = combine_outcomes(outcomes, s, "local", {2: {"restarts": 1}})
    first, late = combined["consumers"]
    assert (first["status"], late["status"], late["error"], late["restarts"]) == ("ok", "failed", NO_ROUND, 1)
    assert combined["status"] == "ok" and combined["verified"] is True
    assert summary_line(combined).endswith(", 2 consumers (consumer 2 lost), verified"), summary_line(combined)
    # Without continue a consumer with no round is no special case (a one-shot run always has its round).
    one_shot = combine_outcomes(outcomes, settings("role=local", "role.num_consumers=2"), "local")
    assert one_shot["consumers"][1]["status"] == "ok"
