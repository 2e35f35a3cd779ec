"""Failure behaviour of ``python -m refit_app`` (issue 4), with real processes.

Every case checks the same contract: each process that is not the victim exits non-zero with exactly one line on
stderr (``refit_app: error: ...``, no traceback) that names what went wrong, within its deadlines of the failure
(``deadline_budget``: a stated multiple of ``group.timeout_s`` plus exit slack), and no output that existed before
is touched.

Time is measured from the event a deadline is about, never from process start: from the SIGKILL/SIGSTOP, or from
the moment the ranks entered the rendezvous (they start gated, see ``failure_utils``, so start-up, 3 to 30 s on a
loaded 2-core machine, is outside every deadline). Readiness is waited for by a signal (the gate's file, a log
line), never by sleeping.

Each process spends seconds importing torch on a 2-core machine, so the cases run as *scenarios* in a thread
pool: the module fixture starts the scenarios of the selected tests at once, and each test waits for its own and
checks it. Every process has a hard limit and is killed when its scenario ends, whatever happened.

Set ``REFIT_FAILURE_TABLE=path.md`` to write the table of exit codes, messages and exit times the run measured.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import conditions
import pytest
import torch
from conditions import needs_no_cuda
from failure_utils import Launcher, Outcome, RefitProcess, listing, snapshot, write_checkpoint
from mp_utils import STARTUP_LIMIT_S, deadline_budget, free_port

from refit_app.checkpoint.writer import save_tensors
from refit_app.models.sources import SyntheticSource
from refit_app.packed_tensor import chunk_ids

TIMEOUT_S = 6
"""group.timeout_s of every case: short, so that deadline cases stay cheap."""
BUDGET_S = deadline_budget(TIMEOUT_S)
"""The most a deadline assert allows from the event (a kill, a stop, entering the rendezvous) to the exit."""
HANG_LIMIT_S = 4 * BUDGET_S
"""Hard limit after a gated process's release, or after a kill or stop: four times what any deadline assert allows,
so only a hang reaches it (the process is killed and the test fails)."""
FROM_START_LIMIT_S = STARTUP_LIMIT_S + HANG_LIMIT_S
"""Hard limit for a process that is not gated: its start-up (while the pool starts a dozen others), then its run."""
HANDSHAKE_DONE = r"accepted the manifest"
"""The producer logs this after the handshake, right before the first chunk moves."""
MID_TRANSFER_DELAY_S = 0.3
# Not a wait for readiness (HANDSHAKE_DONE is the signal that the transfer starts): it only moves the kill or stop
# into the transfer, which lasts seconds here (1 GiB at about 0.3 GB/s through gloo, longer under load). Had the
# transfer ended first, the producer would succeed and the test would fail, not pass.
LONG_SOURCE = ("source.preset=llama-1b", "source.size=1GiB", "refit.buffer_size_bytes=8MiB")
LOCAL_TIMEOUT_S = STARTUP_LIMIT_S
"""group.timeout_s for role=local: it spawns its ranks itself, ungated, so the gap between their start-ups (up to one
start-up under load) is inside its rendezvous deadline. The case using it fails on purpose, but not by a deadline."""
POOL_WORKERS = 6
LOST_OR_LATE = rf"within {TIMEOUT_S}s|rank \d|may have died"
"""What a survivor's message must say: the deadline passed, or which rank (or that a rank) was lost."""
ERROR_PREFIX = "refit_app: error: "


# ---------------------------------------------------------------------------------------------------------------
# Scenario machinery


@dataclass
class Result:
    """What a scenario observed: the outcome of each process, plus anything else its test checks."""

    outcomes: dict[str, Outcome] = field(default_factory=dict)
    before: dict[str, str] = field(default_factory=dict)
    after: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


SCENARIOS: dict[str, Callable[[Path], Result]] = {}
TABLE: list[tuple[str, str, int, str, float, str]] = []


def scenario(fn: Callable[[Path], Result]) -> Callable[[Path], Result]:
    SCENARIOS[fn.__name__] = fn
    return fn


def _record(case: str, *outcomes: Outcome, gated: bool = True) -> None:
    for o in outcomes:
        if o.since_event_s is not None:
            seconds, since = o.since_event_s, "failure"
        else:
            seconds, since = o.seconds, "rendezvous" if gated else "start"
        TABLE.append((case, o.name, o.returncode, o.error, seconds, since))


