"""Packed broadcast of many tensors from one producer rank to every consumer rank.

Sending each tensor in its own collective pays a fixed cost per tensor; here consecutive tensors are packed into
byte buffers of about ``buffer_size_bytes`` and each buffer goes out in one broadcast. Several buffers rotate so
that packing the next chunk overlaps the broadcast of the current one.

Wire format: the raw bytes of consecutive tensors (row-major, no padding, no header), exactly as vLLM's
``pack_tensors`` lays them out. Nothing but the data travels, and producer and consumer may use different
``num_buffers``.

Chunk rules, stated once, in :class:`ChunkPlanner` (ask it; do not re-derive them): both sides plan from the same
sequence of tensor byte sizes, so the plans cannot drift apart.

- :class:`Chunk` (frozen): ``index``, ``first`` (index of its first tensor), ``count``, ``stop``, ``nbytes``,
  ``broadcast`` (whether it goes over the wire: a chunk of only zero-byte tensors is skipped by both sides in the
  default mode and broadcast as 0 bytes in legacy mode, as vLLM does, so that a vLLM peer on a group that counts
  collectives stays in step) and ``alone`` (bounded mode: a single tensor larger than the target, which nothing
  joins; the producer broadcasts it in place).
- :class:`ChunkPlanner` (streaming): ``add(nbytes)`` returns the chunk that tensor closed, ``finish()`` the last
  one; ``open_index`` / ``open_count`` / ``open_alone`` describe the chunk the latest tensor joined.
- :func:`iter_chunks` (lazy) and :func:`plan_chunks` (a list) give the plan from sizes; :func:`chunk_ids` (each
  tensor's chunk index) is kept for compatibility.
- Every call takes keyword-only ``on_chunk_done(chunk)``, called with each planned :class:`Chunk` in order
  (broadcast or not), so metrics count ``chunk.broadcast`` instead of re-deriving it.

Buffer lifetime (consumer): received tensors are views of receive buffers, and a buffer is never refilled while a
tensor handed out from it is still referenced; see :func:`packed_broadcast_consumer`. A session that repeats the
same tensor list every round passes one :class:`PackedPlan` per side as ``plan=``: later rounds skip planning and
the producer copies each chunk with one fused call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
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
ChunkDoneCallback = Callable[["Chunk"], None]
"""Called once per planned chunk with its :class:`Chunk` record, in order, broadcast or not."""


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
# Chunk planning: the single place where chunk boundaries, and what travels, are decided.


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

    Pure: no tensors, no devices. :func:`iter_chunks`, :func:`plan_chunks` and :func:`chunk_ids` are built on it.
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
            if self._legacy:
                full = self._bytes > self._target
            else:
                full = self._bytes + nbytes > self._target
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


def _storage_use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_UNSHARED_USE_COUNT = _storage_use_count(torch.empty(1, dtype=torch.uint8))
"""The storage use count of a buffer that no other tensor uses: the buffer tensor plus the Python storage object
that asking creates (torch keeps one per storage). Measured once here rather than assumed, so a torch that counts
differently shifts the baseline instead of breaking the check."""


def _shared(buffer: torch.Tensor) -> bool:
    """Whether a tensor other than ``buffer`` (a view handed to a consumer, a numpy array over it, a tensor that
    vLLM's layerwise reload still holds) uses its memory: refilling it then would change that tensor's values."""
    return _storage_use_count(buffer) > _UNSHARED_USE_COUNT


class _HostBufferPool:
    """Host byte buffers kept from one call to the next.

    A refit repeats every training step with the same sizes. Fresh host memory is faulted in page by page on first
    write, which on VMs that hand freed pages back to their host runs at 0.5-1 GB/s, slower than the transport
    itself (see the benchmark in README); reused buffers are already resident. Memory stays bounded: the pool keeps
    at most as many buffers as the last call used, the largest ones. A consumer's buffer may still back tensors
    the caller holds; the pool keeps it (that costs nothing while the caller holds it) but never hands it out until
    nothing else uses it. CUDA buffers are not pooled here: torch's caching allocator keeps them already, and an
    inference engine wants free GPU memory back.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []

    def take(self) -> torch.Tensor | None:
        """The largest kept buffer that no other tensor uses, now owned by the caller, or None."""
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):  # sorted by size, largest last
                if not _shared(self._free[i]):
                    return self._free.pop(i)
            return None

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
        self._keepalive: Any = None

    def hold(self, objects: Any) -> None:
        """Keep ``objects`` (a chunk's source tensors) alive until :meth:`wait`: a copy on the slot's stream may
        still read them."""
        self._keepalive = objects

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
        self._keepalive = (data, self._keepalive)

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


