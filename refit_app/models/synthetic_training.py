"""Training-like rounds for a synthetic model (``source.update=training``): fp32 master weights that take a seeded,
Adam-sized step per element before every round, sent cast to the model's dtype.

At RL learning rates most steps are smaller than half a bf16 rounding step, so only ~1% of the sent elements
change from one round to the next (the share delta refits live on). That share comes out of real rounding here,
not out of a chosen probability: each master sits somewhere inside its bf16 rounding cell and an element's bytes
change when its master crosses the cell's edge.

Cost per round is two passes over the model (the step into the masters, the cast into the send buffer), in
cache-sized slices so the cast reads what the step just wrote; nothing is allocated per round. Memory is 4 bytes
per element for the masters plus the model itself for the send buffer (none extra for fp32, which sends the
masters), plus one 16 MiB pool of random steps.
"""

from __future__ import annotations

import hashlib
import math
from typing import NamedTuple

import torch

from refit_app.common.errors import SourceError
from refit_app.core.meta import TensorMeta

STEP_POOL_NUMEL = 4 * 1024**2
"""Random steps in units of lr (16 MiB of fp32) that every round reads at fresh per-slice offsets."""
ADAM_UPDATE_STD = math.sqrt((1 - 0.9) / (1 + 0.9))
"""Spread of Adam's update m / sqrt(v) in units of lr, for beta1 = 0.9 and gradients whose noise dwarfs their mean
(as an RL step's do): m, an average of the last ~10 gradients, has std sqrt((1 - b1) / (1 + b1)) sigma = 0.23 sigma,
while sqrt(v) ~ sigma averages ~1000. So the steps are normal with this std (times lr), their signs and sizes
drawn afresh per element and per round."""
SLICE_NUMEL = 1024**2
"""Elements stepped and cast per slice: 4 MiB of fp32 masters stay in a small machine's cache (8 MiB of L3 on 2
cores) between the two passes, and few slices mean few thread wake-ups (each op splits over the intra-op threads;
on a busy 2-core machine a wake-up can cost a millisecond: 64K-element slices ran several times slower there)."""
_BITS = {1: torch.int8, 2: torch.int16}


class _Scratch(NamedTuple):
    """Slice-sized buffers for spreading the masters (allocated once: a fresh tensor per op and slice page-faults
    its memory in every time, which cost more than the arithmetic)."""

    neighbour: torch.Tensor
    away: torch.Tensor
    toward: torch.Tensor
    part: torch.Tensor
    mask: torch.Tensor
    back: torch.Tensor


