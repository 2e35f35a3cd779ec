"""Ctrl-C and SIGTERM end a run like any other failure: one stderr line, metrics.json with status "failed" and the
reason, an exit status of 128 + the signal, and no rank left running (nor one that could still publish)."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mp_utils import STARTUP_LIMIT_S

from refit_app.common.errors import Interrupted

REACH_ROUND_3_S = 2 * STARTUP_LIMIT_S
"""A hang limit for the run to reach its third round: two start-ups in sequence (the launcher's, then its ranks'),
on a loaded machine; never a deadline under test."""
EXIT_S = 30.0
"""From the signal to the exit: the launcher stops its ranks at once (SIGKILL), then writes metrics.json; measured
in seconds, so 30 s is a wide margin for a loaded machine, and a launcher that waited out its ranks' deadline
(group.timeout_s, a whole start-up here) would still miss it."""


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from /proc (children of children included)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
            for k in kids:
                if k not in found:
                    found.add(k)
                    todo.append(k)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().split()[2]
        except OSError:
            continue
        if state != "Z":
            alive.add(p)
    return alive


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_the_run_with_metrics_and_no_rank_left(tmp_path: Path, sig: signal.Signals, status: int):
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "refit_app",
                "refit.rounds=1000000",
                "source.size=16MiB",
                "refit.buffer_size_bytes=4MiB",
                f"group.timeout_s={STARTUP_LIMIT_S:g}",
                f"hydra.run.dir={tmp_path / 'run'}",
            ],
            cwd=tmp_path,
            stdout=o,
            stderr=e,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + REACH_ROUND_3_S
        while not re.search(r"round 3/1000000", out.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-2000:] + err.read_text()
            time.sleep(0.05)
        ranks = _descendants(proc.pid)
        assert ranks, "role=local should have rank processes"
        sent = time.monotonic()
        os.kill(proc.pid, sig)  # the launcher only, as a scheduler or `kill` does
        code = proc.wait(EXIT_S)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert code == status, err.read_text()
    assert took <= EXIT_S
    lines = [line for line in err.read_text().splitlines() if line.strip() and not line.startswith("[")]
    assert lines == [f"refit_app: error: interrupted by {sig.name}"], err.read_text()
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (metrics["status"], metrics["error"]) == ("failed", f"interrupted by {sig.name}")
    # Ranks die with their launcher; give the kernel a moment to reap what it killed.
    deadline = time.monotonic() + 10
    while _alive(ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(ranks), f"left running: {_alive(ranks)}"


def test_interrupted_survives_pickling():
    """An Interrupted crosses process boundaries (a result queue, a pool) as itself, with its signal."""
    again = pickle.loads(pickle.dumps(Interrupted(signal.SIGTERM)))
    assert isinstance(again, Interrupted)
    assert (again.signum, again.exit_status, str(again)) == (signal.SIGTERM, 143, "interrupted by SIGTERM")


def test_the_supervisor_raises_a_signal_only_where_it_checks():
    """role=local's launcher notes SIGINT/SIGTERM and raises Interrupted at its loop's next check, never from inside
    whatever it was running (a queue's lock, a join), which could leave a lock taken for the clean-up after it."""
    from refit_app.app.rank_harness import DeferredSignals

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(Interrupted) as raised:
        signals = DeferredSignals()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # the handlers have run: nothing was raised here
            reached = True
            signals.check()
        finally:
            signals.restore()
    assert reached and raised.value.signum == signal.SIGINT and raised.value.exit_status == 130
    assert signal.getsignal(signal.SIGINT) is before

    with pytest.raises(Interrupted):
        signals = DeferredSignals()
        os.kill(os.getpid(), signal.SIGTERM)  # noted during the clean-up: raised once the handlers are restored
        signals.restore()
        signals.check()
