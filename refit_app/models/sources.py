"""Where the producer's weights come from: a safetensors checkpoint, or a synthetic model-shaped state dict.

Every source states its full list of tensors before any data is read (the handshake sends it to the
consumers), then yields the tensors lazily in that same order, so a model larger than memory streams.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch

from refit_app.checkpoint.reader import Checkpoint, read_companion_files
from refit_app.common.errors import SourceError
from refit_app.common.sizes import format_size
from refit_app.core.meta import TensorMeta, dtype_itemsize
from refit_app.models.defaults import (
    DEFAULT_PRESET,
    DEFAULT_SEED,
    DEFAULT_SYNTHETIC_DTYPE,
    DEFAULT_SYNTHETIC_LR,
    DEFAULT_SYNTHETIC_UPDATE,
    SYNTHETIC_UPDATES,
)
from refit_app.models.plugins import instantiate
from refit_app.models.presets import PRESETS, fit_arch
from refit_app.models.synthetic_training import TrainingSteps

logger = logging.getLogger(__name__)


class Source(Protocol):
    def describe(self) -> str:
        """One line for logs and metrics: what is being sent."""
        ...

    def manifest_tensors(self) -> list[TensorMeta]:
        """Every tensor, in the order ``tensors()`` yields them; known before any data is read."""
        ...

    def metadata(self) -> dict[str, str]:
        """Checkpoint-level metadata (safetensors ``__metadata__``) for a consumer that saves."""
        ...

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, lazily. They may alias files or each other: callers read them, never write them."""
        ...

    # Optional, for runs of several rounds and model checks (docs/extending.md):
    # advance(round_index) -> dict: change the weights before round round_index (2, 3, ...), as a training step
    #     does; the dict (a "loss", say) goes into that round's metrics. Without it every round sends the same.
    # model_config() -> str: a config.json that travels with the manifest (sink=model builds its model from it).
    # companion_files() -> dict[str, str | bytes]: files that travel with the manifest (config.json, tokenizer
    #     files) and that sink=save writes beside the weights, so the saved directory opens with from_pretrained.
    # probe(probe_tokens) -> dict: this model's answer to the probe a model sink compares itself with.


class SafetensorsSource:
    """A ``.safetensors`` file or a Hugging Face model directory, streamed from mmap'd files."""

    def __init__(self, path: str):
        # The step a slow source (a header of 600k tensors) is stuck in, should a peer give up waiting meanwhile.
        logger.info("reading the tensor list of %s", path)
        self._checkpoint = Checkpoint(path)
        self._metas = self._checkpoint.metas()
        # Read once: every round's manifest then carries the same files, and a file edited mid-run cannot make
        # the saved checkpoint's config disagree with its weights.
        self._files = read_companion_files(self._checkpoint.path) if self._checkpoint.path.is_dir() else {}

    def describe(self) -> str:
        ckpt = self._checkpoint
        return (
            f"safetensors {ckpt.path} ({len(ckpt.files)} file(s), {len(self._metas)} tensors, "
            f"{format_size(ckpt.total_bytes)})"
        )

    def manifest_tensors(self) -> list[TensorMeta]:
        return list(self._metas)

    def metadata(self) -> dict[str, str]:
        return self._checkpoint.metadata()

    def companion_files(self) -> dict[str, str | bytes]:
        """A model directory's config.json, generation config and tokenizer files (see
        :data:`~refit_app.checkpoint.layout.COMPANION_FILE_NAMES`); none for a single file."""
        return dict(self._files)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._checkpoint.iter_tensors()


# ---------------------------------------------------------------------------------------------------------
# Synthetic models

POOL_MIN_BYTES = 16 * 1024**2
"""Random bytes generated per dtype at least; tensors are views into the pool at name-derived offsets."""


