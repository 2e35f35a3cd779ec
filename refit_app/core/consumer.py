"""The consumer's side: receive each chunk into a slot's buffer and hand its tensors out as views.

:class:`Receiver` keeps up to ``num_buffers`` receives in flight and decides which buffer each chunk goes into,
so that no buffer is refilled while a tensor handed out from it is still referenced. The orchestration around it
(settings, the callback and iterator forms) is :func:`refit_app.packed_tensor.packed_broadcast_consumer`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from refit_app.core.buffers import Slot, drain, is_shared, keep_buffers, on_stream
from refit_app.core.chunks import ChunkCallback, ChunkDoneCallback, ChunkPlanner
from refit_app.core.wire import ChunkLayout, TensorMeta, meta_nbytes

logger = logging.getLogger(__name__)


def normalize_meta(item: Any) -> TensorMeta:
    """A consumer's ``(name, (shape, dtype))`` item as a :data:`TensorMeta`; shape may be a list, tuple or Size."""
    name, (shape, dtype) = item
    return name, tuple(int(d) for d in shape), dtype


def planned_layouts(metas: Iterable[TensorMeta], target: int, legacy: bool) -> Iterator[ChunkLayout]:
    """Each chunk of the plan with its tensors' layout; the consumer needs a whole chunk's size before receiving."""
    planner = ChunkPlanner(target, legacy)
    members: list[TensorMeta] = []
    for meta in metas:
        closed = planner.add(meta_nbytes(meta[1], meta[2]))
        if closed is not None:
            yield ChunkLayout(closed, members)
            members = []
        members.append(meta)
    last = planner.finish()
    if last is not None:
        yield ChunkLayout(last, members)


class Receiver:
    """The consumer's receive loop: up to ``num_buffers`` chunks in flight, and batches handed out as views.

    Buffer lifetime: a batch's tensors are views of the slot's receive buffer. A buffer is refilled only when no
    tensor handed out from it is still referenced (its storage use count, :func:`is_shared`); otherwise the slot
    takes a spare buffer and the old one belongs to whoever holds the views (at most ``num_buffers`` spares are
    kept for reuse once they are free; the pool gets them at the end). A consumer that drops each tensor after
    loading it therefore receives into exactly ``num_buffers`` buffers, one that keeps tensors costs one buffer per
    chunk it holds, and none is ever overwritten while referenced.
    """

    def __init__(
        self,
        planned: Iterator[ChunkLayout],
        group: Any,
        src: int,
        slots: list[Slot],
        target: int,
        on_chunk: ChunkCallback | None,
        on_chunk_done: ChunkDoneCallback | None,
    ) -> None:
        self._planned = planned
        self._group = group
        self._src = src
        self._slots = slots
        self._target = target
        self._on_chunk = on_chunk
        self._on_chunk_done = on_chunk_done
        self._next: ChunkLayout | None = None  # taken from the plan, waiting for its slot
        self._in_flight: deque[tuple[Slot, ChunkLayout]] = deque()
        self._handed: Slot | None = None  # the slot of the batch handed out last
        self._spares: deque[torch.Tensor] = deque()
        self._done = False

    def refill(self, *, force: bool) -> None:
        """Start receiving the next chunks into idle slots. A slot whose buffer still backs tensors handed out is
        skipped unless ``force`` (then it gets a spare buffer): a caller's loop variable keeps the previous chunk's
        last tensor alive until it has the next one, and waiting one step spares a buffer."""
        while len(self._in_flight) + (self._handed is not None) < len(self._slots):
            if self._next is None:
                self._next = next(self._planned, None)
                if self._next is None:
                    return
            layout = self._next
            chunk = layout.chunk
            slot = self._slots[chunk.index % len(self._slots)]
            if chunk.broadcast and slot.buffer is not None and is_shared(slot.buffer, settle=force):
                if not force:
                    return
                self._swap(slot)
            self._next = None
            self._post(slot, layout)

    def next_batch(self, *, force: bool) -> list[tuple[str, torch.Tensor]] | None:
        """The next chunk's ``(name, tensor)`` list, or None after the last; the caller is done with the previous
        batch's buffer once it asks (though it may still hold tensors from it: see the class docstring)."""
        self._handed = None
        self.refill(force=force)
        if not self._in_flight:
            self.refill(force=True)  # nothing in flight to wait for: a spare beats waiting for nothing
        if not self._in_flight:
            if not self._done:
                self._done = True
                keep_buffers(self._slots, self._spares)
            return None
        slot, layout = self._in_flight.popleft()
        slot.wait()
        chunk = layout.chunk
        if self._on_chunk is not None:
            self._on_chunk(chunk.nbytes, chunk.count)
        if self._on_chunk_done is not None:
            self._on_chunk_done(chunk)
        source = slot.buffer if chunk.nbytes else torch.empty(0, dtype=torch.uint8, device=slot.device)
        batch = layout.unpack(source)
        self._handed = slot
        return batch

    def close(self) -> None:
        """Wait for the receives in flight (an early close or a caller's exception)."""
        if self._in_flight:
            try:
                drain(slot for slot, _ in self._in_flight)
            except BaseException:  # noqa: BLE001 - the caller's exception (or close) is the one that matters
                logger.debug("in-flight receive failed while unwinding", exc_info=True)
            self._in_flight.clear()

    def _post(self, slot: Slot, layout: ChunkLayout) -> None:
        chunk = layout.chunk
        if chunk.broadcast:
            if slot.stream is not None:
                # The caller may still be reading the previous batch of this buffer on its stream.
                slot.stream.wait_stream(torch.cuda.current_stream(slot.device))
            # Exact size at first; a later, larger chunk grows the buffer to the target so it grows only once.
            buffer = slot.reserve(chunk.nbytes, min_capacity=self._target if slot.buffer is not None else 0)
            with on_stream(slot):
                slot.broadcast(self._group, buffer[: chunk.nbytes], self._src)
        self._in_flight.append((slot, layout))

    def _swap(self, slot: Slot) -> None:
        """The slot's buffer still backs tensors handed out: leave it to them and receive into another one."""
        held = slot.buffer
        slot.buffer = None  # reserve() then takes a free host buffer from the pool or allocates one
        for i, spare in enumerate(self._spares):
            if not is_shared(spare, settle=True):
                slot.buffer = spare
                del self._spares[i]
                break
        self._spares.append(held)
        if len(self._spares) > len(self._slots):
            self._spares.popleft()  # whoever holds its views owns it now


def iter_tensors(
    rx: Receiver, post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The received ``(name, tensor)`` pairs one by one (the consumer's iterator form), each batch shown to
    ``post_unpack_func`` first when given."""
    # Closing the receiver at once (not at garbage collection) drains its in-flight receives.
    with contextlib.closing(rx):
        while (batch := rx.next_batch(force=False)) is not None:
            if post_unpack_func is not None:
                post_unpack_func(batch)
            items = iter(batch)
            del batch  # the exhausted list iterator then drops the list, so only the caller holds its tensors
            yield next(items)
            # The caller asked for more, so it no longer holds the previous chunk's last tensor: that buffer can
            # take the next receive without a spare.
            rx.refill(force=True)
            yield from items
