"""Where the producer's weights come from: a safetensors checkpoint, or a synthetic model-shaped state dict.

Every source states its full list of tensors before any data is read (the handshake sends it to the
consumers), then yields the tensors lazily in that same order, so a model larger than memory streams.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from refit_app.errors import SourceError
from refit_app.manifest import TensorMeta, dtype_itemsize
from refit_app.safetensors_io import Checkpoint
from refit_app.sizes import format_size, parse_size

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


class SafetensorsSource:
    """A ``.safetensors`` file or a Hugging Face model directory, streamed from mmap'd files."""

    def __init__(self, path: str):
        self._checkpoint = Checkpoint(path)
        self._metas = self._checkpoint.metas()

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

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._checkpoint.iter_tensors()


# ---------------------------------------------------------------------------------------------------------
# Synthetic models

LORA_RANK = 16
POOL_MIN_BYTES = 16 * 1024**2
"""Random bytes generated per dtype at least; tensors are views into the pool at name-derived offsets."""
SIZE_TOLERANCE = 0.1
"""How far (relative) a layer count may miss the requested size before the dims are rescaled to hit it."""


@dataclass(frozen=True)
class _Arch:
    """A decoder-only transformer's shapes, or (with ``lora_rank``) a LoRA adapter over one."""

    vocab: int
    hidden: int
    q_dim: int
    kv_dim: int
    intermediate: int
    layers: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    kv_scales: bool = False
    lora_rank: int | None = None

    def scaled(self, factor: float, layers: int) -> _Arch:
        def dim(d: int) -> int:
            return max(1, round(d * factor))

        return replace(
            self,
            vocab=dim(self.vocab),
            hidden=dim(self.hidden),
            q_dim=dim(self.q_dim),
            kv_dim=dim(self.kv_dim),
            intermediate=dim(self.intermediate),
            layers=layers,
        )

    def layer_specs(self, i: int) -> list[tuple[str, tuple[int, ...], bool]]:
        """(name, shape, is_fp32_scale) of layer ``i``."""
        h, q, kv, inter = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        projections = [
            ("self_attn", "q_proj", h, q),
            ("self_attn", "k_proj", h, kv),
            ("self_attn", "v_proj", h, kv),
            ("self_attn", "o_proj", q, h),
            ("mlp", "gate_proj", h, inter),
            ("mlp", "up_proj", h, inter),
            ("mlp", "down_proj", inter, h),
        ]
        if self.lora_rank is not None:
            prefix = f"base_model.model.model.layers.{i}"
            r = self.lora_rank
            specs = []
            for block, proj, d_in, d_out in projections:
                specs.append((f"{prefix}.{block}.{proj}.lora_A.weight", (r, d_in), False))
                specs.append((f"{prefix}.{block}.{proj}.lora_B.weight", (d_out, r), False))
            return specs
        prefix = f"model.layers.{i}"
        specs = [(f"{prefix}.input_layernorm.weight", (h,), False)]
        for block, proj, d_in, d_out in projections[:4]:
            specs.append((f"{prefix}.{block}.{proj}.weight", (d_out, d_in), False))
            if self.qkv_bias and proj != "o_proj":
                specs.append((f"{prefix}.{block}.{proj}.bias", (d_out,), False))
        if self.kv_scales:
            # FP8-KV-cache checkpoints carry these 0-dim fp32 scales; 4-byte tensors between bf16 matrices
            # shift every later slice of a packed buffer off 8- and 16-byte alignment.
            specs.append((f"{prefix}.self_attn.k_scale", (), True))
            specs.append((f"{prefix}.self_attn.v_scale", (), True))
        specs.append((f"{prefix}.post_attention_layernorm.weight", (h,), False))
        for block, proj, d_in, d_out in projections[4:]:
            specs.append((f"{prefix}.{block}.{proj}.weight", (d_out, d_in), False))
        return specs

    def head_specs(self) -> list[tuple[str, tuple[int, ...], bool]]:
        return [] if self.lora_rank is not None else [("model.embed_tokens.weight", (self.vocab, self.hidden), False)]

    def tail_specs(self) -> list[tuple[str, tuple[int, ...], bool]]:
        if self.lora_rank is not None:
            return []
        specs = [("model.norm.weight", (self.hidden,), False)]
        if not self.tie_embeddings:
            specs.append(("lm_head.weight", (self.vocab, self.hidden), False))
        return specs

    def specs(self) -> Iterator[tuple[str, tuple[int, ...], bool]]:
        yield from self.head_specs()
        for i in range(self.layers):
            yield from self.layer_specs(i)
        yield from self.tail_specs()

    def total_bytes(self, itemsize: int) -> int:
        def nbytes(specs: list[tuple[str, tuple[int, ...], bool]]) -> int:
            return sum(math.prod(shape) * (4 if scale else itemsize) for _, shape, scale in specs)

        return nbytes(self.head_specs()) + nbytes(self.tail_specs()) + self.layers * nbytes(self.layer_specs(0))


