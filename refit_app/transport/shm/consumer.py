"""A consumer's side of ``group.backend=shm`` (:mod:`refit_app.transport.shm` describes the whole transport): the
producer's segments mapped read-only, each publication either copied into a tensor of the caller's or handed out
as a view, and the answers that tell the producer when it may write a segment again. On GPUs
(:class:`CudaShmConsumerGroup`) the segments are the producer's device memory, opened by CUDA IPC handle, and
always copied from (:mod:`refit_app.transport.shm.cuda`)."""

from __future__ import annotations

import threading
import time

import torch

from refit_app.common.errors import PeerError
from refit_app.core.buffers import is_shared
from refit_app.core.wire import memmove, tensor_bytes
from refit_app.transport.control import Control
from refit_app.transport.shm.cuda import HOST, copy_bytes, map_cuda_segment
from refit_app.transport.shm.link import (
    FORGET,
    FREE,
    INLINE,
    INLINE_MAX,
    KEEP,
    NEED,
    PUB,
    RELEASE,
    UPLOAD,
    Link,
    LinkClosed,
    Message,
    close_fds,
)
from refit_app.transport.shm.segments import map_segment
from refit_app.transport.spec import PRODUCER_RANK


class _Landing:
    """A receive into the caller's tensor: ``wait()`` returns once its bytes are there."""

    def __init__(self, group: ShmConsumerGroup, seq: int) -> None:
        self._group, self._seq = group, seq

    def wait(self) -> None:
        self._group.wait_landed(self._seq)


class _View:
    """A receive without a copy: ``wait()`` returns the bytes as a read-only view of the producer's segment."""

    def __init__(self, group: ShmConsumerGroup, seq: int, nbytes: int) -> None:
        self._group, self._seq, self._nbytes = group, seq, nbytes

    def wait(self) -> torch.Tensor:
        return self._group.wait_view(self._seq, self._nbytes)


class _Sent:
    def wait(self) -> None:
        return None


