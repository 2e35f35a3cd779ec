"""A sharded refit's bytes: each rank sends and receives the regions the plan gives it, packed per pair.

Every (source, destination) pair of the plan is a stream of its regions in plan order, cut into chunks by the same
:class:`~refit_app.core.chunks.ChunkPlanner` on both sides (the packed format: regions back to back, no header), so
the two ends agree on every chunk's size from the plan alone. A rank keeps up to ``num_buffers`` chunks in flight
per pair and takes its pairs in turn, chunk by chunk, so all pairs move at once and packing overlaps sending.

A consumer that passes regions on to a replica (a relayed transfer) sends each of its relay chunks as soon as all
the regions in it have landed, so a chain of replicas moves its bytes in a pipeline rather than one replica after
the other. A region larger than a buffer travels as pieces of a buffer's size (:func:`pieces`).

With a ``checksum`` function, the source of each region hashes the bytes it packed, and after a pair's last chunk
sends the pair's hashes (one 8-byte word a region); the destination hashes the bytes it received and names the
first region that differs (:class:`RegionMismatch`). A relay hashes what it passes on from the bytes it holds.

No tensor is assembled anywhere: a producer packs straight from its local shard, a consumer unpacks straight into
the tensor of the box it needs, which may be a view into a fused parameter (q, k and v slices into one ``qkv_proj``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from refit_app.common.errors import PeerError, one_line
from refit_app.core.chunks import Chunk, plan_chunks
from refit_app.core.group import Work
from refit_app.core.reshard.plan import Box, LayoutError, Transfer, volume
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

    def __post_init__(self) -> None:
        extents = [stop - start for start, stop in self.box]
        if list(self.tensor.shape) != extents:
            raise LayoutError(
                f"a tensor of shape {list(self.tensor.shape)} cannot hold the box {list(self.box)}, which is {extents}"
            )

    def region(self, box: Box) -> torch.Tensor:
        """The part of :attr:`tensor` that is ``box`` of the global tensor (a view)."""
        index = tuple(slice(b0 - h0, b1 - h0) for (b0, b1), (h0, _) in zip(box, self.box))
        return self.tensor[index] if index else self.tensor


Checksum = Callable[[Any], int]
"""A hash of a byte buffer (memoryview), as :func:`refit_app.protocol.checksum.checksum_function` gives."""


class RegionMismatch(RuntimeError):
    """A region's bytes arrived other than its source hashed them; the message names it."""


@dataclass
class Pair:
    """One (this rank, peer) stream: its regions, their chunks, the buffers in flight, the regions' hashes."""

    peer: int
    regions: list[Transfer]
    chunks: list[Chunk]
    slots: deque[tuple[Work, torch.Tensor, Chunk]] = field(default_factory=deque)
    next_chunk: int = 0
    hashes: list[int] = field(default_factory=list)
    trailer: tuple[Work, torch.Tensor] | None = None

    def done(self) -> bool:
        return self.next_chunk >= len(self.chunks) and not self.slots and self.trailer is None


def _hashes(checksum: Checksum, buffer: torch.Tensor, sizes: Sequence[int]) -> list[int]:
    view = memoryview(buffer.numpy())
    out, offset = [], 0
    for n in sizes:
        out.append(checksum(view[offset : offset + n]))
        offset += n
    return out


def as_words(hashes: Sequence[int]) -> torch.Tensor:
    return torch.tensor([h - (1 << 64) if h >= 1 << 63 else h for h in hashes], dtype=torch.int64)


def wait_for(work: Work, group: PairGroup, peer: int, what: str) -> None:
    """Wait for one send or receive (the group bounds it by its timeout); a peer that died or stalled is named in one
    line (:class:`~refit_app.common.errors.PeerError`), with the backend's own first line after it."""
    try:
        work.wait()
    except RuntimeError as e:
        raise PeerError(f"rank {group.rank}: lost rank {peer} while {what} it: {one_line(e)[:300]}") from e


def _nbytes(t: Transfer, held: Mapping[str, Held]) -> int:
    return volume(t.box) * held[t.name].tensor.element_size()


def pieces(box: Box, itemsize: int, limit: int) -> list[Box]:
    """``box`` cut into pieces of at most ``limit`` bytes along its outermost dims (rows first), where it is
    larger: a region never needs a buffer larger than the others, and a relay forwards a large tensor piece by
    piece as it arrives instead of storing it whole first. Both ends cut alike. A single element is never cut."""
    if volume(box) * itemsize <= limit:
        return [box]
    for d, (start, stop) in enumerate(box):
        if stop - start > 1:
            step_bytes = volume(box[d + 1 :]) * itemsize  # one index along dim d
            if step_bytes <= limit:
                step = limit // step_bytes
                return [(*box[:d], (a, min(a + step, stop)), *box[d + 1 :]) for a in range(start, stop, step)]
            return [
                p for a in range(start, stop) for p in pieces((*box[:d], (a, a + 1), *box[d + 1 :]), itemsize, limit)
            ]
    return [box]


