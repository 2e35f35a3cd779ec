"""Packed broadcast of many tensors from one producer rank to every consumer rank: the spec's API.

Sending each tensor in its own collective pays a fixed cost per tensor; here consecutive tensors are packed into
byte buffers of about ``buffer_size_bytes`` and each buffer goes out in one broadcast. Several buffers rotate so
that packing the next chunk overlaps the broadcast of the current one.

This module holds the API of ``shared/spec/packed_tensor_api.txt`` (the environment helpers,
:func:`packed_broadcast_producer`, :func:`packed_broadcast_consumer`) as a short orchestrator over
:mod:`refit_app.core`, one concept per module:

- Wire format (:mod:`~refit_app.core.wire`): the raw bytes of consecutive tensors (row-major, no padding, no
  header), exactly as vLLM's ``pack_tensors`` lays them out. Nothing but the data travels, and producer and
  consumer may use different ``num_buffers``.
- Chunk rules (:mod:`~refit_app.core.chunks`), stated once, in :class:`ChunkPlanner` (ask it; do not re-derive
  them): both sides plan from the same sequence of tensor byte sizes, so the plans cannot drift apart. Every call
  takes keyword-only ``on_chunk_done(chunk)``, called with each planned :class:`Chunk` in order (broadcast or
  not), so metrics count ``chunk.broadcast`` instead of re-deriving it.
- Buffer lifetime (:mod:`~refit_app.core.buffers`): received tensors are views of receive buffers, and a buffer
  is never refilled while a tensor handed out from it is still referenced; see :func:`packed_broadcast_consumer`.
- Repeated rounds (:mod:`~refit_app.core.plan`): a session that repeats the same tensor list every round passes
  one :class:`PackedPlan` per side as ``plan=``: later rounds skip planning and the producer copies each chunk
  by precomputed offsets (memmove on the host, one fused copy on CUDA).

The core's names that other modules use are re-exported here (``__all__``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from refit_app.core.buffers import (
    drain,
    keep_buffers,
    make_slots,
    release_buffers,
    resolve_device,
)
from refit_app.core.chunks import (
    Chunk,
    ChunkCallback,
    ChunkDoneCallback,
    ChunkPlanner,
    chunk_ids,
    iter_chunks,
    plan_chunks,
)
from refit_app.core.consumer import (
    Receiver,
    iter_tensors,
    normalize_meta,
    planned_layouts,
)
from refit_app.core.defaults import (
    BUFFER_MEMORY_RATIO_ENV,
    DEFAULT_BUFFER_MEMORY_RATIO,
    DEFAULT_HOST_TARGET_PACKED_TENSOR_SIZE,
    DEFAULT_NUM_BUFFERS,
    MAX_TARGET_PACKED_TENSOR_SIZE,
    NUM_BUFFERS_ENV,
    get_num_buffers,
    get_target_packed_tensor_size,
)
from refit_app.core.group import BroadcastGroup, Work
from refit_app.core.plan import PackedPlan, follow_plan, produce_planned
from refit_app.core.producer import Sender, produce_streaming
from refit_app.core.wire import pack_into, pack_tensors, tensor_bytes, unpack_from

__all__ = [  # noqa: RUF022 - grouped as the spec lists them, not sorted
    # The spec's API.
    "get_target_packed_tensor_size",
    "get_num_buffers",
    "packed_broadcast_producer",
    "_packed_broadcast_consumer_batches",
    "packed_broadcast_consumer",
    # The batch form under a public name, for this package's own callers.
    "packed_broadcast_consumer_batches",
    # Settings.
    "BUFFER_MEMORY_RATIO_ENV",
    "DEFAULT_BUFFER_MEMORY_RATIO",
    "DEFAULT_HOST_TARGET_PACKED_TENSOR_SIZE",
    "DEFAULT_NUM_BUFFERS",
    "MAX_TARGET_PACKED_TENSOR_SIZE",
    "NUM_BUFFERS_ENV",
    # Re-exported from refit_app.core.
    "BroadcastGroup",
    "Chunk",
    "ChunkCallback",
    "ChunkDoneCallback",
    "ChunkPlanner",
    "PackedPlan",
    "Work",
    "chunk_ids",
    "iter_chunks",
    "pack_into",
    "pack_tensors",
    "plan_chunks",
    "release_buffers",
    "tensor_bytes",
    "unpack_from",
]

logger = logging.getLogger(__name__)


def _resolve_settings(buffer_size_bytes: int | None, num_buffers: int | None) -> tuple[int, int]:
    target = get_target_packed_tensor_size() if buffer_size_bytes is None else buffer_size_bytes
    count = get_num_buffers() if num_buffers is None else num_buffers
    if isinstance(target, bool) or not isinstance(target, int) or target < 1:
        raise ValueError(f"buffer_size_bytes={target!r} is invalid: it must be an integer >= 1")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"num_buffers={count!r} is invalid: it must be an integer >= 1")
    return target, count


# --------------------------------------------------------------------------------------------------------------
# Producer.


def packed_broadcast_producer(
    iterator: Iterator[tuple[str, torch.Tensor]],
    group: BroadcastGroup,
    src: int,
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
    *,
    buffer_size_bytes: int | None = None,
    num_buffers: int | None = None,
    use_legacy_packing: bool = False,
    device: torch.device | str | None = None,
    on_chunk: ChunkCallback | None = None,
    on_chunk_done: ChunkDoneCallback | None = None,
    plan: PackedPlan | None = None,
) -> None:
    """Broadcast a list of tensors in a packed manner.

    Args:
        iterator: yields ``(name, tensor)`` in the order the consumers expect.
        group: the communicator (:class:`BroadcastGroup`); this rank is ``src``.
        src: the broadcasting rank.
        post_iter_func: maps each ``(name, tensor)`` to the tensor to send (a dtype cast, say).
        buffer_size_bytes: chunk target; :func:`get_target_packed_tensor_size` when unset.
        num_buffers: buffers in flight; :func:`get_num_buffers` when unset.
        use_legacy_packing: vLLM's chunking (an oversized tensor shares the chunk before it) instead of bounded.
        device: where the send buffers live; the group's ``device``, else the current CUDA device, else CPU.
            Tensors on another device (host tensors for a CUDA producer) are copied there while packing.
        on_chunk: called with (bytes, tensors) as each chunk is handed to the group.
        on_chunk_done: called with each planned :class:`Chunk` once it is handed to the group, in order, including
            chunks that are not broadcast (``chunk.broadcast`` says which were).
        plan: a :class:`PackedPlan` kept by a session across rounds of the same tensor list: the first round
            records the plan, later rounds follow it (precomputed offsets, no planning).

    Tensors are packed as they arrive, following a :class:`ChunkPlanner`; the plan is never needed up front. Returns
    only after every broadcast has completed. An exception from ``iterator`` or ``post_iter_func`` is raised
    unchanged once the broadcasts already started have finished.
    """
    target, count = _resolve_settings(buffer_size_bytes, num_buffers)
    slots = make_slots(resolve_device(group, device), count, group)
    sender = Sender(group, src, slots, target, on_chunk, on_chunk_done)
    if plan is not None:
        plan.check_settings(target, use_legacy_packing, count)
    following = plan is not None and plan.ready
    try:
        if following:
            produce_planned(iterator, post_iter_func, plan, slots, sender)
        else:
            planner = ChunkPlanner(target, use_legacy_packing)
            recorded = produce_streaming(iterator, post_iter_func, planner, sender, record=plan is not None)
    except BaseException:
        try:
            drain(slots)
        except BaseException:
            logger.debug("in-flight broadcast failed while unwinding", exc_info=True)
        raise
    drain(slots)
    if plan is not None and not following:
        plan.adopt(recorded)
    keep_buffers(slots)


# --------------------------------------------------------------------------------------------------------------
# Consumer.


def packed_broadcast_consumer_batches(
    iterator: Iterator[Any],
    group: Any,
    src: int,
    *,
    num_buffers: int | None = None,
    buffer_size_bytes: int | None = None,
    use_legacy_packing: bool = False,
    device: torch.device | str | None = None,
    on_chunk: ChunkCallback | None = None,
    on_chunk_done: ChunkDoneCallback | None = None,
    plan: PackedPlan | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield unpacked batches while retaining ownership of their receive buffers.

    ``iterator`` yields ``(name, (shape, dtype))`` in the producer's order; ``buffer_size_bytes`` and
    ``use_legacy_packing`` must match the producer's (``num_buffers`` need not). Each yielded batch is the list of
    one chunk's ``(name, tensor)``; most tensors are views of a receive buffer (those that start unaligned for their
    dtype are copies).

    Lifetime: a tensor stays intact for as long as anything references it. The library keeps ownership of a receive
    buffer only while none of the tensors handed out from it is alive; a buffer with live tensors is left to them
    and the next chunk goes into another buffer. Dropping a batch before asking for the next one keeps memory at
    ``num_buffers`` buffers; ``for batch in batches:`` keeps the previous batch bound while asking, which costs one
    extra buffer (reused from then on). Holding tensors costs memory, never correctness.

    While a batch is being processed, up to ``num_buffers - 1`` further chunks are already being received. Every
    receive has finished before the last batch is yielded. If the generator is closed early or the caller raises,
    the receives in flight are waited for before the exception propagates. ``on_chunk_done`` is called with each
    planned :class:`Chunk` as it is received (or, not broadcast, reached), in order. ``plan``: see
    :class:`PackedPlan`.
    """
    rx = _make_receiver(
        iterator, group, src, num_buffers, buffer_size_bytes, use_legacy_packing, device, on_chunk, on_chunk_done, plan
    )
    with contextlib.closing(rx):
        while (batch := rx.next_batch(force=True)) is not None:
            yield batch
            del batch  # do not hold the batch while asking for the next one