def _selected_cases(request: pytest.FixtureRequest) -> list[str]:
    names = []
    for item in request.session.items:
        if item.module is not request.module or conditions.unmet(item):
            continue  # another module's, or skipped here: no processes for it
        callspec = getattr(item, "callspec", None)
        name = callspec.params["case"].name if callspec and "case" in callspec.params else None
        name = name or item.originalname.removeprefix("test_")
        if name in SCENARIOS and name not in names:
            names.append(name)
    return names


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    pool = ThreadPoolExecutor(max_workers=POOL_WORKERS, thread_name_prefix="scenario")
    futures = {name: pool.submit(SCENARIOS[name], tmp_path_factory.mktemp(name)) for name in _selected_cases(request)}
    try:
        yield futures
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _write_table()


def _write_table() -> None:
    path = os.environ.get("REFIT_FAILURE_TABLE")
    if not path or not TABLE:
        return
    lines = [
        f"Measured by tests/test_failures.py with group.timeout_s={TIMEOUT_S}. Seconds since failure: from the "
        "SIGKILL/SIGSTOP. Since rendezvous: from the moment a multi-rank case's ranks, start-up done, entered the "
        "rendezvous together; since start: a bad-input case, from process start, torch and Hydra imports included.",
        "",
        "| case | process | exit code | message (stderr line) | seconds to exit |",
        "|---|---|---|---|---|",
    ]
    for case, name, rc, error, seconds, since in sorted(TABLE):
        message = error.replace("|", "\\|")
        lines.append(f"| {case} | {name} | {rc} | `{message}` | {seconds:.1f} (since {since}) |")
    Path(path).write_text("\n".join(lines) + "\n")


def outcome_of(results: dict[str, Future], name: str) -> Result:
    return results[name].result(timeout=600)


def assert_failed_cleanly(o: Outcome, *expected: str) -> None:
    """Non-zero exit, exactly one ``refit_app: error:`` line on stderr, containing every ``expected`` fragment."""
    details = o.describe()
    assert o.returncode != 0, details
    assert "Traceback" not in o.stderr, details
    assert len(o.error_lines) == 1, details
    assert o.error.startswith(ERROR_PREFIX), details
    for fragment in expected:
        assert fragment in o.error, f"{fragment!r} not in the error line\n{details}"


def assert_within_deadline(o: Outcome) -> None:
    """Exited within its deadlines of the failure (of entering the rendezvous, where the test caused none)."""
    if o.since_event_s is None:
        seconds, since = o.seconds, "entering the rendezvous"
    else:
        seconds, since = o.since_event_s, "the failure"
    assert seconds <= BUDGET_S, (
        f"{o.name} exited {seconds:.1f}s after {since}; group.timeout_s={TIMEOUT_S} allows {BUDGET_S:g}s "
        f"(deadline_budget)\n{o.describe()}"
    )


def gave_up_after(proc: RefitProcess) -> float:
    """Seconds from a gated process's release to its error line (polled, so not its exit: teardown excluded)."""
    return proc.wait_for(re.escape(ERROR_PREFIX), HANG_LIMIT_S)


def assert_waited_its_deadline(res: Result, name: str) -> None:
    """``name`` gave up no earlier than ``group.timeout_s`` after entering the rendezvous: its deadline was not cut
    short. Load cannot fail this: the release precedes the deadline's start, and the error line follows the end."""
    seconds = res.extra["gave_up_after"][name]
    assert seconds >= TIMEOUT_S, (
        f"{name} gave up {seconds:.1f}s after entering the rendezvous; group.timeout_s={TIMEOUT_S}\n"
        f"{res.outcomes[name].describe()}"
    )


def group_args(port: int, world_size: int) -> list[str]:
    return [f"group.port={port}", f"group.world_size={world_size}", f"group.timeout_s={TIMEOUT_S}"]


def consumer_args(port: int, world_size: int, rank: int, *more: str) -> list[str]:
    return ["role=consumer", *group_args(port, world_size), f"group.rank={rank}", *more]


def producer_args(port: int, world_size: int, *more: str) -> list[str]:
    return ["role=producer", *group_args(port, world_size), *more]