PRESETS: dict[str, _Arch] = {
    # About 8 MiB at bf16: the default run stays well under a minute on a laptop.
    "tiny": _Arch(vocab=2048, hidden=256, q_dim=256, kv_dim=128, intermediate=704, layers=4, kv_scales=True),
    # Llama-3.2-1B (tied embeddings).
    "llama-1b": _Arch(
        vocab=128256, hidden=2048, q_dim=2048, kv_dim=512, intermediate=8192, layers=16,
        tie_embeddings=True, kv_scales=True,
    ),
    # Llama-3-8B.
    "llama-8b": _Arch(
        vocab=128256, hidden=4096, q_dim=4096, kv_dim=1024, intermediate=14336, layers=32, kv_scales=True
    ),
    # Qwen2-0.5B: tied embeddings and biases on q/k/v.
    "qwen-0.5b": _Arch(
        vocab=151936, hidden=896, q_dim=896, kv_dim=128, intermediate=4864, layers=24,
        tie_embeddings=True, qkv_bias=True,
    ),
    # A rank-16 LoRA adapter on all seven projections of a deep, narrow model: 2240 matrices of 8-88 KiB.
    "lora": _Arch(vocab=0, hidden=1024, q_dim=1024, kv_dim=256, intermediate=2816, layers=160, lora_rank=LORA_RANK),
}


def _fit_arch(arch: _Arch, size_bytes: int, itemsize: int) -> _Arch:
    """The preset resized to about ``size_bytes``: by layer count, then by width when layers alone miss."""
    fixed = arch.scaled(1.0, 0).total_bytes(itemsize)
    per_layer = arch.scaled(1.0, 1).total_bytes(itemsize) - fixed
    layers = max(1, round((size_bytes - fixed) / per_layer))
    fitted = arch.scaled(1.0, layers)
    if abs(fitted.total_bytes(itemsize) - size_bytes) <= SIZE_TOLERANCE * size_bytes:
        return fitted
    # Bytes grow monotonically (about quadratically) with the width factor, so bisect on it.
    lo, hi = 0.0, 2.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if arch.scaled(mid, layers).total_bytes(itemsize) < size_bytes:
            lo = mid
        else:
            hi = mid
    below, above = arch.scaled(lo, layers), arch.scaled(hi, layers)
    return min((below, above), key=lambda a: abs(a.total_bytes(itemsize) - size_bytes))


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

    def __init__(self, preset: str, size_bytes: int | None, seed: int, dtype: torch.dtype):
        if preset not in PRESETS:
            raise SourceError(f"unknown synthetic preset {preset!r}; choose one of {', '.join(PRESETS)}")
        if size_bytes is not None and size_bytes <= 0:
            raise SourceError(f"synthetic size {size_bytes} must be a positive number of bytes")
        self.preset, self.seed, self.dtype = preset, seed, dtype
        itemsize = dtype_itemsize(dtype)
        natural = PRESETS[preset]
        self._arch = natural if size_bytes is None else _fit_arch(natural, size_bytes, itemsize)
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

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for meta in self._metas:
            pool = self._pools[meta.dtype]
            digest = hashlib.blake2b(f"{self.seed}/{meta.name}".encode(), digest_size=8).digest()
            start = int.from_bytes(digest, "little") % (pool.numel() - meta.numel + 1)
            yield meta.name, pool[start : start + meta.numel].view(meta.shape)


def _dtype_param(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value), None)
    if not isinstance(dtype, torch.dtype):
        raise SourceError(f"source.dtype {value!r} is not a torch dtype; use e.g. bfloat16, float16, float32")
    return dtype


def make_source(kind: str, **params: Any) -> Source:
    """Build a source from config values.

    ``synthetic`` takes ``preset``, ``size`` (bytes, a size string such as ``2GiB``, or None for the
    preset's own size), ``seed`` and ``dtype`` (a torch dtype or its name); ``safetensors`` takes ``path``.
    """
    allowed = {"synthetic": {"preset", "size", "seed", "dtype"}, "safetensors": {"path"}}
    if kind not in allowed:
        raise SourceError(f"unknown source {kind!r}; choose one of {', '.join(allowed)}")
    unknown = sorted(set(params) - allowed[kind])
    if unknown:
        raise SourceError(f"source={kind} takes {', '.join(sorted(allowed[kind]))}; got unknown {', '.join(unknown)}")
    if kind == "safetensors":
        if not params.get("path"):
            raise SourceError("source=safetensors needs source.path: a .safetensors file or a model directory")
        return SafetensorsSource(str(params["path"]))
    size = params.get("size")
    return SyntheticSource(
        preset=str(params.get("preset", "tiny")),
        size_bytes=None if size is None else parse_size(size, "source.size"),
        seed=int(params.get("seed", 0)),
        dtype=_dtype_param(params.get("dtype", torch.bfloat16)),
    )
