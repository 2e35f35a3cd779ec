"""Dense against delta session rounds (``--delta-shares``), one side each: the producer's model as a trainer holds
it, changed between rounds at a chosen share of its elements, and one session pair per delta mode on one group.

Changes: each element of each tensor changes independently with probability ``share`` (seeded by the round and the
tensor), by flipping the lowest bit that survives the case's ``post`` (bit 0 of a bf16 or fp32 element; bit 16 of
an fp32 element that the ``cast`` post sends as bf16, so that the bytes on the wire change too). Independent,
scattered changes are the codec's hard case: their positions do not compress, unlike whole changed rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from refit_app.bench.cases import SEED, Case, post_func
from refit_app.bench.modes import discard
from refit_app.core.meta import TensorMeta
from refit_app.protocol.defaults import DELTA_MODES
from refit_app.protocol.session import ConsumerSession, ProducerSession, Round
from refit_app.transport.groups import RefitGroup

_INT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SLICE = 1 << 20
"""Elements changed per step: keeps the scratch arrays at a few MiB, so the changes add no memory of note."""
_GAPS_BELOW = 0.05
"""Below this share, drawing the gaps between changed elements costs less than drawing a mask of every element
(both are the same random process; measured at 1.4 ms against 45 ms per 16 Mi elements at 1%)."""
_MASK_STEPS = 1 << 16
"""The mask compares one uint16 per element with ``share x 2^16``: shares from ``_GAPS_BELOW`` up are exact to
better than 0.03%."""


class ChangingModel:
    """The producer's model, held as a trainer holds it (one tensor per name, its own memory, unlike the synthetic
    source's views of one pool, which would alias), and changed in place by :meth:`change` between rounds."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], wire: Sequence[TensorMeta], post: str) -> None:
        self.named = [(name, t.clone()) for name, t in named]
        self._post = post_func(post)
        # The lowest bit that survives the post: a cast to a narrower type drops the low bytes of each element.
        self._bits = [8 * (t.element_size() - meta.dtype.itemsize) for (_, t), meta in zip(self.named, wire)]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors as they travel (after the post)."""
        post = self._post
        return ((name, post((name, t))) for name, t in self.named)

    def change(self, share: float, round_index: int) -> int:
        """Flip one bit in about ``share`` of every tensor's elements, drawn anew for ``round_index``; returns how
        many elements changed."""
        changed = 0
        for i, ((_, t), bit) in enumerate(zip(self.named, self._bits)):
            rng = np.random.default_rng([SEED, round_index, i])
            changed += _flip(t, share, bit, rng)
        return changed


def _flip(t: torch.Tensor, share: float, bit: int, rng: np.random.Generator) -> int:
    if t.numel() == 0:
        return 0
    words = t.view(-1).view(_INT_VIEWS[t.element_size()]).numpy()
    value = words.dtype.type(1 << bit)
    threshold = round(share * _MASK_STEPS)
    changed = 0
    for start in range(0, words.size, _SLICE):
        part = words[start : start + _SLICE]
        if threshold >= _MASK_STEPS:
            part ^= value
            changed += part.size
        elif share < _GAPS_BELOW:
            positions = _positions(part.size, share, rng)
            part[positions] ^= value
            changed += positions.size
        else:
            mask = rng.integers(0, _MASK_STEPS, part.size, dtype=np.uint16) < threshold
            part ^= mask.astype(words.dtype) * value
            changed += int(np.count_nonzero(mask))
    return changed


def _positions(n: int, share: float, rng: np.random.Generator) -> np.ndarray:
    """The changed positions among ``n`` elements, each changed with probability ``share``: the gaps between
    changes of such a process are geometric."""
    found, at = [], -1
    while True:
        expected = n * share
        gaps = rng.geometric(share, int(expected + 6 * math.sqrt(expected) + 16))  # one draw almost always suffices
        positions = at + np.cumsum(gaps)
        found.append(positions[positions < n])
        if positions[-1] >= n:
            return np.concatenate(found)
        at = int(positions[-1])


class DeltaSessions:
    """One session pair per delta mode, on the same group and the same model: the producer sends the same tensors
    in each; consumers verify every round, and keep a mirror that delta rounds patch (with ``delta="off"`` no
    mirror is kept: the consumer drops each batch after verifying it, as ``sink=verify`` would without deltas)."""

    def __init__(
        self,
        rg: RefitGroup,
        model: ChangingModel | None,
        metas: list[TensorMeta],
        case: Case,
        modes: Sequence[str] = DELTA_MODES,
    ) -> None:
        self._model, self._metas = model, metas
        self.sides: dict[str, ProducerSession | ConsumerSession] = {}
        for mode in modes:  # in the same order on every rank: each session exchanges its needs as it starts
            if rg.rank == 0:
                self.sides[mode] = ProducerSession(
                    rg, buffer_size_bytes=case.buffer_size_bytes, num_buffers=case.num_buffers, delta=mode
                )
            else:
                self.sides[mode] = ConsumerSession(rg, num_buffers=case.num_buffers, verify=True, mirror=True)

    def run(self, mode: str) -> Round:
        """One round of ``mode``'s session: the whole ``send()`` or ``receive()``."""
        side = self.sides[mode]
        if isinstance(side, ProducerSession):
            assert self._model is not None
            return side.send(self._model.tensors(), metas=self._metas)
        result = side.receive(discard)
        if not isinstance(result, Round):
            raise RuntimeError(f"the producer's {mode} session ended early")
        return result

    def close(self) -> None:
        """End every session, in order, on every rank (a consumer's last receive() sees its producer's end)."""
        for mode, side in self.sides.items():
            if isinstance(side, ProducerSession):
                side.close()
            elif side.receive(discard) is not None:
                raise RuntimeError(f"the producer's {mode} session did not end when expected")
        self.sides.clear()  # the snapshots and mirrors go with the sessions
