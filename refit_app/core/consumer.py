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

from refit_app.core.buffers import (
    Slot,
    drain,
    extra_users,
    is_shared,
    keep_buffers,
    on_stream,
)
from refit_app.core.chunks import ChunkCallback, ChunkDoneCallback, ChunkPlanner
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import ChunkLayout, meta_nbytes

logger = logging.getLogger(__name__)

_END = object()
"""What :meth:`Receiver._more` found past the plan's last chunk."""


def normalize_meta(item: Any) -> TensorMeta:
    """A consumer's ``(name, (shape, dtype))`` item as a :class:`TensorMeta`; shape may be a list, tuple or Size."""
    name, (shape, dtype) = item
    return TensorMeta(name, tuple(map(int, shape)), dtype)


def planned_layouts(metas: Iterable[TensorMeta], target: int, legacy: bool) -> Iterator[ChunkLayout]:
    """Each chunk of the plan with its tensors' layout; the consumer needs a whole chunk's size before receiving."""
    planner = ChunkPlanner(target, legacy)
    members: list[TensorMeta] = []
    sizes: list[int] = []
    for meta in metas:
        nbytes = meta_nbytes(meta.shape, meta.dtype)
        closed = planner.add(nbytes)
        if closed is not None:
            yield ChunkLayout(closed, members, sizes)
            members, sizes = [], []
        members.append(meta)
        sizes.append(nbytes)
    last = planner.finish()
    if last is not None:
        yield ChunkLayout(last, members, sizes)


class Receiver:
    """The consumer's receive loop: up to ``num_buffers`` chunks in flight, and batches handed out as views.

    Buffer lifetime: a batch's tensors are views of the slot's receive buffer. A buffer is refilled only when no
    tensor handed out from it is still referenced (its storage use count, :func:`is_shared`); otherwise the slot
    takes a spare buffer and the old one belongs to whoever holds the views (at most ``num_buffers`` spares are
    kept for reuse once they are free; the pool gets them at the end). A consumer that drops each tensor after
    loading it therefore receives into exactly ``num_buffers`` buffers, one that keeps tensors costs one buffer per
    chunk it holds, and none is ever overwritten while referenced. Each buffer is allocated once per slot at the
    target size (at the chunk's size when larger, or for the plan's only or last chunk), so none grows in a call.
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
        self._ahead: Any = None  # the plan's layout after _next once looked at: a layout, _END or the error
        self._in_flight: deque[tuple[Slot, ChunkLayout]] = deque()
        self._handed: Slot | None = None  # the slot of the batch handed out last
        self._spares: deque[torch.Tensor] = deque()
        self._deferred = False  # a forced refill left a slot for after the next wait (see refill)
        self._done = False
        # A group that can hand its own memory out (shared memory read in place) receives with no copy; its
        # views are then under the group's lifetime rule, and the slots' buffers are never refilled here.
        self._view = getattr(group, "receive_view_async", None) if _on_group_device(group, slots) else None
        self._release = getattr(group, "release_unused", None) if self._view is not None else None

    def refill(self, *, force: bool) -> None:
        """Start receiving the next chunks into idle slots. A slot whose buffer still backs tensors handed out is
        skipped unless ``force`` (then it gets a spare buffer): a caller's loop variable keeps the previous chunk's
        last tensor alive until it has the next one, and waiting one step spares a buffer. Receiving views of the
        group's memory, it tells the group what it no longer holds instead."""
        if self._release is not None:
            self._release()
        while len(self._in_flight) + (self._handed is not None) < len(self._slots):
            if self._next is None:
                self._next = self._pull()
                if self._next is None:
                    return
            layout = self._next
            chunk = layout.chunk
            slot = self._slots[chunk.index % len(self._slots)]
            if chunk.broadcast and slot.buffer is not None and self._view is None:
                users = extra_users(slot.buffer)
                if users:
                    if not force:
                        return
                    if users == 1 and self._in_flight:
                        # One other user is most often the transport letting go late (TRANSPORT_RELEASE_S), not a
                        # caller's tensor: post this chunk right after the receive in flight has been waited for
                        # (next_batch), rather than sleep on it or take a spare now.
                        self._deferred = True
                        return
                    if is_shared(slot.buffer, settle=True):
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
        self._handed = slot  # from here on: its buffer is this batch's, not to be refilled
        if self._deferred:
            self._deferred = False
            try:
                self.refill(force=True)
            except Exception as e:
                self._ahead = e
        chunk = layout.chunk
        if self._on_chunk is not None:
            self._on_chunk(chunk.nbytes, chunk.count)
        if self._on_chunk_done is not None:
            self._on_chunk_done(chunk)
        source = slot.buffer if chunk.nbytes else torch.empty(0, dtype=torch.uint8, device=slot.device)
        if self._view is not None:
            slot.buffer = None  # the views alone hold the group's memory: the group sees when they are gone
        batch = layout.unpack(source)
        self._handed = slot
        return batch

    def close(self) -> None:
        """Wait for the receives in flight (an early close or a caller's exception)."""
        if self._in_flight:
            try:
                drain(slot for slot, _ in self._in_flight)
            except BaseException:
                logger.debug("in-flight receive failed while unwinding", exc_info=True)
            self._in_flight.clear()

    def _post(self, slot: Slot, layout: ChunkLayout) -> None:
        chunk = layout.chunk
        if chunk.broadcast and self._view is not None:
            slot.receive(self._view, chunk.nbytes, self._src)
        elif chunk.broadcast:
            if slot.stream is not None:
                # The caller may still be reading the previous batch of this buffer on its stream.
                slot.stream.wait_stream(torch.cuda.current_stream(slot.device))
            # A buffer is sized for the target at once (the producer's are too), so it never grows: growing
            # allocates the new buffer while the old one is still held, and glibc keeps the freed one resident
            # in its heap (measured: +16 MiB above 2 x 16 MiB for the whole process's life). Only the plan's last
            # chunk (a model smaller than one target, on CUDA 2% of the device) gets its exact size.
            buffer = slot.reserve(chunk.nbytes, min_capacity=self._target if self._more() else 0)
            with on_stream(slot):
                slot.broadcast(self._group, buffer[: chunk.nbytes], self._src)
        self._in_flight.append((slot, layout))

    def _pull(self) -> ChunkLayout | None:
        """The plan's next layout (None at its end), the one looked at ahead if any."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return next(self._planned, None)
        if ahead is _END:
            return None
        if isinstance(ahead, Exception):
            raise ahead  # the metadata's error, raised where it would have been without the look-ahead
        return ahead

    def _more(self) -> bool:
        """Whether the plan has a chunk after the one being posted (looks one chunk of metadata ahead; an error
        there is kept for :meth:`_pull`, so the chunks before it are still received)."""
        if self._ahead is None:
            try:
                self._ahead = next(self._planned, _END)
            except Exception as e:
                self._ahead = e
        return self._ahead is not _END

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


def _on_group_device(group: Any, slots: list[Slot]) -> bool:
    device = getattr(group, "device", None)
    return device is not None and all(slot.device == device for slot in slots)


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