def _keep_buffers(slots: Iterable[_Slot], spares: Iterable[torch.Tensor] = ()) -> None:
    """Hand the slots' host buffers (and a consumer's spares) to the next call; only once nothing in flight can
    still touch them. Buffers that back tensors the caller still holds go too: the pool skips them until free."""
    buffers = [slot.buffer for slot in slots if slot.buffer is not None and slot.device.type == "cpu"]
    _HOST_POOL.give(buffers + [b for b in spares if b.device.type == "cpu"])


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
            records the plan, later rounds follow it with one fused copy per chunk.

    Tensors are packed as they arrive, following a :class:`ChunkPlanner`; the plan is never needed up front. Returns
    only after every broadcast has completed. An exception from ``iterator`` or ``post_iter_func`` is raised
    unchanged once the broadcasts already started have finished.
    """
    target, count = _resolve_settings(buffer_size_bytes, num_buffers)
    slots = _make_slots(_resolve_device(group, device), count)
    planner = ChunkPlanner(target, use_legacy_packing)
    sender = _Sender(group, src, slots, target, on_chunk, on_chunk_done)
    if plan is not None:
        plan._check_settings(target, use_legacy_packing, count)
    following = plan is not None and plan.ready
    recorded: list[_Layout] | None = [] if plan is not None and not following else None
    metas: list[_Meta] = []
    try:
        if following:
            _produce_planned(iterator, post_iter_func, plan, slots, sender)
        else:
            for item in iterator:
                t = post_iter_func(item)
                closed = planner.add(t.numel() * t.element_size())
                if closed is not None:
                    sender.send(closed)
                    if recorded is not None:
                        recorded.append(_Layout(closed, metas))
                        metas = []
                if planner.open_count == 1:
                    sender.open(planner.open_index)
                sender.pack(t, alone=planner.open_alone)
                if recorded is not None:
                    metas.append((item[0], tuple(t.shape), t.dtype))
            last = planner.finish()
            if last is not None:
                sender.send(last)
                if recorded is not None:
                    recorded.append(_Layout(last, metas))
    except BaseException:
        try:
            _drain(slots)
        except BaseException:  # noqa: BLE001 - the caller's exception is the one that matters
            logger.debug("in-flight broadcast failed while unwinding", exc_info=True)
        raise
    _drain(slots)
    if recorded is not None:
        plan._layouts = recorded
    if not following:
        _keep_buffers(slots)


class _Sender:
    """The producer's side of one chunk at a time: packs tensors into a slot's buffer, then broadcasts it."""

    def __init__(
        self,
        group: BroadcastGroup,
        src: int,
        slots: list[_Slot],
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
    def slot(self) -> _Slot:
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

    def pack(self, t: torch.Tensor, *, alone: bool) -> None:
        slot = self._slot
        if slot.stream is not None and t.device.type == "cuda":
            # The copy runs on the slot's stream: make it see the producer's writes, and keep the allocator from
            # handing t's memory to someone else before the copy has read it.
            slot.stream.wait_stream(torch.cuda.current_stream(t.device))
            t.record_stream(slot.stream)
        if alone and t.device == slot.device and t.is_contiguous():
            # The planner guarantees nothing joins this tensor's chunk: broadcast its own memory, no copy.
            self._whole = _flat_bytes(t)
            return
        with _on_stream(slot):
            buffer = self._buffer = slot.reserve(self._offset + _nbytes(t), keep=self._offset,
                                                 min_capacity=self._target)
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
            with _on_stream(slot):
                slot.broadcast(self._group, data, self._src)
        self._whole = self._buffer = None
        if self._on_chunk is not None:
            self._on_chunk(chunk.nbytes, chunk.count)
        if self._on_chunk_done is not None:
            self._on_chunk_done(chunk)


# --------------------------------------------------------------------------------------------------------------
# Consumer.

_Meta = tuple[str, tuple[int, ...], torch.dtype]


def _normalize_meta(item: Any) -> _Meta:
    name, (shape, dtype) = item
    return name, tuple(int(d) for d in shape), dtype


def _planned_layouts(metas: Iterable[_Meta], target: int, legacy: bool) -> Iterator[_Layout]:
    """Each chunk of the plan with its tensors' layout; the consumer needs a whole chunk's size before receiving."""
    planner = ChunkPlanner(target, legacy)
    members: list[_Meta] = []
    for meta in metas:
        closed = planner.add(_meta_nbytes(meta[1], meta[2]))
        if closed is not None:
            yield _Layout(closed, members)
            members = []
        members.append(meta)
    last = planner.finish()
    if last is not None:
        yield _Layout(last, members)


def _followed_layouts(plan: PackedPlan, items: Iterator[Any]) -> Iterator[_Layout]:
    """A recorded plan's layouts, checking that the consumer's metadata still says the same."""
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


class _Receiver:
    """The consumer's receive loop: up to ``num_buffers`` chunks in flight, and batches handed out as views.

    Buffer lifetime: a batch's tensors are views of the slot's receive buffer. A buffer is refilled only when no
    tensor handed out from it is still referenced (its storage use count, :func:`_shared`); otherwise the slot takes
    a spare buffer and the old one belongs to whoever holds the views (at most ``num_buffers`` spares are kept for
    reuse once they are free; the pool gets them at the end). A consumer that drops each tensor after loading it
    therefore receives into exactly ``num_buffers`` buffers, one that keeps tensors costs one buffer per chunk
    it holds, and none is ever overwritten while referenced.
    """

    def __init__(
        self,
        planned: Iterator[_Layout],
        group: Any,
        src: int,
        slots: list[_Slot],
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
        self._next: _Layout | None = None  # taken from the plan, waiting for its slot
        self._in_flight: deque[tuple[_Slot, _Layout]] = deque()
        self._handed: _Slot | None = None  # the slot of the batch handed out last
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
            if chunk.broadcast and slot.buffer is not None and _shared(slot.buffer):
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
                _keep_buffers(self._slots, self._spares)
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
                _drain(slot for slot, _ in self._in_flight)
            except BaseException:  # noqa: BLE001 - the caller's exception (or close) is the one that matters
                logger.debug("in-flight receive failed while unwinding", exc_info=True)
            self._in_flight.clear()

    def _post(self, slot: _Slot, layout: _Layout) -> None:
        chunk = layout.chunk
        if chunk.broadcast:
            if slot.stream is not None:
                # The caller may still be reading the previous batch of this buffer on its stream.
                slot.stream.wait_stream(torch.cuda.current_stream(slot.device))
            # Exact size at first; a later, larger chunk grows the buffer to the target so it grows only once.
            buffer = slot.reserve(chunk.nbytes, min_capacity=self._target if slot.buffer is not None else 0)
            with _on_stream(slot):
                slot.broadcast(self._group, buffer[: chunk.nbytes], self._src)
        self._in_flight.append((slot, layout))

    def _swap(self, slot: _Slot) -> None:
        """The slot's buffer still backs tensors handed out: leave it to them and receive into another one."""
        held = slot.buffer
        slot.buffer = None  # reserve() then takes a free host buffer from the pool or allocates one
        for i, spare in enumerate(self._spares):
            if not _shared(spare):
                slot.buffer = spare
                del self._spares[i]
                break
        self._spares.append(held)
        if len(self._spares) > len(self._slots):
            self._spares.popleft()  # whoever holds its views owns it now


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
    rx = _make_receiver(iterator, group, src, num_buffers, buffer_size_bytes, use_legacy_packing, device, on_chunk,
                        on_chunk_done, plan)
    with contextlib.closing(rx):
        while (batch := rx.next_batch(force=True)) is not None:
            yield batch
            del batch  # do not hold the batch while asking for the next one


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
) -> _Receiver:
    target, count = _resolve_settings(buffer_size_bytes, num_buffers)
    slots = _make_slots(_resolve_device(group, device), count)
    if plan is not None:
        plan._check_settings(target, use_legacy_packing, count)
    if plan is not None and plan.ready:
        planned = _followed_layouts(plan, iterator)
    else:
        planned = _planned_layouts((_normalize_meta(item) for item in iterator), target, use_legacy_packing)
        if plan is not None:
            planned = plan._record(planned)
    return _Receiver(planned, group, src, slots, target, on_chunk, on_chunk_done)


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
        num_buffers, buffer_size_bytes, use_legacy_packing, device, on_chunk, on_chunk_done: as for
            :func:`_packed_broadcast_consumer_batches`; the chunking settings must match the producer's.
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
    rx = _make_receiver(iterator, group, src, num_buffers, buffer_size_bytes, use_legacy_packing, device, on_chunk,
                        on_chunk_done, plan)
    if return_iterator:
        return _flatten(rx, post_unpack_func)
    with contextlib.closing(rx):
        while (batch := rx.next_batch(force=True)) is not None:
            post_unpack_func(batch)
            del batch  # not held while the next receive picks its buffer
    return None


