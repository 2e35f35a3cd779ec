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
from refit_app.common.sizes import format_size
from refit_app.core.meta import TensorMeta, dtype_itemsize
from refit_app.models.plugins import instantiate
from refit_app.models.presets import PRESETS, fit_arch

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
    """

    def __init__(
        self, preset: str = "tiny", size_bytes: int | None = None, seed: int = 0, dtype: torch.dtype | str = "bfloat16"
    ):
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.preset, self.seed, self.dtype = preset, seed, dtype
        self._round = 1
        itemsize = dtype_itemsize(dtype)
        natural = PRESETS[preset]
        self._arch = natural if size_bytes is None else fit_arch(natural, size_bytes, itemsize)
        self._metas = [
            TensorMeta(name, shape, torch.float32 if scale else dtype) for name, shape, scale in self._arch.specs()
        ]
        largest: dict[torch.dtype, int] = {}
        for m in self._metas:
            largest[m.dtype] = max(largest.get(m.dtype, 0), m.numel)
        generator = torch.Generator().manual_seed(seed)
        self._pools: dict[torch.dtype, torch.Tensor] = {}
        for pool_dtype in sorted(largest, key=str):
            self._pools[pool_dtype] = _random_pool(pool_dtype, largest[pool_dtype], generator)
        logger.debug("%s", self.describe())

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self._metas)

    def describe(self) -> str:
        return (
            f"synthetic {self.preset} ({self._arch.layers} layers, {len(self._metas)} tensors, "
            f"{format_size(self.total_bytes)} {str(self.dtype).removeprefix('torch.')}, seed {self.seed})"
        )

    def manifest_tensors(self) -> list[TensorMeta]:
        return list(self._metas)

    def metadata(self) -> dict[str, str]:
        return {"format": "pt", "synthetic_preset": self.preset, "synthetic_seed": str(self.seed)}

    def advance(self, round_index: int) -> dict:
        """New values for round ``round_index``, as after a training step: deterministic, so a consumer can verify
        every round, and free (the tensors move to other offsets of the same pools)."""
        self._round = round_index
        return {}

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        salt = f"{self.seed}" if self._round <= 1 else f"{self.seed}/round{self._round}"
        for meta in self._metas:
            pool = self._pools[meta.dtype]
            digest = hashlib.blake2b(f"{salt}/{meta.name}".encode(), digest_size=8).digest()
            start = int.from_bytes(digest, "little") % (pool.numel() - meta.numel + 1)
            yield meta.name, pool[start : start + meta.numel].view(meta.shape)


def make_source(target: str, params: Mapping[str, Any]) -> Source:
    """The source that ``target`` (a ``module.Class`` path, as a config's ``_target_``) names, built with
    ``params``; the config has checked the built-in sources' parameters already."""
    return instantiate(target, params)
