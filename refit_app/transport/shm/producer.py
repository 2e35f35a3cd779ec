"""The producer's side of ``group.backend=shm`` (:mod:`refit_app.transport.shm` describes the whole transport):
:class:`ShmProducerGroup`, which packs chunks straight into a ring of shared segments and publishes where they lie,
reuses a segment only once every consumer has released it, and fails in one place (:meth:`ShmProducerGroup._lost`)
when a consumer is lost; and :func:`make_shm_group`, which connects a rank's side of the group."""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from refit_app.common.errors import ConfigError, PeerError, one_line
from refit_app.core.wire import tensor_bytes
from refit_app.transport.control import Control, Poller
from refit_app.transport.records import RecordError, RecordKind, RunStore, need
from refit_app.transport.shm.consumer import CudaShmConsumerGroup, ShmConsumerGroup, explain_loss
from refit_app.transport.shm.cuda import HOST, CudaSegment, copy_bytes
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
    accept_consumers,
    close_fds,
    connect_producer,
    listen,
    remaining_ms,
)
from refit_app.transport.shm.segments import SHM_MEMORY_FIX, HostSegment, round_up, shm_memory_problem
from refit_app.transport.spec import PRODUCER_RANK, GroupSpec

logger = logging.getLogger(__name__)

STAGING_SEGMENTS = 4
"""Staging segments for broadcasts of tensors outside the ring; more in flight wait for consumers to copy out."""
STAGING_MIN_BYTES = 1 << 20
SPARE_SEGMENTS = 2
"""Idle segments kept for reuse (one left a ring slot because a consumer kept views, and was freed since)."""
_K_ADDRESS = "shm/address"
_ADDRESS = RecordKind("shm", "the producer's shared-memory record", lambda doc: need(doc, "name", str))
"""Where the producer's socket listens (an abstract name)."""
_SETUP_POLL_S = 0.2
"""During set-up, how often a waiting rank looks for an error another rank published (it then fails at once)."""


Segment = HostSegment | CudaSegment


class Done:
    """The work of a broadcast that finished when it was started."""

    def wait(self) -> None:
        return None


DONE = Done()


class _Upload:
    def __init__(self, nbytes: int) -> None:
        self.data = bytearray(nbytes)
        self.filled = 0


