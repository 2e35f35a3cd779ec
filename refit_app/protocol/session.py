"""Refit sessions: many refits over one group, as a trainer and an engine do every training step.

A :class:`ProducerSession` sends a model's tensors once per round with :meth:`~ProducerSession.send`; each
:class:`ConsumerSession` takes them with :meth:`~ConsumerSession.receive`, as callbacks or as a lazy iterator. The
manifest (names, shapes, dtypes, settings, a model's config) goes over the group in the first round only; later
rounds carry data (and checksums where a consumer verifies) alone, until the tensor list changes: then both sides
see it in the round header, the producer sends a fresh manifest and every consumer accepts it (or refuses, and
every rank stops) before any tensor moves.

Every round, over the group::

    producer                                       consumers
    header [magic, round, flags, extra bytes] ---> (END: the session is over; receive() returns None)
    (MANIFEST) manifest, gather "handshake" <----> accept: settings agree, on_manifest(manifest), ack
    packed broadcast of the data ----------------> unpack, consume(batch) ...
    (manifest.checksums) checksum trailer -------> verify
    (extra bytes) extra payload (a model probe) -> on_round_end(round) (a model check, say)
    gather "done" <------------------------------> report "done" (or this round's error, naming the round)

At the start, each consumer tells the producer whether it verifies and how long a probe it wants, so the producer
computes checksums and probes only for a consumer that uses them. A failure on any rank in round k ends every rank
within the group's deadline, with that rank's reason and the round.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from refit_app.common.errors import HandshakeError, PeerError, RefitError, SourceError
from refit_app.common.sizes import gb_per_s
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import host_bytes
from refit_app.packed_tensor import (
    Chunk,
    ChunkCallback,
    PackedPlan,
    get_target_packed_tensor_size,
    iter_chunks,
    packed_broadcast_consumer,
    packed_broadcast_producer,
)
from refit_app.protocol.checksum import checksum_function, default_algorithm
from refit_app.protocol.handshake import (
    accept_manifest,
    finish,
    recv_checksums,
    send_checksums,
    send_manifest,
)
from refit_app.protocol.manifest import Manifest, tensor_list_changes
from refit_app.protocol.verify import Verifier
from refit_app.transport.groups import RefitGroup
from refit_app.transport.spec import PRODUCER_RANK

logger = logging.getLogger(__name__)

ROUND_MAGIC = 0x5245_4649_5432  # "REFIT2"
"""First word of every round header: a peer that is not a refit_app session of this version is caught at once."""
_MANIFEST = 1
_END = 2
_HEADER_WORDS = 4


@dataclass
class Round:
    """What one round moved, as both sides report it."""

    round: int
    """1 for the first round."""
    bytes: int = 0
    seconds: float = 0.0
    """Wall time of the data transfer, from the first chunk to the last, manifest and trailers excluded."""
    num_tensors: int = 0
    num_chunks: int = 0
    num_broadcasts: int = 0
    """Chunks that went over the wire (the planner skips empty chunks in bounded mode)."""
    manifest_sent: bool = False
    """Whether this round carried a manifest (the first round, or the tensor list changed)."""
    handshake_seconds: float = 0.0
    """Time to send and agree on the manifest; 0 where none was sent."""
    checksums: list[int] | None = None
    """The producer's per-tensor checksums, where it sent them."""
    verified: bool | None = None
    """True when this consumer checked every tensor bit for bit; None where it did not check."""
    extra: bytes = b""
    """The producer's extra payload for this round (a model probe)."""
    facts: dict[str, Any] = field(default_factory=dict)
    """Whatever ``on_round_end`` (consumer) or the caller (producer) adds: a training loss, a model check."""

    @property
    def gb_per_s(self) -> float | None:
        return gb_per_s(self.bytes, self.seconds)


class _Counter:
    """Counts what went over the wire in one round and forwards each chunk to the caller's callback."""

    def __init__(self, round_: Round, forward: ChunkCallback | None) -> None:
        self._round = round_
        self._forward = forward

    def __call__(self, nbytes: int, ntensors: int) -> None:
        self._round.bytes += nbytes
        self._round.num_chunks += 1
        self._round.num_tensors += ntensors
        if self._forward is not None:
            self._forward(nbytes, ntensors)