def wait_all(
    procs: list[RefitProcess], event_at: float | None = None, limit_s: float = HANG_LIMIT_S
) -> dict[str, Outcome]:
    """Every process's outcome, each waited for up to ``limit_s`` (a gated process's run: from its release)."""
    return {p.name: p.wait(limit_s, event_at=event_at) for p in procs}


def metrics_statuses(cwd: Path) -> dict[str, str]:
    """``status`` of every metrics.json the runs in ``cwd`` wrote, by output directory name."""
    return {p.parent.name: json.loads(p.read_text())["status"] for p in sorted((cwd / "outputs").rglob("metrics.json"))}


# ---------------------------------------------------------------------------------------------------------------
# Peers that die, stall or never show up


def _kill_mid_transfer(cwd: Path, world_size: int, victim: str, sig: signal.Signals) -> Result:
    port = free_port()
    res = Result()
    with Launcher(cwd) as launcher:
        ranks = {"producer": producer_args(port, world_size, *LONG_SOURCE)}
        for rank in range(1, world_size):
            ranks[f"consumer{rank}"] = consumer_args(port, world_size, rank, "sink=discard")
        procs = launcher.start_together(ranks, STARTUP_LIMIT_S)
        procs["producer"].wait_for(HANDSHAKE_DONE, HANG_LIMIT_S)
        time.sleep(MID_TRANSFER_DELAY_S)
        event_at = time.monotonic()
        procs[victim].signal(sig)
        others = [p for name, p in procs.items() if name != victim]
        res.outcomes = wait_all(others, event_at)
        if sig == signal.SIGSTOP:
            # The stalled rank, once resumed, must not claim a refit that its peers gave up on.
            procs[victim].signal(signal.SIGCONT)
            res.outcomes[victim] = procs[victim].wait(HANG_LIMIT_S, event_at=event_at)
    res.extra["statuses"] = metrics_statuses(cwd)
    return res


@scenario
def kill_consumer(cwd: Path) -> Result:
    res = _kill_mid_transfer(cwd, 2, "consumer1", signal.SIGKILL)
    _record("SIGKILL consumer mid-transfer (1+1)", *res.outcomes.values())
    return res


@scenario
def kill_one_of_two_consumers(cwd: Path) -> Result:
    res = _kill_mid_transfer(cwd, 3, "consumer1", signal.SIGKILL)
    _record("SIGKILL consumer 1 of 2 mid-transfer", *res.outcomes.values())
    return res


@scenario
def kill_producer(cwd: Path) -> Result:
    res = _kill_mid_transfer(cwd, 3, "producer", signal.SIGKILL)
    _record("SIGKILL producer mid-transfer (1+2)", *res.outcomes.values())
    return res


@scenario
def stall_consumer(cwd: Path) -> Result:
    res = _kill_mid_transfer(cwd, 3, "consumer1", signal.SIGSTOP)
    _record("SIGSTOP consumer 1 of 2 mid-transfer", *res.outcomes.values())
    return res


@scenario
def stall_producer(cwd: Path) -> Result:
    res = _kill_mid_transfer(cwd, 2, "producer", signal.SIGSTOP)
    _record("SIGSTOP producer mid-transfer (1+1)", *res.outcomes.values())
    return res


@scenario
def producer_alone(cwd: Path) -> Result:
    with Launcher(cwd) as launcher:
        procs = launcher.start_together({"producer": producer_args(free_port(), 2)}, STARTUP_LIMIT_S)
        gave_up = {"producer": gave_up_after(procs["producer"])}
        res = Result(wait_all(list(procs.values())), extra={"gave_up_after": gave_up})
    _record("producer alone (no consumer shows up)", *res.outcomes.values())
    return res


@scenario
def consumer_missing(cwd: Path) -> Result:
    port = free_port()
    with Launcher(cwd) as launcher:
        procs = launcher.start_together(
            {"producer": producer_args(port, 3), "consumer1": consumer_args(port, 3, 1)}, STARTUP_LIMIT_S
        )
        gave_up = {"producer": gave_up_after(procs["producer"])}
        res = Result(wait_all(list(procs.values())), extra={"gave_up_after": gave_up})
    _record("1 of 2 consumers never shows up", *res.outcomes.values())
    return res


