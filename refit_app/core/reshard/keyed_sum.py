"""A check of a sharded refit's result that trusts neither the plan nor the transfer: the keyed sum of a box of a
tensor, the sum over its elements of a 32-bit mix of (the element's flat index in the whole tensor, its bytes),
modulo 2**64.

Sums over disjoint parts of a box add up to the sum over the box. So producers that each hold some rows of a tensor
can each sum their part of a consumer's box, and the consumer compares the total with the sum over the slice it
received, with no rank ever holding the whole tensor. An element that landed in another place (a misrouted region,
rows swapped), that changed on the way, or that was sent from the wrong place of a shard changes the sum; a wrong
element escapes only where its mix collides, a chance of about 2**-32.

The arithmetic stays in int64 without overflow (32-bit values times a 27-bit constant; sums of at most
:data:`STEP_ELEMENTS` 32-bit values), so it is exact and the same on every rank and every build.
"""

from __future__ import annotations

from math import prod

import torch

from refit_app.core.reshard.plan import Box, intersect
from refit_app.core.reshard.transfer import Held

STEP_ELEMENTS = 1 << 20
"""Elements summed at a time: the temporaries (a few int64 per element) stay near 32 MiB whatever the tensor."""

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B
_SALT = 0x9E3779B9
_WORD_DTYPE = {1: torch.uint8, 2: torch.int16}


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit values (held in int64), each output bit depending on every input bit."""
    x = ((x ^ (x >> 16)) * _MUL) & _M32
    x = ((x ^ (x >> 16)) * _MUL) & _M32
    return x ^ (x >> 16)


def _words(t: torch.Tensor) -> torch.Tensor:
    """Each element's bytes as 32-bit words in int64, ``[numel, words]``: one word for 1-, 2- and 4-byte elements,
    two for 8 (float64, int64, complex64), four for complex128."""
    flat = t.contiguous().reshape(-1)
    size = flat.element_size()
    if size in _WORD_DTYPE:
        return (flat.view(_WORD_DTYPE[size]).to(torch.int64) & _M32).unsqueeze(1)
    return flat.view(torch.int32).reshape(flat.numel(), size // 4).to(torch.int64) & _M32


def _flat_index(box: Box, shape: tuple[int, ...]) -> torch.Tensor:
    """The row-major flat index in a tensor of ``shape`` of every element of ``box``, in the box's own order."""
    index = torch.zeros((), dtype=torch.int64)
    for dim, (start, stop) in enumerate(box):
        stride = prod(shape[dim + 1 :])
        index = index.unsqueeze(-1) + torch.arange(start, stop, dtype=torch.int64) * stride
    return index.reshape(-1)


def _sum(region: torch.Tensor, box: Box, shape: tuple[int, ...]) -> int:
    index = _flat_index(box, shape)
    key = _mix((index & _M32) ^ _mix((index >> 32) ^ _SALT))
    for word in _words(region).unbind(1):
        key = _mix(key ^ word)
    return int(key.sum())


def keyed_sum(held: Held, box: Box, shape: tuple[int, ...]) -> int:
    """The keyed sum of the part of ``box`` (of a tensor of global ``shape``) that ``held`` holds; 0 where they do
    not meet. Summing it over holders of disjoint parts gives the sum over ``box``, modulo 2**64."""
    part = intersect(held.box, box)
    if part is None:
        return 0
    region = held.region(part)
    if not part:  # a 0-dim tensor
        return _sum(region, part, shape)
    rows = max(1, STEP_ELEMENTS // max(1, prod(b - a for a, b in part[1:])))
    total = 0
    for start in range(part[0][0], part[0][1], rows):
        stop = min(start + rows, part[0][1])
        step = ((start, stop), *part[1:])
        total += _sum(region[start - part[0][0] : stop - part[0][0]], step, shape)
    return total % (1 << 64)