def count_chunks(manifest: Manifest) -> tuple[int, int]:
    """``manifest``'s chunks, and how many of them go over the wire, as the chunk planner decides."""
    sizes = (t.nbytes for t in manifest.tensors)
    chunks = list(iter_chunks(sizes, manifest.buffer_size_bytes, manifest.use_legacy_packing))
    return len(chunks), sum(c.broadcast for c in chunks)


def _round_error(round_index: int, exc: BaseException) -> str:
    """This rank's failure as the line every rank reports: the round it happened in, then the reason."""
    text = str(exc) if isinstance(exc, RefitError) else f"{type(exc).__name__}: {exc}"
    return text if text.startswith("round ") else f"round {round_index}: {text}"


def _with_round(round_index: int, exc: BaseException) -> BaseException:
    """``exc`` with the round prefixed, keeping its type (a peer's error already names the round)."""
    if isinstance(exc, PeerError) or not isinstance(exc, RefitError) or str(exc).startswith(("round ", "rank ")):
        return exc
    return type(exc)(_round_error(round_index, exc))


class _Session:
    def __init__(self, group: RefitGroup) -> None:
        self.group = group
        self.device = group.group.device
        self.rounds = 0
        """Rounds completed so far."""
        self.manifest: Manifest | None = None
        """The manifest in force (the last one sent or accepted)."""
        self.closed = False
        self._plan = PackedPlan()
        """The chunk plan of the manifest in force: the first round records it, later rounds follow it (one fused
        copy per chunk on the producer, precomputed views on the consumer)."""
        self.num_chunks = 0
        """Chunks of the manifest in force (planned once per manifest, not per round)."""
        self._broadcasts = 0
        """Chunks of the manifest in force that go over the wire."""

    def _new_plan(self) -> None:
        """A fresh manifest is in force: plan it anew."""
        self._plan.release()
        self._plan = PackedPlan()
        assert self.manifest is not None
        self.num_chunks, self._broadcasts = count_chunks(self.manifest)

    def _broadcast_header(self, header: torch.Tensor) -> None:
        self.group.group.broadcast(header, PRODUCER_RANK)

    def _exchange_needs(self, verify: bool, probe_tokens: int) -> tuple[bool, int]:
        """Each consumer in turn tells every rank whether it verifies and how long a probe it wants; returns
        (any consumer verifies, the longest probe asked for). One tiny broadcast per consumer, over the data group,
        so it works with every backend."""
        any_verify, longest_probe = False, 0
        for rank in range(1, self.group.world_size):
            mine = self.group.rank == rank
            need = torch.tensor([int(verify and mine), probe_tokens if mine else 0], dtype=torch.int64,
                                device=self.device)
            self.group.group.broadcast(need, rank)
            any_verify |= bool(need[0].item())
            longest_probe = max(longest_probe, int(need[1].item()))
        return any_verify, longest_probe

    def _extra(self, data: bytes | None, length: int) -> bytes:
        """Broadcast ``data`` (producer) or receive ``length`` bytes of it (consumer)."""
        if length == 0:
            return b""
        if data is not None:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            payload = torch.empty(length, dtype=torch.uint8, device=self.device)
        self.group.group.broadcast(payload, PRODUCER_RANK)
        return data if data is not None else payload.cpu().numpy().tobytes()

    def __enter__(self) -> _Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class ProducerSession(_Session):
    """The trainer's side: :meth:`send` the current weights once per round, :meth:`close` when done.

    Args:
        group: a connected :class:`~refit_app.transport.groups.RefitGroup` (from :func:`~refit_app.transport.groups.connect` or
            :func:`~refit_app.transport.groups.from_process_group`) on which this rank is the producer (rank 0).
        buffer_size_bytes: as for :func:`~refit_app.packed_tensor.packed_broadcast_producer`; it travels in the
            manifest, so consumers that leave theirs unset adopt it.
        num_buffers: as for :func:`~refit_app.packed_tensor.packed_broadcast_producer`.
        use_legacy_packing: as for :func:`~refit_app.packed_tensor.packed_broadcast_producer`; it travels in the
            manifest like the buffer size.
        on_chunk: called with (bytes, tensors) as each chunk is handed to the group (progress, metrics).
        checksum_algorithm: how to checksum for verifying consumers (:mod:`refit_app.protocol.checksum`); None picks the
            fastest installed. It travels in the manifest; a consumer that cannot compute it refuses at the handshake.

    Construct it on every rank at the same point: the consumers' needs are exchanged here.
    """

    def __init__(
        self,
        group: RefitGroup,
        *,
        buffer_size_bytes: int | None = None,
        num_buffers: int | None = None,
        use_legacy_packing: bool = False,
        on_chunk: ChunkCallback | None = None,
        checksum_algorithm: str | None = None,
    ) -> None:
        super().__init__(group)
        self.checksum_algorithm = checksum_algorithm or default_algorithm()
        self._checksum = checksum_function(self.checksum_algorithm)
        if group.rank != PRODUCER_RANK:
            raise ValueError(f"a ProducerSession runs on rank {PRODUCER_RANK}, this is rank {group.rank}")
        self.buffer_size_bytes = get_target_packed_tensor_size() if buffer_size_bytes is None else buffer_size_bytes
        self.num_buffers = num_buffers
        self.use_legacy_packing = use_legacy_packing
        self.on_chunk = on_chunk
        self.checksums_needed, self.probe_tokens = self._exchange_needs(False, 0)
        """Whether some consumer verifies; the longest model probe a consumer asked for (0: none)."""

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        metas: list[TensorMeta] | None = None,
        metadata: dict[str, str] | None = None,
        files: dict[str, str | bytes] | None = None,
        source: str = "",
        extra: bytes = b"",
    ) -> Round:
        """Send one round: every ``(name, tensor)`` in order, to every consumer.

        ``metas``: the tensor list, when known before the tensors are read (a lazy source); otherwise the
        iterable is listed first (references, not copies). A fresh manifest goes out when the list, ``metadata``
        or ``files`` differ from the last round's; each tensor is then checked against it as it is packed, so a
        shape that changed without the list saying so fails the round instead of corrupting it. ``extra``: bytes
        every consumer receives after the data (a model probe). Returns when every consumer has finished the round
        (raises if any failed, with its reason and the round).
        """
        if self.closed:
            raise RuntimeError("send() after close()")
        k = self.rounds + 1
        result = Round(round=k)
        try:
            if metas is None:
                named_tensors = list(named_tensors)
                metas = [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in named_tensors]
            manifest = Manifest(
                list(metas),
                self.buffer_size_bytes,
                self.use_legacy_packing,
                checksums=self.checksums_needed,
                checksum_algorithm=self.checksum_algorithm,
                metadata=dict(metadata or {}),
                source=source,
                files=dict(files or {}),
            )
            fresh = self.manifest != manifest  # field by field: no re-encoding of the model every round
            flags = _MANIFEST if fresh else 0
            self._broadcast_header(torch.tensor([ROUND_MAGIC, k, flags, len(extra)], dtype=torch.int64,
                                                device=self.device))
            if fresh:
                if self.manifest is not None:
                    changes = tensor_list_changes(self.manifest.tensors, manifest.tensors) or ["settings or files"]
                    logger.info("round %d: the tensor list changed (%s); sending a fresh manifest", k,
                                "; ".join(changes))
                started = time.perf_counter()
                send_manifest(self.group, manifest)
                result.manifest_sent, result.handshake_seconds = True, time.perf_counter() - started
                self.manifest = manifest
                self._new_plan()
            hasher = _SendHasher(self._checksum) if manifest.checksums else None
            post = hasher.post if hasher is not None else _tensor_of
            result.num_broadcasts = self._broadcasts
            # Once the plan is recorded it checks every tensor against it itself; the first round checks here.
            tensors = named_tensors if self._plan.ready else _checked(named_tensors, manifest.tensors)
            started = time.perf_counter()
            # Parameters require grad; packing only reads their values, which must not join an autograd graph.
            with torch.no_grad():
                packed_broadcast_producer(
                    tensors,
                    self.group.group,
                    PRODUCER_RANK,
                    post,
                    buffer_size_bytes=manifest.buffer_size_bytes,
                    num_buffers=self.num_buffers,
                    use_legacy_packing=manifest.use_legacy_packing,
                    on_chunk=_Counter(result, self.on_chunk),
                    on_chunk_done=None if hasher is None else hasher.chunk_sent,
                    plan=self._plan,
                )
            if hasher is not None:
                checksums = hasher.checksums()
                send_checksums(self.group, checksums)
                result.checksums = checksums
            result.seconds = time.perf_counter() - started
            self._extra(extra, len(extra))
        except BaseException as e:
            finish(self.group, _round_error(k, e))
            raise _with_round(k, e) from e
        finish(self.group, None)
        self.rounds += 1
        return result

    def close(self, *, notify: bool = True) -> None:
        """Tell every consumer that the session is over (their :meth:`~ConsumerSession.receive` returns None), and
        free the send buffers. ``notify=False`` skips the end-of-session header, for consumers that only receive
        when asked to (a vLLM worker inside ``update_weights``): closing the group ends their session instead."""
        if self.closed:
            return
        self.closed = True
        self._plan.release()
        if notify:
            self._broadcast_header(torch.tensor([ROUND_MAGIC, self.rounds, _END, 0], dtype=torch.int64,
                                                device=self.device))