class ShmProducerGroup:
    """The producer's side (rank 0): the ring, staging, and one link per consumer."""

    def __init__(
        self,
        links: dict[int, Link],
        world_size: int,
        control: Control,
        timeout_s: float,
        device: torch.device = HOST,
    ) -> None:
        self.rank = PRODUCER_RANK
        self.world_size = world_size
        self.device = device
        """Where the segments are: host memory, or (every rank has a GPU) this GPU's memory, passed by CUDA IPC."""
        self._cuda = device.type == "cuda"
        self.timeout_s = timeout_s
        self._control = control
        self._links = links
        self._by_fd = {link.fileno(): link for link in links.values()}
        self._poller = select.poll()
        for fd in self._by_fd:
            self._poller.register(fd, select.POLLIN)
        self._lock = threading.RLock()
        self._seq = 0
        self._made = 0
        self._committed = 0
        """Bytes of host segments made and not yet given up: what a new one is checked against memory with."""
        self._ring: dict[int, Segment] = {}
        self._staging: list[Segment] = []
        self._spares: list[Segment] = []
        self._retired: dict[int, Segment] = {}
        """Out of the ring and staging, still read by a consumer; a spare once nobody reads it."""
        self._pending: dict[int, Segment] = {}
        """Publication (seq) -> its segment, until every consumer has answered it."""
        self._uploads: dict[int, _Upload] = {}
        self._broken: PeerError | None = None

    # ---- the broadcast seam

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> Done:
        """Publish ``tensor`` (``src`` 0) or receive it from consumer ``src`` and pass it on to the others. Returns
        once the caller may change or drop ``tensor``: its bytes are in shared memory or in every message."""
        data = _group_bytes(tensor, self.device, writable=src != self.rank)
        with self._lock:
            self._usable()
            seq = self._take_seq()
            if src == self.rank:
                self._publish(seq, data, skip=None)
            else:
                upload = self._await_upload(seq, src, data.numel())
                if data.numel():
                    copy_bytes(data, torch.frombuffer(upload.data, dtype=torch.uint8))
                self._publish(seq, data, skip=src)
        return DONE

    def slot_buffer(self, index: int, nbytes: int, keep: int = 0) -> torch.Tensor:
        """The shared buffer of slot ``index``, at least ``nbytes``, once no consumer reads it any more (waits up
        to the group's deadline). A larger one replaces it keeping its first ``keep`` bytes (a chunk that grew while
        packed). Every write into a slot's buffer must follow a call: a slot kept by a consumer gets another one."""
        with self._lock:
            self._usable()
            seg = self._ring.get(index)
            if seg is not None and not seg.retired:
                self._wait_idle(seg)
                if not seg.retired and seg.nbytes >= nbytes:
                    return seg.tensor
            fresh = self._fresh(max(nbytes, keep), "a packed buffer (buffer_size_bytes, or a tensor larger than it)")
            if keep:
                assert seg is not None
                copy_bytes(fresh.tensor[:keep], seg.tensor[:keep])
            if seg is not None:
                self._leave(seg)
            self._ring[index] = fresh
            return fresh.tensor

    def shutdown(self, *, abort: bool) -> None:
        """Close every link (each consumer then sees the end at once) and give up every segment's descriptor; the
        memory goes with the last mapping. No lock: a thread blocked in a wait must see its sockets close."""
        del abort
        for link in self._links.values():
            link.close()
        for seg in self._segments():
            self._close(seg)
        self._ring, self._staging, self._spares, self._retired, self._pending = {}, [], [], {}, {}
        if self._broken is None:
            self._broken = PeerError("the refit group was closed")

    # ---- publishing

    def _take_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _publish(self, seq: int, data: torch.Tensor, skip: int | None) -> None:
        n = data.numel()
        targets = [r for r in self._links if r != skip]
        if not targets:
            return
        seg, offset = self._locate(data)
        if seg is None:
            if n <= INLINE_MAX:
                payload = data.cpu().numpy().tobytes()
                for r in targets:
                    self._send(r, INLINE, seq, 0, 0, n, payload=payload)
                return
            seg, offset = self._acquire_staging(n), 0
            copy_bytes(seg.tensor[:n], data)
        elif self._cuda:
            # Packed on the slots' streams: consumers read it from other processes, which no event reaches.
            torch.cuda.synchronize(self.device)
        self._poll_now()
        seg.latest_seq = seq
        seg.busy = set(targets)
        seg.asked = set()
        self._pending[seq] = seg
        for r in targets:
            # A consumer gets the segment with its first publication to it: a descriptor, or a CUDA IPC handle.
            first = r not in seg.sent_to
            fds = (seg.fd,) if first and not self._cuda else ()
            handle = seg.handle if first and self._cuda else b""
            self._send(r, PUB, seq, seg.id, offset, n, seg.nbytes, payload=handle, fds=fds)
            seg.sent_to.add(r)

    def _locate(self, data: torch.Tensor) -> tuple[Segment | None, int]:
        """The ring segment ``data`` lies in, idle, and the offset; (None, 0) for anything else (which is copied)."""
        for seg in self._ring.values():
            offset = seg.holds(data)
            if offset is not None:
                return (seg, offset) if seg.idle and not seg.retired else (None, 0)
        return None, 0

    def _acquire_staging(self, nbytes: int) -> Segment:
        deadline = time.monotonic() + self.timeout_s
        while True:
            for seg in [s for s in self._staging if s.retired]:
                self._staging.remove(seg)
                self._leave(seg)
            fits = [s for s in self._staging if s.idle and s.nbytes >= nbytes]
            if fits:
                return min(fits, key=lambda s: s.nbytes)
            idle = [s for s in self._staging if s.idle]
            if idle and len(self._staging) >= STAGING_SEGMENTS:
                smallest = min(idle, key=lambda s: s.nbytes)
                self._staging.remove(smallest)
                self._drop(smallest)
            if len(self._staging) < STAGING_SEGMENTS:
                seg = self._fresh(max(STAGING_MIN_BYTES, 1 << (nbytes - 1).bit_length()), "a staging segment")
                self._staging.append(seg)
                return seg
            oldest = min(self._staging, key=lambda s: s.latest_seq)
            self._ask(oldest)
            self._pump(deadline, oldest.busy or oldest.kept_by)

    # ---- segments

    def _segments(self) -> list[Segment]:
        return [*self._ring.values(), *self._staging, *self._spares, *self._retired.values()]

    def _fresh(self, nbytes: int, what: str) -> Segment:
        fits = [s for s in self._spares if s.nbytes >= nbytes]
        if fits:
            seg = min(fits, key=lambda s: s.nbytes)
            self._spares.remove(seg)
            return seg
        if self._cuda:
            self._made += 1
            return CudaSegment(self._made, nbytes, self.device)
        # Checked before the pages are allocated, which happens in full at once: past the host's memory the OOM
        # killer, not this process, would end it (and may pick another process first).
        problem = shm_memory_problem(round_up(nbytes), self._committed)
        if problem is not None:
            raise ConfigError(f"group.backend=shm: {what}: {problem}; {SHM_MEMORY_FIX}")
        self._made += 1
        seg = HostSegment(self._made, nbytes)
        self._committed += seg.nbytes
        return seg

    def _leave(self, seg: Segment) -> None:
        """``seg`` left the ring or staging: a spare if nobody reads it, else retired until they are done."""
        seg.retired = False
        if seg.idle:
            self._spare(seg)
        else:
            seg.retired = True
            self._retired[seg.id] = seg

    def _spare(self, seg: Segment) -> None:
        if len(self._spares) < SPARE_SEGMENTS:
            self._spares.append(seg)
        else:
            self._drop(seg)

    def _drop(self, seg: Segment) -> None:
        """Give ``seg`` up: the consumers that mapped it drop their mapping (views of it stay valid)."""
        for r in sorted(seg.sent_to):
            if not self._links[r].closed:
                self._send(r, FORGET, 0, seg.id)
        self._close(seg)

    def _close(self, seg: Segment) -> None:
        if seg.fd is not None and not self._cuda:
            self._committed -= seg.nbytes
        seg.close()

    def _wait_idle(self, seg: Segment) -> None:
        deadline = time.monotonic() + self.timeout_s
        if not seg.idle:
            self._poll_now()
        while not seg.idle and not seg.retired:
            self._ask(seg)
            self._pump(deadline, seg.busy)

    def _ask(self, seg: Segment) -> None:
        """Tell the consumers that have not answered ``seg``'s publication that the producer waits for them."""
        for r in sorted(seg.busy - seg.asked):
            self._send(r, NEED, seg.latest_seq)
            seg.asked.add(r)

    # ---- what consumers send

    def _poll_now(self) -> None:
        for fd, _ in self._poller.poll(0):
            self._drain(self._by_fd[fd])

    def _pump(self, deadline: float, waiting_on: Iterable[int]) -> None:
        """Handle what consumers sent, waiting up to ``deadline`` for something to arrive."""
        ready = self._poller.poll(remaining_ms(deadline))
        if not ready:
            if time.monotonic() >= deadline:
                ranks = ", ".join(str(r) for r in sorted(waiting_on)) or "?"
                raise self._lost(
                    min(waiting_on, default=-1),
                    TimeoutError(f"rank(s) {ranks} did not answer for a shared buffer"),
                )
            return
        for fd, _ in ready:
            self._drain(self._by_fd[fd])

    def _drain(self, link: Link) -> None:
        while True:
            try:
                msg = link.recv()
            except (LinkClosed, ValueError) as e:
                raise self._lost(link.peer, e) from e
            if msg is None:
                return
            close_fds(msg.fds)
            self._handle(link.peer, msg)

    def _handle(self, rank: int, msg: Message) -> None:
        if msg.kind in (RELEASE, KEEP):
            seg = self._pending.get(msg.seq)
            if seg is None or rank not in seg.busy:
                what = f"rank {rank} answered publication {msg.seq}, which it does not hold"
                raise self._lost(rank, ValueError(what))
            seg.busy.discard(rank)
            seg.asked.discard(rank)
            if msg.kind == KEEP:
                seg.kept_by.add(rank)
                seg.retired = True
            if not seg.busy:
                del self._pending[msg.seq]
            self._settle(seg)
        elif msg.kind == FREE:
            seg = next((s for s in self._segments() if s.id == msg.seg), None)
            if seg is not None:
                seg.kept_by.discard(rank)
                self._settle(seg)
        elif msg.kind == UPLOAD:
            upload = self._uploads.setdefault(msg.seq, _Upload(msg.nbytes))
            end = msg.offset + len(msg.payload)
            if len(upload.data) != msg.nbytes or end > msg.nbytes:
                raise self._lost(rank, ValueError(f"rank {rank} sent an upload that does not fit its broadcast"))
            upload.data[msg.offset : end] = msg.payload
            upload.filled += len(msg.payload)
        else:
            raise self._lost(rank, ValueError(f"rank {rank} sent a record of unknown kind {msg.kind}"))

    def _settle(self, seg: Segment) -> None:
        if seg.idle and self._retired.pop(seg.id, None) is not None:
            seg.retired = False
            self._spare(seg)

    def _await_upload(self, seq: int, src: int, nbytes: int) -> _Upload:
        deadline = time.monotonic() + self.timeout_s
        while True:
            upload = self._uploads.get(seq)
            if upload is not None and upload.filled >= len(upload.data):
                del self._uploads[seq]
                if len(upload.data) != nbytes:
                    raise self._lost(src, ValueError(_out_of_step(src, len(upload.data), nbytes)))
                return upload
            self._pump(deadline, (src,))

    # ---- failures

    def _send(self, rank: int, kind: int, *fields: int, payload: bytes = b"", fds: tuple[int, ...] = ()) -> None:
        try:
            self._links[rank].send(kind, *fields, payload=payload, fds=fds, deadline=time.monotonic() + self.timeout_s)
        except (LinkClosed, TimeoutError) as e:
            raise self._lost(rank, e) from e

    def _lost(self, rank: int, symptom: BaseException) -> PeerError:
        """The one place where a consumer's loss (its socket closed, a deadline passed, a record that makes no
        sense) becomes the group's failure: every rank fails, the published root cause preferred. Closing the
        links then fails the other consumers at once."""
        # A policy that drops the rank instead of failing everyone (refit.on_consumer_loss) would start here.
        error = explain_loss(self._control, symptom, rank, self.timeout_s)
        self._broken = error
        return error

    def _usable(self) -> None:
        if self._broken is not None:
            raise PeerError(str(self._broken))


