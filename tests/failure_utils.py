"""Run ``python -m refit_app`` as real processes, break them on purpose, and never leave one behind.

Every process runs in its own session (so ``role=local``'s children go down with it), writes stdout and stderr to
files (a full pipe would stall a rank and look like a hang), and is waited on with a hard limit past which it is
killed and the test fails. :class:`Launcher` kills whatever is still running when a test ends, passed or not.

Ranks of one refit start *gated* (:meth:`Launcher.start_together`): each runs its whole start-up and stops at the
door of the rendezvous; all are let in at once, so every deadline under test starts at a moment the test knows,
however long start-up took on a loaded machine.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch
from cli_utils import hermetic_env

from refit_app.checkpoint.writer import save_tensors

_POLL_S = 0.05


@dataclass
class Outcome:
    """How one process ended."""

    name: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    """From start to exit, interpreter start-up included; for a gated process, from its release, the moment it
    entered the rendezvous (where its ``group.timeout_s`` starts)."""
    since_event_s: float | None = None
    """From the failure the test caused (a kill, a stop) to exit; None where the test caused none."""

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    @property
    def error(self) -> str:
        """The single stderr line a failed run must print (the test asserts there is exactly one)."""
        lines = self.error_lines
        return lines[-1] if lines else ""

    def describe(self) -> str:
        return (
            f"{self.name}: exit {self.returncode} after {self.seconds:.1f}s\n--- stderr ---\n{self.stderr[-3000:]}"
            f"\n--- stdout (tail) ---\n{self.stdout[-3000:]}"
        )


_GATED_MAIN = """
import os, runpy, sys
import refit_app.__main__  # the entry point's own start-up (it sets up logging before torch loads), not main()
import refit_app.app.roles  # what runs the ranks (the app imports it lazily); its imports are the slow part
del sys.modules["refit_app.__main__"]  # run_module executes it afresh, as __main__

def _find_connect():
    found = {
        id(f): f
        for name, m in list(sys.modules.items())
        if name.startswith("refit_app") and callable(f := getattr(m, "connect", None))
        and getattr(f, "__module__", "").startswith("refit_app")
    }
    if len(found) != 1:
        sys.exit(f"test gate: expected one refit_app connect(), found {len(found)}; update failure_utils")
    return next(iter(found.values()))

_connect = _find_connect()

def _gated_connect(*args, **kwargs):
    if not sys.stdin.closed:
        open(os.environ["REFIT_TEST_READY_FILE"], "w").close()
        sys.stdin.readline()
        sys.stdin.close()
    return _connect(*args, **kwargs)

for m in list(sys.modules.values()):
    if getattr(m, "__name__", "").startswith("refit_app") and getattr(m, "connect", None) is _connect:
        m.connect = _gated_connect
runpy.run_module("refit_app", run_name="__main__", alter_sys=True)
"""
"""``python -m refit_app`` that runs its whole start-up (imports, Hydra, config, source and sink) and then waits for
a line on stdin at the door of the rendezvous, before ``connect()`` starts its ``group.timeout_s``.