@scenario
def consumer_alone(cwd: Path) -> Result:
    with Launcher(cwd) as launcher:
        procs = launcher.start_together({"consumer1": consumer_args(free_port(), 2, 1)}, STARTUP_LIMIT_S)
        gave_up = {"consumer1": gave_up_after(procs["consumer1"])}
        res = Result(wait_all(list(procs.values())), extra={"gave_up_after": gave_up})
    _record("consumer alone (no producer; nothing listening)", *res.outcomes.values())
    return res


def test_kill_consumer(results: dict[str, Future]) -> None:
    res = outcome_of(results, "kill_consumer")
    producer = res.outcomes["producer"]
    assert_failed_cleanly(producer)
    assert re.search(LOST_OR_LATE, producer.error), producer.describe()
    assert_within_deadline(producer)
    assert set(res.extra["statuses"].values()) == {"failed"}, res.extra


@pytest.mark.slow
def test_kill_one_of_two_consumers(results: dict[str, Future]) -> None:
    res = outcome_of(results, "kill_one_of_two_consumers")
    for name in ("producer", "consumer2"):
        o = res.outcomes[name]
        assert_failed_cleanly(o)
        assert re.search(LOST_OR_LATE, o.error), o.describe()
        assert_within_deadline(o)
    assert set(res.extra["statuses"].values()) == {"failed"}, res.extra


@pytest.mark.slow
def test_kill_producer(results: dict[str, Future]) -> None:
    res = outcome_of(results, "kill_producer")
    for name in ("consumer1", "consumer2"):
        o = res.outcomes[name]
        assert_failed_cleanly(o, "rank 0")
        assert_within_deadline(o)


@pytest.mark.slow
def test_stall_consumer(results: dict[str, Future]) -> None:
    res = outcome_of(results, "stall_consumer")
    for name in ("producer", "consumer2"):
        o = res.outcomes[name]
        assert_failed_cleanly(o)
        assert_within_deadline(o)
    assert res.outcomes["consumer1"].returncode != 0, res.outcomes["consumer1"].describe()
    assert set(res.extra["statuses"].values()) == {"failed"}, res.extra


@pytest.mark.slow
def test_stall_producer(results: dict[str, Future]) -> None:
    res = outcome_of(results, "stall_producer")
    o = res.outcomes["consumer1"]
    assert_failed_cleanly(o, "rank 0")
    assert_within_deadline(o)
    assert res.outcomes["producer"].returncode != 0, res.outcomes["producer"].describe()
    assert set(res.extra["statuses"].values()) == {"failed"}, res.extra


def test_producer_alone(results: dict[str, Future]) -> None:
    res = outcome_of(results, "producer_alone")
    o = res.outcomes["producer"]
    assert_failed_cleanly(o, "rank 1 did not join", f"within {TIMEOUT_S}s")
    assert_waited_its_deadline(res, "producer")
    assert_within_deadline(o)


def test_consumer_missing(results: dict[str, Future]) -> None:
    res = outcome_of(results, "consumer_missing")
    for o in res.outcomes.values():
        assert_failed_cleanly(o, f"within {TIMEOUT_S}s")
        assert_within_deadline(o)
    assert "rank 2 did not join" in res.outcomes["producer"].error
    assert_waited_its_deadline(res, "producer")


def test_consumer_alone(results: dict[str, Future]) -> None:
    res = outcome_of(results, "consumer_alone")
    o = res.outcomes["consumer1"]
    assert_failed_cleanly(o, "could not reach the producer", f"within {TIMEOUT_S}s", "group.port")
    assert_waited_its_deadline(res, "consumer1")
    assert_within_deadline(o)


# ---------------------------------------------------------------------------------------------------------------
# One consumer fails: every rank fails, with its reason


def _tiny_chunk_tensor(buffer_size: int, chunk: int) -> str:
    """The tensor the corrupt_chunk hook flips in chunk ``chunk`` of the default synthetic source."""
    metas = SyntheticSource("tiny", None, 0, torch.bfloat16).manifest_tensors()
    ids = chunk_ids((m.nbytes for m in metas), buffer_size)
    return next(m.name for m, i in zip(metas, ids) if i == chunk and m.nbytes)


CORRUPT_BUFFER_BYTES = 1 << 20
"""Several chunks of the default (tiny) source, so that the hook hits a chunk in the middle."""
CORRUPT_CHUNK = 2


