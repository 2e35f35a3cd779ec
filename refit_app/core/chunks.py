"""Chunk planning: the single place where chunk boundaries, and what travels, are decided.

Both sides plan from the same sequence of tensor byte sizes with the same :class:`ChunkPlanner`, so their plans
cannot drift apart. Ask the planner (or the :class:`Chunk` records it produces); do not re-derive its rules.

- :class:`Chunk` (frozen): ``index``, ``first`` (index of its first tensor), ``count``, ``stop``, ``nbytes``,
  ``broadcast`` (whether it goes over the wire) and ``alone`` (bounded mode: a single oversized tensor that
  nothing joins, which the producer broadcasts in place).
- :class:`ChunkPlanner` (streaming): ``add(nbytes)`` returns the chunk that tensor closed, ``finish()`` the last
  one; ``open_index`` / ``open_count`` / ``open_alone`` describe the chunk the latest tensor joined.
- :func:`iter_chunks` (lazy) and :func:`plan_chunks` (a list) give the plan from sizes; :func:`chunk_ids` (each
  tensor's chunk index) is kept for compatibility.

Pure: no tensors, no devices, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

ChunkCallback = Callable[[int, int], None]
"""Called once per chunk with (chunk bytes, number of tensors), for progress and metrics."""
ChunkDoneCallback = Callable[["Chunk"], None]
"""Called once per planned chunk with its :class:`Chunk` record, in order, broadcast or not."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of the plan: consecutive tensors that travel in one broadcast (or none, see ``broadcast``)."""

    index: int
    """Position of the chunk in the plan, from 0."""
    first: int
    """Index of the chunk's first tensor in the tensor sequence."""
    count: int
    """Number of tensors in the chunk (at least 1)."""
    nbytes: int
    """Bytes on the wire: the sum of the tensors' byte sizes."""
    broadcast: bool
    """Whether the chunk goes over the wire. Both sides skip a chunk of only zero-byte tensors in bounded mode;
    legacy mode broadcasts it (0 bytes), as vLLM does, so that a vLLM peer on a group that counts collectives
    (gloo) stays in step."""
    alone: bool
    """Bounded mode only: the chunk is a single tensor larger than the target, which nothing joins. The producer
    broadcasts such a tensor in place (no copy) when it is contiguous and on the buffers' device."""

    @property
    def stop(self) -> int:
        """Index one past the chunk's last tensor."""
        return self.first + self.count


class ChunkPlanner:
    """Streaming chunk planner: feed tensor byte sizes in order, get each :class:`Chunk` as it closes.

    Membership is known as soon as a tensor arrives (:attr:`open_index`), so a producer can pack each tensor as it
    comes without holding the rest of its chunk. The rules:

    - Bounded (default): a tensor that would push the open chunk past the target closes it first, so every chunk is
      at most ``target_bytes`` except one holding a single oversized tensor, which nothing joins (``alone``).
    - Legacy (vLLM's ``pack_tensors``): the tensor is appended first and the chunk closes once it exceeds the target,
      so an oversized tensor shares its chunk with the ones before it.
    - A chunk of only zero-byte tensors is broadcast in legacy mode only (:attr:`Chunk.broadcast`).

    :func:`iter_chunks`, :func:`plan_chunks` and :func:`chunk_ids` are built on it.
    """

    __slots__ = ("_bytes", "_count", "_first", "_index", "_legacy", "_target")

    def __init__(self, target_bytes: int, use_legacy_packing: bool = False) -> None:
        if isinstance(target_bytes, bool) or not isinstance(target_bytes, int) or target_bytes < 1:
            raise ValueError(f"target_bytes={target_bytes!r} is invalid: it must be an integer >= 1")
        self._target = target_bytes
        self._legacy = bool(use_legacy_packing)
        self._index = 0  # of the open chunk
        self._first = 0  # tensor index where the open chunk starts
        self._count = 0  # tensors in the open chunk
        self._bytes = 0

    def add(self, nbytes: int) -> Chunk | None:
        """Place the next tensor. Returns the chunk it closed (the one open before it), or None if it joined the
        open chunk. The tensor itself is then in the open chunk, :attr:`open_index`."""
        closed = None
        if self._count:
            full = self._bytes > self._target if self._legacy else self._bytes + nbytes > self._target
            if full:
                closed = self._close()
        self._bytes += nbytes
        self._count += 1
        return closed

    def finish(self) -> Chunk | None:
        """Close the open chunk at the end of the sequence; None when there is none (no tensor since the last)."""
        return self._close() if self._count else None

    @property
    def open_index(self) -> int:
        """Index of the open chunk: the chunk of the tensor added last."""
        return self._index

    @property
    def open_count(self) -> int:
        """Tensors in the open chunk so far (1 right after a tensor opened it)."""
        return self._count

    @property
    def open_alone(self) -> bool:
        """Whether the open chunk is a single oversized tensor in bounded mode: final, nothing will join it."""
        return not self._legacy and self._count == 1 and self._bytes > self._target

    def _close(self) -> Chunk:
        chunk = Chunk(
            index=self._index,
            first=self._first,
            count=self._count,
            nbytes=self._bytes,
            broadcast=self._bytes > 0 or self._legacy,
            alone=self.open_alone,
        )
        self._index += 1
        self._first += self._count
        self._count = self._bytes = 0
        return chunk


def iter_chunks(sizes: Iterable[int], target_bytes: int, use_legacy_packing: bool = False) -> Iterator[Chunk]:
    """The chunk plan for tensors of these byte sizes, lazily: each chunk is yielded once the size after it (or the
    end) is seen."""
    planner = ChunkPlanner(target_bytes, use_legacy_packing)
    for nbytes in sizes:
        closed = planner.add(nbytes)
        if closed is not None:
            yield closed
    last = planner.finish()
    if last is not None:
        yield last


def plan_chunks(sizes: Iterable[int], target_bytes: int, use_legacy_packing: bool = False) -> list[Chunk]:
    """The whole chunk plan for tensors of these byte sizes (what producer and consumer both follow)."""
    return list(iter_chunks(sizes, target_bytes, use_legacy_packing))


def chunk_ids(sizes: Iterable[int], target_bytes: int, use_legacy_packing: bool = False) -> Iterator[int]:
    """The chunk index of each tensor, given the tensors' byte sizes in order (kept for compatibility; the
    :class:`Chunk` records of :func:`plan_chunks` also say which chunks are broadcast)."""
    planner = ChunkPlanner(target_bytes, use_legacy_packing)
    for nbytes in sizes:
        planner.add(nbytes)
        yield planner.open_index