class ShmConsumerGroup:
    """A consumer's side: its link to the producer, the segments it mapped, and what it still holds of them."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        link: Link,
        control: Control,
        timeout_s: float,
        device: torch.device = HOST,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        self._control = control
        self._link = link
        self._lock = threading.RLock()
        self._seq = 0
        self._maps: dict[int, torch.Tensor] = {}
        """Segment id -> this process's read-only mapping of it."""
        self._arrived: dict[int, Message] = {}
        """Publications (by seq) that arrived before this rank asked for them."""
        self._posted: dict[int, torch.Tensor] = {}
        """Receives into the caller's tensors (by seq) whose publication has not arrived."""
        self._landed: set[int] = set()
        self._held: dict[int, int] = {}
        """Publications handed out as views (seq -> segment id), not yet answered."""
        self._asked: set[int] = set()
        """Publications the producer waits for (it sent NEED)."""
        self._kept: dict[int, torch.Tensor] = {}
        """Segments answered KEEP whose views are still alive: FREE once they are gone."""
        self._broken: PeerError | None = None

    # ---- the broadcast seam

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> _Landing | _Sent:
        """Send ``tensor`` to every rank (``src`` is this rank) or receive a broadcast into it (a copy)."""
        if tensor.device.type != self.device.type:
            raise ValueError(
                f"this shared-memory group moves tensors on {self.device.type}, and this one is on {tensor.device}"
            )
        if src != self.rank and not tensor.is_contiguous():
            raise ValueError("a shared-memory broadcast receives into contiguous tensors only")
        data = tensor_bytes(tensor)
        with self._lock:
            self._usable()
            seq = self._take_seq()
            if src == self.rank:
                self._upload(seq, data)
                return _Sent()
            msg = self._arrived.pop(seq, None)
            if msg is None:
                self._posted[seq] = data
            else:
                self._land(msg, data)
                self._landed.add(seq)
            self._drain()
            return _Landing(self, seq)

    def receive_view_async(self, nbytes: int, src: int) -> _View:
        """Receive the next broadcast of ``nbytes`` without copying it: ``wait()`` returns a read-only uint8 view of
        the producer's memory, valid for as long as it (or a view of it) is referenced. Writing into it kills this
        process (the mapping is read-only, so that no consumer can change what the others read)."""
        if src != PRODUCER_RANK:
            raise ValueError("views of shared memory come from the producer (rank 0) only")
        with self._lock:
            self._usable()
            return _View(self, self._take_seq(), nbytes)

    def release_unused(self) -> None:
        """Tell the producer about every publication this rank no longer holds views of (cheap: one use count per
        held segment). The packed broadcast's receiver calls it as it moves on; every wait does too."""
        with self._lock:
            if self._broken is None:
                self._answer(blocking=False)

    def shutdown(self, *, abort: bool) -> None:
        """Close the link (the producer sees it at once). Views handed out stay valid: each keeps its mapping."""
        del abort
        self._link.close()
        self._maps, self._kept, self._arrived, self._posted = {}, {}, {}, {}
        if self._broken is None:
            self._broken = PeerError("the refit group was closed")

    # ---- waits (called by the works above)

    def wait_landed(self, seq: int) -> None:
        with self._lock:
            deadline = time.monotonic() + self.timeout_s
            while seq not in self._landed:
                self._block(deadline, seq)
            self._landed.discard(seq)

    def wait_view(self, seq: int, nbytes: int) -> torch.Tensor:
        with self._lock:
            deadline = time.monotonic() + self.timeout_s
            while seq not in self._arrived:
                self._block(deadline, seq)
            msg = self._arrived.pop(seq)
            self._check_size(msg, nbytes)
            if msg.kind == INLINE:
                return torch.frombuffer(bytearray(msg.payload), dtype=torch.uint8) if nbytes else _EMPTY.clone()
            self._held[seq] = msg.seg
            return self._maps[msg.seg][msg.offset : msg.offset + nbytes]

    # ---- internals

    def _take_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _upload(self, seq: int, data: torch.Tensor) -> None:
        n = data.numel()
        raw = data.cpu().numpy().tobytes() if n else b""
        for offset in range(0, max(n, 1), INLINE_MAX):
            self._send(UPLOAD, seq, 0, offset, n, payload=raw[offset : offset + INLINE_MAX])

    def _block(self, deadline: float, seq: int) -> None:
        """Wait for the next record from the producer, first answering what it may be waiting for."""
        self._answer(blocking=True)
        try:
            msg = self._link.recv_wait(deadline)
        except (LinkClosed, ValueError) as e:
            raise self._lost(e) from e
        if msg is None:
            raise self._lost(TimeoutError(f"broadcast {seq} did not arrive"))
        self._handle(msg)
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                msg = self._link.recv()
            except (LinkClosed, ValueError) as e:
                raise self._lost(e) from e
            if msg is None:
                return
            self._handle(msg)

    def _handle(self, msg: Message) -> None:
        if msg.kind == PUB:
            if msg.fds or msg.payload:
                try:
                    self._maps[msg.seg] = self._map(msg)
                except (OSError, ValueError, RuntimeError) as e:
                    raise self._lost(e) from e
            elif msg.seg not in self._maps:
                raise self._lost(ValueError(f"the producer published into segment {msg.seg} without passing it"))
            self._arrive(msg)
        elif msg.kind == INLINE:
            close_fds(msg.fds)
            self._arrive(msg)
        elif msg.kind == NEED:
            self._asked.add(msg.seq)
        elif msg.kind == FORGET:
            self._maps.pop(msg.seg, None)
            self._kept.pop(msg.seg, None)
        else:
            close_fds(msg.fds)
            raise self._lost(ValueError(f"the producer sent a record of unknown kind {msg.kind}"))

    def _arrive(self, msg: Message) -> None:
        dest = self._posted.pop(msg.seq, None)
        if dest is None:
            self._arrived[msg.seq] = msg
            return
        self._land(msg, dest)
        self._landed.add(msg.seq)

    def _land(self, msg: Message, dest: torch.Tensor) -> None:
        n = dest.numel()
        self._check_size(msg, n)
        if msg.kind == INLINE:
            if n:
                self._copy(dest, torch.frombuffer(bytearray(msg.payload), dtype=torch.uint8))
            return
        if n:
            self._copy(dest, self._maps[msg.seg][msg.offset : msg.offset + n])
        self._send(RELEASE, msg.seq)

    def _map(self, msg: Message) -> torch.Tensor:
        """This process's mapping of the segment a first publication passes (its descriptor, closed here)."""
        if not msg.fds:
            raise ValueError(f"the producer passed segment {msg.seg} without its descriptor")
        close_fds(msg.fds[1:])
        return map_segment(msg.fds[0], msg.size)

    def _copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        memmove(dest.data_ptr(), src.data_ptr(), dest.numel())

    def _answer(self, *, blocking: bool) -> None:
        """RELEASE every held publication whose views are gone; about to block, KEEP those the producer waits for
        (it may be waiting for them to send what this rank waits for). FREE kept segments whose views are gone."""
        for seq, seg in list(self._held.items()):
            base = self._maps[seg]
            if not is_shared(base):
                del self._held[seq]
                self._asked.discard(seq)
                self._send(RELEASE, seq)
            elif blocking and seq in self._asked:
                del self._held[seq]
                self._asked.discard(seq)
                self._kept[seg] = base
                self._send(KEEP, seq)
        for seg, base in list(self._kept.items()):
            if not is_shared(base):
                del self._kept[seg]
                self._send(FREE, 0, seg)

    def _check_size(self, msg: Message, nbytes: int) -> None:
        if msg.nbytes != nbytes:
            raise self._lost(
                ValueError(
                    f"the producer broadcast {msg.nbytes} bytes where rank {self.rank} expects {nbytes}: the ranks "
                    "are out of step (different tensors or settings)"
                )
            )

    def _send(self, kind: int, *fields: int, payload: bytes = b"") -> None:
        try:
            self._link.send(kind, *fields, payload=payload, deadline=time.monotonic() + self.timeout_s)
        except (LinkClosed, TimeoutError) as e:
            raise self._lost(e) from e

    def _lost(self, symptom: BaseException) -> PeerError:
        """This rank's link to the producer broke (or its records make no sense): the group fails, preferring the
        reason a failing rank published."""
        error = explain_loss(self._control, symptom, PRODUCER_RANK, self.timeout_s)
        self._broken = error
        return error

    def _usable(self) -> None:
        if self._broken is not None:
            raise PeerError(str(self._broken))


