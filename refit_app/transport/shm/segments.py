"""Shared memory for ``group.backend=shm``: anonymous memory files that the producer fills and consumers map
read-only, and the host identity that tells whether two ranks can share them.

A segment is a ``memfd_create`` file: it has no name in ``/dev/shm`` or anywhere else, so nothing can leak when
every rank is killed (the kernel frees its pages once the last descriptor and mapping are gone) and nobody can open
it by name. A consumer gets a segment only as a file descriptor passed over its authenticated connection to the
producer (:mod:`refit_app.transport.shm.link`). The producer maps it read-write and then seals it
(``F_SEAL_FUTURE_WRITE``, ``F_SEAL_SHRINK``, ``F_SEAL_GROW``): from then on no process, a consumer holding the
descriptor included, can map it writable, write to it or change its size; the producer's own mapping keeps working.
A consumer therefore cannot corrupt what the other consumers read, nor make their mappings fault by shrinking it.

Memory: a segment's pages are allocated in full when it is made, and no ``/dev/shm`` size bounds a memfd: a ring
larger than the host's memory sets off the kernel's OOM killer, whose first victim may be an unrelated process.
:func:`shm_memory_problem` refuses, before anything is allocated, segments that would not fit the memory available
to this process (its cgroup's limit included).
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import socket
import warnings

import torch

from refit_app.common.memory import memory_problem

SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
"""Linux 5.1's seal (Python 3.11's fcntl lacks the name): no new writable mapping or write, existing ones kept."""
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
PAGE = mmap.PAGESIZE
_MAP_SHARED_POPULATE = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
"""A mapping's page tables filled when it is made, rather than one fault per page on first touch."""


def host_identity() -> str:
    """Who can share memory with this process: its kernel's boot (two hosts, or one host rebooted, differ) and its
    network namespace (the consumers reach the producer over an abstract Unix socket, which lives in one network
    namespace: containers with their own network stacks on one machine count as different hosts). Hashed, since
    without a token the check-in that carries it is readable by anyone who reaches the store."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        ns = os.stat("/proc/self/ns/net")
        netns = f"{ns.st_dev}:{ns.st_ino}"
    except OSError:
        netns = "?"
    return hashlib.sha256(f"refit-app/host/{boot}/{netns}".encode()).hexdigest()[:32]


def shm_supported() -> str | None:
    """Why this process cannot use ``group.backend=shm`` (None: it can)."""
    if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds") or not hasattr(socket, "AF_UNIX"):
        return "it needs Linux (memfd_create and file descriptors passed over Unix sockets)"
    return None


SHM_MEMORY_FIX = (
    "lower buffer_size_bytes (refit.buffer_size_bytes) or the buffers in flight (NRL_REFIT_NUM_BUFFERS), "
    "or use group.backend=gloo"
)
"""How to make shared segments fit, in every refusal (the library's names, then the app's)."""


def shm_memory_problem(nbytes: int, committed: int = 0) -> str | None:
    """Why ``nbytes`` more of shared segments, on top of the ``committed`` bytes a group holds, should not be
    allocated (None: they fit): :func:`~refit_app.common.memory.memory_problem`, for segments."""
    problem = memory_problem(nbytes, committed)
    return None if problem is None else f"{problem}; no /dev/shm size bounds shared segments"


def _as_tensor(mapping: mmap.mmap) -> torch.Tensor:
    # The tensor keeps the mapping object alive and unmaps it when the last view of it goes (never close it by
    # hand: torch does not hold a buffer export, so a closed mapping would leave its tensors dangling).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": a consumer's mapping is read-only
        return torch.frombuffer(mapping, dtype=torch.uint8)


def round_up(nbytes: int) -> int:
    """A segment's size for ``nbytes``: whole pages, at least one."""
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


class RingSegment:
    """What the ring knows about one segment of the producer's: who still reads it (kept here, filled in by
    :mod:`refit_app.transport.shm`). Subclasses give it its memory (``tensor``, ``address``, ``nbytes``)."""

    tensor: torch.Tensor
    address: int
    nbytes: int

    def __init__(self, seg_id: int) -> None:
        self.id = seg_id
        self.busy: set[int] = set()
        """Consumers that have not yet answered this segment's latest publication."""
        self.asked: set[int] = set()
        """Consumers told that the producer waits for their answer (a ``NEED``) since that publication."""
        self.kept_by: set[int] = set()
        """Consumers that keep views of it (they answered ``KEEP``): it is never written again until they free it."""
        self.sent_to: set[int] = set()
        """Consumers that have it (its descriptor or handle, sent with its first publication to each)."""
        self.latest_seq = -1
        self.retired = False
        """Kept by a consumer: its ring slot gets another segment."""

    @property
    def idle(self) -> bool:
        """Nobody reads it: it may be written."""
        return not self.busy and not self.kept_by

    def holds(self, t: torch.Tensor) -> int | None:
        """The byte offset of ``t``'s memory in this segment, or None if it lies (even partly) elsewhere."""
        if t.device != self.tensor.device:
            return None
        start = t.data_ptr() - self.address
        end = start + t.numel() * t.element_size()
        return start if start >= 0 and end <= self.nbytes else None


class HostSegment(RingSegment):
    """One producer-side segment of host memory: its descriptor (to pass to consumers) and its bytes as a tensor."""

    def __init__(self, seg_id: int, nbytes: int) -> None:
        super().__init__(seg_id)
        self.nbytes = round_up(nbytes)
        fd = os.memfd_create(f"refit_app-shm-{seg_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.nbytes)
            # Pages allocated in one call and mapped at once: faulted in one by one on first write they cost
            # 2.5 s per GiB on this VM, allocated and populated 0.43 s (scripts in docs/results.md).
            os.posix_fallocate(fd, 0, self.nbytes)
            mapping = mmap.mmap(fd, self.nbytes, _MAP_SHARED_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self.tensor = _as_tensor(mapping)
        self.address = self.tensor.data_ptr()

    def close(self) -> None:
        """Give up the descriptor; the memory goes once every mapping of it (tensors here and in consumers) is gone."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def map_segment(fd: int, nbytes: int) -> torch.Tensor:
    """A consumer's read-only view of the segment behind ``fd`` (the descriptor is closed here), as a uint8 tensor.
    Raises ValueError for a descriptor that is not a sealed segment of at least ``nbytes``: reading past a file's
    end would kill this process with SIGBUS."""
    try:
        size = os.fstat(fd).st_size
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if size < nbytes or not seals & fcntl.F_SEAL_SHRINK:
            raise ValueError(
                f"the producer passed a segment of {size} bytes (sealed: {bool(seals & fcntl.F_SEAL_SHRINK)}) "
                f"for {nbytes}; refusing to map it"
            )
        mapping = mmap.mmap(fd, nbytes, _MAP_SHARED_POPULATE, mmap.PROT_READ)
    finally:
        os.close(fd)
    return _as_tensor(mapping)