def _random_pool(dtype: torch.dtype, largest_numel: int, generator: torch.Generator) -> torch.Tensor:
    """Room for the largest tensor plus one 16 MiB random block, filled by tiling that block.

    Tiling makes a pool of any size cost a memcpy, not a random draw per element; the block of headroom
    lets equal-sized tensors start at different offsets.
    """
    block = max(1, POOL_MIN_BYTES // dtype_itemsize(dtype))
    numel = largest_numel + block
    if dtype == torch.bool:
        base = torch.randint(0, 2, (block,), generator=generator).to(torch.bool)
    elif dtype.is_floating_point or dtype.is_complex:
        gen_dtype = torch.complex64 if dtype.is_complex else torch.float32
        # Weight-like magnitudes; fp8 inherits them through the cast, as a quantised checkpoint would.
        base = (torch.randn(block, generator=generator, dtype=gen_dtype) * 0.02).to(dtype)
    else:
        info = torch.iinfo(dtype)
        low, high = max(info.min, -128), min(info.max, 127) + 1
        base = torch.randint(low, high, (block,), generator=generator, dtype=torch.int64).to(dtype)
    return base.repeat(-(-numel // block))[:numel]


class SyntheticSource:
    """A model-shaped state dict whose tensors are views into one random pool per dtype.

    Each tensor starts at an offset derived from (seed, name), so tensors differ from one another, the
    same seed always gives the same bytes, and producing a tensor costs nothing: a benchmark times the
    transfer, not the generator. Memory is the largest tensor plus 16 MiB per dtype, whatever the model size.

    Between rounds (``advance``), ``update`` says how the weights change. ``shuffle``: every tensor moves to other
    offsets of the pools, so every element changes, at no cost. ``training``: fp32 masters, started from the same
    seeded values, take a seeded Adam-sized step (``lr``) per element and are sent cast to ``dtype``, so that only
    the elements whose rounding changed differ, ~1% at RL learning rates in bf16
    (:mod:`refit_app.models.synthetic_training`). That costs 6 bytes per bf16 element (the masters and the cast
    they are sent from), held for the whole run, and two passes over the model per round.
    """

    def __init__(
        self,
        preset: str = DEFAULT_PRESET,
        size_bytes: int | None = None,
        seed: int = DEFAULT_SEED,
        dtype: torch.dtype | str = DEFAULT_SYNTHETIC_DTYPE,
        *,
        update: str = DEFAULT_SYNTHETIC_UPDATE,
        lr: float = DEFAULT_SYNTHETIC_LR,
    ):
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if update not in SYNTHETIC_UPDATES:
            raise SourceError(f"update={update!r} is not one of {', '.join(SYNTHETIC_UPDATES)}")
        if update == "training" and not dtype.is_floating_point:
            raise SourceError(f"update='training' needs a floating-point dtype to round its masters to, not {dtype}")
        self.preset, self.seed, self.dtype, self.update, self.lr = preset, seed, dtype, update, lr
        self._round = 1
        itemsize = dtype_itemsize(dtype)
        natural = PRESETS[preset]
        self._arch = natural if size_bytes is None else fit_arch(natural, size_bytes, itemsize)
        specs = list(self._arch.specs())
        self._metas = [TensorMeta(name, shape, torch.float32 if scale else dtype) for name, shape, scale in specs]
        largest: dict[torch.dtype, int] = {}
        for m in self._metas:
            largest[m.dtype] = max(largest.get(m.dtype, 0), m.numel)
        generator = torch.Generator().manual_seed(seed)
        self._pools: dict[torch.dtype, torch.Tensor] = {}
        for pool_dtype in sorted(largest, key=str):
            self._pools[pool_dtype] = _random_pool(pool_dtype, largest[pool_dtype], generator)
        self._training: TrainingSteps | None = None
        self._frozen: dict[str, torch.Tensor] = {}
        if update == "training":
            initial = dict(self._views(f"{seed}"))
            # The fp32 scales of an FP8 checkpoint are calibration constants, not trained: they stay as in round 1.
            trained = [m for m, (_, _, scale) in zip(self._metas, specs) if not scale]
            self._frozen = {m.name: initial[m.name].clone() for m, (_, _, scale) in zip(self._metas, specs) if scale}
            self._training = TrainingSteps([(m, initial[m.name]) for m in trained], dtype, lr, seed)
            self._pools = {}  # everything sent now lives in the masters' cast and the frozen copies
        logger.debug("%s", self.describe())

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self._metas)

    def describe(self) -> str:
        steps = f", training-like steps at lr {self.lr:g}" if self._training is not None else ""
        return (
            f"synthetic {self.preset} ({self._arch.layers} layers, {len(self._metas)} tensors, "
            f"{format_size(self.total_bytes)} {str(self.dtype).removeprefix('torch.')}, seed {self.seed}{steps})"
        )

    def manifest_tensors(self) -> list[TensorMeta]:
        return list(self._metas)

    def metadata(self) -> dict[str, str]:
        return {"format": "pt", "synthetic_preset": self.preset, "synthetic_seed": str(self.seed)}

    def advance(self, round_index: int) -> dict:
        """New values for round ``round_index``, as after a training step, deterministic, so a consumer can verify
        every round. ``shuffle``: free (the tensors move to other offsets of the same pools), any round in any
        order. ``training``: the steps of every round up to ``round_index`` not taken yet, in place; rounds only
        go forward."""
        if self._training is not None:
            self._training.advance(round_index)
        self._round = round_index
        return {}

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Views, free to produce; with ``training``, views of buffers that the next ``advance`` overwrites."""
        if self._training is not None:
            for meta in self._metas:
                frozen = self._frozen.get(meta.name)
                yield meta.name, frozen if frozen is not None else self._training.tensor(meta.name)
            return
        yield from self._views(f"{self.seed}" if self._round <= 1 else f"{self.seed}/round{self._round}")

    def _views(self, salt: str) -> Iterator[tuple[str, torch.Tensor]]:
        for meta in self._metas:
            pool = self._pools[meta.dtype]
            digest = hashlib.blake2b(f"{salt}/{meta.name}".encode(), digest_size=8).digest()
            start = int.from_bytes(digest, "little") % (pool.numel() - meta.numel + 1)
            yield meta.name, pool[start : start + meta.numel].view(meta.shape)


def make_source(target: str, params: Mapping[str, Any]) -> Source:
    """The source that ``target`` (a ``module.Class`` path, as a config's ``_target_``) names, built with
    ``params``; the config has checked the built-in sources' parameters already."""
    return instantiate(target, params)
