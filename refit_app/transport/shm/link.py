"""The connections of ``group.backend=shm``: one Unix socket between the producer and each consumer, which carries
the small messages that say where each broadcast's bytes lie (the bytes themselves lie in shared memory), passes the
segments' descriptors, and tells each side at once when the other dies (the kernel closes a dead process's socket).

Where: the producer listens on an abstract Unix socket (Linux's namespace without files: nothing to leak or clean
up) whose name is random and published in the run's store under a key only the run's ranks can name, signed with
the run's key (:mod:`refit_app.transport.auth`). Who: before any descriptor is passed, each consumer proves that it
holds the run's key by signing a fresh challenge with its rank, and the producer proves the same back::

    producer                                  consumer
    listen on a random abstract name; publish it (hidden key, signed)
    accept  --- CHALLENGE: a fresh nonce  --->  connect (the name from the store)
            <-- JOIN: rank, CUDA?, MAC(key, nonce, rank)
    every rank joined: the device (host memory, or CUDA IPC where every rank has a GPU)
            --- WELCOME: device, MAC(key, nonce, rank, device) --->  checks it, then maps what it is sent

A connection that does not check (another token, a stranger, a second claim of a rank) is closed and logged; the
producer goes on waiting for the real rank until the deadline. Without ``group.token`` the MACs are empty: any
process on the host that reads the store can join, as with every backend without a token.

Messages are SOCK_SEQPACKET records (kept whole by the kernel): a fixed header, then a payload (small broadcasts'
bytes, a handshake's fields), and for a segment a consumer has not seen, its descriptor (SCM_RIGHTS).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from refit_app.transport.auth import RunAuth, new_secret
from refit_app.transport.records import RecordError, distrust, load_record

logger = logging.getLogger(__name__)

# Message kinds. Producer to consumer:
PUB = 1
"""A broadcast's bytes lie in segment ``seg`` at ``offset`` (``size``: the segment's size, for its first mapping)."""
INLINE = 2
"""A small broadcast's bytes, in the payload."""
NEED = 3
"""The producer waits for the answer to publication ``seq``: answer it before blocking (``KEEP`` if still held)."""
FORGET = 4
"""Segment ``seg`` is gone: drop its mapping (views of it stay valid; the memory goes with the last one)."""
CHALLENGE = 5
WELCOME = 6
# Consumer to producer:
RELEASE = 10
"""This consumer is done with publication ``seq``: its segment may be written again, as far as it is concerned."""
KEEP = 11
"""This consumer still holds views of publication ``seq``: never write that segment again until it is freed."""
FREE = 12
"""The views this consumer kept of segment ``seg`` are all gone."""
UPLOAD = 13
"""Part of a broadcast from this consumer: its bytes at ``offset`` of ``nbytes`` in all."""
JOIN = 14

_HEADER = struct.Struct("<B7xqqqqq")
INLINE_MAX = 64 << 10
"""Broadcasts up to this size travel inside the message (round headers, needs, small manifests): no segment to
acquire, nothing to release. Well under the kernel's default socket buffer (208 KiB), which bounds a record."""
_MAX_RECORD = _HEADER.size + INLINE_MAX
_MAX_FDS = 4
SOCKET_PREFIX = "refit_app/shm/"
_CONNECT_RETRY_S = (0.001, 0.05)
"""A consumer's connect that found the producer's queue of unaccepted connections full (``EAGAIN``: many consumers
at once) tries again, first after 1 ms, backing off to 50 ms, until the group's deadline."""
_SETUP_CHECK_S = 0.2
"""While consumers connect, how often the producer looks for an error another rank published."""


class LinkClosed(ConnectionError):
    """The peer closed its end: it exited or was killed."""


class Message(NamedTuple):
    kind: int
    seq: int = 0
    seg: int = 0
    offset: int = 0
    nbytes: int = 0
    size: int = 0
    payload: bytes = b""
    fds: tuple[int, ...] = ()


def remaining_ms(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000) + 1)