def _flatten(
    rx: _Receiver, post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None] | None
) -> Iterator[tuple[str, torch.Tensor]]:
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


# --------------------------------------------------------------------------------------------------------------
# A plan kept across rounds (many small tensors, issue 14).


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


class _Layout:
    """Where one chunk's tensors lie in its buffer, computed once: aligned ones become ``as_strided`` views."""

    __slots__ = ("aligned", "chunk", "names", "specs", "unaligned")

    def __init__(self, chunk: Chunk, metas: list[_Meta]) -> None:
        self.chunk = chunk
        self.names = [name for name, _, _ in metas]
        self.specs = []  # (shape, strides, dtype, byte offset, nbytes) per tensor
        offset = 0
        for _, shape, dtype in metas:
            n = _meta_nbytes(shape, dtype)
            self.specs.append((shape, _contiguous_strides(shape), dtype, offset, n))
            offset += n
        # Tensor positions that can be typed views (aligned, non-empty), the rest is handled one by one.
        self.aligned = [i for i, (_, _, dtype, off, n) in enumerate(self.specs) if n and off % dtype.itemsize == 0]
        aligned = set(self.aligned)
        self.unaligned = [i for i in range(len(self.specs)) if i not in aligned]

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor | None]:
        """Every tensor of the chunk as a view of ``buffer`` (None where not aligned or empty)."""
        out: list[torch.Tensor | None] = [None] * len(self.specs)
        typed: dict[torch.dtype, torch.Tensor] = {}
        usable = buffer.numel()
        for i in self.aligned:
            shape, strides, dtype, off, _ = self.specs[i]
            base = typed.get(dtype)
            if base is None:
                # buffer starts aligned (a fresh allocation), so one typed view serves every aligned tensor.
                base = typed[dtype] = buffer[: usable - usable % dtype.itemsize].view(dtype)
            out[i] = base.as_strided(shape, strides, off // dtype.itemsize)
        return out

    def unpack(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        views = self.views(buffer)
        for i in self.unaligned:
            shape, _, dtype, off, _ = self.specs[i]
            views[i] = unpack_from(buffer, off, shape, dtype)
        return list(zip(self.names, views))


class PackedPlan:
    """A chunk plan kept from one refit round to the next, for a session that sends the same tensors every round.

    Create one per side and pass it as ``plan=`` to every call of that side (producer, or consumer). The first call
    plans as usual and records the plan; later calls follow it instead of re-planning:

    - the producer gathers each chunk's tensors and copies them with one fused ``torch._foreach_copy_`` into views
      of send buffers that the plan owns and keeps between rounds (:meth:`release` frees them); while a chunk is
      gathered, its ``post_iter_func`` outputs are held (up to one chunk of them: extra memory only when
      ``post_iter_func`` makes new tensors, a cast say);
    - the consumer reuses each chunk's precomputed layout. Receive buffers and the lifetime contract are those of
      :func:`packed_broadcast_consumer` (fresh view objects every round, so a tensor held from an earlier round
      keeps its values and its buffer).

    A round whose tensors differ from the recorded one (name, shape or dtype, or their number) raises ValueError
    naming the first difference; planned chunks before it have been sent. Use a new plan when the model changes.
    The settings (``buffer_size_bytes``, ``use_legacy_packing``, ``num_buffers``) must stay the same too.
    """

    def __init__(self) -> None:
        self._settings: tuple[int, bool, int] | None = None
        self._layouts: list[_Layout] | None = None
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

    def _check_settings(self, target: int, legacy: bool, count: int) -> None:
        settings = (target, legacy, count)
        if self._settings is None:
            self._settings = settings
        elif settings != self._settings:
            raise ValueError(
                f"this PackedPlan was recorded with (buffer_size_bytes, use_legacy_packing, num_buffers)="
                f"{self._settings}, now called with {settings}; use a new PackedPlan for other settings"
            )

    def _record(self, planned: Iterator[_Layout]) -> Iterator[_Layout]:
        layouts = []
        for layout in planned:
            layouts.append(layout)
            yield layout
        self._layouts = layouts  # only a complete round becomes the plan

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

    def _copy_plan(self, layout: _Layout, buffer: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
        key = layout.chunk.index
        cached = self._copy_plans.get(key)
        if cached is None:
            views = layout.views(buffer)
            cached = self._copy_plans[key] = ([views[i] for i in layout.aligned], layout.aligned)
        return cached


def _produce_planned(
    iterator: Iterator[tuple[str, torch.Tensor]],
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
    plan: PackedPlan,
    slots: list[_Slot],
    sender: _Sender,
) -> None:
    """Follow a recorded plan: gather each chunk's tensors, check them, copy them with one fused call, send."""
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
            sender.pack(tensors[0], alone=True)
        elif chunk.nbytes:
            buffer = plan._send_buffer(slot_index, chunk.nbytes, slot.device)
            dst, aligned = plan._copy_plan(layout, buffer)
            with _on_stream(slot):
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
