"""Shapes of the synthetic models (``source.preset``): decoder-only transformers and a LoRA adapter, scaled to a
requested size. Pure Python (no torch), so the config can name the presets without loading torch."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

LORA_RANK = 16
SIZE_TOLERANCE = 0.1
"""How far (relative) a layer count may miss the requested size before the dims are rescaled to hit it."""


@dataclass(frozen=True)
class Arch:
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

    def scaled(self, factor: float, layers: int) -> Arch:
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
        """Bytes at ``itemsize`` per element (fp32 scales at 4)."""

        def nbytes(specs: list[tuple[str, tuple[int, ...], bool]]) -> int:
            return sum(math.prod(shape) * (4 if scale else itemsize) for _, shape, scale in specs)

        return nbytes(self.head_specs()) + nbytes(self.tail_specs()) + self.layers * nbytes(self.layer_specs(0))


PRESETS: dict[str, Arch] = {
    # About 8 MiB at bf16: the default run stays well under a minute on a laptop.
    "tiny": Arch(vocab=2048, hidden=256, q_dim=256, kv_dim=128, intermediate=704, layers=4, kv_scales=True),
    # Llama-3.2-1B (tied embeddings).
    "llama-1b": Arch(
        vocab=128256,
        hidden=2048,
        q_dim=2048,
        kv_dim=512,
        intermediate=8192,
        layers=16,
        tie_embeddings=True,
        kv_scales=True,
    ),
    # Llama-3-8B.
    "llama-8b": Arch(vocab=128256, hidden=4096, q_dim=4096, kv_dim=1024, intermediate=14336, layers=32, kv_scales=True),
    # Qwen2-0.5B: tied embeddings and biases on q/k/v.
    "qwen-0.5b": Arch(
        vocab=151936,
        hidden=896,
        q_dim=896,
        kv_dim=128,
        intermediate=4864,
        layers=24,
        tie_embeddings=True,
        qkv_bias=True,
    ),
    # A rank-16 LoRA adapter on all seven projections of a deep, narrow model: 2240 matrices of 8-88 KiB.
    "lora": Arch(vocab=0, hidden=1024, q_dim=1024, kv_dim=256, intermediate=2816, layers=160, lora_rank=LORA_RANK),
}


def fit_arch(arch: Arch, size_bytes: int, itemsize: int) -> Arch:
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