@scenario
def unwritable_sink_on_one_consumer(cwd: Path) -> Result:
    blocker = cwd / "a-file"
    blocker.write_text("not a directory\n")
    port = free_port()
    res = Result(before=snapshot(blocker))
    with Launcher(cwd) as launcher:
        procs = launcher.start_together(
            {
                "producer": producer_args(port, 3),
                "consumer1": consumer_args(port, 3, 1, "sink=save", f"sink.path={blocker}/ckpt"),
                "consumer2": consumer_args(port, 3, 2, "sink=verify"),
            },
            STARTUP_LIMIT_S,
        )
        res.outcomes = wait_all(list(procs.values()))
    res.after = snapshot(blocker)
    res.extra["statuses"] = metrics_statuses(cwd)
    _record("sink.path unwritable on consumer 1 of 2", *res.outcomes.values())
    return res


@scenario
def corrupt_chunk_on_one_consumer(cwd: Path) -> Result:
    port = free_port()
    buffer = [f"refit.buffer_size_bytes={CORRUPT_BUFFER_BYTES}"]
    with Launcher(cwd) as launcher:
        procs = launcher.start_together(
            {
                "producer": producer_args(port, 3, *buffer),
                "consumer1": consumer_args(port, 3, 1, "sink=verify", f"refit.debug.corrupt_chunk={CORRUPT_CHUNK}"),
                "consumer2": consumer_args(port, 3, 2, "sink=verify"),
            },
            STARTUP_LIMIT_S,
        )
        res = Result(wait_all(list(procs.values())))
    res.extra["statuses"] = metrics_statuses(cwd)
    _record("verification fails on consumer 1 of 2 (corrupt_chunk)", *res.outcomes.values())
    return res


def test_unwritable_sink_on_one_consumer(results: dict[str, Future]) -> None:
    res = outcome_of(results, "unwritable_sink_on_one_consumer")
    assert_failed_cleanly(res.outcomes["consumer1"], "a-file/ckpt")
    for name in ("producer", "consumer2"):
        assert_failed_cleanly(res.outcomes[name], "rank 1 failed", "a-file/ckpt")
    assert set(res.extra["statuses"].values()) == {"failed"}, res.extra
    assert res.after == res.before


def test_corrupt_chunk_on_one_consumer(results: dict[str, Future]) -> None:
    res = outcome_of(results, "corrupt_chunk_on_one_consumer")
    tensor = _tiny_chunk_tensor(CORRUPT_BUFFER_BYTES, CORRUPT_CHUNK)
    assert_failed_cleanly(res.outcomes["consumer1"], "verification failed", repr(tensor))
    for name in ("producer", "consumer2"):
        assert_failed_cleanly(res.outcomes[name], "rank 1 failed", "verification failed", repr(tensor))
    assert set(res.extra["statuses"].values()) == {"failed"}, res.extra


@scenario
def local_corrupt_chunk(cwd: Path) -> Result:
    with Launcher(cwd) as launcher:
        proc = launcher.start(
            "local",
            "role=local",
            f"group.timeout_s={LOCAL_TIMEOUT_S:g}",
            f"refit.buffer_size_bytes={CORRUPT_BUFFER_BYTES}",
            f"refit.debug.corrupt_chunk={CORRUPT_CHUNK}",
        )
        res = Result(wait_all([proc], limit_s=FROM_START_LIMIT_S))
    _record("role=local sink=verify refit.debug.corrupt_chunk=2", *res.outcomes.values(), gated=False)
    return res


def test_local_corrupt_chunk(results: dict[str, Future]) -> None:
    o = outcome_of(results, "local_corrupt_chunk").outcomes["local"]
    tensor = _tiny_chunk_tensor(CORRUPT_BUFFER_BYTES, CORRUPT_CHUNK)
    assert_failed_cleanly(o, "verification failed", "differ from what the producer sent", repr(tensor))


# ---------------------------------------------------------------------------------------------------------------
# Disagreement at the handshake


def _pair(cwd: Path, producer_more: list[str], consumer_more: list[str], consumer_world: int = 2) -> Result:
    port = free_port()
    with Launcher(cwd) as launcher:
        procs = launcher.start_together(
            {
                "producer": producer_args(port, 2, *producer_more),
                "consumer1": consumer_args(port, consumer_world, 1, *consumer_more),
            },
            STARTUP_LIMIT_S,
        )
        return Result(wait_all(list(procs.values())))


