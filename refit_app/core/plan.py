"""A chunk plan kept across rounds, for a session that sends the same tensors every round (issue 14).

The first round plans as usual and records each chunk's :class:`~refit_app.core.wire.ChunkLayout`; later rounds
follow the record: the producer copies each chunk by precomputed offsets (:func:`produce_planned`) and the consumer
skips planning (:func:`follow_plan`). Both check every tensor against the record and fail on the first change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from refit_app.core.buffers import Slot, on_stream
from refit_app.core.chunks import Chunk
from refit_app.core.producer import Sender
from refit_app.core.wire import ChunkLayout, pack_all, pack_into


class PackedPlan:
    """A chunk plan kept from one refit round to the next, for a session that sends the same tensors every round.

    Create one per side and pass it as ``plan=`` to every call of that side (producer, or consumer). The first call
    plans as usual and records the plan; later calls follow it instead of re-planning:

    - the producer gathers each chunk's tensors and copies them into its send buffers: on the host with one
      memmove per tensor by precomputed offset into the pooled buffers every call uses, on CUDA with one fused
      ``torch._foreach_copy_`` into precomputed views of send buffers that the plan owns and keeps between rounds
      (:meth:`release` frees them); while a chunk is gathered, its ``post_iter_func`` outputs are held (up to one
      chunk of them: extra memory only when ``post_iter_func`` makes new tensors, a cast say);
    - the consumer reuses each chunk's precomputed layout. Receive buffers and the lifetime contract are those of
      :func:`packed_broadcast_consumer` (fresh view objects every round, so a tensor held from an earlier round
      keeps its values and its buffer). Handing out the same view objects every round would save their creation
      (one ``as_strided`` per tensor, about 1.5 us) but could not tell a caller who kept last round's tensor (its
      buffer's use count does not change) and would overwrite it.

    A round whose tensors differ from the recorded one (name, shape or dtype, or their number) raises ValueError
    naming the first difference; planned chunks before it have been sent. Use a new plan when the model changes.
    The settings (``buffer_size_bytes``, ``use_legacy_packing``, ``num_buffers``) must stay the same too.
    """

    def __init__(self) -> None:
        self._settings: tuple[int, bool, int] | None = None
        self._layouts: list[ChunkLayout] | None = None
        self._buffers: list[torch.Tensor | None] = []
        self._copy_plans: dict[int, tuple[list[torch.Tensor], list[int]]] = {}

    @property
    def ready(self) -> bool:
        """Whether a round has been recorded, so the next call follows the plan."""
        return self._layouts is not None

    @property
    def chunks(self) -> list[Chunk]:
        """The recorded chunk plan (empty before the first round)."""
        return [layout.chunk for layout in self._layouts or []]

    def release(self) -> None:
        """Free the producer's send buffers (the next round allocates them again)."""
        self._buffers = []
        self._copy_plans = {}

    def check_settings(self, target: int, legacy: bool, count: int) -> None:
        """Fix the settings on the first call; refuse a later call with other ones (its chunks would differ)."""
        settings = (target, legacy, count)
        if self._settings is None:
            self._settings = settings
        elif settings != self._settings:
            raise ValueError(
                f"this PackedPlan was recorded with (buffer_size_bytes, use_legacy_packing, num_buffers)="
                f"{self._settings}, now called with {settings}; use a new PackedPlan for other settings"
            )

    def adopt(self, layouts: list[ChunkLayout]) -> None:
        """Make a complete round's chunk layouts the plan that later rounds follow."""
        self._layouts = layouts

    def record(self, planned: Iterator[ChunkLayout]) -> Iterator[ChunkLayout]:
        """Pass ``planned`` through, and adopt it once it has been consumed to the end."""
        layouts = []
        for layout in planned:
            layouts.append(layout)
            yield layout
        self.adopt(layouts)  # only a complete round becomes the plan

    def _mismatch(self, index: int, got: str, want: str) -> ValueError:
        return ValueError(
            f"tensor {index} is {got}, but the PackedPlan recorded {want} at that position: "
            "the tensor list changed since the plan was recorded; use a new PackedPlan"
        )

    # ---- producer

    def _send_buffer(self, slot_index: int, nbytes: int, device: torch.device) -> torch.Tensor:
        while len(self._buffers) <= slot_index:
            self._buffers.append(None)
        buffer = self._buffers[slot_index]
        if buffer is None or buffer.numel() < nbytes or buffer.device != device:
            capacity = max(layout.chunk.nbytes for layout in self._layouts)
            buffer = self._buffers[slot_index] = torch.empty(capacity, dtype=torch.uint8, device=device)
            self._copy_plans = {k: v for k, v in self._copy_plans.items() if k % len(self._buffers) != slot_index}
        return buffer

    def _copy_plan(self, layout: ChunkLayout, buffer: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
        key = layout.chunk.index
        cached = self._copy_plans.get(key)
        if cached is None:
            views = layout.views(buffer)
            cached = self._copy_plans[key] = ([views[i] for i in layout.aligned], layout.aligned)
        return cached


def produce_planned(
    iterator: Iterator[tuple[str, torch.Tensor]],
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
    plan: PackedPlan,
    slots: list[Slot],
    sender: Sender,
) -> None:
    """Follow a recorded plan: gather each chunk's tensors, check them, copy them by precomputed offset, send."""
    iterator = iter(iterator)
    count = len(slots)
    for layout in plan._layouts:
        chunk = layout.chunk
        slot_index = chunk.index % count
        sender.open(chunk.index)
        tensors = []
        for position in range(chunk.first, chunk.stop):
            item = next(iterator, None)
            if item is None:
                raise plan._mismatch(position, "missing (the iterator ended)", "a tensor")
            tensors.append(post_iter_func(item))
        names = layout.names
        for i, (t, (shape, _, dtype, _, _)) in enumerate(zip(tensors, layout.specs)):
            if t.dtype != dtype or t.shape != shape:
                raise plan._mismatch(chunk.first + i, f"{tuple(t.shape)} {t.dtype}", f"{names[i]} {shape} {dtype}")
        slot = sender.slot
        if chunk.alone and tensors[0].device == slot.device and tensors[0].is_contiguous():
            sender.pack(tensors[0], alone=True)  # in place, or into the group's own buffer (Sender.pack says)
        elif chunk.nbytes and slot.device.type == "cpu":
            # Host: one memmove per tensor by address. torch's copies (fused or not) hand anything over 32K
            # elements to the intra-op threads, whose barrier stalls on a machine busy with gloo's threads.
            # The slot's own (pooled) buffer, as in the first round: a plan that kept buffers of its own would
            # leave the pool's idle beside them, doubling the producer's memory.
            buffer = slot.reserve(chunk.nbytes, min_capacity=sender.target)
            pack_all(buffer, layout.spans, tensors)
            slot.hold(tensors)
            sender.use_buffer(buffer)
        elif chunk.nbytes:
            if slot.shared is not None:
                # The group's buffer (consumers read it in place) may differ from one round to the next.
                buffer = slot.reserve(chunk.nbytes, min_capacity=sender.target)
                views = layout.views(buffer)
                dst, aligned = [views[i] for i in layout.aligned], layout.aligned
            else:
                buffer = plan._send_buffer(slot_index, chunk.nbytes, slot.device)
                dst, aligned = plan._copy_plan(layout, buffer)
            with on_stream(slot):
                if slot.stream is not None:
                    slot.stream.wait_stream(torch.cuda.current_stream(slot.device))
                if dst:
                    torch._foreach_copy_(dst, [tensors[i] for i in aligned])
                for i in layout.unaligned:
                    _, _, _, off, n = layout.specs[i]
                    if n:
                        pack_into(buffer, off, tensors[i])
            slot.hold(tensors)  # until the copy (on the slot's stream) and the broadcast are done
            sender.use_buffer(buffer)
        sender.send(chunk)
    extra = next(iterator, None)
    if extra is not None:
        raise plan._mismatch(len(plan._layouts) and plan._layouts[-1].chunk.stop, "one more", "the end of the list")


def follow_plan(plan: PackedPlan, items: Iterator[Any]) -> Iterator[ChunkLayout]:
    """A recorded plan's layouts for the consumer, checking that its metadata still says the same."""
    items = iter(items)
    for layout in plan._layouts:
        for i, (name, (shape, _, dtype, _, _)) in enumerate(zip(layout.names, layout.specs)):
            item = next(items, None)
            if item is None:
                raise plan._mismatch(layout.chunk.first + i, "missing (the iterator ended)", name)
            if item[0] != name or item[1][1] != dtype or tuple(item[1][0]) != shape:
                raise plan._mismatch(layout.chunk.first + i, repr(item), f"{name} {shape} {dtype}")
        yield layout
    if next(items, None) is not None:
        raise plan._mismatch(plan._layouts[-1].chunk.stop if plan._layouts else 0, "one more", "the end")