def _generator(seed: int, label: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{label}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


class TrainingSteps:
    """Master weights of ``dtype`` tensors (one flat fp32 buffer) and their cast (one flat buffer of ``dtype``).

    The state before round ``k`` is a function of (initial values, lr, seed, k) alone: a consumer that recomputes
    it and a re-run of the producer agree bit for bit.
    """

    def __init__(self, initial: list[tuple[TensorMeta, torch.Tensor]], dtype: torch.dtype, lr: float, seed: int):
        """``initial``: each tensor's round-1 values, in ``dtype`` (a floating-point one); copied, not kept."""
        self.dtype, self.lr, self.seed = dtype, lr, seed
        self.round = 1
        numel = sum(m.numel for m, _ in initial)
        # fp32 (and fp64) send the masters themselves: nothing to round, every stepped element changes, as in
        # fp32 training.
        master_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self._masters = torch.empty(numel, dtype=master_dtype)
        self._sent = self._masters if dtype == master_dtype else torch.empty(numel, dtype=dtype)
        self._views: dict[str, torch.Tensor] = {}
        offset = 0
        for meta, t in initial:
            self._sent[offset : offset + meta.numel].copy_(t.reshape(-1))
            self._views[meta.name] = self._sent[offset : offset + meta.numel].view(meta.shape)
            offset += meta.numel
        if self._sent is not self._masters:
            self._masters.copy_(self._sent)
            uniform = torch.rand(STEP_POOL_NUMEL, generator=_generator(seed, "cells")).mul_(2).sub_(1)
            scratch = _Scratch(
                torch.empty(SLICE_NUMEL, dtype=_BITS[dtype.itemsize]),
                torch.empty(SLICE_NUMEL, dtype=master_dtype),
                torch.empty(SLICE_NUMEL, dtype=master_dtype),
                torch.empty(SLICE_NUMEL, dtype=torch.float32),
                torch.empty(SLICE_NUMEL, dtype=torch.bool),
                torch.empty(SLICE_NUMEL, dtype=dtype),
            )
            self._each_slice("cells", uniform, lambda start, end, u: self._spread_in_cell(start, end, u, scratch))
        self._pool = torch.randn(STEP_POOL_NUMEL, generator=_generator(seed, "steps")).mul_(ADAM_UPDATE_STD)

    @property
    def nbytes(self) -> int:
        """Memory held: the masters, the send buffer (when separate) and the step pool."""
        sent = 0 if self._sent is self._masters else self._sent.numel() * self._sent.element_size()
        masters = self._masters.numel() * self._masters.element_size()
        return masters + sent + self._pool.numel() * self._pool.element_size()

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as sent this round: a view that the next ``advance`` overwrites in place."""
        return self._views[name]

    def advance(self, round_index: int) -> None:
        """Take the steps of rounds ``self.round + 1 .. round_index``: one per round, whichever rounds were asked."""
        if round_index < self.round:
            raise SourceError(
                f"synthetic training-like steps only go forward: round {round_index} asked after round {self.round}"
            )
        for k in range(self.round + 1, round_index + 1):
            self._each_slice(f"round{k}", self._pool, self._step)
            self.round = k

    def _each_slice(self, label: str, pool: torch.Tensor, fn) -> None:
        """``fn(start, end, draws)`` over the masters in slices, each with ``pool`` read at a seeded offset."""
        n = self._masters.numel()
        slices = -(-n // SLICE_NUMEL)
        offsets = torch.randint(
            0, pool.numel() - SLICE_NUMEL + 1, (slices,), generator=_generator(self.seed, label)
        ).tolist()
        for i, o in enumerate(offsets):
            start, end = i * SLICE_NUMEL, min(n, (i + 1) * SLICE_NUMEL)
            fn(start, end, pool[o : o + end - start])

    def _spread_in_cell(self, start: int, end: int, u: torch.Tensor, scratch: _Scratch) -> None:
        """Move each master from its start ``x`` (a value of ``dtype``) to a uniform place in x's rounding cell
        (``u``: uniform in [-1, 1), which half and how far across it).

        Trained fp32 masters lie anywhere in their cells. Left on the grid, every master would be half a cell from
        both edges: no step under half a cell would show at first, then the share of changed elements would creep
        up over thousands of rounds as the masters diffuse. Spread uniformly (right up to the edges: the smallest
        steps cross only there), each round changes about E|step| / cell width of the elements from round 2 on.
        """
        n = end - start
        masters, bits = self._masters[start:end], self._sent[start:end].view(_BITS[self.dtype.itemsize])
        neighbour, away, toward, part, mask, back = (t[:n] for t in scratch)
        # x's neighbours in dtype are its bit pattern plus and minus one (sign-magnitude formats): one further from
        # zero, one closer. Zero's pattern minus one is a NaN (nan_to_num: that half-cell is not used). u >= 0 moves
        # u of the way to half the gap away from zero, u < 0 |u| of the way toward it; arithmetic, not torch.where,
        # which is several times slower per element.
        away.copy_(torch.add(bits, 1, out=neighbour).view(self.dtype)).sub_(masters).nan_to_num_(0.0, 0.0, 0.0)
        away.mul_(torch.clamp(u, min=0, out=part))
        toward.copy_(torch.sub(bits, 1, out=neighbour).view(self.dtype)).sub_(masters).nan_to_num_(0.0, 0.0, 0.0)
        toward.mul_(torch.clamp(u, max=0, out=part))
        spread = away.sub_(toward).mul_(0.5).add_(masters)
        # A master on a cell edge (|u| = 1, or the fp32 sum rounded onto it) may round to the neighbour: those stay
        # at x, so that round 1 sends exactly the seeded values; copysign keeps -0.0 (which -0.0 + 0.0 would lose).
        back.copy_(spread)
        off = torch.ne(back.view(bits.dtype), bits, out=mask)
        spread.add_(torch.sub(masters, spread, out=toward).mul_(off)).copysign_(masters)
        masters.copy_(spread)

    def _step(self, start: int, end: int, z: torch.Tensor) -> None:
        masters = self._masters[start:end]
        masters.add_(z, alpha=self.lr)
        if self._sent is not self._masters:
            self._sent[start:end].copy_(masters)