@scenario
def buffer_size_mismatch(cwd: Path) -> Result:
    res = _pair(cwd, ["refit.buffer_size_bytes=8MiB"], ["refit.buffer_size_bytes=16MiB"])
    _record("consumer refit.buffer_size_bytes differs", *res.outcomes.values())
    return res


@scenario
def packing_mismatch(cwd: Path) -> Result:
    res = _pair(cwd, [], ["refit.use_legacy_packing=true"])
    _record("consumer refit.use_legacy_packing differs", *res.outcomes.values())
    return res


@scenario
def world_size_mismatch(cwd: Path) -> Result:
    res = _pair(cwd, [], [], consumer_world=3)
    _record("consumer group.world_size differs", *res.outcomes.values())
    return res


@scenario
def duplicate_rank(cwd: Path) -> Result:
    port = free_port()
    with Launcher(cwd) as launcher:
        procs = launcher.start_together(
            {
                "producer": producer_args(port, 3),
                "consumer1a": consumer_args(port, 3, 1),
                "consumer1b": consumer_args(port, 3, 1),
            },
            STARTUP_LIMIT_S,
        )
        res = Result(wait_all(list(procs.values())))
    _record("two consumers claim rank 1", *res.outcomes.values())
    return res


def _stopped_before_transfer(o: Outcome) -> None:
    assert HANDSHAKE_DONE not in o.stdout, o.describe()
    assert not re.search(r"GB/s", o.stdout), o.describe()


def test_buffer_size_mismatch(results: dict[str, Future]) -> None:
    res = outcome_of(results, "buffer_size_mismatch")
    for o in res.outcomes.values():
        assert_failed_cleanly(o, "refit.buffer_size_bytes differs", "8 MiB (8388608)", "16 MiB (16777216)")
        _stopped_before_transfer(o)


def test_packing_mismatch(results: dict[str, Future]) -> None:
    res = outcome_of(results, "packing_mismatch")
    for o in res.outcomes.values():
        assert_failed_cleanly(o, "refit.use_legacy_packing differs", "producer false", "consumer true")
        _stopped_before_transfer(o)


def test_world_size_mismatch(results: dict[str, Future]) -> None:
    res = outcome_of(results, "world_size_mismatch")
    for o in res.outcomes.values():
        assert_failed_cleanly(o, "group.world_size differs", "the producer has 2", "consumer rank 1 has 3")


def test_duplicate_rank(results: dict[str, Future]) -> None:
    res = outcome_of(results, "duplicate_rank")
    for o in res.outcomes.values():
        assert_failed_cleanly(o, "group.rank=1 is claimed by two consumers")


# ---------------------------------------------------------------------------------------------------------------
# sink=save killed mid-way


@scenario
def save_killed_midway(cwd: Path) -> Result:
    target = cwd / "ckpt"
    write_checkpoint(target)
    port = free_port()
    res = Result(before=snapshot(target))
    with Launcher(cwd) as launcher:
        procs = launcher.start_together(
            {
                "producer": producer_args(port, 2, *LONG_SOURCE),
                "consumer1": consumer_args(port, 2, 1, "sink=save", f"sink.path={target}"),
            },
            STARTUP_LIMIT_S,
        )
        producer, consumer = procs["producer"], procs["consumer1"]
        producer.wait_for(HANDSHAKE_DONE, HANG_LIMIT_S)
        time.sleep(MID_TRANSFER_DELAY_S)
        event_at = time.monotonic()
        consumer.signal(signal.SIGKILL)
        res.outcomes = wait_all([producer], event_at)
    res.after = snapshot(target, only=res.before)
    res.extra["new_files"] = sorted(listing(target) - set(res.before))
    # A save writes into a hidden directory beside its target, swapped in whole only once complete.
    res.extra["staged"] = sorted(str(p.relative_to(cwd)) for p in cwd.glob(".ckpt.refit-save-*/*"))
    _record("sink=save consumer SIGKILLed mid-transfer", *res.outcomes.values())
    return res


@pytest.mark.slow
def test_save_killed_midway(results: dict[str, Future]) -> None:
    res = outcome_of(results, "save_killed_midway")
    assert_failed_cleanly(res.outcomes["producer"])
    assert_within_deadline(res.outcomes["producer"])
    assert res.extra["new_files"] == [], "the killed save left files in the checkpoint's directory"
    # The killed consumer was writing: its temporary file is there, in a hidden directory beside the target.
    staged = res.extra["staged"]
    assert staged, "no temporary file: the consumer was not killed while saving"
    assert all(
        re.fullmatch(r"\.ckpt\.refit-save-[0-9a-f]{12}/\.model\.safetensors\.[0-9a-f]+\.tmp", n) for n in staged
    ), staged
    assert res.after == res.before


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one line, non-zero exit, nothing lost


