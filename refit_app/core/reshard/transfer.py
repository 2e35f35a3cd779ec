"""A sharded refit's bytes: each rank sends and receives the regions the plan gives it, packed per pair.

Every (source, destination) pair of the plan is a stream of its regions in plan order, cut into chunks by the same
:class:`~refit_app.core.chunks.ChunkPlanner` on both sides (the packed format: regions back to back, no header), so
the two ends agree on every chunk's size from the plan alone. A rank keeps up to ``num_buffers`` chunks in flight
per pair and takes its pairs in turn, chunk by chunk, so all pairs move at once and packing overlaps sending.

A consumer that passes regions on to a replica (a relayed transfer) sends each of its relay chunks as soon as all
the regions in it have landed, so a chain of replicas moves its bytes in a pipeline rather than one replica after
the other.

No tensor is assembled anywhere: a producer packs straight from its local shard, a consumer unpacks straight into
the tensor of the box it needs, which may be a view into a fused parameter (q, k and v slices into one ``qkv_proj``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from refit_app.core.chunks import Chunk, plan_chunks
from refit_app.core.group import Work
from refit_app.core.reshard.plan import Box, Transfer, volume
from refit_app.core.wire import pack_into, unpack_from


class PairGroup(Protocol):
    """What a sharded refit needs of a communicator: point-to-point sends and receives that return a handle
    (torch.distributed's ``isend``/``irecv`` over gloo fit)."""

    rank: int

    def isend(self, tensor: torch.Tensor, dst: int) -> Work: ...

    def irecv(self, tensor: torch.Tensor, src: int) -> Work: ...


@dataclass(frozen=True)
class Held:
    """A tensor a rank holds or fills: ``tensor`` is the region ``box`` of the global tensor (a producer's local
    shard, a consumer's slice)."""

    tensor: torch.Tensor
    box: Box

    def region(self, box: Box) -> torch.Tensor:
        """The part of :attr:`tensor` that is ``box`` of the global tensor (a view)."""
        index = tuple(slice(b0 - h0, b1 - h0) for (b0, b1), (h0, _) in zip(box, self.box))
        return self.tensor[index] if index else self.tensor


@dataclass
class _Pair:
    """One (this rank, peer) stream: its regions, their chunks, the buffers in flight."""

    peer: int
    regions: list[Transfer]
    chunks: list[Chunk]
    slots: deque[tuple[Work, torch.Tensor, Chunk]] = field(default_factory=deque)
    next_chunk: int = 0

    def done(self) -> bool:
        return self.next_chunk >= len(self.chunks) and not self.slots


def _nbytes(t: Transfer, held: Mapping[str, Held]) -> int:
    return volume(t.box) * held[t.name].tensor.element_size()


def _pairs(transfers: Sequence[Transfer], held: Mapping[str, Held], key: str, buffer_size_bytes: int) -> list[_Pair]:
    by_peer: dict[int, list[Transfer]] = {}
    for t in transfers:
        by_peer.setdefault(getattr(t, key), []).append(t)
    return [
        _Pair(peer, regions, plan_chunks([_nbytes(t, held) for t in regions], buffer_size_bytes))
        for peer, regions in sorted(by_peer.items())
    ]


def _pack(pair: _Pair, chunk: Chunk, held: Mapping[str, Held], buffer: torch.Tensor) -> torch.Tensor:
    """``chunk``'s regions, packed from ``held`` into ``buffer`` (grown for a region larger than a buffer)."""
    if buffer.numel() < chunk.nbytes:
        buffer = torch.empty(chunk.nbytes, dtype=torch.uint8)
    offset = 0
    for t in pair.regions[chunk.first : chunk.stop]:
        offset = pack_into(buffer, offset, held[t.name].region(t.box))
    return buffer[: chunk.nbytes]


def _unpack(pair: _Pair, chunk: Chunk, buffer: torch.Tensor, held: Mapping[str, Held]) -> list[Transfer]:
    offset = 0
    landed = []
    for t in pair.regions[chunk.first : chunk.stop]:
        dst = held[t.name].region(t.box)
        n = _nbytes(t, held)
        dst.copy_(unpack_from(buffer, offset, tuple(dst.shape), dst.dtype))
        offset += n
        landed.append(t)
    return landed


def send_regions(
    group: PairGroup,
    transfers: Sequence[Transfer],
    shards: Mapping[str, Held],
    *,
    buffer_size_bytes: int,
    num_buffers: int,
) -> int:
    """Send every region this rank is the source of (its local shards, ``shards``: tensor name -> :class:`Held`);
    returns the bytes sent. Returns once every send has completed."""
    pairs = _pairs([t for t in transfers if t.src == group.rank], shards, "dst", buffer_size_bytes)
    sent = 0
    while not all(p.done() for p in pairs):
        for pair in pairs:
            sent += _send_next(group, pair, shards, buffer_size_bytes, num_buffers)
    return sent


def _send_next(
    group: PairGroup, pair: _Pair, held: Mapping[str, Held], buffer_size_bytes: int, num_buffers: int
) -> int:
    """Pack and send ``pair``'s next chunk, first waiting for its oldest buffer when all are in flight; at the end,
    wait for what is left."""
    if pair.next_chunk >= len(pair.chunks):
        while pair.slots:
            pair.slots.popleft()[0].wait()
        return 0
    buffer = None
    if len(pair.slots) >= num_buffers:
        work, buffer, _ = pair.slots.popleft()
        work.wait()
    if buffer is None:
        buffer = torch.empty(buffer_size_bytes, dtype=torch.uint8)
    chunk = pair.chunks[pair.next_chunk]
    pair.next_chunk += 1
    data = _pack(pair, chunk, held, buffer)
    pair.slots.append((group.isend(data, pair.peer), buffer, chunk))
    return chunk.nbytes


def receive_regions(
    group: PairGroup,
    transfers: Sequence[Transfer],
    slices: Mapping[str, Held],
    *,
    buffer_size_bytes: int,
    num_buffers: int,
) -> int:
    """Receive every region this rank is the destination of into ``slices`` (tensor name -> :class:`Held`: the
    tensor of the box this rank needs), and pass on each region it relays to a replica as soon as its chunk is
    complete; returns the bytes received. Returns once every receive and relay has completed."""
    pairs = _pairs([t for t in transfers if t.dst == group.rank], slices, "src", buffer_size_bytes)
    relays = _pairs([t for t in transfers if t.src == group.rank and t.relayed], slices, "dst", buffer_size_bytes)
    for pair in pairs:
        while pair.next_chunk < len(pair.chunks) and len(pair.slots) < num_buffers:
            _post_receive(group, pair, buffer_size_bytes)
    landed: set[tuple[str, Box]] = set()
    received = 0
    while not all(p.done() for p in pairs):
        for pair in pairs:
            if not pair.slots:
                continue
            work, buffer, chunk = pair.slots.popleft()
            work.wait()
            landed.update((t.name, t.box) for t in _unpack(pair, chunk, buffer, slices))
            received += chunk.nbytes
            if pair.next_chunk < len(pair.chunks):
                _post_receive(group, pair, buffer_size_bytes, buffer)
            for relay in relays:
                _relay_ready(group, relay, slices, landed, buffer_size_bytes, num_buffers)
    for relay in relays:
        _relay_ready(group, relay, slices, landed, buffer_size_bytes, num_buffers)
        if relay.next_chunk < len(relay.chunks):
            raise RuntimeError(f"rank {group.rank}: regions to relay to rank {relay.peer} never arrived")
        while relay.slots:
            relay.slots.popleft()[0].wait()
    return received


def _post_receive(group: PairGroup, pair: _Pair, buffer_size_bytes: int, buffer: torch.Tensor | None = None) -> None:
    chunk = pair.chunks[pair.next_chunk]
    pair.next_chunk += 1
    if buffer is None or buffer.numel() < chunk.nbytes:
        buffer = torch.empty(max(buffer_size_bytes, chunk.nbytes), dtype=torch.uint8)
    pair.slots.append((group.irecv(buffer[: chunk.nbytes], pair.peer), buffer, chunk))


def _relay_ready(
    group: PairGroup,
    relay: _Pair,
    slices: Mapping[str, Held],
    landed: set[tuple[str, Box]],
    buffer_size_bytes: int,
    num_buffers: int,
) -> None:
    """Send each of ``relay``'s next chunks whose regions have all landed."""
    while relay.next_chunk < len(relay.chunks):
        chunk = relay.chunks[relay.next_chunk]
        if not all((t.name, t.box) in landed for t in relay.regions[chunk.first : chunk.stop]):
            return
        _send_next(group, relay, slices, buffer_size_bytes, num_buffers)