def _check_held(t: Transfer, held: Mapping[str, Held], rank: int) -> None:
    """The tensor a transfer packs from or unpacks into is there, of its dtype, and holds its box: checked for every
    transfer before any byte moves (a wrong one would be clipped or overrun silently by the copy, or fail inside the
    backend)."""
    h = held.get(t.name)
    if h is None:
        raise LayoutError(f"rank {rank}: the plan moves tensor {t.name!r} here, and no tensor was given for it")
    dtype = str(h.tensor.dtype).removeprefix("torch.")
    if t.dtype and dtype != t.dtype.removeprefix("torch."):
        raise LayoutError(f"rank {rank}: tensor {t.name!r} is {dtype} here, the plan moves it as {t.dtype}")
    if any(b0 < h0 or b1 > h1 for (b0, b1), (h0, h1) in zip(t.box, h.box)) or len(t.box) != len(h.box):
        raise LayoutError(
            f"rank {rank}: the plan moves {list(t.box)} of tensor {t.name!r}, outside the {list(h.box)} given here"
        )


def pair_streams(
    transfers: Sequence[Transfer], held: Mapping[str, Held], key: str, buffer_size_bytes: int, rank: int
) -> list[Pair]:
    """The pairs of rank ``rank`` in ``transfers`` (``key``: ``"dst"`` for its sends, ``"src"`` for its receives),
    each with its regions cut into pieces and chunked; every tensor checked against its transfers first."""
    for t in transfers:
        _check_held(t, held, rank)
    by_peer: dict[int, list[Transfer]] = {}
    for t in transfers:
        size = held[t.name].tensor.element_size()
        by_peer.setdefault(getattr(t, key), []).extend(
            replace(t, box=box) for box in pieces(t.box, size, buffer_size_bytes)
        )
    return [
        Pair(peer, regions, plan_chunks([_nbytes(t, held) for t in regions], buffer_size_bytes))
        for peer, regions in sorted(by_peer.items())
    ]


def _pack(pair: Pair, chunk: Chunk, held: Mapping[str, Held], buffer: torch.Tensor) -> torch.Tensor:
    """``chunk``'s regions, packed from ``held`` into ``buffer`` (grown for a region larger than a buffer)."""
    if buffer.numel() < chunk.nbytes:
        buffer = torch.empty(chunk.nbytes, dtype=torch.uint8)
    offset = 0
    for t in pair.regions[chunk.first : chunk.stop]:
        offset = pack_into(buffer, offset, held[t.name].region(t.box))
    return buffer[: chunk.nbytes]


def _unpack(
    pair: Pair, chunk: Chunk, buffer: torch.Tensor, held: Mapping[str, Held], checksum: Checksum | None
) -> list[Transfer]:
    offset = 0
    landed = pair.regions[chunk.first : chunk.stop]
    if checksum is not None:
        pair.hashes += _hashes(checksum, buffer[: chunk.nbytes], [_nbytes(t, held) for t in landed])
    for t in landed:
        dst = held[t.name].region(t.box)
        dst.copy_(unpack_from(buffer, offset, tuple(dst.shape), dst.dtype))
        offset += _nbytes(t, held)
    return landed


def _check_hashes(group: PairGroup, pair: Pair) -> None:
    """Receive ``pair``'s hashes from its source and compare them with those of the bytes that arrived."""
    theirs = torch.empty(len(pair.regions), dtype=torch.int64)
    wait_for(group.irecv(theirs, pair.peer), group, pair.peer, "receiving the hashes from")
    for t, mine, sent in zip(pair.regions, as_words(pair.hashes).tolist(), theirs.tolist()):
        if mine != sent:
            raise RegionMismatch(
                f"rank {group.rank}: region {list(t.box)} of tensor {t.name!r} from rank {t.src} arrived other "
                "than it was sent (checksums differ)"
            )


def send_regions(
    group: PairGroup,
    transfers: Sequence[Transfer],
    shards: Mapping[str, Held],
    *,
    buffer_size_bytes: int,
    num_buffers: int,
    checksum: Checksum | None = None,
) -> int:
    """Send every region this rank is the source of (its local shards, ``shards``: tensor name -> :class:`Held`);
    returns the bytes sent. Returns once every send has completed."""
    pairs = pair_streams([t for t in transfers if t.src == group.rank], shards, "dst", buffer_size_bytes, group.rank)
    sent = 0
    while not all(p.done() for p in pairs):
        for pair in pairs:
            sent += _send_next(group, pair, shards, buffer_size_bytes, num_buffers, checksum)
    return sent


