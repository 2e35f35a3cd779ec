"""The producer's side: pack each tensor as it arrives into a slot's buffer, and broadcast every chunk.

:class:`Sender` handles one chunk at a time (the slot it uses, what it was packed into, the broadcast);
:func:`produce_streaming` drives it from a :class:`~refit_app.core.chunks.ChunkPlanner`, never needing the whole
plan up front. The orchestration around it (settings, draining, keeping buffers) is
:func:`refit_app.packed_tensor.packed_broadcast_producer`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from refit_app.core.buffers import Slot, on_stream
from refit_app.core.chunks import Chunk, ChunkCallback, ChunkDoneCallback, ChunkPlanner
from refit_app.core.group import BroadcastGroup
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import (
    ChunkLayout,
    is_dense_host,
    memmove,
    pack_into,
    tensor_bytes,
    tensor_nbytes,
)


class Sender:
    """The producer's side of one chunk at a time: packs tensors into a slot's buffer, then broadcasts it."""

    def __init__(
        self,
        group: BroadcastGroup,
        src: int,
        slots: list[Slot],
        target: int,
        on_chunk: ChunkCallback | None,
        on_chunk_done: ChunkDoneCallback | None,
    ) -> None:
        self._group = group
        self._src = src
        self._slots = slots
        self._target = target
        self._on_chunk = on_chunk
        self._on_chunk_done = on_chunk_done
        self._slot = slots[0]
        self._offset = 0
        self._buffer: torch.Tensor | None = None  # what the open chunk was packed into
        self._whole: torch.Tensor | None = None  # the bytes of an `alone` tensor, sent in place

    @property
    def target(self) -> int:
        """The chunk target: a buffer grows straight to it, so it grows once."""
        return self._target

    @property
    def slot(self) -> Slot:
        """The slot of the open chunk."""
        return self._slot

    def use_buffer(self, buffer: torch.Tensor) -> None:
        """The open chunk was packed into ``buffer`` (a :class:`PackedPlan`'s) rather than the slot's own."""
        self._buffer = buffer

    def open(self, index: int) -> None:
        """Start chunk ``index``: its slot's previous broadcast must have finished before the buffer is refilled."""
        self._slot = self._slots[index % len(self._slots)]
        self._slot.wait()
        self._offset = 0
        self._buffer = None
        self._whole = None

    def pack(self, t: torch.Tensor, *, alone: bool, nbytes: int | None = None) -> None:
        """Append ``t`` (``nbytes`` on the wire, when the caller knows) to the open chunk; ``alone`` (the planner's
        word that nothing joins it) sends it in place."""
        slot = self._slot
        if slot.stream is not None and t.device.type == "cuda":
            # The copy runs on the slot's stream: make it see the producer's writes, and keep the allocator from
            # handing t's memory to someone else before the copy has read it.
            slot.stream.wait_stream(torch.cuda.current_stream(t.device))
            t.record_stream(slot.stream)
        if alone and t.device == slot.device and t.is_contiguous() and slot.shared is None:
            # The planner guarantees nothing joins this tensor's chunk: broadcast its own memory, no copy. (Not
            # where the group provides the buffers: its consumers read those in place, so the tensor goes in.)
            self._whole = tensor_bytes(t)
            return
        offset = self._offset
        end = offset + (tensor_nbytes(t) if nbytes is None else nbytes)
        buffer = self._buffer
        if buffer is None or buffer.numel() < end:
            buffer = self._buffer = slot.reserve(end, keep=offset, min_capacity=self._target)
        if slot.stream is None:
            if end > offset and slot.device.type == "cpu" and is_dense_host(t):
                # The common case, kept lean (it runs once per tensor): one memmove by address into the slot's
                # own host buffer (uint8, contiguous, at least ``end`` bytes: reserve() made it so).
                memmove(buffer.data_ptr() + offset, t.data_ptr(), end - offset)
                self._offset = end
                return
            self._offset = pack_into(buffer, offset, t)
            return
        with on_stream(slot):
            self._offset = pack_into(buffer, self._offset, t)

    def send(self, chunk: Chunk) -> None:
        """Broadcast the packed chunk if the plan says it travels; report it either way."""
        slot = self._slot
        if chunk.broadcast:
            if self._whole is not None:
                data = self._whole
            elif chunk.nbytes:
                data = self._buffer[: chunk.nbytes]
            else:
                data = torch.empty(0, dtype=torch.uint8, device=slot.device)
            with on_stream(slot):
                slot.broadcast(self._group, data, self._src)
        self._whole = self._buffer = None
        if self._on_chunk is not None:
            self._on_chunk(chunk.nbytes, chunk.count)
        if self._on_chunk_done is not None:
            self._on_chunk_done(chunk)


def produce_streaming(
    iterator: Iterator[tuple[str, torch.Tensor]],
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
    planner: ChunkPlanner,
    sender: Sender,
    *,
    record: bool,
) -> list[ChunkLayout] | None:
    """Pack and send every tensor, chunk by chunk as the planner closes them. With ``record``, returns each
    chunk's layout (for a :class:`PackedPlan`'s later rounds), else None. Broadcasts may still be in flight."""
    recorded: list[ChunkLayout] | None = [] if record else None
    metas: list[TensorMeta] = []
    for item in iterator:
        t = post_iter_func(item)
        nbytes = tensor_nbytes(t)
        closed = planner.add(nbytes)
        if closed is not None:
            sender.send(closed)
            if recorded is not None:
                recorded.append(ChunkLayout(closed, metas))
                metas = []
        if planner.open_count == 1:
            sender.open(planner.open_index)
        sender.pack(t, alone=planner.open_alone, nbytes=nbytes)
        if recorded is not None:
            metas.append(TensorMeta(item[0], tuple(t.shape), t.dtype))
    last = planner.finish()
    if last is not None:
        sender.send(last)
        if recorded is not None:
            recorded.append(ChunkLayout(last, metas))
    return recorded
