"""Buffer lifetimes: the byte buffers a broadcast reads or writes, and when each may be reused.

A :class:`Slot` is one buffer plus the broadcast currently using it (and, on CUDA, its own stream); ``num_buffers``
slots rotate so that packing or unpacking one chunk overlaps the broadcast of another. The rules this module
keeps:

- a slot's buffer is refilled only after :meth:`Slot.wait` (the broadcast reading or writing it has finished);
- a buffer that still backs a tensor handed to a consumer (:func:`is_shared`) is never refilled or handed out;
- host buffers are kept for the next call (:data:`HOST_POOL`), CUDA streams are cached per device
  (:func:`get_streams`), and everything in flight is drained (:func:`drain`) before a call returns.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from refit_app.common.errors import ConfigError, one_line
from refit_app.common.sizes import format_size
from refit_app.core.group import BroadcastGroup, Work

_STREAMS: dict[tuple[torch.device, int], list[torch.cuda.Stream]] = {}


def get_streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
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


TRANSPORT_RELEASE_S = 0.02
"""How long a buffer with exactly one other user may take to lose it. gloo's worker thread drops its reference to
a broadcast's tensor only after ``wait()`` has returned: measured here, 6-17 ms later in about a third of the
broadcasts on a loaded 2-core machine. Without this grace a receive buffer looked held by a caller and the slot took
a fresh one (+16 MiB peak, now and then, over a 50-round run). The consumer sleeps on it only with nothing else in
flight: otherwise it posts that receive after waiting for the one in flight (by then the transport has let go), since
sleeping here stalled the pipeline (3-4 waits of 10-30 ms in each 1 GiB, 65-chunk round on the loaded machine)."""
_SETTLE_POLL_S = 0.0002


def extra_users(buffer: torch.Tensor) -> int:
    """How many tensors other than ``buffer`` use its memory right now (0: nobody else)."""
    return max(0, _storage_use_count(buffer) - _UNSHARED_USE_COUNT)


def is_shared(buffer: torch.Tensor, *, settle: bool = False) -> bool:
    """Whether a tensor other than ``buffer`` (a view handed to a consumer, a numpy array over it, a tensor that
    vLLM's layerwise reload still holds) uses its memory: refilling it then would change that tensor's values.

    ``settle``: where a decision allocates memory, give exactly one other user (a transport's just-finished
    broadcast, see :data:`TRANSPORT_RELEASE_S`) that long to let go; a caller's views are many users, or stay.
    """
    extra = _storage_use_count(buffer) - _UNSHARED_USE_COUNT
    if extra <= 0:
        return False
    if not settle or extra > 1:
        return True
    deadline = time.monotonic() + TRANSPORT_RELEASE_S
    while time.monotonic() < deadline:
        time.sleep(_SETTLE_POLL_S)
        if _storage_use_count(buffer) <= _UNSHARED_USE_COUNT:
            return False
    return True


class HostBufferPool:
    """Host byte buffers kept from one call to the next.

    A refit repeats every training step with the same sizes. Fresh host memory is faulted in page by page on first
    write, which on VMs that hand freed pages back to their host runs at 0.5-1 GB/s, slower than the transport
    itself (docs/results.md); reused buffers are already resident. Memory stays bounded: the pool keeps
    at most as many buffers as the last call used, the largest ones. A consumer's buffer may still back tensors
    the caller holds; the pool keeps it (that costs nothing while the caller holds it) but never hands it out until
    nothing else uses it. CUDA buffers are not pooled here: torch's caching allocator keeps them already, and an
    inference engine wants free GPU memory back.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []

    def __len__(self) -> int:
        """Number of buffers kept, free or still backing a caller's tensors."""
        with self._lock:
            return len(self._free)

    def take(self) -> torch.Tensor | None:
        """The largest kept buffer that no other tensor uses, now owned by the caller, or None. Among equal sizes
        the one given first: slots that take in order get the same buffers every call (and so resident pages and,
        on a planned round, the same addresses)."""
        with self._lock:
            best = None
            for i, buffer in enumerate(self._free):  # sorted by size, stably: equal sizes in the order given
                if (best is None or buffer.numel() > self._free[best].numel()) and not is_shared(buffer, settle=True):
                    best = i
            return None if best is None else self._free.pop(best)

    def give(self, buffers: list[torch.Tensor]) -> None:
        """Keep these buffers (a finished call's) for the next call, and drop any kept before beyond their count."""
        with self._lock:
            self._free = sorted(self._free + buffers, key=torch.Tensor.numel)[-len(buffers) :] if buffers else []

    def clear(self) -> None:
        with self._lock:
            self._free = []


HOST_POOL = HostBufferPool()
"""The process's one pool: every producer and consumer call on the host takes from it and gives back to it."""


def release_buffers() -> None:
    """Free the host buffers that refit calls keep for the next call (at most ``num_buffers`` of them)."""
    HOST_POOL.clear()


SharedBuffer = Callable[[int, int], torch.Tensor]
"""A group's buffer for one slot: ``(nbytes, keep) -> buffer``, at least ``nbytes``, keeping its first ``keep``
bytes if it had to grow; it returns only once nobody reads the buffer any more (see :class:`Slot`)."""


class Slot:
    """A reusable byte buffer and the broadcast currently using it.

    ``shared``: where the group itself provides the buffers (a shared-memory ring that consumers read in place,
    ``slot_buffer(index, nbytes, keep)``), the slot asks it for its buffer every time it is reserved, and never
    pools it: the group decides when a buffer may be written again, and may hand out another one.
    """

    def __init__(
        self, device: torch.device, stream: torch.cuda.Stream | None, shared: SharedBuffer | None = None
    ) -> None:
        self.device = device
        self.stream = stream
        self.shared = shared
        self.buffer: torch.Tensor | None = None
        self._work: Work | None = None
        self._keepalive: Any = None
        self._receiving = False
        self.viewed = False
        """Whether :attr:`buffer` came from :meth:`receive`: the group's memory, never pooled or refilled here."""

    def hold(self, objects: Any) -> None:
        """Keep ``objects`` (a chunk's source tensors) alive until :meth:`wait`: a copy on the slot's stream may
        still read them."""
        self._keepalive = objects

    def reserve(self, nbytes: int, *, keep: int = 0, min_capacity: int = 0) -> torch.Tensor:
        """A buffer of at least ``nbytes``; grows (keeping the first ``keep`` bytes) only when too small."""
        if self.shared is not None:
            self.buffer = self.shared(max(nbytes, min_capacity), keep)
            return self.buffer
        if self.viewed:
            self.buffer, self.viewed = None, False
        if self.buffer is None and self.device.type == "cpu":
            self.buffer = HOST_POOL.take()
        if self.buffer is None or self.buffer.numel() < nbytes:
            if not keep:
                self.buffer = None  # let the old buffer go before the new one exists: no third buffer at the peak
            grown = _allocate(max(nbytes, min_capacity), self.device)
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

    def receive(self, receive_view: Callable[[int, int], Work], nbytes: int, src: int) -> None:
        """Start receiving ``nbytes`` from ``src`` through the group's own memory (``receive_view_async``): after
        :meth:`wait`, :attr:`buffer` is a view of it, no copy made."""
        self.buffer = None
        self.viewed = True
        self._work = receive_view(nbytes, src)
        self._receiving = True

    def wait(self) -> None:
        """Block until the slot's broadcast has finished, so its buffer may be read or refilled."""
        work, self._work = self._work, None
        receiving, self._receiving = self._receiving, False
        try:
            if work is not None:
                # On CUDA, a work's wait() orders the *current* stream after the collective (NCCL) rather than
                # blocking the host: make that the slot's stream, which the synchronize below then waits for.
                with on_stream(self):
                    result = work.wait()
                if receiving:
                    self.buffer = result
        finally:
            if self.stream is not None:
                self.stream.synchronize()
            self._keepalive = None


def _allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    """A buffer of ``nbytes``; a size this rank cannot allocate is the user's setting, said in one line (torch's
    allocator error names neither the setting nor the fix, and comes after the ranks started)."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError) as e:
        raise ConfigError(
            f"cannot allocate a buffer of {format_size(nbytes)} on {device} ({one_line(e)}); lower the buffer size "
            "(buffer_size_bytes; the application's refit.buffer_size_bytes) or the number of buffers in flight "
            "(NRL_REFIT_NUM_BUFFERS)"
        ) from e


def make_slots(device: torch.device, count: int, group: Any = None) -> list[Slot]:
    """``count`` slots on ``device``, each with its own cached stream on CUDA. A ``group`` that provides the
    buffers itself (``slot_buffer(index, nbytes, keep)``, on its own ``device``) gives each slot its own."""
    streams: list[Any] = get_streams(device, count) if device.type == "cuda" else [None] * count
    provider = getattr(group, "slot_buffer", None)
    if provider is None or getattr(group, "device", None) != device:
        return [Slot(device, s) for s in streams]
    return [Slot(device, s, functools.partial(provider, i)) for i, s in enumerate(streams)]


def keep_buffers(slots: Iterable[Slot], spares: Iterable[torch.Tensor] = ()) -> None:
    """Hand the slots' host buffers (and a consumer's spares) to the next call; only once nothing in flight can
    still touch them. Buffers that back tensors the caller still holds go too: the pool skips them until free.
    A group's own buffers (:attr:`Slot.shared`) stay the group's."""
    slots = list(slots)
    own = [slot for slot in slots if slot.shared is None and not slot.viewed]
    buffers = [slot.buffer for slot in own if slot.buffer is not None and slot.device.type == "cpu"]
    spare = [b for b in spares if b.device.type == "cpu"]
    if slots and not own and not spare:
        # A call through the group's own memory (shm) took nothing from the pool: what the pool keeps is another
        # group's, and emptying it made every gloo round of a process that also uses shm fault its ~530 MB of
        # buffers in again (136k page faults, +0.19 s of a consumer's CPU per 1.13 GB round).
        return
    HOST_POOL.give(buffers + spare)


def drain(slots: Iterable[Slot]) -> None:
    """Wait for every slot; the first failure is raised after all were waited on."""
    error: BaseException | None = None
    for slot in slots:
        try:
            slot.wait()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


def on_stream(slot: Slot) -> contextlib.AbstractContextManager[Any]:
    """Run the enclosed CUDA work on the slot's stream (a no-op context for a host slot)."""
    return torch.cuda.stream(slot.stream) if slot.stream is not None else contextlib.nullcontext()


def resolve_device(group: Any, device: torch.device | str | None) -> torch.device:
    """Where the buffers live: ``device``, else the group's ``device``, else the current CUDA device, else CPU."""
    if device is None:
        device = getattr(group, "device", None)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