def _tensor_of(item: tuple[str, torch.Tensor]) -> torch.Tensor:
    return item[1]


class _SendHasher:
    """The producer's per-tensor checksums, each computed while its chunk is on the wire.

    ``post`` keeps each tensor exactly as it is packed (the ``post_iter_func`` output: the bytes that travel);
    ``chunk_sent`` runs once the chunk's broadcast has started (the packed broadcast's ``on_chunk_done``) and hashes
    that chunk's tensors then, so the hash overlaps the send (gloo sends on its own threads, the hash releases the
    GIL) instead of delaying it; the consumers hash what they received as it arrives. Only references are held, to
    about one chunk's tensors (those of the chunk being packed and the next tensor: the planner closes a chunk when
    the tensor after it arrives). Hashing the tensors rather than the send buffer also covers the packing copy."""

    def __init__(self, checksum: Callable[[memoryview], int]) -> None:
        self._checksum = checksum
        self._pending: deque[torch.Tensor] = deque()
        self._done: list[int] = []

    def post(self, item: tuple[str, torch.Tensor]) -> torch.Tensor:
        self._pending.append(item[1])
        return item[1]

    def chunk_sent(self, chunk: Chunk) -> None:
        checksum, pending, done = self._checksum, self._pending, self._done
        for _ in range(chunk.count):
            done.append(checksum(host_bytes(pending.popleft())))

    def checksums(self) -> list[int]:
        """Every tensor's checksum, in order, once the packed broadcast has returned."""
        while self._pending:  # none left when every chunk was reported; kept exact if one was not
            self._done.append(self._checksum(host_bytes(self._pending.popleft())))
        return self._done