def _out_of_step(rank: int, sent: int, expected: int) -> str:
    return (
        f"rank {rank} broadcast {sent} bytes where this rank expects {expected}: the ranks are out of step "
        "(different tensors or settings)"
    )


def _group_bytes(tensor: torch.Tensor, device: torch.device, *, writable: bool) -> torch.Tensor:
    """``tensor``'s bytes as a 1-D uint8 tensor over its memory (a copy only when it must be, to read it)."""
    if tensor.device.type != device.type:
        raise ValueError(
            f"this shared-memory group moves tensors on {device.type}, and this one is on {tensor.device}; "
            f"move it to {device.type} first"
        )
    if writable and not tensor.is_contiguous():
        raise ValueError("a shared-memory broadcast receives into contiguous tensors only")
    return tensor_bytes(tensor)


def _wait_address(records: RunStore, control: Control, deadline: float) -> bytes:
    """The producer's socket record, polling the store so that an error another rank published ends the wait."""
    poller = Poller(0.001, _SETUP_POLL_S)
    while True:
        try:
            if records.check([_K_ADDRESS]):
                return records.get(_K_ADDRESS)
        except dist.DistError as e:
            raise PeerError(control.explain(e)) from e
        published = control.error()
        if published is not None:
            raise PeerError(published)
        if time.monotonic() >= deadline:
            raise PeerError(control.explain(TimeoutError("the producer's shared memory did not appear: timed out")))
        poller.sleep(deadline)