Ranks of one refit are started together this way: start-up takes from 3 to 30 seconds on a loaded 2-core machine
(10 s from torch loaded to the rendezvous alone was measured), and a rank that starts that much later than its
peers misses a short rendezvous deadline. Gated, start-up is outside every deadline, and the release is the moment
the deadline starts. A process that exits before the gate (it never reached the rendezvous) fails
:meth:`RefitProcess.wait_ready` with its output."""


class RefitProcess:
    """One ``python -m refit_app ...`` process; ``gated`` ones wait for :meth:`release` before they run."""

    def __init__(
        self, name: str, cwd: Path, overrides: list[str], env: dict[str, str] | None = None, *, gated: bool = False
    ) -> None:
        self.name = name
        self.cwd = cwd
        self.overrides = overrides
        self._out_path = cwd / f"{name}.stdout"
        self._err_path = cwd / f"{name}.stderr"
        self._ready_path = cwd / f"{name}.ready" if gated else None
        child_env = hermetic_env({"PYTHONUNBUFFERED": "1", **(env or {})})
        if self._ready_path is not None:
            child_env["REFIT_TEST_READY_FILE"] = str(self._ready_path)
        command = ["-c", _GATED_MAIN] if gated else ["-m", "refit_app"]
        with open(self._out_path, "wb") as out, open(self._err_path, "wb") as err:
            self.started = time.monotonic()
            self._popen = subprocess.Popen(
                [sys.executable, *command, *overrides],
                cwd=cwd,
                env=child_env,
                stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        self.outcome: Outcome | None = None

    def wait_ready(self, timeout_s: float) -> None:
        """Block until a gated process has started up and waits at the rendezvous for :meth:`release`."""
        assert self._ready_path is not None, f"{self.name} is not gated"
        deadline = time.monotonic() + timeout_s
        while not self._ready_path.exists():
            if not self.running():
                raise AssertionError(f"{self.name} exited before the rendezvous\n{self.wait(1).describe()}")
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"{self.name} did not reach the rendezvous within {timeout_s:g}s of start-up\n{self.output()}"
                )
            time.sleep(_POLL_S)

    def release(self) -> None:
        """Let a gated process into the rendezvous; its clock starts now, as its ``group.timeout_s`` does."""
        assert self._popen.stdin is not None, f"{self.name} is not gated"
        self.started = time.monotonic()
        self._popen.stdin.write(b"go\n")
        self._popen.stdin.close()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def running(self) -> bool:
        return self._popen.poll() is None

    def output(self) -> str:
        return self._out_path.read_text(errors="replace") + self._err_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float) -> float:
        """Block until ``pattern`` (a regex) shows up in the output; fail if the process exits or time runs out.
        Returns the seconds from start (a gated process: from its release) to when it was seen."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while not regex.search(self.output()):
            if not self.running():
                raise AssertionError(f"{self.name} exited before printing {pattern!r}\n{self.wait(1).describe()}")
            if time.monotonic() >= deadline:
                raise AssertionError(f"{self.name} did not print {pattern!r} within {timeout_s:g}s:\n{self.output()}")
            time.sleep(_POLL_S)
        return time.monotonic() - self.started

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process (not its session: role=local children must see their parent vanish)."""
        self._popen.send_signal(sig)

    def wait(self, timeout_s: float, *, event_at: float | None = None) -> Outcome:
        """Wait up to ``timeout_s`` for the exit; a process still running then is killed and the test fails."""
        if self.outcome is not None:
            return self.outcome
        try:
            self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{self.name} hung: still running {timeout_s:g}s later; killed\n{self.output()[-4000:]}"
            ) from None
        ended = time.monotonic()
        self.outcome = Outcome(
            self.name,
            self._popen.returncode,
            self._out_path.read_text(errors="replace"),
            self._err_path.read_text(errors="replace"),
            ended - self.started,
            None if event_at is None else ended - event_at,
        )
        return self.outcome

    def kill(self) -> None:
        """Kill the whole session (role=local spawns ranks); resume it first in case a test stopped it."""
        if self._popen.stdin is not None and not self._popen.stdin.closed:
            self._popen.stdin.close()
        if self._popen.poll() is not None:
            return
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(self._popen.pid, sig)
            except ProcessLookupError:
                break
        self._popen.wait(timeout=10)


class Launcher:
    """Starts refit processes in one directory and kills every one of them on exit."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self._procs: list[RefitProcess] = []

    def start(self, name: str, *overrides: str, env: dict[str, str] | None = None) -> RefitProcess:
        proc = RefitProcess(name, self.cwd, list(overrides), env)
        self._procs.append(proc)
        return proc

    def start_together(
        self, ranks: dict[str, list[str]], startup_limit_s: float, envs: dict[str, dict[str, str]] | None = None
    ) -> dict[str, RefitProcess]:
        """Start one gated process per ``name: overrides`` and let them all into the rendezvous at once, when every
        one has started up (each within ``startup_limit_s``, a hang limit: no deadline under test includes it).
        ``envs``: extra environment variables of the process of that name."""
        envs = envs or {}
        procs = {
            name: RefitProcess(name, self.cwd, overrides, envs.get(name), gated=True)
            for name, overrides in ranks.items()
        }
        self._procs.extend(procs.values())
        for proc in procs.values():
            proc.wait_ready(startup_limit_s)
        for proc in procs.values():
            proc.release()
        return procs

    def __enter__(self) -> Launcher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for proc in self._procs:
            proc.kill()


# ---------------------------------------------------------------------------------------------------------------
# Files the bad-input cases start from, and a way to prove they were left alone.


def write_checkpoint(directory: Path, seed: int = 0) -> None:
    """A small valid single-file checkpoint: the "existing output" a failed run must not touch."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    save_tensors(
        directory / "model.safetensors",
        {"a.weight": torch.randn(16, 8, generator=g), "b.bias": torch.arange(5, dtype=torch.int64)},
        {"format": "pt"},
    )


def snapshot(root: Path, only: Iterable[str] | None = None) -> dict[str, str]:
    """Every file under ``root`` (or those of ``only`` that exist) with a hash of its bytes."""
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    names = listing(root) if only is None else listing(root) & set(only)
    return {name: hashlib.sha256((root / name).read_bytes()).hexdigest() for name in sorted(names)}


def listing(root: Path) -> set[str]:
    """Names of every file under ``root``, without reading them (a half-written checkpoint can be large)."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
