"""The trainer's end of a session: :class:`ProducerSession` (see :mod:`refit_app.protocol.session`)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from refit_app.common.errors import SourceError
from refit_app.core.chunks import Chunk
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import host_bytes
from refit_app.packed_tensor import (
    ChunkCallback,
    get_num_buffers,
    get_target_packed_tensor_size,
    packed_broadcast_producer,
)
from refit_app.protocol.checksum import checksum_function, default_algorithm
from refit_app.protocol.delta.auto import DELTA as DELTA_ROUND
from refit_app.protocol.delta.auto import KEEP
from refit_app.protocol.delta.auto import PLAIN as PLAIN_ROUND
from refit_app.protocol.delta.send import ProducerDelta
from refit_app.protocol.delta.types import delta_chunk_bytes
from refit_app.protocol.handshake import (
    finish,
    send_checksums,
    send_manifest,
)
from refit_app.protocol.manifest import Manifest, tensor_list_changes
from refit_app.protocol.rounds import (
    DELTA,
    END,
    MANIFEST,
    PLAIN,
    REGROUP,
    ROUND_MAGIC,
    ChunkCounter,
    Round,
    round_error,
    with_round,
)
from refit_app.protocol.session_base import Session
from refit_app.transport.groups import RefitGroup
from refit_app.transport.spec import PRODUCER_RANK

logger = logging.getLogger(__name__)


class ProducerSession(Session):
    """The trainer's side: :meth:`send` the current weights once per round, :meth:`close` when done.

    Args:
        group: a connected :class:`~refit_app.transport.groups.RefitGroup` (from
            :func:`~refit_app.transport.groups.connect` or :func:`~refit_app.transport.groups.from_process_group`)
            on which this rank is the producer (rank 0).
        buffer_size_bytes: as for :func:`~refit_app.packed_tensor.packed_broadcast_producer`; it travels in the
            manifest, so consumers that leave theirs unset adopt it.
        num_buffers: as for :func:`~refit_app.packed_tensor.packed_broadcast_producer`.
        use_legacy_packing: as for :func:`~refit_app.packed_tensor.packed_broadcast_producer`; it travels in the
            manifest like the buffer size.
        on_chunk: called with (bytes, tensors) as each chunk is handed to the group (progress, metrics).
        checksum_algorithm: how to checksum for verifying consumers (:mod:`refit_app.protocol.checksum`); None picks
            the fastest installed. It travels in the manifest; a consumer that cannot compute it refuses at the
            handshake.
        delta: ``"off"`` (every round dense), ``"on"`` or ``"auto"`` (rounds after the first send only the changed
            elements where every consumer holds the last round; see :mod:`refit_app.protocol.delta.send`). On or auto
            keep one host copy of the sent model here.
        rounds: how many rounds this session will send, where that is known; it travels in the manifest, and a
            consumer that names another number stops every rank at the handshake. None: open-ended.

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
        rounds: int | None = None,
    ) -> None:
        super().__init__(group)
        self.planned_rounds = rounds
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
        round_started = time.perf_counter()
        kind = KEEP
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
                rounds=self.planned_rounds,
                files=dict(files or {}),
            )
            fresh = self.manifest != manifest  # field by field: no re-encoding of the model every round
            if fresh and self._delta.enabled:
                reset_started = time.perf_counter()
                self._delta.reset(manifest.tensors)
                round_started += time.perf_counter() - reset_started  # allocating the snapshot is no round's cost
            kind = self._delta.choose(held) if self._delta_on and not fresh else KEEP
            base = self._delta.base if kind == DELTA_ROUND else 0
            result.plain = kind == PLAIN_ROUND
            flags = (MANIFEST if fresh else 0) | (DELTA if base else 0) | (PLAIN if result.plain else 0)
            self._broadcast_header(
                torch.tensor([ROUND_MAGIC, k, flags, len(extra), base], dtype=torch.int64, device=self.device)
            )
            if fresh:
                self._send_manifest(manifest, result)
            started = time.perf_counter()
            # Parameters require grad; packing only reads their values, which must not join an autograd graph.
            with torch.no_grad():
                checksums = self._send_data(named_tensors, manifest, result, kind, k)
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
        # The whole round but the manifest's handshake: until every consumer has applied and checked it.
        self._delta.observe(kind, time.perf_counter() - round_started - result.handshake_seconds, cold=fresh)
        return result

    def _send_manifest(self, manifest: Manifest, result: Round) -> None:
        """A fresh manifest goes out (every consumer accepts it or every rank stops) and is in force from now on."""
        if self.manifest is not None:
            changes = tensor_list_changes(self.manifest.tensors, manifest.tensors) or ["settings or files"]
            logger.info(
                "round %d: the tensor list changed (%s); sending a fresh manifest", result.round, "; ".join(changes)
            )
        started = time.perf_counter()
        send_manifest(self.group, manifest)
        result.manifest_sent, result.handshake_seconds = True, time.perf_counter() - started
        self.manifest = manifest
        self._new_plan()

    def _send_data(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest, result: Round, kind: str, k: int
    ) -> list[int] | None:
        """The round's data, by ``kind`` (:mod:`refit_app.protocol.delta.auto`); returns the checksums where
        consumers verify."""
        algorithm = self.checksum_algorithm if manifest.checksums else None
        num_buffers = self.num_buffers or get_num_buffers()
        base = self._delta.base if kind == DELTA_ROUND else 0
        if self._delta.enabled and kind != PLAIN_ROUND:
            tensors = (t for _, t in _checked(named_tensors, manifest.tensors))
            result.bytes = manifest.total_bytes
            result.num_tensors = len(manifest.tensors)
            if base:
                stats, sums = self._delta.send_delta(
                    tensors,
                    self.group.group,
                    PRODUCER_RANK,
                    chunk_bytes=delta_chunk_bytes(manifest.buffer_size_bytes),
                    num_buffers=num_buffers,
                    device=self.device,
                    checksum_algorithm=algorithm,
                    round_index=k,
                    on_chunk=self._stream_counter(result),
                )
                record_delta(result, base, stats)
                return sums
            sums = self._delta.send_dense(
                tensors,
                self._chunks,
                self.group.group,
                PRODUCER_RANK,
                num_buffers=num_buffers,
                device=self.device,
                checksum_algorithm=algorithm,
                round_index=k,
            )
            self._count_dense(result)
            self._record_sample(result, manifest)
            return sums
        hasher = _SendHasher(self._checksum) if manifest.checksums else None
        post = hasher.post if hasher is not None else _tensor_of
        sample = self._delta.plain_round(k) if self._delta.enabled else None
        if sample is not None:
            post = _sampled(post, sample)
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
        if self._delta.enabled:
            self._delta.end_plain_round(k)
            self._record_sample(result, manifest)
        return hasher.checksums() if hasher is not None else None

    def _record_sample(self, result: Round, manifest: Manifest) -> None:
        """A dense round of ``auto``: its changes as estimated from the sample."""
        if self._delta.sampled_fraction is not None:
            result.total_elements = sum(m.numel for m in manifest.tensors)
            result.changed_elements = round(self._delta.sampled_fraction * result.total_elements)

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

    def close(self, *, notify: bool = True, regroup_to: int = 0) -> None:
        """Tell every consumer that the session is over (their :meth:`~ConsumerSession.receive` returns None), and
        free the send buffers and the snapshot. ``notify=False`` skips the end-of-session header, for consumers that
        only receive when asked to (a vLLM worker inside ``update_weights``): closing the group ends their session
        instead. ``regroup_to``: an elastic session's next generation; this group's session ends for that instead
        (:attr:`ConsumerSession.regroup_to`)."""
        if self.closed:
            return
        self.closed = True
        self._plan.release()
        self._delta.image = None
        self._delta.buffers.clear()
        if notify:
            if self._delta_on:
                self._exchange_held(0)
            flags = REGROUP if regroup_to else END
            self._broadcast_header(
                torch.tensor([ROUND_MAGIC, self.rounds, flags, 0, regroup_to], dtype=torch.int64, device=self.device)
            )


def record_delta(result: Round, base: int, stats: Any) -> None:
    result.base_round = base
    result.wire_bytes = stats.wire_bytes
    result.changed_elements = stats.changed_elements
    result.total_elements = stats.total_elements
    result.encodings = dict(stats.encodings)
    result.delta_seconds = stats.seconds


def _tensor_of(item: tuple[str, torch.Tensor]) -> torch.Tensor:
    return item[1]


def _sampled(
    post: Callable[[tuple[str, torch.Tensor]], torch.Tensor], sample: Callable[[torch.Tensor], None]
) -> Callable[[tuple[str, torch.Tensor]], torch.Tensor]:
    def both(item: tuple[str, torch.Tensor]) -> torch.Tensor:
        t = post(item)
        sample(t)
        return t

    return both


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