class CudaShmConsumerGroup(ShmConsumerGroup):
    """A consumer on a GPU: the producer's segments are its device memory, opened by CUDA IPC handle; every
    publication is copied device to device into this rank's own buffers and synchronized before it is released."""

    receive_view_async = None
    """No views handed out: a view would let this rank's kernels read the producer's memory after it was released
    (no event crosses processes), and an engine wants its weights in memory of its own."""

    def _map(self, msg: Message) -> torch.Tensor:
        close_fds(msg.fds)
        return map_cuda_segment(msg.payload, msg.size, self.device)

    def _copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        copy_bytes(dest, src)


_EMPTY = torch.empty(0, dtype=torch.uint8)


def explain_loss(control: Control, symptom: BaseException, peer: int, timeout_s: float) -> PeerError:
    """The one-line error for a peer lost on a shared-memory link: the reason a failing rank published (waited for
    briefly, as every backend does), else what this link saw of ``peer``."""
    explained = control.explain(symptom)
    try:
        published = control.error()
    except Exception:  # the producer's store is gone: explain() has said so
        return PeerError(explained)
    if published is not None:
        return PeerError(published)
    who = "the producer (rank 0)" if peer == PRODUCER_RANK else f"rank {peer}"
    if isinstance(symptom, LinkClosed):
        return PeerError(f"lost {who}: its shared-memory connection closed; it may have died")
    if isinstance(symptom, TimeoutError):
        return PeerError(f"no progress from {who} within {timeout_s:g}s ({symptom}); it may have stalled or died")
    return PeerError(f"{who} is out of step: {symptom}")