@dataclass
class BadInput:
    name: str
    overrides: tuple[str, ...]
    expected: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[Path], None] | None = None
    """Creates the files the case points at, in the case's directory (the process's cwd)."""
    uses_sink: bool = True
    """Whether the case also names a prior checkpoint as sink.path, to show it stays untouched."""
    marks: tuple = ()
    """What the case needs from the machine (:mod:`conditions`)."""

    def __str__(self) -> str:
        return self.name


def _truncated(cwd: Path) -> None:
    path = save_tensors(cwd / "model.safetensors", {"w": torch.ones(64, 64), "b": torch.zeros(64)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _bad_header(cwd: Path) -> None:
    path = save_tensors(cwd / "model.safetensors", {"w": torch.ones(8, 8)})
    data = bytearray(path.read_bytes())
    data[8:12] = b"#!?{"
    path.write_bytes(bytes(data))


def _missing_shard(cwd: Path) -> None:
    model = cwd / "model"
    model.mkdir()
    save_tensors(model / "model-00001-of-00002.safetensors", {"a": torch.ones(4)})
    index = {
        "metadata": {"total_size": 32},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index))


def _empty_dir(cwd: Path) -> None:
    (cwd / "model").mkdir()
    (cwd / "model" / "README.md").write_text("weights elsewhere\n")


def _unwritable_target(cwd: Path) -> None:
    (cwd / "a-file").write_text("not a directory\n")


HELD_PORT = "{held_port}"
"""Replaced by a port the test holds a listening socket on."""
FREE_PORT = "{free_port}"
"""Replaced by a port nothing listens on."""

BAD_INPUTS = [
    BadInput("unknown_role", ("role=lol",), ("role=lol is not an option", "consumer, local, producer")),
    BadInput("misspelled_key", ("refit.bufer_size_bytes=8MiB",), ("refit.bufer_size_bytes",)),
    BadInput("negative_buffer_size", ("refit.buffer_size_bytes=-1",), ("refit.buffer_size_bytes", "-1")),
    BadInput("zero_buffer_size", ("refit.buffer_size_bytes=0",), ("refit.buffer_size_bytes", "more than 0 bytes")),
    BadInput(
        "unparsable_buffer_size", ("refit.buffer_size_bytes=12XB",), ("refit.buffer_size_bytes", "12XB", "256MiB")
    ),
    BadInput("zero_num_buffers", ("refit.num_buffers=0",), ("refit.num_buffers=0", ">= 1")),
    BadInput("num_buffers_env", (), ("NRL_REFIT_NUM_BUFFERS", "abc"), env={"NRL_REFIT_NUM_BUFFERS": "abc"}),
    BadInput(
        "source_path_missing",
        ("source=safetensors", "source.path=no-such-model"),
        ("source.path", "no-such-model", "no such file or directory"),
    ),
    BadInput(
        "source_dir_without_safetensors",
        ("source=safetensors", "source.path=model"),
        ("model", "safetensors"),
        setup=_empty_dir,
    ),
    BadInput(
        "source_truncated",
        ("source=safetensors", "source.path=model.safetensors"),
        ("model.safetensors", "truncated"),
        setup=_truncated,
    ),
    BadInput(
        "source_corrupt_header",
        ("source=safetensors", "source.path=model.safetensors"),
        ("model.safetensors", "header"),
        setup=_bad_header,
    ),
    BadInput(
        "source_index_missing_shard",
        ("source=safetensors", "source.path=model"),
        ("model-00002-of-00002.safetensors", "missing"),
        setup=_missing_shard,
    ),
    BadInput(
        "sink_path_not_writable",
        ("sink=save", "sink.path=a-file/ckpt"),
        ("a-file/ckpt",),
        setup=_unwritable_target,
        uses_sink=False,
    ),
    BadInput("port_out_of_range", ("group.port=70000",), ("group.port=70000", "1..65535")),
    BadInput(
        "port_in_use",
        ("role=producer", f"group.port={HELD_PORT}"),
        ("already in use", "group.port"),
        uses_sink=False,
    ),
    BadInput(
        "host_refuses",
        ("role=consumer", f"group.port={FREE_PORT}"),
        ("could not reach the producer", f"within {TIMEOUT_S}s"),
    ),
    BadInput(
        "host_unresolvable",
        ("role=consumer", "group.host=no-such-host.invalid"),
        ("group.host='no-such-host.invalid'", "cannot be resolved"),
    ),
    BadInput(
        "pynccl_without_vllm_or_gpu",
        ("group.backend=pynccl",),
        ("group.backend=pynccl", "vLLM", "GPU"),
        marks=(needs_no_cuda,),
    ),
    BadInput(
        "nccl_without_gpu", ("group.backend=nccl",), ("group.backend=nccl", "GPU", "gloo"), marks=(needs_no_cuda,)
    ),
    BadInput(
        "world_size_below_2",
        ("role=producer", "group.world_size=1"),
        ("group.world_size=1", "in 2..1024"),
        uses_sink=False,
    ),
    BadInput("no_consumers", ("role.num_consumers=0",), ("role.num_consumers=0", "in 1..1023")),
    BadInput("rank_out_of_range", ("role=consumer", "group.rank=2"), ("group.rank=2", "1..1")),
    BadInput("consumer_rank_0", ("role=consumer", "group.rank=0"), ("group.rank=0", "rank 0 is the producer")),
]


def _bad_input_scenario(case: BadInput) -> Callable[[Path], Result]:
    def run(cwd: Path) -> Result:
        if case.setup is not None:
            case.setup(cwd)
        prior = cwd / "prior-checkpoint"
        write_checkpoint(prior)
        previous_run = cwd / "outputs" / "previous-run"
        previous_run.mkdir(parents=True)
        (previous_run / "metrics.json").write_text('{"status": "ok"}\n')
        before = snapshot(cwd)
        sink = ["sink=save", f"sink.path={prior}"] if case.uses_sink else []
        with socket.create_server(("", 0)) as held:
            values = {HELD_PORT: str(held.getsockname()[1]), FREE_PORT: str(free_port())}
            overrides = [_fill(o, values) for o in case.overrides]
            # role=local (no role given) starts its ranks ungated: their start-up gap is inside the rendezvous.
            local = not any(o.startswith("role=") for o in case.overrides)
            timeout = f"group.timeout_s={LOCAL_TIMEOUT_S if local else TIMEOUT_S:g}"
            with Launcher(cwd) as launcher:
                proc = launcher.start(case.name, timeout, *sink, *overrides, env=case.env)
                res = Result(wait_all([proc], limit_s=FROM_START_LIMIT_S))
        after = snapshot(cwd)
        res.before = before
        res.after = {k: after.get(k, "<removed>") for k in before}
        res.extra["new_in_prior"] = sorted(listing(prior) - {"model.safetensors"})
        _record(f"bad input: {case.name}", *res.outcomes.values(), gated=False)
        return res

    return run


def _fill(override: str, values: dict[str, str]) -> str:
    for placeholder, value in values.items():
        override = override.replace(placeholder, value)
    return override


for _case in BAD_INPUTS:
    SCENARIOS[_case.name] = _bad_input_scenario(_case)


@pytest.mark.parametrize("case", [pytest.param(case, marks=case.marks, id=case.name) for case in BAD_INPUTS])
def test_bad_input(case: BadInput, results: dict[str, Future]) -> None:
    res = outcome_of(results, case.name)
    assert_failed_cleanly(res.outcomes[case.name], *case.expected)
    assert res.after == res.before, "a failed run changed files that existed before it"
    assert res.extra["new_in_prior"] == [], "a failed run left files in the existing checkpoint's directory"


def test_full_error_shows_the_traceback(tmp_path: Path) -> None:
    """HYDRA_FULL_ERROR=1 is the escape hatch: the one-line rule must not hide the traceback then."""
    with Launcher(tmp_path) as launcher:
        proc = launcher.start(
            "full", "source=safetensors", "source.path=nope.safetensors", env={"HYDRA_FULL_ERROR": "1"}
        )
        o = proc.wait(FROM_START_LIMIT_S)
    assert o.returncode != 0
    assert "Traceback" in o.stderr, o.describe()
