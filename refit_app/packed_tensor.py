"""Packed broadcast of many tensors from one producer rank to every consumer rank.

Sending each tensor in its own collective pays a fixed cost per tensor; here consecutive tensors are packed into
byte buffers of about ``buffer_size_bytes`` and each buffer goes out in one broadcast. Several buffers rotate so
that packing the next chunk overlaps the broadcast of the current one.

Wire format: the raw bytes of consecutive tensors (row-major, no padding, no header), exactly as vLLM's
``pack_tensors`` lays them out. Both sides derive chunk boundaries from the same sequence of tensor byte sizes with
:func:`chunk_ids`, so nothing but the data travels, and producer and consumer may use different ``num_buffers``.
A chunk that holds only zero-byte tensors is skipped by both sides in the default mode; legacy mode broadcasts it
(0 bytes), as vLLM does, so that a vLLM peer on a group that counts collectives (gloo) stays in step.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

logger = logging.getLogger(__name__)

NUM_BUFFERS_ENV = "NRL_REFIT_NUM_BUFFERS"
BUFFER_MEMORY_RATIO_ENV = "NRL_REFIT_BUFFER_MEMORY_RATIO"
DEFAULT_NUM_BUFFERS = 2
DEFAULT_BUFFER_MEMORY_RATIO = 0.02
MAX_TARGET_PACKED_TENSOR_SIZE = 5 * 1024**3

ChunkCallback = Callable[[int, int], None]
"""Called once per chunk with (chunk bytes, number of tensors), for progress and metrics."""


@runtime_checkable
class BroadcastGroup(Protocol):
    """The one operation the packed broadcast needs from a communicator.

    vLLM's ``PyNcclCommunicator`` and a thin wrapper over ``torch.distributed.broadcast`` both fit. A group may also
    offer ``broadcast_async(tensor, src)`` returning a handle with ``wait()`` (used for overlap on CPU), and a
    ``device`` attribute naming where its tensors must live.
    """

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...


class Work(Protocol):
    def wait(self) -> Any: ...


# --------------------------------------------------------------------------------------------------------------
# Settings from the environment (the spec's helpers).


def get_num_buffers() -> int:
    """Number of rotating buffers: ``NRL_REFIT_NUM_BUFFERS``, default 2. Read at every call."""
    raw = os.environ.get(NUM_BUFFERS_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_NUM_BUFFERS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{NUM_BUFFERS_ENV}={raw!r} is not an integer; set it to a whole number >= 1") from None
    if value < 1:
        raise ValueError(f"{NUM_BUFFERS_ENV}={raw!r} is out of range; set it to a whole number >= 1")
    return value


def _total_device_memory() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def get_target_packed_tensor_size() -> int:
    """Target chunk size in bytes: ``NRL_REFIT_BUFFER_MEMORY_RATIO`` (default 0.02) of the current CUDA device's
    memory, or of physical memory without a GPU, capped at 5 GiB. Read at every call."""
    raw = os.environ.get(BUFFER_MEMORY_RATIO_ENV)
    ratio = DEFAULT_BUFFER_MEMORY_RATIO
    if raw is not None and raw.strip() != "":
        try:
            ratio = float(raw)
        except ValueError:
            raise ValueError(
                f"{BUFFER_MEMORY_RATIO_ENV}={raw!r} is not a number; set it to a fraction in (0, 1], e.g. 0.02"
            ) from None
        if not 0.0 < ratio <= 1.0:  # also rejects nan
            raise ValueError(f"{BUFFER_MEMORY_RATIO_ENV}={raw!r} is out of range; set it to a fraction in (0, 1]")
    return max(1, min(int(_total_device_memory() * ratio), MAX_TARGET_PACKED_TENSOR_SIZE))


def _resolve_settings(buffer_size_bytes: int | None, num_buffers: int | None) -> tuple[int, int]:
    target = get_target_packed_tensor_size() if buffer_size_bytes is None else buffer_size_bytes
    count = get_num_buffers() if num_buffers is None else num_buffers
    if isinstance(target, bool) or not isinstance(target, int) or target < 1:
        raise ValueError(f"buffer_size_bytes={target!r} is invalid: it must be an integer >= 1")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"num_buffers={count!r} is invalid: it must be an integer >= 1")
    return target, count


# --------------------------------------------------------------------------------------------------------------
# Chunk planning: the single place where chunk boundaries are decided.


class _ChunkPlanner:
    """Assigns each tensor, by its byte size alone, to a chunk; membership is known as soon as a tensor arrives.

    Bounded (default): a tensor that would push the open chunk past the target closes it first, so every chunk is
    at most ``target`` bytes except one holding a single oversized tensor, which nothing joins.
    Legacy (vLLM): the tensor is appended first and the chunk closes once it exceeds the target, so an oversized
    tensor shares its chunk with the ones before it.
    """

    def __init__(self, target_bytes: int, legacy: bool) -> None:
        self._target = target_bytes
        self._legacy = legacy
        self._chunk = 0
        self._open_bytes = 0
        self._open_count = 0

    def place(self, nbytes: int) -> int:
        if self._open_count:
            if self._legacy:
                full = self._open_bytes > self._target
            else:
                full = self._open_bytes + nbytes > self._target
            if full:
                self._chunk += 1
                self._open_bytes = self._open_count = 0
        self._open_bytes += nbytes
        self._open_count += 1
        return self._chunk


def chunk_ids(sizes: Iterable[int], target_bytes: int, use_legacy_packing: bool = False) -> Iterator[int]:
    """The chunk index of each tensor, given the tensors' byte sizes in order."""
    planner = _ChunkPlanner(target_bytes, use_legacy_packing)
    for nbytes in sizes:
        yield planner.place(nbytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _meta_nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * dtype.itemsize


# --------------------------------------------------------------------------------------------------------------
# Packing and unpacking of one tensor (pure, device-agnostic).


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in row-major order as a 1-D uint8 tensor, copying only when it is not contiguous.

    ``view(torch.uint8)`` needs a last stride of 1, which a contiguous tensor can lack when a dimension has size 1
    (``torch.zeros(3, 2)[:1, 1]``); re-striding the dense storage as 1-D avoids that failure.
    """
    # A lazily conjugated or negated view stores other bytes than its values; resolve it to real values first.
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def pack_into(buffer: torch.Tensor, offset: int, t: torch.Tensor) -> int:
    """Copy ``t``'s bytes into ``buffer[offset:]``; returns the offset after it."""
    n = _nbytes(t)
    if n == 0:
        return offset
    dst = buffer[offset : offset + n]
    if n >= _HOST_MEMCPY_MIN_BYTES and _is_plain_host_copy(dst, t):
        # torch's copy_ splits a large copy across its intra-op threads and then waits for all of them. A CPU
        # refit keeps the cores busy with the broadcast's own send and receive threads, so that barrier stalls
        # the packing whenever one of its threads is descheduled, and doubles its CPU time. One memcpy per
        # tensor on the calling thread (8-9 GB/s) stays well ahead of the transport.
        np.copyto(dst.numpy(), _flat_bytes(t.detach()).numpy())
    elif offset % t.element_size() == 0:
        # Aligned: copy straight from a strided source, no temporary.
        dst.view(t.dtype).view(t.shape).copy_(t)
    else:
        dst.copy_(_flat_bytes(t))
    return offset + n


_HOST_MEMCPY_MIN_BYTES = 64 * 1024
"""Below this, torch's copy_ runs on one thread anyway and costs less per call than the numpy round trip."""


def _is_plain_host_copy(dst: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be copied as they lie in memory: dense, on the host, with no lazy conjugation
    or negation (those bits change the values without changing the stored bytes)."""
    return (
        dst.device.type == "cpu"
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    )


def unpack_from(buffer: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor stored at ``buffer[offset:]``: a view when aligned for ``dtype``, otherwise an aligned copy.

    A slice that starts mid-element (a bf16 scalar before fp32 weights leaves every later offset odd) cannot be
    viewed as the wider dtype, so it is cloned into fresh, aligned storage; that copy is independent of the buffer.
    """
    n = _meta_nbytes(shape, dtype)
    data = buffer[offset : offset + n]
    itemsize = dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=buffer.device)
    if offset % itemsize:
        data = data.clone()
    return data.view(dtype).view(shape)


def pack_tensors(tensors: Iterable[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """Pack tensors into one new byte buffer (the layout of a chunk). For tests and tools, not the hot path."""
    tensors = list(tensors)
    out = torch.empty(sum(_nbytes(t) for t in tensors), dtype=torch.uint8, device=device)
    offset = 0
    for t in tensors:
        offset = pack_into(out, offset, t)
    return out


# --------------------------------------------------------------------------------------------------------------
# Buffer slots: one per in-flight broadcast.

_STREAMS: dict[tuple[torch.device, int], list[torch.cuda.Stream]] = {}


def _get_streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    """One stream per buffer, created once per (device, count) and reused: fresh streams per call strand memory
    in the caching allocator, which keys free blocks by stream."""
    key = (device, count)
    if key not in _STREAMS:
        _STREAMS[key] = [torch.cuda.Stream(device=device) for _ in range(count)]
    return _STREAMS[key]


class _HostBufferPool:
    """Host byte buffers kept from one call to the next.

    A refit repeats every training step with the same sizes. Fresh host memory is faulted in page by page on first
    write, which on VMs that hand freed pages back to their host runs at 0.5-1 GB/s, slower than the transport
    itself (see the benchmark in README); reused buffers are already resident. Memory stays bounded: the pool keeps
    at most as many buffers as the last call used, the largest ones. CUDA buffers are not pooled here: torch's
    caching allocator keeps them already, and an inference engine wants free GPU memory back.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []

    def take(self) -> torch.Tensor | None:
        """The largest kept buffer, now owned by the caller, or None."""
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            self._free = sorted(self._free + buffers, key=torch.Tensor.numel)[-len(buffers) :] if buffers else []

    def clear(self) -> None:
        with self._lock:
            self._free = []


_HOST_POOL = _HostBufferPool()


def release_buffers() -> None:
    """Free the host buffers that refit calls keep for the next call (at most ``num_buffers`` of them)."""
    _HOST_POOL.clear()


class _Slot:
    """A reusable byte buffer and the broadcast currently using it."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        self.device = device
        self.stream = stream
        self.buffer: torch.Tensor | None = None
        self._work: Work | None = None
        self._keepalive: torch.Tensor | None = None

    def reserve(self, nbytes: int, *, keep: int = 0, min_capacity: int = 0) -> torch.Tensor:
        """A buffer of at least ``nbytes``; grows (keeping the first ``keep`` bytes) only when too small."""
        if self.buffer is None and self.device.type == "cpu":
            self.buffer = _HOST_POOL.take()
        if self.buffer is None or self.buffer.numel() < nbytes:
            grown = torch.empty(max(nbytes, min_capacity), dtype=torch.uint8, device=self.device)
            if keep:
                grown[:keep].copy_(self.buffer[:keep])
            self.buffer = grown
        return self.buffer

    def broadcast(self, group: BroadcastGroup, data: torch.Tensor, src: int) -> None:
        """Start broadcasting ``data``; the slot stays busy until :meth:`wait`."""
        async_broadcast = getattr(group, "broadcast_async", None)
        if async_broadcast is not None:
            self._work = async_broadcast(data, src)
        else:
            group.broadcast(data, src)
        self._keepalive = data

    def wait(self) -> None:
        """Block until the slot's broadcast has finished, so its buffer may be read or refilled."""
        work, self._work = self._work, None
        try:
            if work is not None:
                # On CUDA, a work's wait() orders the *current* stream after the collective (NCCL) rather than
                # blocking the host: make that the slot's stream, which the synchronize below then waits for.
                with _on_stream(self):
                    work.wait()
        finally:
            if self.stream is not None:
                self.stream.synchronize()
            self._keepalive = None


def _make_slots(device: torch.device, count: int) -> list[_Slot]:
    streams: list[Any] = _get_streams(device, count) if device.type == "cuda" else [None] * count
    return [_Slot(device, s) for s in streams]


def _keep_buffers(slots: Iterable[_Slot]) -> None:
    """Hand the slots' host buffers to the next call; only once nothing in flight can still touch them."""
    _HOST_POOL.give([slot.buffer for slot in slots if slot.buffer is not None and slot.device.type == "cpu"])


def _drain(slots: Iterable[_Slot]) -> None:
    """Wait for every slot; the first failure is raised after all were waited on."""
    error: BaseException | None = None
    for slot in slots:
        try:
            slot.wait()
        except BaseException as e:  # noqa: BLE001 - re-raised below once nothing is in flight
            error = error or e
    if error is not None:
        raise error


def _on_stream(slot: _Slot) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.stream(slot.stream) if slot.stream is not None else contextlib.nullcontext()


def _resolve_device(group: Any, device: torch.device | str | None) -> torch.device:
    if device is None:
        device = getattr(group, "device", None)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


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

    Returns only after every broadcast has completed. An exception from ``iterator`` or ``post_iter_func`` is
    raised unchanged once the broadcasts already started have finished.
    """
    target, count = _resolve_settings(buffer_size_bytes, num_buffers)
    device = _resolve_device(group, device)
    slots = _make_slots(device, count)

    def sized() -> Iterator[tuple[str, torch.Tensor]]:
        for item in iterator:
            yield item[0], post_iter_func(item)

    planner = _ChunkPlanner(target, use_legacy_packing)
    placed = ((planner.place(_nbytes(t)), (name, t)) for name, t in sized())
    try:
        for index, members in itertools.groupby(placed, key=lambda p: p[0]):
            slot = slots[index % count]
            slot.wait()
            with _on_stream(slot):
                data, ntensors = _pack_chunk(slot, (item for _, item in members), target, use_legacy_packing)
                if data is not None:
                    slot.broadcast(group, data, src)
            if on_chunk is not None:
                on_chunk(0 if data is None else data.numel(), ntensors)
    except BaseException:
        try:
            _drain(slots)
        except BaseException:  # noqa: BLE001 - the caller's exception is the one that matters
            logger.debug("in-flight broadcast failed while unwinding", exc_info=True)
        raise
    _drain(slots)
    _keep_buffers(slots)


def _pack_chunk(
    slot: _Slot, members: Iterator[tuple[str, torch.Tensor]], target: int, legacy: bool
) -> tuple[torch.Tensor | None, int]:
    """Copy one chunk's tensors into the slot's buffer as they arrive; returns (bytes to send or None, count)."""
    offset = 0
    ntensors = 0
    for _, t in members:
        ntensors += 1
        n = _nbytes(t)
        if slot.stream is not None and t.device.type == "cuda":
            # The copy runs on the slot's stream: make it see the producer's writes, and keep the allocator from
            # handing t's memory to someone else before the copy has read it.
            slot.stream.wait_stream(torch.cuda.current_stream(t.device))
            t.record_stream(slot.stream)
        if n > target and not legacy and t.device == slot.device and t.is_contiguous():
            # Bounded mode sends an oversized tensor alone: broadcast it in place instead of copying it.
            return _flat_bytes(t), ntensors
        buffer = slot.reserve(offset + n, keep=offset, min_capacity=target)
        offset = pack_into(buffer, offset, t)
    if offset == 0:
        return (torch.empty(0, dtype=torch.uint8, device=slot.device) if legacy else None), ntensors
    return slot.buffer[:offset], ntensors


# --------------------------------------------------------------------------------------------------------------
# Consumer.


def _normalize_meta(item: Any) -> tuple[str, tuple[int, ...], torch.dtype]:
    name, (shape, dtype) = item
    return name, tuple(int(d) for d in shape), dtype


def _packed_broadcast_consumer_batches(
    iterator: Iterator[Any],
    group: Any,
    src: int,
    *,
    num_buffers: int | None = None,
    buffer_size_bytes: int | None = None,
    use_legacy_packing: bool = False,
    device: torch.device | str | None = None,
    on_chunk: ChunkCallback | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield unpacked batches while retaining ownership of their receive buffers.

    ``iterator`` yields ``(name, (shape, dtype))`` in the producer's order; ``buffer_size_bytes`` and
    ``use_legacy_packing`` must match the producer's (``num_buffers`` need not). Each yielded batch is the list of
    one chunk's ``(name, tensor)``; most tensors are views of a receive buffer (those that start unaligned for their
    dtype are copies). A batch stays valid until the generator is resumed: at that point its buffer is handed back
    to the next receive. Copy (or load) what you need before asking for the next batch.

    While a batch is being processed, up to ``num_buffers - 1`` further chunks are already being received. Every
    receive has finished before the last batch is yielded. If the generator is closed early or the caller raises,
    the receives in flight are waited for before the exception propagates.
    """
    target, count = _resolve_settings(buffer_size_bytes, num_buffers)
    device = _resolve_device(group, device)
    slots = _make_slots(device, count)

    metas = (_normalize_meta(item) for item in iterator)
    planner = _ChunkPlanner(target, use_legacy_packing)
    placed = ((planner.place(_meta_nbytes(shape, dtype)), (name, shape, dtype)) for name, shape, dtype in metas)
    chunks = ([m for _, m in members] for _, members in itertools.groupby(placed, key=lambda p: p[0]))

    in_flight: deque[tuple[_Slot, list[tuple[str, tuple[int, ...], torch.dtype]], int]] = deque()

    def post(index: int, chunk: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        slot = slots[index % count]
        nbytes = sum(_meta_nbytes(shape, dtype) for _, shape, dtype in chunk)
        if nbytes or use_legacy_packing:  # legacy mode receives empty chunks too (see the module docstring)
            if slot.stream is not None:
                # The caller may still be reading the previous batch of this buffer on its stream.
                slot.stream.wait_stream(torch.cuda.current_stream(device))
            # Exact size at first; a later, larger chunk grows the buffer to the target so it grows only once.
            buffer = slot.reserve(nbytes, min_capacity=target if slot.buffer is not None else 0)
            with _on_stream(slot):
                slot.broadcast(group, buffer[:nbytes], src)
        in_flight.append((slot, chunk, nbytes))

    def complete() -> list[tuple[str, torch.Tensor]]:
        slot, chunk, nbytes = in_flight.popleft()
        slot.wait()
        if on_chunk is not None:
            on_chunk(nbytes, len(chunk))
        source = slot.buffer if nbytes else torch.empty(0, dtype=torch.uint8, device=device)
        batch = []
        offset = 0
        for name, shape, dtype in chunk:
            batch.append((name, unpack_from(source, offset, shape, dtype)))
            offset += _meta_nbytes(shape, dtype)
        return batch

    try:
        for index, chunk in enumerate(chunks):
            post(index, chunk)
            if len(in_flight) == count:
                yield complete()
        while in_flight:
            yield complete()
        # The caller asked past the last batch, so it is done with it: its buffer may serve the next call.
        _keep_buffers(slots)
    finally:
        if in_flight:
            try:
                _drain(slot for slot, _, _ in in_flight)
            except BaseException:  # noqa: BLE001 - the caller's exception (or close) is the one that matters
                logger.debug("in-flight receive failed while unwinding", exc_info=True)
            in_flight.clear()


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
) -> Iterator[tuple[str, torch.Tensor]] | None:
    """Consume a packed tensor as callbacks or a lazy weight iterator.

    Args:
        iterator: yields ``(name, (shape, dtype))`` in the producer's order; shape may be a list, tuple or Size.
        group: the communicator; ``src`` is the producer's rank.
        post_unpack_func: called with each batch (one chunk's ``(name, tensor)`` list). May be None when
            ``return_iterator`` is True; when given together with it, it still sees each batch first.
        return_iterator: return a lazy, flattened ``(name, tensor)`` iterator (for vLLM's ``reload_weights``)
            instead of consuming everything now. A tensor from it stays valid until the iterator has moved past the
            last tensor of its chunk, so a consumer that loads each weight as it arrives is safe; clone to keep.
        num_buffers, buffer_size_bytes, use_legacy_packing, device, on_chunk: as for
            :func:`_packed_broadcast_consumer_batches`; the chunking settings must match the producer's.
    """
    if post_unpack_func is None and not return_iterator:
        raise ValueError("post_unpack_func is None and return_iterator is False: nothing would receive the tensors")
    # Validate before any communication, also for the lazy form.
    _resolve_settings(buffer_size_bytes, num_buffers)
    batches = _packed_broadcast_consumer_batches(
        iterator,
        group,
        src,
        num_buffers=num_buffers,
        buffer_size_bytes=buffer_size_bytes,
        use_legacy_packing=use_legacy_packing,
        device=device,
        on_chunk=on_chunk,
    )
    if return_iterator:
        return _flatten(batches, post_unpack_func)
    with contextlib.closing(batches):
        for batch in batches:
            post_unpack_func(batch)
    return None


def _flatten(
    batches: Iterator[list[tuple[str, torch.Tensor]]],
    post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    # Closing the batches at once (not at garbage collection) drains their in-flight receives.
    with contextlib.closing(batches):
        for batch in batches:
            if post_unpack_func is not None:
                post_unpack_func(batch)
            yield from batch

