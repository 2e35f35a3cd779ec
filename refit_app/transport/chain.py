"""``group.topology=chain``: a broadcast relayed rank to rank, chunk by chunk, so every link carries each byte once.

torch's gloo broadcasts a buffer along a binomial tree, the whole buffer per hop, and the producer's link carries it
several times: a refit of B bytes over links of rate R took 2.1x and 2.9x B / R with 2 and 3 consumers (docs/results.md,
"The link is the limit"). In a chain the source sends to the next rank only; every other rank receives from the one
before
it and forwards to the one after it, and it forwards chunk k while chunk k+1 is already arriving (the packed
broadcast keeps ``num_buffers`` chunks in flight). The chain fills once, then every link streams at R.

Segments: each broadcast travels as consecutive slices of at most ``segment_bytes`` (:data:`DEFAULT_SEGMENT_BYTES`),
each relayed as soon as it has arrived. A tensor larger than the chunk target travels alone in a chunk of its own
(the 436 MB embedding of ``source.preset=llama-1b source.size=512MiB``, 81% of its bytes); without slices every hop
would store and forward it whole, and the chain would pay that tensor once more per consumer (measured: 2.7x B / R
with three consumers instead of 1.1x). Slicing is the group's business: the bytes land where a whole
broadcast would put them, so the wire format and chunk plan are untouched. With slices of S bytes, a refit takes
about (B + (N - 1) S) / R.

Order: ``src, src + 1, ..., src - 1`` (mod world size), so a broadcast from any rank works; the application's data
always starts at the producer, rank 0. Each broadcast is a matched pair of ``send``/``recv`` on the same gloo
process group, with a tag that every rank counts up in the same order (broadcasts are collective: every rank makes
the same calls), so a message can never land in another broadcast's buffer. Same wire format, chunk plan,
handshake and deadlines as the tree: the packed broadcast sees the same :class:`~refit_app.core.group.BroadcastGroup`
seam.

For gloo only (CPU hosts, CI, debugging): NCCL already pipelines its broadcast in slices along rings on GPUs.

Buffer lifetime: on a relaying rank, ``wait()`` returns once the chunk has arrived *and* the forward send that
reads the same buffer has finished, so the packed broadcast never refills a buffer that is still being forwarded.
Deadlines: every receive and send waits at most the group's timeout (gloo's own, set when the group was built); a
killed neighbour fails the hops next to it at once, and each rank names the neighbour it lost.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import weakref
from typing import Any

import torch

from refit_app.common.errors import PeerError, one_line
from refit_app.transport.control import EXPLAIN_WAIT_S, RELAYED_EXPLAIN_WAIT_S, Control

logger = logging.getLogger(__name__)

_TAG_SPACE = 1 << 31
"""gloo's point-to-point tags are non-negative 32-bit ints; the count wraps long before two messages in flight
could share one."""
DEFAULT_SEGMENT_BYTES = 4 << 20
"""The largest message of a chain: the chain fills in (N - 1) of them (N consumers), about 17 ms each at 2 Gbit/s,
while each costs a relay step of tens of microseconds."""


class _Hop:
    """One segment on a relaying rank: it arrives from ``src``, then goes on to ``dst``."""

    def __init__(self, recv: Any, segment: torch.Tensor, src: int, dst: int, tag: int) -> None:
        self.recv = recv
        self.segment: torch.Tensor | None = segment
        """Held until the forward send has finished reading it."""
        self.src = src
        self.dst = dst
        self.tag = tag
        self.send: Any = None
        self.error: BaseException | None = None
        self.failed_peer = src
        self.forwarded = threading.Event()
        """Set by the relay thread once the segment arrived and its forward send was posted, or once that failed."""

    def wait(self, group: ChainBroadcastGroup) -> None:
        # Bounded without a deadline of its own: the relay thread sets the event after a receive that gloo's
        # timeout bounds, or at once when an earlier hop failed or the group closed.
        self.forwarded.wait()
        try:
            if self.error is not None:
                if not isinstance(self.error, RuntimeError):
                    raise self.error
                verb = "sending to" if self.failed_peer == self.dst else "receiving from"
                raise group.lost(self.error, verb, self.failed_peer) from self.error
            try:
                self.send.wait()
            except RuntimeError as e:
                raise group.lost(e, "sending to", self.dst) from e
        finally:
            # Every reference to the buffer goes with the hop: one left behind makes the packed broadcast think a
            # caller still holds the chunk's tensors, and it then waits for the other receives before the next.
            self.segment = self.send = None


class ChainWork:
    """One broadcast on one rank: its sends (the source), its receives (the last rank) or its relayed segments.

    ``wait()`` returns once all of them finished; on a relaying rank that includes the forward sends, which read the
    buffer. A failure names the neighbour it lost.
    """

    def __init__(
        self, group: ChainBroadcastGroup, works: list[Any], peer: int | None, verb: str, hops: list[_Hop]
    ) -> None:
        self._group = group
        self._works = works
        self._hops = hops
        self._peer = peer
        self._verb = verb
        self._cut = False

    def wait(self) -> None:
        if self._cut:
            raise PeerError("the refit group was closed before this broadcast finished")
        while self._works:
            try:
                self._works[0].wait()
            except RuntimeError as e:
                raise self._group.lost(e, self._verb, self._peer) from e
            # gloo's work holds the tensor: drop it now, or the buffer looks held by a caller (see _Hop).
            del self._works[0]
        while self._hops:
            self._hops[0].wait(self._group)
            del self._hops[0]

    def cut(self) -> None:
        """The group is closing: drop the backend's work objects, so that its sockets can close."""
        if self._works or self._hops:
            self._cut = True
        self._works, self._hops = [], []