def make_shm_group(store: dist.Store, spec: GroupSpec, control: Control) -> ShmProducerGroup | ShmConsumerGroup:
    """This rank's side of a shared-memory group: the producer listens and accepts every consumer, a consumer
    connects; both within one ``spec.timeout_s``, each wait ending early at an error another rank published."""
    deadline = time.monotonic() + spec.timeout_s
    auth = control.auth
    records = RunStore(store, auth, spec.address)
    cuda_here = torch.cuda.is_available()
    if spec.rank == PRODUCER_RANK:
        # Every consumer may connect at once: a smaller queue made those beyond it fail (they retry, see
        # link._connect, but each retry costs them time).
        listener, name = listen(auth, max(spec.world_size, socket.SOMAXCONN))
        try:
            records.put(_K_ADDRESS, _ADDRESS, {"name": name})
            try:
                links, device = accept_consumers(listener, auth, spec.world_size, cuda_here, deadline, control.error)
            except TimeoutError as e:
                raise PeerError(f"{e} (group.timeout_s={spec.timeout_s:g}); a consumer may have died") from e
            except RuntimeError as e:
                raise PeerError(str(e)) from e
        finally:
            listener.close()
        logger.info("rank 0: %d consumer(s) share this host's %s memory", len(links), _MEMORY[device])
        return ShmProducerGroup(links, spec.world_size, control, spec.timeout_s, _device(device))
    raw = _wait_address(records, control, deadline)
    try:
        name = records.open(_ADDRESS, raw)["name"]
    except RecordError as e:
        raise PeerError(f"the producer's shared-memory record at {spec.address} {e}; refusing it") from e
    try:
        link, device = connect_producer(name, auth, spec.rank, cuda_here, deadline)
    except (OSError, TimeoutError, ValueError) as e:
        raise PeerError(f"could not join the producer's shared memory: {one_line(e)}") from e
    if device == "cuda":
        return CudaShmConsumerGroup(spec.rank, spec.world_size, link, control, spec.timeout_s, _device(device))
    return ShmConsumerGroup(spec.rank, spec.world_size, link, control, spec.timeout_s)


_MEMORY = {"cpu": "host", "cuda": "GPU"}


def _device(kind: str) -> torch.device:
    """The group's device: host memory, or this rank's current GPU (the one ``group.local_rank`` picked)."""
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else HOST
