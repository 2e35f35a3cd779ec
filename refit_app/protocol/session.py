"""Refit sessions: many refits over one group, as a trainer and an engine do every training step.

A :class:`ProducerSession` sends a model's tensors once per round with :meth:`~ProducerSession.send`; each
:class:`ConsumerSession` takes them with :meth:`~ConsumerSession.receive`, as callbacks or as a lazy iterator. The
manifest (names, shapes, dtypes, settings, a model's config) goes over the group in the first round only; later
rounds carry data (and checksums where a consumer verifies) alone, until the tensor list changes: then both sides
see it in the round header, the producer sends a fresh manifest and every consumer accepts it (or refuses, and
every rank stops) before any tensor moves. With ``delta`` on, a round after the first can carry only the elements
that changed (:mod:`refit_app.protocol.delta`).

Every round, over the group::

    producer                                       consumers
    (delta on) which round each consumer holds <-- report held round (0: nothing it can vouch for)
    header [magic, round, flags, extra, base] ---> (END: the session is over; receive() returns None)
    (MANIFEST) manifest, gather "handshake" <----> accept: settings agree, on_manifest(manifest), ack
    packed broadcast of the data, or (DELTA) ---> unpack, consume(batch) ... / apply each record
    the delta stream against round ``base``
    (manifest.checksums) checksum trailer -------> verify (every tensor in full, also in a delta round)
    (extra bytes) extra payload (a model probe) -> on_round_end(round) (a model check, say)
    gather "done" <------------------------------> report "done" (or this round's error, naming the round)

At the start, the producer says whether it may send deltas and each consumer whether it verifies and how long a
probe it wants, so the producer computes checksums and probes only for a consumer that uses them. A failure on any
rank in round k ends every rank within the group's deadline, with that rank's reason and the round.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

import torch

from refit_app.common.errors import HandshakeError, RefitError, SourceError
from refit_app.core.chunks import Chunk
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import host_bytes, tensor_bytes
from refit_app.packed_tensor import (
    ChunkCallback,
    get_num_buffers,
    PackedPlan,
    _packed_broadcast_consumer_batches,
    get_target_packed_tensor_size,
    packed_broadcast_consumer,
    packed_broadcast_producer,
)
from refit_app.protocol.checksum import checksum_function, default_algorithm
from refit_app.protocol.delta import ConsumerDelta, DeltaStats, ProducerDelta, TensorDelta
from refit_app.protocol.handshake import (
    accept_manifest,
    finish,
    recv_checksums,
    send_checksums,
    send_manifest,
)
from refit_app.protocol.manifest import Manifest, tensor_list_changes
from refit_app.protocol.rounds import (
    DELTA,
    END,
    HEADER_WORDS,
    MANIFEST,
    ROUND_MAGIC,
    ChunkCounter,
    Round,
    plan_manifest,
    round_error,
    with_round,
)
from refit_app.protocol.verify import Verifier
from refit_app.transport.groups import RefitGroup
from refit_app.transport.spec import PRODUCER_RANK

logger = logging.getLogger(__name__)

__all__ = ["ConsumerSession", "ProducerSession", "Round", "TensorDelta"]

Batch = list[tuple[str, Any]]


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
        self._chunks: list[Chunk] = []
        """The manifest's chunks (planned once per manifest, not per round)."""
        self._delta_on = False
        """Whether the producer may send delta rounds (it says so when the session starts)."""

    @property
    def num_chunks(self) -> int:
        """Chunks of the manifest in force."""
        return len(self._chunks)

    @property
    def _broadcasts(self) -> int:
        return sum(c.broadcast for c in self._chunks)

    def _new_plan(self) -> None:
        """A fresh manifest is in force: plan it anew."""
        self._plan.release()
        self._plan = PackedPlan()
        assert self.manifest is not None
        self._chunks = plan_manifest(self.manifest)

    def _broadcast_header(self, header: torch.Tensor) -> None:
        self.group.group.broadcast(header, PRODUCER_RANK)

    def _exchange_needs(self, delta: bool, verify: bool, probe_tokens: int) -> tuple[bool, bool, int]:
        """The producer says whether it may send deltas; then each consumer in turn tells every rank whether it
        verifies and how long a probe it wants. Returns (deltas on, any consumer verifies, the longest probe asked
        for). Tiny broadcasts over the data group, so it works with every backend."""
        mode = torch.tensor([int(delta)], dtype=torch.int64, device=self.device)
        self.group.group.broadcast(mode, PRODUCER_RANK)
        any_verify, longest_probe = False, 0
        for rank in range(1, self.group.world_size):
            mine = self.group.rank == rank
            need = torch.tensor([int(verify and mine), probe_tokens if mine else 0], dtype=torch.int64,
                                device=self.device)
            self.group.group.broadcast(need, rank)
            any_verify |= bool(need[0].item())
            longest_probe = max(longest_probe, int(need[1].item()))
        return bool(mode.item()), any_verify, longest_probe

    def _exchange_held(self, mine: int) -> list[int]:
        """With deltas on, before each round: every consumer's held round, in rank order."""
        held = []
        for rank in range(1, self.group.world_size):
            value = torch.tensor([mine if self.group.rank == rank else 0], dtype=torch.int64, device=self.device)
            self.group.group.broadcast(value, rank)
            held.append(int(value.item()))
        return held

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
        group: a connected :class:`~refit_app.transport.groups.RefitGroup` (from
            :func:`~refit_app.transport.groups.connect` or :func:`~refit_app.transport.groups.from_process_group`)
            on which this rank is the producer (rank 0).
        buffer_size_bytes, num_buffers, use_legacy_packing: as for
            :func:`~refit_app.packed_tensor.packed_broadcast_producer`; the buffer size and packing mode travel in
            the manifest, so consumers that leave theirs unset adopt them.
        on_chunk: called with (bytes, tensors) as each chunk is handed to the group (progress, metrics).
        checksum_algorithm: how to checksum for verifying consumers (:mod:`refit_app.protocol.checksum`); None picks
            the fastest installed. It travels in the manifest; a consumer that cannot compute it refuses at the
            handshake.
        delta: ``"off"`` (every round dense), ``"on"`` or ``"auto"`` (rounds after the first send only the changed
            elements where every consumer holds the last round; see :mod:`refit_app.protocol.delta`). On or auto
            keep one host copy of the sent model here.

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
        delta: str = "off",
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
        self._delta = ProducerDelta(delta)
        self._delta_on, self.checksums_needed, self.probe_tokens = self._exchange_needs(self._delta.enabled, False, 0)
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
            held = self._exchange_held(0) if self._delta_on else []
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
            if fresh and self._delta.enabled:
                self._delta.reset(manifest.tensors)
            base = self._delta.base_for(held) if self._delta_on and not fresh else 0
            flags = (MANIFEST if fresh else 0) | (DELTA if base else 0)
            self._broadcast_header(torch.tensor([ROUND_MAGIC, k, flags, len(extra), base], dtype=torch.int64,
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
            started = time.perf_counter()
            # Parameters require grad; packing only reads their values, which must not join an autograd graph.
            with torch.no_grad():
                checksums = self._send_data(named_tensors, manifest, result, base, k)
            if checksums is not None:
                send_checksums(self.group, checksums)
                result.checksums = checksums
            result.seconds = time.perf_counter() - started
            self._extra(extra, len(extra))
        except BaseException as e:
            self._delta.invalidate()
            finish(self.group, round_error(k, e))
            raise with_round(k, e) from e
        finish(self.group, None)
        self.rounds += 1
        return result

    def _send_data(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest, result: Round, base: int, k: int
    ) -> list[int] | None:
        """The round's data, dense or delta; returns the checksums where consumers verify."""
        algorithm = self.checksum_algorithm if manifest.checksums else None
        num_buffers = self.num_buffers or get_num_buffers()
        if self._delta.enabled:
            tensors = (t for _, t in _checked(named_tensors, manifest.tensors))
            result.bytes = manifest.total_bytes
            result.num_tensors = len(manifest.tensors)
            if base:
                stats, sums = self._delta.send_delta(
                    tensors, self.group.group, PRODUCER_RANK, chunk_bytes=manifest.buffer_size_bytes,
                    num_buffers=num_buffers, device=self.device, checksum_algorithm=algorithm, round_index=k,
                    on_chunk=self._stream_counter(result))
                _record_delta(result, base, stats)
                return sums
            sums = self._delta.send_dense(tensors, self._chunks, self.group.group, PRODUCER_RANK,
                                          num_buffers=num_buffers, device=self.device, checksum_algorithm=algorithm,
                                          round_index=k)
            self._count_dense(result)
            return sums
        hasher = _SendHasher(self._checksum) if manifest.checksums else None
        post = hasher.post if hasher is not None else _tensor_of
        result.num_broadcasts = self._broadcasts
        # Once the plan is recorded it checks every tensor against it itself; the first round checks here.
        tensors = named_tensors if self._plan.ready else _checked(named_tensors, manifest.tensors)
        packed_broadcast_producer(
            tensors,
            self.group.group,
            PRODUCER_RANK,
            post,
            buffer_size_bytes=manifest.buffer_size_bytes,
            num_buffers=self.num_buffers,
            use_legacy_packing=manifest.use_legacy_packing,
            on_chunk=ChunkCounter(result, self.on_chunk),
            on_chunk_done=None if hasher is None else hasher.chunk_sent,
            plan=self._plan,
        )
        result.wire_bytes = result.bytes
        return hasher.checksums() if hasher is not None else None

    def _count_dense(self, result: Round) -> None:
        """A dense round's figures, from the plan (the image path sends every planned chunk)."""
        result.num_chunks = len(self._chunks)
        result.num_broadcasts = self._broadcasts
        result.wire_bytes = result.bytes
        if self.on_chunk is not None:
            for chunk in self._chunks:
                self.on_chunk(chunk.nbytes, chunk.count)

    def _stream_counter(self, result: Round) -> Callable[[int], None]:
        def counted(nbytes: int) -> None:
            result.num_chunks += 1
            result.num_broadcasts += 1
            if self.on_chunk is not None:
                self.on_chunk(nbytes, 0)

        return counted

    def close(self, *, notify: bool = True) -> None:
        """Tell every consumer that the session is over (their :meth:`~ConsumerSession.receive` returns None), and
        free the send buffers and the snapshot. ``notify=False`` skips the end-of-session header, for consumers that
        only receive when asked to (a vLLM worker inside ``update_weights``): closing the group ends their session
        instead."""
        if self.closed:
            return
        self.closed = True
        self._plan.release()
        self._delta.image = None
        self._delta.buffers.clear()
        if notify:
            if self._delta_on:
                self._exchange_held(0)
            self._broadcast_header(torch.tensor([ROUND_MAGIC, self.rounds, END, 0, 0], dtype=torch.int64,
                                                device=self.device))


def _record_delta(result: Round, base: int, stats: Any) -> None:
    result.base_round = base
    result.wire_bytes = stats.wire_bytes
    result.changed_elements = stats.changed_elements
    result.total_elements = stats.total_elements
    result.encodings = dict(stats.encodings)
    result.delta_seconds = stats.seconds


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
        buffer_size_bytes, use_legacy_packing: None adopts the producer's; a value that differs from the
            producer's stops every rank at the handshake, naming both.
        num_buffers: receive buffers in flight (need not match the producer's).
        verify: ask for per-tensor checksums and check every tensor bit for bit, every round.
        probe_tokens: ask the producer for a model probe of this many positions after every round (0: none); it
            arrives as :attr:`Round.extra`.
        on_chunk: called with (bytes, tensors) as each chunk arrives.
        mirror: keep a copy of the model here (one host copy) that every round, dense or delta, brings up to date;
            the callback and the iterator get views of it. For a consumer that keeps no tensors of its own but
            wants the producer's deltas.
        accept_deltas: in a delta round, hand each changed tensor's changes to the callback as a
            :class:`~refit_app.protocol.delta.TensorDelta` (an engine that applies them through its own loader),
            where neither ``mirror`` nor :meth:`receive`'s ``targets`` hold the tensors.

    A consumer that holds no tensors the producer could send a delta against (no mirror, no targets, not
    accepting deltas, or verifying without tensors to verify) gets dense rounds only. Construct it on every rank
    at the same point as the producer's session.
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
        mirror: bool = False,
        accept_deltas: bool = False,
    ) -> None:
        super().__init__(group)
        if group.rank == PRODUCER_RANK:
            raise ValueError(f"a ConsumerSession runs on a consumer rank, not on rank {PRODUCER_RANK}")
        self.buffer_size_bytes = buffer_size_bytes
        self.use_legacy_packing = use_legacy_packing
        self.num_buffers = num_buffers
        self.verify = verify
        self.on_chunk = on_chunk
        self.accept_deltas = accept_deltas
        self._verifier: Verifier | None = None
        self.last_round: Round | None = None
        """The round :meth:`receive` finished last (for the iterator form, once it is exhausted)."""
        self._delta_on, _, _ = self._exchange_needs(False, verify, probe_tokens)
        # The copy is kept only where the producer may send deltas: dense rounds need none.
        self._delta = ConsumerDelta(mirror=mirror and self._delta_on)

    @property
    def mirror(self) -> bool:
        return self._delta.mirror

    def receive(
        self,
        post_unpack_func: Callable[[Batch], None] | None = None,
        return_iterator: bool = False,
        *,
        on_manifest: Callable[[Manifest], None] | None = None,
        on_round_end: Callable[[Round], dict[str, Any] | None] | None = None,
        targets: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]] | None = None,
    ) -> Round | Iterator[tuple[str, Any]] | None:
        """Receive one round; None once the producer has closed the session.

        ``post_unpack_func`` gets each batch of ``(name, tensor)`` as it arrives, exactly as with
        :func:`~refit_app.packed_tensor.packed_broadcast_consumer` (views into receive buffers: load or copy them;
        a buffer is not refilled while a tensor from it is still referenced). With ``return_iterator`` the
        round's tensors come back as a lazy iterator instead, and the round ends (trailers, verification, the
        all-ranks "done") when it is exhausted; :attr:`last_round` then holds its figures.

        ``targets``: tensors by name that this round writes into, bit for bit (a dense round copies every tensor,
        a delta round patches the changed elements), or a function returning them once the manifest is in (the
        first round builds the model they belong to); the batches then hold those tensors, every one of them
        every round, each once it is final for the round. With ``mirror`` the batches hold views of the session's
        copy, likewise. Without either, a delta round hands ``(name, TensorDelta)`` items for the changed tensors
        only (``accept_deltas``).

        ``on_manifest(manifest)`` runs when a fresh manifest arrives (first round, or the tensor list changed),
        before any tensor moves: what it raises is this consumer's refusal, and every rank stops with it.
        ``on_round_end(round)`` runs after the data and trailers, before the round's all-ranks "done": what it
        raises fails the round on every rank; what it returns is merged into ``round.facts``.
        """
        if self.closed:
            return None
        k = self.rounds + 1
        result = Round(round=k)
        given = targets
        try:
            if self._delta_on:
                self._exchange_held(self._held(given))
            header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
            self._broadcast_header(header)
            magic, round_index, flags, extra_len, base = (int(x) for x in header.cpu().tolist())
            if magic != ROUND_MAGIC:
                raise HandshakeError(
                    "the producer's round header is not a refit_app session's; run the same refit_app version "
                    "with a session on every rank"
                )
            if flags & END:
                self.closed = True
                return None
            if round_index != k:
                raise HandshakeError(f"the producer is in round {round_index}, this consumer in round {k}")
            if flags & MANIFEST:
                started = time.perf_counter()
                self._accept(on_manifest)
                result.manifest_sent, result.handshake_seconds = True, time.perf_counter() - started
            elif self.manifest is None:
                raise HandshakeError("the producer sent no manifest in the first round")
            if flags & DELTA and base != self._delta.held_round:
                raise HandshakeError(f"the producer sends round {k} as changes to round {base}, but this consumer "
                                     f"holds {'no round' if not self._delta.held_round else f'round {self._delta.held_round}'}")
            manifest = self.manifest
            assert manifest is not None
            targets = given() if callable(given) else given
            store = self._delta.targets_for(manifest.tensors, targets) if (
                self._delta.mirror or targets is not None) else None
        except BaseException as e:
            self._fail(k, e)
        started = time.perf_counter()
        if flags & DELTA or self._delta.mirror or targets is not None:
            result.base_round = base if flags & DELTA else 0
            batches = self._stored_batches(result, store, targets, post_unpack_func)
            if return_iterator:
                return self._iterate(_flatten(batches), result, extra_len, on_round_end, targets)
            try:
                for _ in batches:
                    pass
            except BaseException as e:
                self._fail(k, e)
            return self._end_round(result, started, extra_len, on_round_end, targets)
        result.num_broadcasts = self._broadcasts
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
                on_chunk=ChunkCounter(result, self.on_chunk),
                plan=self._plan,
            )
        except BaseException as e:
            self._fail(k, e)
        if return_iterator:
            return self._iterate(stream, result, extra_len, on_round_end, targets)
        result.wire_bytes = result.bytes
        return self._end_round(result, started, extra_len, on_round_end, targets)

    def _held(self, given: Any) -> int:
        """The round this consumer can take changes against (0: send it a dense round)."""
        stores = self._delta.mirror or given is not None
        if not stores and (self.verify or not self.accept_deltas):
            return 0
        if self.manifest is None:
            return 0
        targets = given() if callable(given) else given
        return self._delta.held(targets if stores else None)

    def _stored_batches(
        self,
        result: Round,
        store: list[Any] | None,
        targets: Mapping[str, torch.Tensor] | None,
        post_unpack_func: Callable[[Batch], None] | None,
    ) -> Iterator[Batch]:
        """The round's batches where the session writes into tensors (mirror or targets) or a delta round hands
        changes out: each batch is shown to the verifier and ``post_unpack_func`` before it is yielded."""
        manifest = self.manifest
        assert manifest is not None
        metas = manifest.tensors
        verifier = self._verifier

        def deliver(batch: Batch) -> Batch:
            if post_unpack_func is not None and batch:
                post_unpack_func(batch)
            if verifier is not None:
                verifier.consume([(n, t) for n, t in batch if not isinstance(t, TensorDelta)])
            return batch

        result.bytes = manifest.total_bytes
        result.num_tensors = len(metas)
        if result.base_round:
            # The verifier sees every tensor once it is final (changed or not); the callback only what changed.
            stats = DeltaStats()
            for final, _, deltas in self._delta.receive_delta(
                metas, self.group.group, PRODUCER_RANK, stats, device=self.device, targets=store,
                on_chunk=self._stream_counter(result),
            ):
                if store is not None:
                    yield deliver([(metas[i].name, self._delta.view(metas, i, targets)) for i in final])
                else:
                    yield deliver([(d.name, d) for d in deltas])
            _record_delta(result, result.base_round, stats)
            return
        result.num_broadcasts = self._broadcasts
        result.wire_bytes = manifest.total_bytes
        if self._delta.mirror:
            assert self._delta.image is not None
            for chunk in self._delta.receive_dense(self._chunks, self.group.group, PRODUCER_RANK,
                                                   num_buffers=self.num_buffers or get_num_buffers(), device=self.device):
                result.num_chunks += 1
                if self.on_chunk is not None:
                    self.on_chunk(chunk.nbytes, chunk.count)
                yield deliver([(metas[i].name, self._delta.image.view(i)) for i in range(chunk.first, chunk.stop)])
            return
        # Targets: receive into rotating buffers, copy each tensor into its target.
        assert targets is not None
        for batch in _packed_broadcast_consumer_batches(
            ((t.name, (t.shape, t.dtype)) for t in metas), self.group.group, PRODUCER_RANK,
            num_buffers=self.num_buffers, buffer_size_bytes=manifest.buffer_size_bytes,
            use_legacy_packing=manifest.use_legacy_packing, on_chunk=ChunkCounter(result, self.on_chunk),
            plan=self._plan,
        ):
            out: Batch = []
            for name, view in batch:
                target = targets[name]
                tensor_bytes(target).copy_(tensor_bytes(view))
                out.append((name, target))
            del batch
            yield deliver(out)

    def _stream_counter(self, result: Round) -> Callable[[int], None]:
        def counted(nbytes: int) -> None:
            result.num_chunks += 1
            result.num_broadcasts += 1
            if self.on_chunk is not None:
                self.on_chunk(nbytes, 0)

        return counted

    def _consumer(self, post_unpack_func: Callable[[Batch], None] | None) -> Callable[[Batch], None] | None:
        verifier = self._verifier
        if verifier is None:
            return post_unpack_func
        if post_unpack_func is None:
            return verifier.consume

        def both(batch: Batch) -> None:
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
                    raise with_round(self.rounds + 1, e) from e

        self.manifest = accept_manifest(
            self.group,
            buffer_size_bytes=self.buffer_size_bytes,
            use_legacy_packing=self.use_legacy_packing,
            prepare=prepare,
        )
        self._verifier = Verifier(self.manifest.tensors, self.manifest.checksum_algorithm) if self.verify else None
        self._delta.reset(self.manifest.tensors)
        self._new_plan()

    def _iterate(
        self,
        stream: Iterator[tuple[str, Any]],
        result: Round,
        extra_len: int,
        on_round_end: Callable[[Round], dict[str, Any] | None] | None,
        targets: Mapping[str, torch.Tensor] | None,
    ) -> Iterator[tuple[str, Any]]:
        started = time.perf_counter()
        try:
            yield from stream
        except GeneratorExit:
            # The caller stopped early: the round cannot complete, and the peers must learn it.
            self._delta.failed()
            self._report_failure(result.round, RefitError("the consumer stopped reading before the round ended"))
            raise
        except BaseException as e:
            self._fail(result.round, e)
        if not result.wire_bytes:
            result.wire_bytes = result.bytes
        self._end_round(result, started, extra_len, on_round_end, targets)

    def _end_round(
        self,
        result: Round,
        started: float,
        extra_len: int,
        on_round_end: Callable[[Round], dict[str, Any] | None] | None,
        targets: Mapping[str, torch.Tensor] | None,
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
        self._delta.completed(k, targets)
        self.last_round = result
        return result

    def _report_failure(self, k: int, exc: BaseException) -> None:
        finish(self.group, round_error(k, exc))

    def _fail(self, k: int, exc: BaseException) -> None:
        self._delta.failed()
        self._report_failure(k, exc)
        raise with_round(k, exc) from exc

    def close(self) -> None:
        """Nothing to tell the producer: it ends the session. Marks this side closed."""
        self.closed = True


def _flatten(batches: Iterator[Batch]) -> Iterator[tuple[str, Any]]:
    for batch in batches:
        yield from batch
