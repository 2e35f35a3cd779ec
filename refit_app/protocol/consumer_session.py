"""An engine's end of a session: :class:`ConsumerSession` (see :mod:`refit_app.protocol.session`).

Over 500 lines as one module on purpose: it is one class, a consumer's round, whose steps (the header, the manifest,
the three ways a round's data lands, a round staged beside the targets, the trailers, the base it claims for the next
round) share the session's state; the byte-level work is already below it (:mod:`refit_app.protocol.delta.receive`,
:mod:`refit_app.protocol.staging`, :mod:`refit_app.core`)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, NoReturn

import torch

from refit_app.common.errors import HandshakeError, RefitError, StagingError, VerificationError, one_line
from refit_app.common.sizes import format_size
from refit_app.core.chunks import Chunk
from refit_app.core.delta.image import Image
from refit_app.core.wire import host_bytes, tensor_bytes
from refit_app.packed_tensor import (
    ChunkCallback,
    get_num_buffers,
    packed_broadcast_consumer,
    packed_broadcast_consumer_batches,
)
from refit_app.protocol.checksum import checksum_function, default_algorithm
from refit_app.protocol.delta.receive import ConsumerDelta
from refit_app.protocol.delta.types import DeltaStats, TensorDelta, delta_chunk_bytes
from refit_app.protocol.handshake import (
    accept_manifest,
    finish,
    recv_checksums,
)
from refit_app.protocol.manifest import Manifest, tensor_list_changes
from refit_app.protocol.producer_session import record_delta
from refit_app.protocol.rounds import (
    DELTA,
    END,
    HEADER_WORDS,
    MANIFEST,
    PLAIN,
    REGROUP,
    ROUND_MAGIC,
    ChunkCounter,
    Round,
    round_error,
    with_round,
)
from refit_app.protocol.session_base import Batch, Session
from refit_app.protocol.staging import APPLIED, BROKEN, StagedChange, StagedRound, stage_changes, stage_dense
from refit_app.protocol.verify import Verifier
from refit_app.transport.groups import RefitGroup
from refit_app.transport.spec import PRODUCER_RANK

logger = logging.getLogger(__name__)


class ConsumerSession(Session):
    """An engine's side: :meth:`receive` one round at a time until the producer closes the session.

    Args:
        group: a connected :class:`~refit_app.transport.groups.RefitGroup` on which this rank is a consumer.
        buffer_size_bytes: None adopts the producer's; a value that differs from the producer's stops every rank
            at the handshake, naming both.
        use_legacy_packing: None adopts the producer's; a difference stops every rank, as for the buffer size.
        rounds: None adopts the producer's number of rounds; a number that differs from the one the producer's
            session announces (or a producer that announces none) stops every rank, as for the buffer size.
        num_buffers: receive buffers in flight (need not match the producer's).
        verify: ask for per-tensor checksums and check every tensor bit for bit, every round.
        probe_tokens: ask the producer for a model probe of this many positions after every round (0: none); it
            arrives as :attr:`Round.extra`.
        on_chunk: called with (bytes, tensors) as each chunk arrives.
        mirror: keep a copy of the model here (one host copy) that every round, dense or delta, brings up to date;
            the callback and the iterator get views of it. For a consumer that keeps no tensors of its own but
            wants the producer's deltas.
        accept_deltas: in a delta round, hand each changed tensor's changes to the callback as a
            :class:`~refit_app.protocol.delta.types.TensorDelta` (an engine that applies them through its own loader),
            where :meth:`receive`'s ``targets`` do not hold the tensors. With ``mirror`` too, the copy is patched
            first and each change carries it (:attr:`~refit_app.protocol.delta.types.TensorDelta.mirror`): for an engine
            that must reload some tensors whole, with their unchanged neighbours.
        check_base: before claiming the tensors it holds (``targets`` or the mirror) as a delta round's base, check
            that their bytes are still the round's: their per-tensor checksums, taken as each round's data is in
            (the producer's, where the round carried them), against a fresh hash of the tensors, on two threads. A
            write torch's version counter does not see (``t.data.copy_``, as vLLM's ``default_weight_loader`` does,
            or through ``t.numpy()``) then gets a dense round instead of a delta onto other bytes. False trusts
            the version counter alone, saving one read of the model per round (two without checksums): only for an
            engine that never writes those tensors by other means.
        max_staging_bytes: the most host memory a round :meth:`stage` holds may take (None: no bound). A staged
            round takes up to one host copy of the model (a dense round exactly that, a delta round its changes), so
            :meth:`stage` refuses, in one line and before anything moves, a model larger than this: at the call where
            the manifest is in force (the session goes on; :meth:`receive` takes the round unstaged), or as this
            consumer's refusal of a fresh manifest (every rank stops, as for ``on_manifest``).

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
        rounds: int | None = None,
        check_base: bool = True,
        max_staging_bytes: int | None = None,
    ) -> None:
        super().__init__(group)
        if group.rank == PRODUCER_RANK:
            raise ValueError(f"a ConsumerSession runs on a consumer rank, not on rank {PRODUCER_RANK}")
        if max_staging_bytes is not None and max_staging_bytes < 0:
            raise ValueError(f"max_staging_bytes={max_staging_bytes}: must be 0 or more, or None for no bound")
        self.max_staging_bytes = max_staging_bytes
        self.buffer_size_bytes = buffer_size_bytes
        self.use_legacy_packing = use_legacy_packing
        self.planned_rounds = rounds
        self.num_buffers = num_buffers
        self.verify = verify
        self.on_chunk = on_chunk
        self.accept_deltas = accept_deltas
        self._verifier: Verifier | None = None
        self.last_round: Round | None = None
        """The round :meth:`receive` finished last (for the iterator form, once it is exhausted)."""
        self._delta_on, _, _ = self._exchange_needs(False, verify, probe_tokens)
        # The copy is kept, and the tensors fingerprinted, only where the producer may send deltas: dense rounds
        # claim no base.
        self._delta = ConsumerDelta(mirror=mirror and self._delta_on, check_base=check_base and self._delta_on)
        self._plain = False
        """This round is plain (:data:`~refit_app.protocol.rounds.PLAIN`)."""
        self._landed: dict[str, int] | None = None
        """This round's tensors' checksums as each became final, before the callback or the iterator's caller saw
        it (where the round carries no checksums of the producer's): the base claimed for the next round."""
        self.regroup_to = 0
        """Set (to the next generation) when the producer ended this group's session to form another one (an
        elastic session, :mod:`refit_app.protocol.elastic`); :meth:`receive` then returned None."""
        self.applied_round = 0
        """The round (weight version) the targets of :meth:`stage` hold: the last staged round applied (0: none)."""
        self._staged: StagedRound | None = None
        """The round :meth:`stage` returned that is neither applied nor discarded yet."""

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
        copy, likewise. Without targets, a consumer that ``accept_deltas`` gets ``(name, TensorDelta)`` items for
        the changed tensors only in a delta round (and, with ``mirror``, views of the copy in a dense round).

        ``on_manifest(manifest)`` runs when a fresh manifest arrives (first round, or the tensor list changed),
        before any tensor moves: what it raises is this consumer's refusal, and every rank stops with it.
        ``on_round_end(round)`` runs after the data and trailers, before the round's all-ranks "done": what it
        raises fails the round on every rank; what it returns is merged into ``round.facts``.
        """
        if self.closed:
            return None
        self._refuse_while_staged("receive")
        k = self.rounds + 1
        result = Round(round=k)
        self._landed = None
        try:
            header = self._begin(k, targets, on_manifest, result)
            if header is None:
                return None
            targets = targets() if callable(targets) else targets
            store = self._store(targets)
        except BaseException as e:
            self._fail(k, e)
        ending = _Ending(header.extra_len, on_round_end, targets)
        # A plain round leaves the copy behind: it is received as without deltas (into targets where given).
        self._plain = result.plain = bool(header.flags & PLAIN)
        if header.flags & DELTA or (self._delta.mirror and not self._plain) or targets is not None:
            result.base_round = header.base if header.flags & DELTA else 0
            return self._receive_stored(result, store, post_unpack_func, return_iterator, ending)
        return self._receive_packed(result, post_unpack_func, return_iterator, ending)

    def stage(
        self,
        targets: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]],
        *,
        on_manifest: Callable[[Manifest], None] | None = None,
    ) -> StagedRound | None:
        """Receive one round beside ``targets`` (an engine's tensors by name, or a function returning them once the
        manifest is in), which keep the round they hold, untouched, until :meth:`StagedRound.apply
        <refit_app.protocol.staging.StagedRound.apply>` writes it into them; None once the producer has closed the
        session. See :mod:`refit_app.protocol.staging`.

        The round lands in memory the session owns (a dense round: one host copy of the model; a delta round: its
        changes to the round the targets hold) and, where the session verifies, is verified there. The stage reads
        the targets (the base's check, a delta round's unchanged tensors) and never writes them, so an engine may
        keep serving from them on another thread; it must not write them until the round is applied. :meth:`stage`
        and :meth:`receive` refuse to take another round until this one is applied or discarded.

        Raises :class:`~refit_app.common.errors.StagingError`, one line naming the round and the reason, where the
        round is not staged, the targets untouched in every case: ``max_staging_bytes`` refused it (see there); it
        failed verification (the round still ended on every rank, so the session goes on, and the targets' round,
        not this one, is the next round's base: it comes dense); a peer failed or the producer died (every rank
        stops, within the group's deadline).
        """
        if self.closed:
            return None
        self._refuse_while_staged("stage")
        k = self.rounds + 1
        if targets is None:  # nothing to stage beside: refused before anything moves, as the bound is
            raise StagingError(f"round {k}: stage() needs the targets (tensors by name) the round is applied to")
        if self._delta.mirror:
            raise StagingError(
                f"round {k}: stage() writes into targets; this session keeps a mirror (mirror=True): receive() instead"
            )
        if self.manifest is not None and (refusal := self._staging_refusal(self.manifest)):
            raise StagingError(f"round {k}: {refusal}")  # nothing moved: the session goes on

        def accept(manifest: Manifest) -> None:
            if refusal := self._staging_refusal(manifest):
                raise StagingError(refusal)
            if on_manifest is not None:
                on_manifest(manifest)

        started = time.perf_counter()
        result = Round(round=k)
        rejected: VerificationError | None = None
        try:
            header = self._begin(k, targets, accept, result)
            if header is None:
                return None
            targets = targets() if callable(targets) else targets
            manifest = self.manifest
            assert manifest is not None
            self._delta.targets_for(manifest.tensors, targets)  # every target there, as the manifest says
            held = self._delta.held_round
            result.plain = bool(header.flags & PLAIN)
            result.base_round = header.base if header.flags & DELTA else 0
            result.bytes, result.num_tensors = manifest.total_bytes, len(manifest.tensors)
            # The round's own hashes where the producer sends none: the base claimed once it is applied.
            landed: dict[str, int] | None = (
                {} if self._delta_on and self._delta.check_base and not manifest.checksums else None
            )
            deliver = _Delivery(landed, None, self._verifier)
            data_started = time.perf_counter()
            image, changes = self._stage_data(
                result, targets, deliver if landed is not None or self._verifier is not None else None
            )
            if manifest.checksums:
                result.checksums = recv_checksums(self.group, len(manifest.tensors))
            result.seconds = time.perf_counter() - data_started
            result.extra = self._extra(None, header.extra_len)
            if self._verifier is not None:
                try:
                    result.facts.update(self._verifier.verdict(result.checksums))
                    result.verified = True
                except VerificationError as e:
                    # Contained: the targets never saw it, and the stream is in step (the trailer is in).
                    rejected, result.verified = e, False
        except Exception as e:
            self._stage_failed(k, e)
        except BaseException as e:
            self._fail(k, e)
        try:
            finish(self.group, None)
        except Exception as e:
            self._delta.failed()
            raise StagingError(f"{round_error(k, e)} (not staged: the targets are untouched)") from e
        self.rounds += 1
        self.last_round = result
        if rejected is not None:
            error = StagingError(
                f"round {k}: not applied, the targets keep {f'round {held}' if held else 'what they held'} and the "
                f"next round comes dense: {rejected}"
            )
            logger.warning("rank %d: %s", self.group.rank, error)  # the session goes on: said where runs are read too
            raise error from rejected
        checksums, algorithm = result.checksums, manifest.checksum_algorithm
        if checksums is None and landed is not None and len(landed) == len(manifest.tensors):
            checksums, algorithm = [landed[m.name] for m in manifest.tensors], default_algorithm()
        staged = StagedRound(
            result,
            manifest.tensors,
            targets,
            image=image,
            changes=changes,
            held_round=held,
            stage_seconds=time.perf_counter() - started,
            settle=functools.partial(self._settle, k, targets, checksums, algorithm),
            base_intact=functools.partial(self._delta.intact, targets),
            base_bytes_intact=functools.partial(self._delta.bytes_intact, targets),
            check_targets=functools.partial(self._delta.targets_for, manifest.tensors, targets),
        )
        self._staged = staged
        return staged

    def _stage_data(
        self, result: Round, targets: Mapping[str, torch.Tensor], show: Callable[[Batch], Any] | None
    ) -> tuple[Image | None, list[StagedChange] | None]:
        """The round's data into the session's memory: a dense round's copy, or a delta round's changes."""
        manifest = self.manifest
        assert manifest is not None
        metas = manifest.tensors
        if result.base_round:
            stats = DeltaStats()
            records = self._delta_records(result, stats, None, hand_out=True)
            changes = stage_changes(records, metas, targets, show=show)
            record_delta(result, result.base_round, stats)
            return None, changes
        result.num_broadcasts = self._broadcasts
        result.wire_bytes = manifest.total_bytes

        def counted(chunk: Chunk) -> None:
            result.num_chunks += 1
            if self.on_chunk is not None:
                self.on_chunk(chunk.nbytes, chunk.count)

        image = stage_dense(
            metas,
            self._chunks,
            self.group.group,
            PRODUCER_RANK,
            num_buffers=self.num_buffers or get_num_buffers(),
            device=self.device,
            on_chunk=counted,
            show=show,
        )
        return image, None

    def _settle(
        self,
        k: int,
        targets: Mapping[str, torch.Tensor],
        checksums: list[int] | None,
        algorithm: str,
        outcome: str,
    ) -> None:
        """A staged round was applied, discarded or broken half-way: the base this consumer claims follows. The round
        stays pending until the base is settled, so a side thread's next :meth:`stage` never claims a stale one."""
        if outcome == APPLIED:
            # Inside the engine's pause, right after the writes: a later write is caught by the next round's check.
            fingerprint = (
                self._delta.fingerprint(targets, checksums=checksums, algorithm=algorithm) if self._delta_on else None
            )
            self._delta.completed(k, targets, fingerprint=fingerprint)
            self.applied_round = k
        elif outcome == BROKEN:
            self._delta.failed()
        self._staged = None

    def _staging_refusal(self, manifest: Manifest) -> str:
        """Why a round of ``manifest`` cannot be staged within ``max_staging_bytes`` ("" where it can)."""
        bound, needed = self.max_staging_bytes, manifest.total_bytes
        if bound is None or needed <= bound:
            return ""
        return (
            f"staging a round of this model takes up to {format_size(needed)} ({needed} bytes, one host copy), over "
            f"max_staging_bytes={bound}; raise it, or receive() the round unstaged"
        )

    def _refuse_while_staged(self, call: str) -> None:
        staged = self._staged
        if staged is not None:
            raise StagingError(
                f"round {staged.version} is staged, neither applied nor discarded: apply() or discard() it before "
                f"{call}() takes round {self.rounds + 1}"
            )

    def _stage_failed(self, k: int, exc: Exception) -> NoReturn:
        self._delta.failed()
        self._report_failure(k, exc)
        raise StagingError(f"{one_line(round_error(k, exc))} (not staged: the targets are untouched)") from exc

    def _begin(
        self,
        k: int,
        given: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]] | None,
        on_manifest: Callable[[Manifest], None] | None,
        result: Round,
    ) -> _Header | None:
        """Round ``k``'s opening: the held round (deltas on), the header, the manifest where a fresh one comes, and
        a delta round's base checked against what this consumer holds. None: the producer ended the session."""
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
        if flags & (END | REGROUP):
            self.closed = True
            self.regroup_to = base if flags & REGROUP else 0
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
            held = self._delta.held_round
            raise HandshakeError(
                f"the producer sends round {k} as changes to round {base}, but this consumer "
                f"holds {f'round {held}' if held else 'no round'}"
            )
        return _Header(flags, extra_len, base)

    def _store(self, targets: Mapping[str, torch.Tensor] | None) -> list[Any] | None:
        """Where the round's bytes go, tensor by tensor (the mirror or ``targets``); None: nowhere of the session's."""
        manifest = self.manifest
        assert manifest is not None
        if self._delta.mirror or targets is not None:
            return self._delta.targets_for(manifest.tensors, targets)
        return None

    def _receive_stored(
        self,
        result: Round,
        store: list[Any] | None,
        post_unpack_func: Callable[[Batch], None] | None,
        return_iterator: bool,
        ending: _Ending,
    ) -> Round | Iterator[tuple[str, Any]]:
        """A round the session writes into tensors (mirror or targets), or a delta round handed out as changes."""
        started = time.perf_counter()
        batches = self._stored_batches(result, store, ending.targets, post_unpack_func)
        if return_iterator:
            return self._iterate(_flatten(batches), result, ending)
        try:
            for _ in batches:
                pass
        except BaseException as e:
            self._fail(result.round, e)
        return self._end_round(result, started, ending)

    def _receive_packed(
        self,
        result: Round,
        post_unpack_func: Callable[[Batch], None] | None,
        return_iterator: bool,
        ending: _Ending,
    ) -> Round | Iterator[tuple[str, Any]]:
        """A dense round into receive buffers only, as :func:`~refit_app.packed_tensor.packed_broadcast_consumer`
        receives it (its lazy iterator's buffer lifetimes included)."""
        manifest = self.manifest
        assert manifest is not None
        started = time.perf_counter()
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
            self._fail(result.round, e)
        if return_iterator:
            return self._iterate(stream, result, ending)
        result.wire_bytes = result.bytes
        return self._end_round(result, started, ending)

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
        kept = not (self._plain and self._delta.mirror)
        self._landed = None
        if self._delta_on and self._delta.check_base and kept and not manifest.checksums:
            self._landed = {}
        deliver = _Delivery(self._landed, post_unpack_func, self._verifier)
        result.bytes = manifest.total_bytes
        result.num_tensors = len(manifest.tensors)
        if result.base_round:
            yield from self._delta_batches(result, store, targets, deliver)
            return
        result.num_broadcasts = self._broadcasts
        result.wire_bytes = manifest.total_bytes
        if self._delta.mirror and not self._plain:
            yield from self._mirror_batches(result, deliver)
            return
        assert targets is not None
        yield from self._target_batches(result, targets, deliver)

    def _delta_batches(
        self,
        result: Round,
        store: list[Any] | None,
        targets: Mapping[str, torch.Tensor] | None,
        deliver: _Delivery,
    ) -> Iterator[Batch]:
        """A delta round's records applied into the store (or handed out as changes, ``accept_deltas`` without
        targets). The verifier sees every tensor once it is final (changed or not); the callback only what
        changed, where changes are handed out."""
        manifest = self.manifest
        assert manifest is not None
        metas = manifest.tensors
        hand_out = self.accept_deltas and targets is None
        stats = DeltaStats()
        for final, _, deltas in self._delta_records(result, stats, store, hand_out=hand_out):
            views = (
                [(metas[i].name, self._delta.view(metas, i, targets)) for i in final]
                if (store is not None and (not hand_out or deliver.verifier is not None))
                else None
            )
            if hand_out:
                landing = (
                    [(metas[i].name, self._delta.view(metas, i, targets)) for i in final]
                    if store is not None and deliver.landed is not None
                    else None
                )
                yield deliver([(d.name, d) for d in deltas], final=views, landing=landing)
            else:
                yield deliver(views)
        record_delta(result, result.base_round, stats)

    def _delta_records(
        self, result: Round, stats: DeltaStats, store: list[Any] | None, *, hand_out: bool
    ) -> Iterator[tuple[list[int], list[int], list[TensorDelta]]]:
        """A delta round's stream, each record applied into ``store`` (None: none) and, with ``hand_out``, handed
        out as it is (:meth:`~refit_app.protocol.delta.receive.ConsumerDelta.receive_delta`)."""
        manifest = self.manifest
        assert manifest is not None
        return self._delta.receive_delta(
            manifest.tensors,
            self.group.group,
            PRODUCER_RANK,
            stats,
            device=self.device,
            targets=store,
            chunk_bytes=delta_chunk_bytes(manifest.buffer_size_bytes),
            on_chunk=self._stream_counter(result),
            hand_out=hand_out,
        )

    def _mirror_batches(self, result: Round, deliver: _Delivery) -> Iterator[Batch]:
        """A dense round into the session's copy: each chunk's tensors as views of it."""
        manifest = self.manifest
        image = self._delta.image
        assert manifest is not None and image is not None
        num_buffers = self.num_buffers or get_num_buffers()
        for chunk in self._delta.receive_dense(
            self._chunks, self.group.group, PRODUCER_RANK, num_buffers=num_buffers, device=self.device
        ):
            result.num_chunks += 1
            if self.on_chunk is not None:
                self.on_chunk(chunk.nbytes, chunk.count)
            yield deliver([(manifest.tensors[i].name, image.view(i)) for i in range(chunk.first, chunk.stop)])

    def _target_batches(
        self, result: Round, targets: Mapping[str, torch.Tensor], deliver: _Delivery
    ) -> Iterator[Batch]:
        """A dense round into ``targets``: received into rotating buffers, each tensor copied into its target."""
        manifest = self.manifest
        assert manifest is not None
        for batch in packed_broadcast_consumer_batches(
            ((t.name, (t.shape, t.dtype)) for t in manifest.tensors),
            self.group.group,
            PRODUCER_RANK,
            num_buffers=self.num_buffers,
            buffer_size_bytes=manifest.buffer_size_bytes,
            use_legacy_packing=manifest.use_legacy_packing,
            on_chunk=ChunkCounter(result, self.on_chunk),
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
                logger.info(
                    "rank %d: round %d brings a fresh manifest (%s)",
                    self.group.rank,
                    self.rounds + 1,
                    "; ".join(changes) or "settings or files changed",
                )
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
            rounds=self.planned_rounds,
            prepare=prepare,
        )
        self._verifier = Verifier(self.manifest.tensors, self.manifest.checksum_algorithm) if self.verify else None
        self._delta.reset(self.manifest.tensors)
        self._new_plan()

    def _iterate(
        self,
        stream: Iterator[tuple[str, Any]],
        result: Round,
        ending: _Ending,
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
        self._end_round(result, started, ending)

    def _end_round(self, result: Round, started: float, ending: _Ending) -> Round:
        """The round's trailers, verdict and base, ``on_round_end``, then the all-ranks "done"."""
        k = result.round
        targets = ending.targets
        manifest = self.manifest
        assert manifest is not None
        kept = not (self._plain and self._delta.mirror)
        fingerprint = None
        try:
            if manifest.checksums:
                result.checksums = recv_checksums(self.group, len(manifest.tensors))
            result.seconds = time.perf_counter() - started
            result.extra = self._extra(None, ending.extra_len)
            if self._verifier is not None:
                result.facts.update(self._verifier.verdict(result.checksums))
                result.verified = True
            if self._delta_on and kept:
                # Taken before on_round_end: the base claimed next round is what the round wrote, so a write
                # there (or later) is caught by the next round's check, not recorded as the base.
                checksums, algorithm = result.checksums, manifest.checksum_algorithm
                landed, self._landed = self._landed, None
                if checksums is None and landed is not None and len(landed) == len(manifest.tensors):
                    checksums = [landed[m.name] for m in manifest.tensors]
                    algorithm = default_algorithm()
                fingerprint = self._delta.fingerprint(targets, checksums=checksums, algorithm=algorithm)
            if ending.on_round_end is not None:
                result.facts.update(ending.on_round_end(result) or {})
        except BaseException as e:
            self._fail(k, e)
        finish(self.group, None)
        self.rounds += 1
        self._delta.completed(k, targets, kept=kept, fingerprint=fingerprint)
        self.last_round = result
        return result

    def _report_failure(self, k: int, exc: BaseException) -> None:
        finish(self.group, round_error(k, exc))

    def _fail(self, k: int, exc: BaseException) -> None:
        self._delta.failed()
        self._report_failure(k, exc)
        raise with_round(k, exc) from exc

    def close(self) -> None:
        """Nothing to tell the producer: it ends the session. Marks this side closed, and discards a round staged
        and not applied: once its session is over, another one may have written newer weights into the targets."""
        if self._staged is not None:
            self._staged.discard()
        self.closed = True


class _Header(NamedTuple):
    """A round header's words after the checks: its flags, the extra payload's length, a delta round's base."""

    flags: int
    extra_len: int
    base: int


class _Ending(NamedTuple):
    """What ends a round once its data is in: the extra payload's length, the caller's ``on_round_end``, the
    targets the round wrote into (its base for the next one)."""

    extra_len: int
    on_round_end: Callable[[Round], dict[str, Any] | None] | None
    targets: Mapping[str, torch.Tensor] | None


class _Delivery:
    """Shows each batch, as it is final, to the base's hashes (``landed``), ``post_unpack_func`` and the verifier,
    in that order: the tensors are hashed before the callback may write into them, so that what it writes is not
    taken as what the round left."""

    def __init__(
        self,
        landed: dict[str, int] | None,
        post_unpack_func: Callable[[Batch], None] | None,
        verifier: Verifier | None,
    ) -> None:
        self.landed = landed
        self.post_unpack_func = post_unpack_func
        self.verifier = verifier
        self._function = checksum_function(default_algorithm()) if landed is not None else None

    def __call__(self, batch: Batch, final: Batch | None = None, landing: Batch | None = None) -> Batch:
        """``batch`` to the callback; ``final`` (default: ``batch``'s tensors) to the verifier. ``landing``
        (default: ``final``): the tensors now final, hashed first."""
        if self.landed is not None:
            assert self._function is not None
            for name, t in landing if landing is not None else (final if final is not None else batch):
                if not isinstance(t, TensorDelta):
                    self.landed[name] = self._function(host_bytes(t))
        if self.post_unpack_func is not None and batch:
            self.post_unpack_func(batch)
        if self.verifier is not None:
            self.verifier.consume(
                final if final is not None else [(n, t) for n, t in batch if not isinstance(t, TensorDelta)]
            )
        return batch


def _flatten(batches: Iterator[Batch]) -> Iterator[tuple[str, Any]]:
    for batch in batches:
        yield from batch
