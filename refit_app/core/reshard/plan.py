"""The plan of a sharded refit: which producer rank sends which region of which tensor to which consumer rank.

A sharded trainer holds each tensor split over K producer ranks the way a DTensor is (a mesh of ranks and one
placement per mesh dim: ``Shard(dim)`` split as ``torch.chunk`` splits, so 33 rows over 2 ranks are 17 + 16, and
``Replicate``); a tensor-parallel engine's M ranks each need one box of it (column-parallel rows, row-parallel
columns, all of it). The plan is a pure, deterministic function of both layouts, so every rank computes the same
one from the same metadata, and :func:`digest` lets them check that before any data byte moves.

Pure Python, no torch: a box is a tuple of ``(start, stop)`` per dim, and every region in the plan is the
intersection of a box a producer holds and a box a consumer needs. Where several producers hold the same box
(``Replicate`` on a mesh dim), the one with the fewest bytes planned so far sends it (ties: the lowest rank), so
replicated tensors are spread over the replicas' links. Consumers that are replicas of one another (D copies of one
tensor-parallel layout) form a chain: the first gets its regions from the producers and each one after it gets them
from the one before, so no producer link carries a region more than once.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod

Box = tuple[tuple[int, int], ...]
"""A region of a tensor: ``(start, stop)`` for each dim (a 0-dim tensor's box is ``()``)."""


@dataclass(frozen=True)
class Shard:
    """The tensor's ``dim`` split over a mesh dim's ranks as ``torch.chunk`` splits it (the last may be short or
    empty)."""

    dim: int

    def __str__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """The whole of the tensor (as far as the other mesh dims leave it) on every rank of a mesh dim."""

    def __str__(self) -> str:
        return "Replicate()"


Placement = Shard | Replicate


@dataclass(frozen=True)
class Layout:
    """How one tensor lies over producer ranks, as a DTensor's ``device_mesh`` and ``placements`` say: ``ranks``
    is the mesh flattened in row-major order, ``mesh`` its shape, one placement per mesh dim."""

    mesh: tuple[int, ...]
    ranks: tuple[int, ...]
    placements: tuple[Placement, ...]

    @classmethod
    def one_dim(cls, ranks: Sequence[int], placement: Placement) -> Layout:
        return cls((len(ranks),), tuple(ranks), (placement,))

    def __str__(self) -> str:
        return f"mesh {self.mesh} ranks {list(self.ranks)} {', '.join(map(str, self.placements))}"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as every rank knows it before any byte moves: the same on every rank, or the plan is refused."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    layout: Layout

    def __str__(self) -> str:
        return f"{self.name}: {self.dtype} {list(self.shape)} over {self.layout}"


@dataclass(frozen=True)
class Need:
    """Consumer rank ``rank`` needs ``box`` of tensor ``name``."""

    rank: int
    name: str
    box: Box


@dataclass(frozen=True)
class Transfer:
    """``src`` sends ``box`` of tensor ``name`` to ``dst``; ``relayed`` when ``src`` is a consumer passing on what
    it received (a replica's chain)."""

    name: str
    src: int
    dst: int
    box: Box
    relayed: bool = False
    dtype: str = ""
    """The tensor's dtype (``"bfloat16"``), so that each end checks the tensor it packs from or unpacks into."""


class LayoutError(ValueError):
    """A layout or a need that no plan can serve; its message names the tensor and what is wrong."""


# -- boxes ----------------------------------------------------------------------------------------------------------


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """Where part ``index`` of ``parts`` lies in ``size`` elements, as ``torch.chunk`` (and DTensor's ``Shard``)
    splits: each part ``ceil(size / parts)`` long, the last ones short or empty."""
    step = -(-size // parts) if size else 0
    start = min(index * step, size)
    return start, min(start + step, size)


def volume(box: Box) -> int:
    return prod(stop - start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The box both hold, or None where they share no element (a 0-dim tensor's boxes always meet)."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(start < stop for start, stop in out) else None


def whole(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


def shard_box(shape: Sequence[int], dim: int, parts: int, index: int) -> Box:
    """Part ``index`` of ``parts`` of the tensor split along ``dim`` (a tensor-parallel rank's slice)."""
    box = list(whole(shape))
    box[dim] = chunk_range(shape[dim], parts, index)
    return tuple(box)


def held_boxes(spec: TensorSpec) -> dict[int, Box]:
    """Producer rank -> the box of ``spec`` it holds. Mesh dims apply in order, each splitting what the ones before
    it left (DTensor's rule for a dim sharded on two mesh axes)."""
    layout = spec.layout
    out: dict[int, Box] = {}
    for flat, rank in enumerate(layout.ranks):
        coord, rest = [], flat
        for size in reversed(layout.mesh):
            coord.append(rest % size)
            rest //= size
        coord.reverse()
        box = list(whole(spec.shape))
        for placement, size, index in zip(layout.placements, layout.mesh, coord):
            if isinstance(placement, Shard):
                start, stop = box[placement.dim]
                lo, hi = chunk_range(stop - start, size, index)
                box[placement.dim] = (start + lo, start + hi)
        out[rank] = tuple(box)
    return out


# -- checks ---------------------------------------------------------------------------------------------------------


def check_spec(spec: TensorSpec) -> None:
    layout = spec.layout
    if any(n < 0 for n in spec.shape):
        raise LayoutError(f"tensor {spec.name!r}: shape {list(spec.shape)} has a negative size")
    if not layout.mesh or any(n < 1 for n in layout.mesh) or prod(layout.mesh) != len(layout.ranks):
        raise LayoutError(
            f"tensor {spec.name!r}: a mesh of shape {layout.mesh} cannot hold the {len(layout.ranks)} ranks "
            f"{list(layout.ranks)}"
        )
    if len(set(layout.ranks)) != len(layout.ranks):
        raise LayoutError(f"tensor {spec.name!r}: a rank appears twice in its mesh {list(layout.ranks)}")
    if len(layout.placements) != len(layout.mesh):
        raise LayoutError(
            f"tensor {spec.name!r}: {len(layout.placements)} placements for a mesh of {len(layout.mesh)} dims"
        )
    for placement in layout.placements:
        if isinstance(placement, Shard) and not 0 <= placement.dim < len(spec.shape):
            raise LayoutError(f"tensor {spec.name!r}: {placement} of a {len(spec.shape)}-dim tensor")


def check_need(need: Need, spec: TensorSpec) -> None:
    if len(need.box) != len(spec.shape) or any(
        not 0 <= start <= stop <= n for (start, stop), n in zip(need.box, spec.shape)
    ):
        raise LayoutError(
            f"consumer rank {need.rank} needs {list(need.box)} of tensor {spec.name!r}, which is {list(spec.shape)}"
        )


# -- the plan -------------------------------------------------------------------------------------------------------


def plan(
    tensors: Sequence[TensorSpec], needs: Iterable[Need], *, chains: Sequence[Sequence[int]] = ()
) -> list[Transfer]:
    """Every transfer of a sharded refit, in a fixed order (tensors in ``tensors``' order, then consumers, then
    regions): the same list on every rank given the same arguments.

    ``chains``: groups of consumer ranks that need the same boxes (replicas of one tensor-parallel rank), each in
    the order the regions travel; a chain's first rank gets them from the producers, each next rank from the one
    before it. Raises :class:`LayoutError` naming the first tensor or need that no plan can serve.
    """
    by_name: dict[str, TensorSpec] = {}
    for spec in tensors:
        if spec.name in by_name:
            raise LayoutError(f"tensor {spec.name!r} is listed twice")
        check_spec(spec)
        by_name[spec.name] = spec
    wanted: dict[str, dict[int, list[Box]]] = {name: {} for name in by_name}
    for need in needs:
        if need.name not in by_name:
            raise LayoutError(f"consumer rank {need.rank} needs tensor {need.name!r}, which no producer has")
        check_need(need, by_name[need.name])
        wanted[need.name].setdefault(need.rank, []).append(need.box)
    relay_from = _relays(chains, wanted)
    sent: dict[int, int] = {}  # producer rank -> bytes planned so far
    out: list[Transfer] = []
    for spec in tensors:
        holders: dict[Box, list[int]] = {}
        for rank, box in held_boxes(spec).items():
            holders.setdefault(box, []).append(rank)
        for dst in sorted(wanted[spec.name]):
            for need in wanted[spec.name][dst]:
                if dst in relay_from:
                    out += _relayed(spec, relay_from[dst], dst, need, holders)
                    continue
                for held, ranks in holders.items():
                    region = intersect(held, need)
                    if region is None:
                        continue
                    src = min(ranks, key=lambda r: (sent.get(r, 0), r))
                    sent[src] = sent.get(src, 0) + volume(region) * spec.itemsize
                    out.append(Transfer(spec.name, src, dst, region, dtype=spec.dtype))
    return out


def _relays(chains: Sequence[Sequence[int]], wanted: dict[str, dict[int, list[Box]]]) -> dict[int, int]:
    """Consumer rank -> the consumer it gets its regions from; every rank of a chain must need the same boxes."""
    relay_from: dict[int, int] = {}
    seen: set[int] = set()
    for chain in chains:
        if len(set(chain)) != len(chain):
            raise LayoutError(f"the replica chain {list(chain)} holds a rank twice")
        strangers = [rank for rank in chain if not any(rank in by_rank for by_rank in wanted.values())]
        if strangers:
            raise LayoutError(f"the replica chain {list(chain)} holds rank {strangers[0]}, which needs nothing")
        for before, rank in itertools.pairwise(chain):
            if rank in seen or rank == before:
                raise LayoutError(f"consumer rank {rank} is in more than one place of the replica chains")
            for name, by_rank in wanted.items():
                if by_rank.get(rank, []) != by_rank.get(before, []):
                    raise LayoutError(
                        f"consumer ranks {before} and {rank} are replicas of one another but need different "
                        f"boxes of tensor {name!r}: {by_rank.get(before, [])} and {by_rank.get(rank, [])}"
                    )
            relay_from[rank] = before
        seen.update(chain)
    return relay_from


def _relayed(spec: TensorSpec, src: int, dst: int, need: Box, holders: dict[Box, list[int]]) -> list[Transfer]:
    """The regions a chain's rank gets from the one before it: the same pieces that one got, so each is forwarded
    whole as it lands."""
    out = []
    for held in holders:
        region = intersect(held, need)
        if region is not None:
            out.append(Transfer(spec.name, src, dst, region, relayed=True, dtype=spec.dtype))
    return out


# -- agreement ------------------------------------------------------------------------------------------------------


def describe(tensors: Sequence[TensorSpec], needs: Iterable[Need], chains: Sequence[Sequence[int]] = ()) -> list[str]:
    """Both layouts as lines of text, one per tensor, need and chain, in a fixed order: what :func:`digest` hashes,
    and what :func:`first_difference` compares between two ranks."""
    lines = [f"tensor {spec}" for spec in tensors]
    lines += [
        f"need rank {n.rank} {n.name!r} {list(n.box)}" for n in sorted(needs, key=lambda n: (n.rank, n.name, n.box))
    ]
    lines += [f"chain {list(chain)}" for chain in chains]
    return lines


def digest(lines: Sequence[str], transfers: Sequence[Transfer]) -> str:
    """One hash of both layouts and the plan made from them; ranks compare it before the first data byte."""
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode() + b"\n")
    for t in transfers:
        h.update(f"{t.name!r} {t.src}->{t.dst} {list(t.box)} {t.relayed}\n".encode())
    return h.hexdigest()


def first_difference(mine: Sequence[str], theirs: Sequence[str], *, rank: int) -> str | None:
    """The first line where this rank's :func:`describe` and rank ``rank``'s differ, as one line for an error; None
    where they agree."""
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return f"entry {i + 1} of the layouts: here {a!r}, on rank {rank} {b!r}"
    if len(mine) != len(theirs):
        extra = mine[len(theirs)] if len(mine) > len(theirs) else theirs[len(mine)]
        side = "only here" if len(mine) > len(theirs) else f"only on rank {rank}"
        return f"entry {min(len(mine), len(theirs)) + 1} of the layouts is {side}: {extra!r}"
    return None
