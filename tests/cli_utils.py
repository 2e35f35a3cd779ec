"""``python -m refit_app`` as a user runs it, for tests: a runner (the ``cli`` fixture in conftest.py is one per
test), the limits a run gets, the checks every run's result gets and where a run leaves its files.

Imports neither Hydra nor torch: conftest.py imports it, and the GPU machine runs its tests without Hydra.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mp_utils import STARTUP_LIMIT_S

from refit_app.core.defaults import BUFFER_MEMORY_RATIO_ENV, NUM_BUFFERS_ENV

CLI_TIMEOUT_S = 2 * STARTUP_LIMIT_S
"""Hard limit on one ``python -m refit_app`` run in a test, past which it has hung: a local refit of the tiny model
takes seconds, after two start-ups in sequence (the application's, then its ranks', which import torch), each of
which can take tens of seconds on a loaded 2-core machine. Never a deadline under test; a sweep passes more."""

COVER_STARTUP = f"group.timeout_s={STARTUP_LIMIT_S:g}"
"""A rendezvous deadline as long as a whole start-up, for runs in tests that are not about that deadline. Ranks
started as separate processes without a gate (a producer and a consumer started together, torchrun's workers) can
start up that far apart; ranks that role=local starts together still reach the rendezvous apart by the time the
producer takes to build its source first (importing transformers and loading a model, for source=model)."""

HERMETIC_ENV = (NUM_BUFFERS_ENV, BUFFER_MEMORY_RATIO_ENV, "HYDRA_FULL_ERROR")
"""Variables the application reads (the last is Hydra's own); a developer's shell must not change what a test sees,
so every process a test starts runs without them unless the test sets them."""


def hermetic_env(extra: dict[str, str] | None = None, *, drop: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment without :data:`HERMETIC_ENV` (and ``drop``), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in HERMETIC_ENV and k not in drop}
    env.update(extra or {})
    return env


@dataclass
class CliResult:
    args: list[str]
    """What followed ``python`` on the command line."""
    returncode: int
    stdout: str
    stderr: str
    wall_s: float

    def describe(self) -> str:
        """Everything a failing assertion needs to show."""
        return (
            f"`python {' '.join(self.args)}` exited {self.returncode} after {self.wall_s:.1f}s\n"
            f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"
        )

    def stderr_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


class CliProcess:
    """One started ``python -m refit_app``; ``wait`` collects it or kills its whole process group at the
    deadline (a ``role=local`` run has spawned ranks that must not outlive the test)."""

    def __init__(self, args: Sequence[str], cwd: Path, env: dict[str, str]) -> None:
        self.args = list(args)
        self._started = time.monotonic()
        self._proc = subprocess.Popen(
            [sys.executable, *self.args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def wait(self, timeout_s: float = CLI_TIMEOUT_S) -> CliResult:
        try:
            stdout, stderr = self._proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            stdout, stderr = self._proc.communicate()
            pytest.fail(
                f"`python {' '.join(self.args)}` did not finish within {timeout_s:g}s; killed\n"
                f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
            )
        return CliResult(self.args, self._proc.returncode, stdout, stderr, time.monotonic() - self._started)

    def kill(self) -> None:
        """Kill the process, if still running, and the ranks it spawned: it leads its own process group."""
        if self._proc.poll() is not None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Cli:
    """Runs the application as a user would: its own process, in a fresh working directory (Hydra writes
    ``outputs/`` there), with the application's environment variables cleared unless a test sets them."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self._started: list[CliProcess] = []

    def start(self, *overrides: str, env: dict[str, str] | None = None) -> CliProcess:
        return self.start_command(["-m", "refit_app", *overrides], env=env)

    def start_command(self, args: Sequence[str], env: dict[str, str] | None = None) -> CliProcess:
        """``python *args`` (another entry point: a launcher, an example script) the same way."""
        proc = CliProcess(args, self.cwd, hermetic_env(env))
        self._started.append(proc)
        return proc

    def __call__(
        self, *overrides: str, env: dict[str, str] | None = None, timeout_s: float = CLI_TIMEOUT_S
    ) -> CliResult:
        return self.start(*overrides, env=env).wait(timeout_s)

    def script(self, path: Path, *args: str, timeout_s: float = CLI_TIMEOUT_S) -> CliResult:
        """Run a Python script (an example) the same way."""
        return self.start_command([str(path), *args]).wait(timeout_s)

    def kill_all(self) -> None:
        for proc in self._started:
            proc.kill()


# ---------------------------------------------------------------------------------------------------------------
# What every run's result gets checked for


def assert_ok(result: CliResult) -> None:
    assert result.returncode == 0, result.describe()
    assert "Traceback" not in result.stderr + result.stdout, result.describe()


def assert_one_line_error(result: CliResult, *fragments: str) -> str:
    """Non-zero exit, exactly one line on stderr naming every fragment, no traceback anywhere."""
    assert result.returncode != 0, result.describe()
    lines = result.stderr_lines()
    assert len(lines) == 1, f"expected one line on stderr\n{result.describe()}"
    assert lines[0].startswith("refit_app: error: "), result.describe()
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} missing from the error line\n{result.describe()}"
    assert "Traceback" not in result.stdout, result.describe()
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# Where a run leaves its files


def run_dir(root: Path, name: str) -> Path:
    """The one output directory ``outputs/<date>/<time>_<name>`` a single run made under ``root``."""
    found = sorted((root / "outputs").glob(f"*/*_{name}"))
    assert len(found) == 1, f"expected one outputs/*/*_{name} directory, found {found}"
    return found[0]


def sweep_dir(root: Path) -> Path:
    """The one sweep directory ``outputs/multirun/<date>/<time>`` a single ``-m`` run made under ``root``."""
    found = sorted((root / "outputs" / "multirun").glob("*/*"))
    assert len(found) == 1, f"expected one sweep directory, found {found}"
    return found[0]


def load_metrics(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "metrics.json").read_text())


def local_metrics(root: Path) -> dict[str, Any]:
    """metrics.json of the one ``role=local`` run made under ``root``."""
    return load_metrics(run_dir(root, "local"))