def _checked(named_tensors: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta]) -> Iterator:
    """The tensors, each checked against its manifest entry as it is read; a mismatch would corrupt the stream."""
    count = 0
    for (name, t), meta in zip(named_tensors, metas):
        if name != meta.name or tuple(t.shape) != meta.shape or t.dtype != meta.dtype:
            raise SourceError(
                f"tensor #{count} is {name!r} {list(t.shape)} {t.dtype}, but the tensor list says {meta.name!r} "
                f"{list(meta.shape)} {meta.dtype}; pass the tensors in the order and shapes of the list (or no "
                "list, to have it taken from the tensors)"
            )
        count += 1
        yield name, t
    if count != len(metas):
        raise SourceError(f"{count} tensors were sent, but the tensor list has {len(metas)}")


class ConsumerSession(_Session):
    """An engine's side: :meth:`receive` one round at a time until the producer closes the session.

    Args:
        group: a connected :class:`~refit_app.transport.groups.RefitGroup` on which this rank is a consumer.
        buffer_size_bytes: None adopts the producer's; a value that differs from the producer's stops every rank
            at the handshake, naming both.
        use_legacy_packing: None adopts the producer's; a difference stops every rank, as for the buffer size.
        num_buffers: receive buffers in flight (need not match the producer's).
        verify: ask for per-tensor checksums and check every tensor bit for bit, every round.
        probe_tokens: ask the producer for a model probe of this many positions after every round (0: none); it
            arrives as :attr:`Round.extra`.
        on_chunk: called with (bytes, tensors) as each chunk arrives.

    Construct it on every rank at the same point as the producer's session.
    """

    def __init__(
        self,
        group: RefitGroup,
        *,
        buffer_size_bytes: int | None = None,
        use_legacy_packing: bool | None = None,
        num_buffers: int | None = None,
        verify: bool = False,
        probe_tokens: int = 0,
        on_chunk: ChunkCallback | None = None,
    ) -> None:
        super().__init__(group)
        if group.rank == PRODUCER_RANK:
            raise ValueError(f"a ConsumerSession runs on a consumer rank, not on rank {PRODUCER_RANK}")
        self.buffer_size_bytes = buffer_size_bytes
        self.use_legacy_packing = use_legacy_packing
        self.num_buffers = num_buffers
        self.verify = verify
        self.on_chunk = on_chunk
        self._verifier: Verifier | None = None
        self.last_round: Round | None = None
        """The round :meth:`receive` finished last (for the iterator form, once it is exhausted)."""
        self._exchange_needs(verify, probe_tokens)

    def receive(
        self,
        post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
        return_iterator: bool = False,
        *,
        on_manifest: Callable[[Manifest], None] | None = None,
        on_round_end: Callable[[Round], dict[str, Any] | None] | None = None,
    ) -> Round | Iterator[tuple[str, torch.Tensor]] | None:
        """Receive one round; None once the producer has closed the session.

        ``post_unpack_func`` gets each batch of ``(name, tensor)`` as it arrives, exactly as with
        :func:`~refit_app.packed_tensor.packed_broadcast_consumer` (views into receive buffers: load or copy them;
        a buffer is not refilled while a tensor from it is still referenced). With ``return_iterator`` the
        round's tensors come back as a lazy iterator instead, and the round ends (trailers, verification, the
        all-ranks "done") when it is exhausted; :attr:`last_round` then holds its figures.

        ``on_manifest(manifest)`` runs when a fresh manifest arrives (first round, or the tensor list changed),
        before any tensor moves: what it raises is this consumer's refusal, and every rank stops with it.
        ``on_round_end(round)`` runs after the data and trailers, before the round's all-ranks "done": what it
        raises fails the round on every rank; what it returns is merged into ``round.facts``.
        """
        if self.closed:
            return None
        k = self.rounds + 1
        result = Round(round=k)
        try:
            header = torch.empty(_HEADER_WORDS, dtype=torch.int64, device=self.device)
            self._broadcast_header(header)
            magic, round_index, flags, extra_len = (int(x) for x in header.cpu().tolist())
            if magic != ROUND_MAGIC:
                raise HandshakeError(
                    "the producer's round header is not a refit_app session's; run the same refit_app version "
                    "with a session on every rank"
                )
            if flags & _END:
                self.closed = True
                return None
            if round_index != k:
                raise HandshakeError(f"the producer is in round {round_index}, this consumer in round {k}")
            if flags & _MANIFEST:
                started = time.perf_counter()
                self._accept(on_manifest)
                result.manifest_sent, result.handshake_seconds = True, time.perf_counter() - started
            elif self.manifest is None:
                raise HandshakeError("the producer sent no manifest in the first round")
        except BaseException as e:
            self._fail(k, e)
        manifest = self.manifest
        assert manifest is not None
        result.num_broadcasts = self._broadcasts
        started = time.perf_counter()
        try:
            stream = packed_broadcast_consumer(
                ((t.name, (t.shape, t.dtype)) for t in manifest.tensors),
                self.group.group,
                PRODUCER_RANK,
                self._consumer(post_unpack_func),
                return_iterator=return_iterator,
                num_buffers=self.num_buffers,
                buffer_size_bytes=manifest.buffer_size_bytes,
                use_legacy_packing=manifest.use_legacy_packing,
                on_chunk=_Counter(result, self.on_chunk),
                plan=self._plan,
            )
        except BaseException as e:
            self._fail(k, e)
        if return_iterator:
            return self._iterate(stream, result, extra_len, on_round_end)
        return self._end_round(result, started, extra_len, on_round_end)

    def _consumer(
        self, post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None] | None
    ) -> Callable[[list[tuple[str, torch.Tensor]]], None] | None:
        verifier = self._verifier
        if verifier is None:
            return post_unpack_func
        if post_unpack_func is None:
            return verifier.consume

        def both(batch: list[tuple[str, torch.Tensor]]) -> None:
            post_unpack_func(batch)
            verifier.consume(batch)

        return both

    def _accept(self, on_manifest: Callable[[Manifest], None] | None) -> None:
        previous = self.manifest

        def prepare(manifest: Manifest) -> None:
            if self.verify and not manifest.checksums:
                raise HandshakeError("this consumer verifies, but the producer's manifest says it sends no checksums")
            if self.verify:
                checksum_function(manifest.checksum_algorithm)  # refuses, naming it, when this host lacks it
            if previous is not None:
                changes = tensor_list_changes(previous.tensors, manifest.tensors)
                logger.info("rank %d: round %d brings a fresh manifest (%s)", self.group.rank, self.rounds + 1,
                            "; ".join(changes) or "settings or files changed")
            if on_manifest is not None:
                try:
                    on_manifest(manifest)
                except RefitError as e:
                    # Acknowledged as this consumer's refusal right away: the reason every rank sees names the round.
                    raise _with_round(self.rounds + 1, e) from e

        self.manifest = accept_manifest(
            self.group,
            buffer_size_bytes=self.buffer_size_bytes,
            use_legacy_packing=self.use_legacy_packing,
            prepare=prepare,
        )
        self._verifier = Verifier(self.manifest.tensors, self.manifest.checksum_algorithm) if self.verify else None
        self._new_plan()

    def _iterate(
        self,
        stream: Iterator[tuple[str, torch.Tensor]],
        result: Round,
        extra_len: int,
        on_round_end: Callable[[Round], dict[str, Any] | None] | None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        started = time.perf_counter()
        try:
            yield from stream
        except GeneratorExit:
            # The caller stopped early: the round cannot complete, and the peers must learn it.
            self._report_failure(result.round, RefitError("the consumer stopped reading before the round ended"))
            raise
        except BaseException as e:
            self._fail(result.round, e)
        self._end_round(result, started, extra_len, on_round_end)

    def _end_round(
        self,
        result: Round,
        started: float,
        extra_len: int,
        on_round_end: Callable[[Round], dict[str, Any] | None] | None,
    ) -> Round:
        k = result.round
        manifest = self.manifest
        assert manifest is not None
        try:
            if manifest.checksums:
                result.checksums = recv_checksums(self.group, len(manifest.tensors))
            result.seconds = time.perf_counter() - started
            result.extra = self._extra(None, extra_len)
            if self._verifier is not None:
                result.facts.update(self._verifier.verdict(result.checksums))
                result.verified = True
            if on_round_end is not None:
                result.facts.update(on_round_end(result) or {})
        except BaseException as e:
            self._fail(k, e)
        finish(self.group, None)
        self.rounds += 1
        self.last_round = result
        return result

    def _report_failure(self, k: int, exc: BaseException) -> None:
        finish(self.group, _round_error(k, exc))

    def _fail(self, k: int, exc: BaseException) -> None:
        self._report_failure(k, exc)
        raise _with_round(k, exc) from exc

    def close(self) -> None:
        """Nothing to tell the producer: it ends the session. Marks this side closed."""
        self.closed = True