class Link:
    """One end of a producer-consumer connection: non-blocking, every wait bounded by the caller's deadline."""

    def __init__(self, sock: socket.socket, peer: int) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.peer = peer
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, kind: int, *fields: int, payload: bytes = b"", fds: tuple[int, ...] = (), deadline: float) -> None:
        """Send one record, waiting (up to ``deadline``) while the peer's buffer is full. Raises :class:`LinkClosed`
        or TimeoutError."""
        data = _HEADER.pack(kind, *(fields + (0,) * (5 - len(fields)))) + payload
        while True:
            try:
                if fds:
                    socket.send_fds(self.sock, [data], list(fds))
                else:
                    self.sock.send(data)
                return
            except BlockingIOError:
                if not _poll_wait(self.sock, select.POLLOUT, deadline):
                    raise TimeoutError(f"rank {self.peer} took no message before the deadline") from None
            except OSError as e:
                if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
                    self.closed = True
                    raise LinkClosed(f"connection closed by rank {self.peer}") from e
                raise

    def recv(self) -> Message | None:
        """The next record, or None if none has arrived. Raises :class:`LinkClosed` at the peer's end."""
        try:
            data, fds, flags, _ = socket.recv_fds(self.sock, _MAX_RECORD, _MAX_FDS)
        except BlockingIOError:
            return None
        except OSError as e:
            if e.errno in (errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
                self.closed = True
                raise LinkClosed(f"connection closed by rank {self.peer}") from e
            raise
        if not data:
            self.closed = True
            raise LinkClosed(f"connection closed by rank {self.peer}")
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) < _HEADER.size:
            close_fds(fds)
            raise ValueError(f"rank {self.peer} sent a malformed record ({len(data)} bytes, flags {flags:#x})")
        kind, seq, seg, offset, nbytes, size = _HEADER.unpack_from(data)
        return Message(kind, seq, seg, offset, nbytes, size, bytes(data[_HEADER.size :]), tuple(fds))

    def recv_wait(self, deadline: float) -> Message | None:
        """The next record, waiting up to ``deadline`` (None then)."""
        while True:
            msg = self.recv()
            if msg is not None:
                return msg
            if not _poll_wait(self.sock, select.POLLIN, deadline):
                return None

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def close_fds(fds: tuple[int, ...] | list[int]) -> None:
    """Close descriptors a peer passed that nobody will use."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _poll_wait(sock: socket.socket, events: int, deadline: float) -> bool:
    """Whether ``sock`` became ready for ``events`` before ``deadline``."""
    poller = select.poll()
    poller.register(sock, events | select.POLLERR | select.POLLHUP)
    while True:
        ready = poller.poll(remaining_ms(deadline))
        if ready:
            return True
        if time.monotonic() >= deadline:
            return False


def _mac(auth: RunAuth, what: str, nonce: str, rank: int, extra: str = "") -> str:
    return auth.mac("shm-" + what, "\0".join((nonce, str(rank), extra)).encode()).hex()


def _fields(msg: Message) -> dict[str, Any]:
    return load_record(msg.payload)


def listen(auth: RunAuth, backlog: int) -> tuple[socket.socket, str]:
    """The producer's listening socket on a fresh random abstract name, queueing up to ``backlog`` connections
    before it accepts them (the kernel caps it at ``net.core.somaxconn``); returns it and the name."""
    name = SOCKET_PREFIX + new_secret()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.bind("\0" + name)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock, name


def accept_consumers(
    listener: socket.socket,
    auth: RunAuth,
    world_size: int,
    cuda_here: bool,
    deadline: float,
    published: Callable[[], str | None],
) -> tuple[dict[int, Link], str]:
    """Producer: accept and check one connection per consumer rank; returns the links by rank and the group's
    device type (``cuda`` where every rank has a GPU, else ``cpu``). Raises TimeoutError naming the ranks that never
    joined, or RuntimeError with the error another rank published meanwhile (``published()``, asked every
    :data:`_SETUP_CHECK_S`)."""
    links: dict[int, Link] = {}
    nonces: dict[int, str] = {}
    pending: dict[int, tuple[Link, str]] = {}  # fd -> (link, nonce): connected, not joined yet
    cuda_everywhere = cuda_here
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    try:
        while len(links) < world_size - 1:
            error = published()
            if error is not None:
                raise RuntimeError(error)
            if time.monotonic() >= deadline:
                missing = [r for r in range(1, world_size) if r not in links]
                raise TimeoutError(
                    f"rank(s) {', '.join(map(str, missing))} did not connect to the producer's shared memory in time"
                )
            for fd, _ in poller.poll(min(remaining_ms(deadline), int(_SETUP_CHECK_S * 1000))):
                if fd == listener.fileno():
                    _accept_one(listener, poller, pending, deadline)
                    continue
                link, nonce = pending[fd]
                try:
                    msg = link.recv()
                    if msg is None:  # not a whole record yet
                        continue
                    rank, cuda = _check_join(msg, auth, nonce, world_size, links)
                except (RecordError, ValueError, OSError) as e:
                    distrust(auth, "a shared-memory connection", "the producer's socket", str(e))
                    poller.unregister(fd)
                    del pending[fd]
                    link.close()
                    continue
                poller.unregister(fd)
                del pending[fd]
                link.peer = rank
                links[rank] = link
                nonces[rank] = nonce
                cuda_everywhere = cuda_everywhere and cuda
    except BaseException:
        for link in links.values():
            link.close()
        raise
    finally:
        for link, _ in pending.values():
            link.close()
    device = "cuda" if cuda_everywhere else "cpu"
    for rank, link in links.items():
        welcome = {"device": device, "mac": _mac(auth, "welcome", nonces[rank], rank, device)}
        link.send(WELCOME, payload=json.dumps(welcome).encode(), deadline=deadline)
    return links, device


def _accept_one(listener: socket.socket, poller: Any, pending: dict[int, tuple[Link, str]], deadline: float) -> None:
    try:
        sock, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return
    link = Link(sock, -1)
    nonce = new_secret()
    try:
        link.send(CHALLENGE, payload=json.dumps({"nonce": nonce}).encode(), deadline=deadline)
    except (OSError, TimeoutError):
        link.close()
        return
    pending[link.fileno()] = (link, nonce)
    poller.register(link.fileno(), select.POLLIN)


def _check_join(msg: Message, auth: RunAuth, nonce: str, world_size: int, links: dict[int, Link]) -> tuple[int, bool]:
    close_fds(msg.fds)
    if msg.kind != JOIN:
        raise RecordError(f"sent a record of kind {msg.kind} instead of joining")
    doc = _fields(msg)
    rank, cuda, mac = doc.get("rank"), doc.get("cuda"), doc.get("mac")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 < rank < world_size:
        raise RecordError(f"claims rank {rank!r}, not one of 1..{world_size - 1}")
    if not isinstance(cuda, bool) or not isinstance(mac, str):
        raise RecordError("lacks valid fields")
    if mac != _mac(auth, "join", nonce, rank):
        raise RecordError("does not prove the run's key (another group.token, or not one of this run's ranks)")
    if rank in links:
        raise RecordError(f"claims rank {rank}, which has joined already")
    return rank, cuda


def connect_producer(name: str, auth: RunAuth, rank: int, cuda_here: bool, deadline: float) -> tuple[Link, str]:
    """Consumer: connect to the producer's socket and join as ``rank``; returns the link and the group's device
    type (``cpu`` or ``cuda``). Raises ValueError for a producer that does not prove the run's key, TimeoutError,
    or :class:`LinkClosed`."""
    link = Link(_connect(name, deadline), 0)
    try:
        challenge = _expect(link, CHALLENGE, deadline)
        nonce = _fields(challenge).get("nonce")
        if not isinstance(nonce, str):
            raise ValueError("the producer's challenge has no nonce")
        join = {"rank": rank, "cuda": cuda_here, "mac": _mac(auth, "join", nonce, rank)}
        link.send(JOIN, payload=json.dumps(join).encode(), deadline=deadline)
        welcome = _fields(_expect(link, WELCOME, deadline))
        device = welcome.get("device")
        if device not in ("cpu", "cuda") or welcome.get("mac") != _mac(auth, "welcome", nonce, rank, str(device)):
            raise ValueError(
                "the process behind the shared-memory socket does not prove the run's key; refusing its memory"
            )
    except BaseException:
        link.close()
        raise
    return link, str(device)


def _connect(name: str, deadline: float) -> socket.socket:
    """A connection to the producer's socket. A full queue (``EAGAIN``) is retried until ``deadline``: the producer
    accepts consumers one at a time, and more of them than its backlog connecting at once is normal. Anything
    else (``ECONNREFUSED``: nobody listens, the producer gave up or died) fails at once."""
    pause, longest = _CONNECT_RETRY_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            sock.connect("\0" + name)
            return sock
        except OSError as e:
            sock.close()
            if e.errno != errno.EAGAIN:
                raise
            if time.monotonic() + pause >= deadline:
                raise TimeoutError(
                    "the producer's shared-memory socket kept its queue full until the deadline "
                    "(too many consumers connecting at once, or a producer that stopped accepting)"
                ) from e
        time.sleep(pause)
        pause = min(pause * 2, longest)


def _expect(link: Link, kind: int, deadline: float) -> Message:
    msg = link.recv_wait(deadline)
    if msg is None:
        raise TimeoutError("the producer did not complete the shared-memory handshake in time")
    close_fds(msg.fds)
    if msg.kind != kind:
        raise ValueError(f"the producer sent a record of kind {msg.kind} during the handshake")
    return msg