def _send_next(
    group: PairGroup,
    pair: Pair,
    held: Mapping[str, Held],
    buffer_size_bytes: int,
    num_buffers: int,
    checksum: Checksum | None,
) -> int:
    """Pack and send ``pair``'s next chunk (after the last, its hashes too), first waiting for its oldest buffer
    when all are in flight; once all are sent, wait for what is left."""
    if pair.next_chunk >= len(pair.chunks):
        while pair.slots:
            wait_for(pair.slots.popleft()[0], group, pair.peer, "sending to")
        if pair.trailer is not None:
            wait_for(pair.trailer[0], group, pair.peer, "sending to")
            pair.trailer = None
        return 0
    buffer = None
    if len(pair.slots) >= num_buffers:
        work, buffer, _ = pair.slots.popleft()
        wait_for(work, group, pair.peer, "sending to")
    if buffer is None:
        buffer = torch.empty(buffer_size_bytes, dtype=torch.uint8)
    chunk = pair.chunks[pair.next_chunk]
    pair.next_chunk += 1
    data = _pack(pair, chunk, held, buffer)
    if checksum is not None:
        pair.hashes += _hashes(checksum, data, [_nbytes(t, held) for t in pair.regions[chunk.first : chunk.stop]])
    pair.slots.append((group.isend(data, pair.peer), buffer, chunk))
    if checksum is not None and pair.next_chunk == len(pair.chunks):
        # At once, not on the pair's next turn: the destination waits for the hashes before it takes its next
        # chunk from anyone.
        words = as_words(pair.hashes)
        pair.trailer = (group.isend(words, pair.peer), words)
    return chunk.nbytes


def receive_regions(
    group: PairGroup,
    transfers: Sequence[Transfer],
    slices: Mapping[str, Held],
    *,
    buffer_size_bytes: int,
    num_buffers: int,
    checksum: Checksum | None = None,
) -> int:
    """Receive every region this rank is the destination of into ``slices`` (tensor name -> :class:`Held`: the
    tensor of the box this rank needs), and pass on each region it relays to a replica as soon as its chunk is
    complete; returns the bytes received. Returns once every receive and relay has completed."""
    pairs = pair_streams([t for t in transfers if t.dst == group.rank], slices, "src", buffer_size_bytes, group.rank)
    relays = pair_streams(
        [t for t in transfers if t.src == group.rank and t.relayed], slices, "dst", buffer_size_bytes, group.rank
    )
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
            wait_for(work, group, pair.peer, "receiving from")
            landed.update((t.name, t.box) for t in _unpack(pair, chunk, buffer, slices, checksum))
            received += chunk.nbytes
            if pair.next_chunk < len(pair.chunks):
                _post_receive(group, pair, buffer_size_bytes, buffer)
            elif not pair.slots and checksum is not None:
                _check_hashes(group, pair)
            for relay in relays:
                _relay_ready(group, relay, slices, landed, buffer_size_bytes, num_buffers, checksum)
    for relay in relays:
        _relay_ready(group, relay, slices, landed, buffer_size_bytes, num_buffers, checksum)
        if relay.next_chunk < len(relay.chunks):
            raise RuntimeError(f"rank {group.rank}: regions to relay to rank {relay.peer} never arrived")
        _send_next(group, relay, slices, buffer_size_bytes, num_buffers, checksum)
    return received


def _post_receive(group: PairGroup, pair: Pair, buffer_size_bytes: int, buffer: torch.Tensor | None = None) -> None:
    chunk = pair.chunks[pair.next_chunk]
    pair.next_chunk += 1
    if buffer is None or buffer.numel() < chunk.nbytes:
        buffer = torch.empty(max(buffer_size_bytes, chunk.nbytes), dtype=torch.uint8)
    pair.slots.append((group.irecv(buffer[: chunk.nbytes], pair.peer), buffer, chunk))


def _relay_ready(
    group: PairGroup,
    relay: Pair,
    slices: Mapping[str, Held],
    landed: set[tuple[str, Box]],
    buffer_size_bytes: int,
    num_buffers: int,
    checksum: Checksum | None,
) -> None:
    """Send each of ``relay``'s next chunks whose regions have all landed."""
    while relay.next_chunk < len(relay.chunks):
        chunk = relay.chunks[relay.next_chunk]
        if not all((t.name, t.box) in landed for t in relay.regions[chunk.first : chunk.stop]):
            return
        _send_next(group, relay, slices, buffer_size_bytes, num_buffers, checksum)
