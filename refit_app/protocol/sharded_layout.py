"""The layouts of a sharded refit: what a producer holds (:func:`from_tensors`: DTensors, or :class:`Declared` plain
shards) and what a consumer needs (:class:`Expected` tensors; :func:`tp_needs` with :data:`COLUMN`, :data:`ROW` or
:data:`WHOLE` for a tensor-parallel engine rank; :func:`allocate` its empty slices). Every name here is also
:mod:`refit_app.protocol.sharded`'s, where the plan is agreed and the rounds run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refit_app.core.reshard.plan import (
    Layout,
    LayoutError,
    Need,
    Placement,
    Replicate,
    Shard,
    TensorSpec,
    check_need,
    check_spec,
    held_boxes,
    shard_box,
    whole,
)
from refit_app.core.reshard.transfer import Held


@dataclass(frozen=True)
class Declared:
    """A plain tensor that is one rank's shard of a larger one: ``local`` is this rank's part of a tensor of global
    ``shape`` that lies over the producers as ``layout`` says (a trainer that shards without DTensor)."""

    local: torch.Tensor
    shape: tuple[int, ...]
    layout: Layout


def _layout_of(name: str, t: Any, ranks: Callable[[int], int]) -> Layout:
    """A DTensor's mesh and placements as a :class:`Layout` of refit ranks."""
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    placements: list[Placement] = []
    for p in t.placements:
        if type(p) is DShard:
            placements.append(Shard(p.dim))
        elif type(p) is DReplicate:
            placements.append(Replicate())
        else:
            raise LayoutError(f"tensor {name!r}: placement {p} is not one a sharded refit reads (Shard, Replicate)")
    mesh = t.device_mesh.mesh
    return Layout(tuple(mesh.shape), tuple(ranks(int(r)) for r in mesh.flatten().tolist()), tuple(placements))


def from_tensors(
    tensors: Iterable[tuple[str, Any]], *, rank: int, ranks: Callable[[int], int] = lambda r: r
) -> tuple[list[TensorSpec], dict[str, Held]]:
    """A producer's tensors as the plan sees them: each one's :class:`TensorSpec` (the same on every producer) and
    this rank's shard of it. Takes DTensors (FSDP2's ``fully_shard``, tensor parallel: ``to_local()`` is the shard)
    and :class:`Declared` plain shards; a plain tensor is refused (say which part it is: a tensor every producer holds
    whole is ``Declared(t, tuple(t.shape), Layout.one_dim(producer_ranks, Replicate()))``). The shards are the live
    tensors: a trainer that updates them in place sends its new weights without calling this again.

    ``ranks`` maps a DTensor mesh's ranks (the trainer's) to refit ranks; by default they are the same. Its checks
    are this rank's own (a shard of the wrong size, a plain tensor): they raise here, before :func:`agree`, and the
    other ranks then see this one lost."""
    specs, shards = [], {}
    for name, t in tensors:
        if isinstance(t, Declared):
            local, shape, layout = t.local, t.shape, t.layout
        elif _is_dtensor(t):
            local, shape, layout = t.to_local(), tuple(t.shape), _layout_of(name, t, ranks)
            _check_coordinate(name, t, layout, rank)
        else:
            raise LayoutError(
                f"tensor {name!r} is a plain tensor: give a DTensor, or Declared(local, shape, layout) saying which "
                "part of which tensor it is"
            )
        local = local.detach()
        spec = TensorSpec(name, str(local.dtype).removeprefix("torch."), shape, local.element_size(), layout)
        check_spec(spec)
        box = held_boxes(spec).get(rank)
        if box is None:
            raise LayoutError(f"tensor {name!r}: rank {rank} is not in its mesh {list(layout.ranks)}")
        if tuple(local.shape) != tuple(b - a for a, b in box):
            raise LayoutError(
                f"tensor {name!r}: rank {rank} holds {list(local.shape)}, but its layout ({layout}) gives it "
                f"{[b - a for a, b in box]}"
            )
        specs.append(spec)
        shards[name] = Held(local, box)
    return specs, shards