class ChainBroadcastGroup:
    """A gloo process group whose ``broadcast`` relays along the ranks instead of a tree (``group.topology=chain``).

    ``backend`` is a ``ProcessGroupGloo``; errors surface as :class:`PeerError` naming the neighbour that was lost,
    unless a failing rank published the root cause first.
    """

    def __init__(
        self,
        backend: Any,
        rank: int,
        world_size: int,
        control: Control,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> None:
        if segment_bytes < 1:
            raise ValueError(f"segment_bytes={segment_bytes} must be >= 1")
        self._backend = backend
        self.device = torch.device("cpu")
        self.rank = rank
        self.world_size = world_size
        self.segment_bytes = segment_bytes
        self._control = control
        self._tags = itertools.count()
        self._works: weakref.WeakSet[ChainWork] = weakref.WeakSet()
        self._hops: queue.SimpleQueue[_Hop | None] = queue.SimpleQueue()
        self._relay: threading.Thread | None = None
        self._closed = False
        before, after = self.neighbours(0)
        logger.info(
            "rank %d: chain topology: receives from %s, forwards to %s",
            rank,
            "nobody" if before is None else f"rank {before}",
            "nobody" if after is None else f"rank {after}",
        )

    def neighbours(self, src: int) -> tuple[int | None, int | None]:
        """The ranks this one receives from and forwards to in a broadcast from ``src`` (None: none)."""
        position = (self.rank - src) % self.world_size
        before = (self.rank - 1) % self.world_size if position > 0 else None
        after = (self.rank + 1) % self.world_size if position < self.world_size - 1 else None
        return before, after

    def segments(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``tensor``'s bytes as consecutive views of at most ``segment_bytes``; every rank cuts the same way, since
        a broadcast's size is the same everywhere. A tensor without bytes is one empty message."""
        if not tensor.is_contiguous():
            raise ValueError("a chain broadcast needs a contiguous tensor")
        flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor.reshape(-1)
        if flat.numel() <= self.segment_bytes:
            return [flat]
        return list(flat.split(self.segment_bytes))

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> ChainWork:
        backend = self._backend
        if backend is None:
            raise PeerError("the refit group was closed")
        before, after = self.neighbours(src)
        works: list[Any] = []
        hops: list[_Hop] = []
        peer, verb = (after, "sending to") if before is None else (before, "receiving from")
        try:
            for segment in self.segments(tensor):
                tag = next(self._tags) % _TAG_SPACE
                if before is None:
                    works.append(backend.send([segment], after, tag))
                elif after is None:
                    works.append(backend.recv([segment], before, tag))
                else:
                    hops.append(_Hop(backend.recv([segment], before, tag), segment, before, after, tag))
        except RuntimeError as e:
            raise self.lost(e, verb, peer) from e
        if hops:
            self._start_relay()
            for hop in hops:
                self._hops.put(hop)
        work = ChainWork(self, works, peer, verb, hops)
        self._works.add(work)
        return work

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.broadcast_async(tensor, src).wait()

    def lost(self, exc: BaseException, verb: str, peer: int | None) -> PeerError:
        """The error for a broken hop: the root cause if a failing rank published one, else the neighbour and
        the symptom (a killed rank publishes nothing; its neighbours are the ones who can name it)."""
        # With three ranks or more the neighbour may not be the one that died, and it publishes what it lost only
        # after its own wait: wait long enough for that, or the dead rank goes unnamed.
        wait_s = RELAYED_EXPLAIN_WAIT_S if self.world_size > 2 else EXPLAIN_WAIT_S
        explained = self._control.explain(exc, wait_s=wait_s)
        try:
            published = self._control.error()
        except Exception:
            published = None
        if published is not None:
            return PeerError(published)
        where = "previous" if verb == "receiving from" else "next"
        return PeerError(f"{verb} rank {peer} ({where} in the chain) failed: {explained}")

    def _start_relay(self) -> None:
        if self._relay is None:
            self._relay = threading.Thread(target=self._relay_loop, name=f"refit-chain-relay-{self.rank}", daemon=True)
            self._relay.start()

    def _relay_loop(self) -> None:
        """Forward each segment the moment it has arrived, in order, while the next ones are already arriving.

        A thread rather than the caller's ``wait()``: the packed broadcast waits for chunk k only when it wants to
        hand chunk k out, and the forward must not wait for that. After the first failure every later hop fails at
        once with it (the chain is broken; their receives can only fail too).
        """
        broken: BaseException | None = None
        while True:
            hop = self._hops.get()
            if hop is None:
                return
            try:
                if broken is not None:
                    raise broken
                hop.recv.wait()
                hop.failed_peer = hop.dst
                backend = self._backend
                if backend is None:
                    raise PeerError("the refit group was closed before this broadcast finished")
                hop.send = backend.send([hop.segment], hop.dst, hop.tag)
            except BaseException as e:
                hop.error = broken = e
            finally:
                hop.recv = None
                hop.forwarded.set()
                # Not the last hop's buffer referenced from here while waiting for the next one (see _Hop.wait).
                hop = None

    def shutdown(self, *, abort: bool) -> None:
        """Stop the relay and drop the backend, as :meth:`refit_app.transport.backends.TorchBroadcastGroup.shutdown`
        does:
        gloo's sockets close only once nothing references the backend's work objects any more."""
        if self._closed:
            return
        self._closed = True
        stop = getattr(self._backend, "abort" if abort else "shutdown", None)
        if stop is not None:
            try:
                stop()
            except RuntimeError as e:
                logger.debug("rank %d: chain group %s failed: %s", self.rank, stop.__name__, one_line(e))
        for work in list(self._works):
            work.cut()
        self._backend = None
        self._hops.put(None)
        if self._relay is not None and not abort:
            # On success the relay is idle on its queue; after a failure it may sit in a receive until gloo's
            # deadline, and as a daemon thread it must not hold up the caller's exit.
            self._relay.join(timeout=1.0)