_packed_broadcast_consumer_batches = packed_broadcast_consumer_batches
"""The spec's name for :func:`packed_broadcast_consumer_batches` (NeMo-RL's, underscore included): the same function,
kept for code written against the spec; this package's own modules import the public name."""


def _make_receiver(
    iterator: Iterator[Any],
    group: Any,
    src: int,
    num_buffers: int | None,
    buffer_size_bytes: int | None,
    use_legacy_packing: bool,
    device: torch.device | str | None,
    on_chunk: ChunkCallback | None,
    on_chunk_done: ChunkDoneCallback | None,
    plan: PackedPlan | None,
) -> Receiver:
    target, count = _resolve_settings(buffer_size_bytes, num_buffers)
    slots = make_slots(resolve_device(group, device), count, group)
    if plan is not None:
        plan.check_settings(target, use_legacy_packing, count)
    if plan is not None and plan.ready:
        planned = follow_plan(plan, iterator)
    else:
        planned = planned_layouts((normalize_meta(item) for item in iterator), target, use_legacy_packing)
        if plan is not None:
            planned = plan.record(planned)
    return Receiver(planned, group, src, slots, target, on_chunk, on_chunk_done)


def packed_broadcast_consumer(
    iterator: Iterator[Any],
    group: Any,
    src: int,
    post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None] | None,
    return_iterator: bool = False,
    *,
    num_buffers: int | None = None,
    buffer_size_bytes: int | None = None,
    use_legacy_packing: bool = False,
    device: torch.device | str | None = None,
    on_chunk: ChunkCallback | None = None,
    on_chunk_done: ChunkDoneCallback | None = None,
    plan: PackedPlan | None = None,
) -> Iterator[tuple[str, torch.Tensor]] | None:
    """Consume a packed tensor as callbacks or a lazy weight iterator.

    Args:
        iterator: yields ``(name, (shape, dtype))`` in the producer's order; shape may be a list, tuple or Size.
        group: the communicator; ``src`` is the producer's rank.
        post_unpack_func: called with each batch (one chunk's ``(name, tensor)`` list). May be None when
            ``return_iterator`` is True; when given together with it, it still sees each batch first.
        return_iterator: return a lazy, flattened ``(name, tensor)`` iterator (for vLLM's ``reload_weights``)
            instead of consuming everything now.
        num_buffers: receive buffers in flight; need not match the producer's.
        buffer_size_bytes: chunk target; must match the producer's.
        use_legacy_packing: chunking mode; must match the producer's.
        device: where the receive buffers live, as for :func:`packed_broadcast_producer`.
        on_chunk: called with (bytes, tensors) as each chunk arrives.
        on_chunk_done: called with each planned :class:`Chunk` as it is received (or, not broadcast, reached).
        plan: a :class:`PackedPlan` kept by a session across rounds of the same tensor list: the first round
            records each chunk's layout, later rounds reuse it (the metadata is still checked against it).

    Lifetime contract, both forms: a received tensor keeps its values for as long as it is referenced, with no
    clone needed. Tensors are views of receive buffers (unaligned slices are copies), and a buffer is refilled only
    once no tensor handed out from it is alive; keeping tensors (``post_unpack_func`` storing them, vLLM's
    layerwise reload holding a layer) makes later chunks go into other buffers, so memory grows by one buffer per
    chunk still held, and is given back as the tensors are dropped. A consumer that loads each tensor and drops it
    (``for name, t in it: load(t)``, or a callback that copies) receives into exactly ``num_buffers`` buffers.
    In iterator form, the buffer of the chunk just finished is refilled once the caller has moved past the next
    chunk's first tensor, so a loop variable still bound to the previous tensor costs nothing.
    """
    if post_unpack_func is None and not return_iterator:
        raise ValueError("post_unpack_func is None and return_iterator is False: nothing would receive the tensors")
    # Validate before any communication, also for the lazy form.
    rx = _make_receiver(
        iterator, group, src, num_buffers, buffer_size_bytes, use_legacy_packing, device, on_chunk, on_chunk_done, plan
    )
    if return_iterator:
        return iter_tensors(rx, post_unpack_func)
    with contextlib.closing(rx):
        while (batch := rx.next_batch(force=True)) is not None:
            post_unpack_func(batch)
            del batch  # not held while the next receive picks its buffer
    return None