def _is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor; imports DTensor only for a tensor that is not :class:`Declared` (seconds on a busy
    host, which a producer of declared shards would spend while its peers' rendezvous deadline runs)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@dataclass(frozen=True)
class Expected:
    """What a consumer's engine expects of one tensor: its name, dtype (``"bfloat16"``) and global shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def expected_of(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[Expected]:
    """The engine's tensors (whole, as its model defines them; a meta-device model will do) as :class:`Expected`."""
    return [Expected(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors]


def _check_coordinate(name: str, t: Any, layout: Layout, rank: int) -> None:
    """This process's place in the DTensor's mesh is where ``layout`` puts ``rank``: a wrong ``rank=`` or
    ``ranks=`` would otherwise send its shard as another rank's, silently, where the shards have one size."""
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:
        raise LayoutError(f"tensor {name!r}: this process is not in its mesh {t.device_mesh.mesh.tolist()}")
    flat = 0
    for index, size in zip(coordinate, layout.mesh):
        flat = flat * size + index
    if layout.ranks[flat] != rank:
        raise LayoutError(
            f"tensor {name!r}: this process holds the shard at mesh coordinate {list(coordinate)}, which the layout "
            f"gives to rank {layout.ranks[flat]}, not rank {rank}: check rank= and ranks="
        )


COLUMN = Shard(0)
"""A column-parallel weight: each tensor-parallel rank needs its rows (vLLM's ``ColumnParallelLinear``)."""
ROW = Shard(1)
"""A row-parallel weight: each rank needs its columns (``RowParallelLinear``); its 1-dim bias is whole on all."""
WHOLE = Replicate()
"""A tensor every rank needs whole (norms, a replicated embedding)."""


def tp_needs(
    specs: Sequence[Expected] | Sequence[TensorSpec],
    rank: int,
    tp_rank: int,
    tp_size: int,
    rule: Callable[[str], Placement],
) -> list[Need]:
    """The boxes tensor-parallel rank ``tp_rank`` of ``tp_size`` (refit rank ``rank``) needs: ``rule(name)`` is
    :data:`COLUMN`, :data:`ROW` or :data:`WHOLE`; a sharded dim the tensor lacks (a row-parallel bias) means whole."""
    if not (isinstance(tp_size, int) and tp_size >= 1 and isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
        raise LayoutError(f"tensor-parallel rank {tp_rank!r} of {tp_size!r}: give 0 <= tp_rank < tp_size")
    needs = []
    for spec in specs:
        placement = rule(spec.name)
        if not isinstance(placement, (Shard, Replicate)):
            raise LayoutError(
                f"the rule gives tensor {spec.name!r} {placement!r}: give COLUMN, ROW or WHOLE (refit_app's Shard or "
                "Replicate, not torch's)"
            )
        if isinstance(placement, Shard) and placement.dim < len(spec.shape):
            box = shard_box(spec.shape, placement.dim, tp_size, tp_rank)
        else:
            box = whole(spec.shape)
        needs.append(Need(rank, spec.name, box))
    return needs


def allocate(specs: Sequence[Expected] | Sequence[TensorSpec], needs: Iterable[Need]) -> dict[str, Held]:
    """A consumer's empty slices for ``needs`` (one box a tensor), in each tensor's dtype."""
    by_name = {s.name: s for s in specs}
    out = {}
    for n in needs:
        spec = by_name.get(n.name)
        if spec is None:
            raise LayoutError(f"a need names tensor {n.name!r}, which the expected tensors do not")
        check_need(n, spec)  # type: ignore[arg-type]
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise LayoutError(f"tensor {n.name!r}: {spec.dtype!r} is not a torch dtype")
        out[n.name] = Held(torch.empty([b - a for a, b in n.box], dtype=dtype), n.box)
    return out
