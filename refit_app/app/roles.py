"""What each rank does in a run: the producer sends its source round after round, a consumer feeds its sink.

One run, on every rank, over one group and one session (:mod:`refit_app.protocol.session`)::

    connect (rendezvous, checks)  ->  session (who verifies? who wants a model probe?)
    ->  round 1: manifest handshake, data, checksums, probe, all ranks agree it worked
    ->  round 2..N: the source changes (a training step), data, checksums, probe, all agree
    ->  end of session; the sink publishes (a checkpoint) and metrics are written

Every failure on any rank ends every rank with that rank's reason and the round, within ``group.timeout_s``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from typing import Any

from refit_app.app.config import RunSettings
from refit_app.app.devices import use_local_gpu
from refit_app.app.metrics import PeakMemory, RoundMetrics, RunMetrics, round_times
from refit_app.app.progress import Progress
from refit_app.common.errors import ConfigError, RefitError
from refit_app.common.sizes import gb_per_s
from refit_app.models.sinks import DELTAS, MIRROR, MIRRORED_DELTAS, TARGETS, Sink, make_sink
from refit_app.models.sources import Source, make_source
from refit_app.packed_tensor import get_target_packed_tensor_size
from refit_app.protocol.elastic import ElasticConsumerSession, ElasticProducerSession
from refit_app.protocol.manifest import Manifest
from refit_app.protocol.session import (
    ConsumerSession,
    ConsumerSessionLike,
    ProducerSession,
    ProducerSessionLike,
    Round,
    SessionLike,
)
from refit_app.transport.elastic import BACKEND as ELASTIC_BACKEND
from refit_app.transport.groups import RefitGroup, connect

logger = logging.getLogger(__name__)


class _RoundProgress:
    """The progress display of the round in flight, started at its first chunk (when its manifest is known)."""

    def __init__(self, label: str, enabled: bool, rounds: int | None) -> None:
        self._label = label
        self._enabled = enabled
        self._rounds = rounds
        self._current: Progress | None = None
        self.session: SessionLike | None = None

    def on_chunk(self, nbytes: int, ntensors: int) -> None:
        if not self._enabled or self.session is None:
            return
        if self._current is None:
            manifest, k = self.session.manifest, self.session.rounds + 1
            of = f"/{self._rounds}" if self._rounds else ""
            label = self._label if self._rounds == 1 else f"{self._label} round {k}{of}"
            self._current = Progress(manifest.total_bytes, self.session.num_chunks, label, stream=sys.stderr)
        self._current.update(nbytes)

    def stop(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None


def _round_metrics(r: Round, memory: PeakMemory, producer: bool) -> RoundMetrics:
    return RoundMetrics(
        round=r.round,
        seconds=r.seconds,
        gb_per_s=r.gb_per_s,
        bytes=r.bytes,
        verified=r.verified,
        manifest_sent=r.manifest_sent,
        handshake_seconds=r.handshake_seconds,
        peak_extra_bytes=memory.peak_extra_bytes,
        peak_rss_bytes=memory.peak_rss,
        loss=r.facts.get("loss"),
        model_check=r.facts.get("model_check"),
        engine_load=r.facts.get("engine_load"),
        staged=r.facts.get("staged"),
        wire_bytes=r.wire_bytes,
        delta=r.delta,
        base_round=r.base_round or None,
        plain=r.plain,
        changed_elements=r.changed_elements,
        changed_fraction=r.changed_fraction,
        encodings=r.encodings or None,
        diff_seconds=r.delta_seconds if r.delta and producer else None,
        apply_seconds=r.delta_seconds if r.delta and not producer else None,
        members=r.members,
    )


def _run_metrics(
    s: RunSettings,
    backend: str,
    manifest: Manifest | None,
    rounds: list[Round],
    memories: list[PeakMemory],
    handshake_s: float,
) -> RunMetrics:
    """The figures both sides report; the top level describes the whole run (see :class:`RunMetrics`)."""
    total_bytes = sum(r.bytes for r in rounds)
    seconds = sum(r.seconds for r in rounds)
    cuda = [m.cuda_peak_bytes for m in memories if m.cuda_peak_bytes is not None]
    cuda_extra = [m.cuda_peak_extra_bytes for m in memories if m.cuda_peak_extra_bytes is not None]
    producer = s.group.is_producer
    return RunMetrics(
        role="producer" if producer else "consumer",
        rank=s.group.rank,
        bytes=total_bytes,
        num_tensors=None if manifest is None else len(manifest.tensors),
        num_chunks=rounds[-1].num_chunks if rounds else None,
        num_broadcasts=rounds[-1].num_broadcasts if rounds else None,
        gb_per_s=gb_per_s(total_bytes, seconds),
        handshake_seconds=handshake_s,
        buffer_size_bytes=None if manifest is None else manifest.buffer_size_bytes,
        num_buffers=s.refit.num_buffers,
        use_legacy_packing=None if manifest is None else manifest.use_legacy_packing,
        backend=backend,
        world_size=s.group.world_size,
        peak_rss_bytes=max((m.peak_rss for m in memories if m.peak_rss is not None), default=None),
        peak_extra_bytes=max((m.peak_extra_bytes for m in memories if m.peak_extra_bytes is not None), default=None),
        cuda_peak_bytes=max(cuda) if cuda else None,
        cuda_peak_extra_bytes=max(cuda_extra) if cuda_extra else None,
        source=None if manifest is None else manifest.source,
        **round_times([r.seconds for r in rounds]),
        rounds=[_round_metrics(r, m, producer) for r, m in zip(rounds, memories)],
        wire_bytes=sum(r.wire_bytes for r in rounds),
    )


def _companion_files(source: Source) -> dict[str, str | bytes]:
    """The small files that belong with the weights (a model's config.json, tokenizer files), sent with the
    manifest; read once per run."""
    files = getattr(source, "companion_files", None)
    return {} if files is None else files()


class ProducerRounds:
    """The producer's rounds of one run: :meth:`send` sends round ``k`` (the source advanced to it first),
    :meth:`finish` ends the session and returns this rank's metrics. :func:`run_producer` loops over it;
    ``python -m refit_app.bench --app`` times its rounds against a bare :class:`ProducerSession`'s on the same
    group, so whatever the application adds to a round shows up there. ``rg`` is the connected group, or None with
    ``refit.on_consumer_loss=continue``, where the session forms a group for each generation of members."""

    def __init__(self, s: RunSettings, rg: RefitGroup | None, source: Source, *, show_progress: bool = True) -> None:
        self._s, self._source = s, source
        self._progress = _RoundProgress("producer", show_progress, s.refit.rounds)
        self._advance: Callable[[int], dict] | None = getattr(source, "advance", None)
        self._probe: Callable[[int], dict] | None = getattr(source, "probe", None)
        target = s.refit.buffer_size_bytes if s.refit.buffer_size_bytes is not None else get_target_packed_tensor_size()
        options: dict[str, Any] = dict(
            buffer_size_bytes=target,
            num_buffers=s.refit.num_buffers,
            use_legacy_packing=bool(s.refit.use_legacy_packing),
            on_chunk=self._progress.on_chunk,
            delta=s.refit.delta,
            rounds=s.refit.rounds,
        )
        if rg is None:
            self.session: ProducerSessionLike = ElasticProducerSession(s.group, **options)
            self.backend = ELASTIC_BACKEND
        else:
            self.session, self.backend = ProducerSession(rg, **options), rg.backend
        self._progress.session = self.session
        self._extra_for = _probe_encoder(self._probe, self.session.probe_tokens, source)
        self._files = _companion_files(source)
        self.rounds: list[Round] = []
        self._memories: list[PeakMemory] = []

    def send(self, k: int) -> Round:
        """Round ``k`` (1, 2, ...): the source changes as a training step would (from round 2), then goes out."""
        source, planned = self._source, self._s.refit.rounds
        facts = self._advance(k) if self._advance is not None and k > 1 else {}
        metas = source.manifest_tensors()
        if self._s.refit.elastic:
            # A round a consumer was lost in goes again, read afresh, with the probe its generation asks for.
            tensors: Any = source.tensors
            extra: Any = lambda: _probe_encoder(self._probe, self.session.probe_tokens, source)()  # noqa: E731
        else:
            tensors, extra = source.tensors(), self._extra_for()
        with PeakMemory() as memory:
            try:
                r = self.session.send(
                    tensors,
                    metas=metas,
                    metadata=source.metadata(),
                    files=self._files,
                    source=source.describe(),
                    extra=extra,
                )
            finally:
                self._progress.stop()
        r.facts.update(facts)
        self.rounds.append(r)
        self._memories.append(memory)
        if planned is not None and planned > 1:
            logger.info(
                "round %d/%d: %.3f s%s%s",
                k,
                planned,
                r.seconds,
                f", loss {facts['loss']:.4f}" if "loss" in facts else "",
                "" if r.members is None else f", consumers {', '.join(map(str, r.members))}",
            )
        return r

    def finish(self) -> dict[str, Any]:
        """End the session on every rank; this rank's metrics."""
        self.session.close()
        rounds = self.rounds
        metrics = _run_metrics(
            self._s, self.backend, self.session.manifest, rounds, self._memories, rounds[0].handshake_seconds
        )
        metrics.checksums = self.session.checksums_needed
        metrics.delta = self._s.refit.delta
        return metrics.to_json()


def run_producer(s: RunSettings, *, show_progress: bool = True) -> dict[str, Any]:
    """Send the configured source to every consumer, ``refit.rounds`` times; returns this rank's metrics."""
    use_local_gpu(s.group.local_rank)  # before the source: a model on device=cuda goes to this rank's GPU
    source = make_source(s.source.target, s.source.params)
    with contextlib.ExitStack() as stack:
        rg = None if s.refit.elastic else stack.enter_context(connect(s.group))
        rounds = ProducerRounds(s, rg, source, show_progress=show_progress)
        if rg is None:
            stack.enter_context(rounds.session)  # on an error, every member learns that the session ended
        for k in range(1, s.refit.rounds + 1):
            rounds.send(k)
        return rounds.finish()


def _probe_encoder(probe: Callable[[int], dict] | None, probe_tokens: int, source: Source) -> Callable[[], bytes]:
    """What the producer sends after each round's data: its model's probe, where a consumer asked for one."""
    if probe_tokens <= 0:
        return lambda: b""
    if probe is None:
        raise ConfigError(
            f"a consumer checks its model against the producer's, but the producer's source ({source.describe()}) "
            "has no model; use source=model"
        )
    from refit_app.models.probe import encode_probe

    return lambda: encode_probe(probe(probe_tokens))


class ConsumerRounds:
    """A consumer's rounds of one run on a connected group: :meth:`receive` feeds one round into the sink (None
    once the producer has ended the session), :meth:`finish` publishes what the sink holds and returns this rank's
    metrics. :func:`run_consumer` loops over it; ``python -m refit_app.bench --app`` times its rounds."""

    def __init__(self, s: RunSettings, rg: RefitGroup | None, sink: Sink, *, show_progress: bool = True) -> None:
        self._s, self._sink = s, sink
        self.verify = bool(getattr(sink, "verifies", False))
        probe_tokens = int(getattr(sink, "probe_tokens", 0))
        self._progress = _RoundProgress(f"consumer {s.group.rank}", show_progress, None)
        storage = getattr(sink, "delta_storage", None)
        self._staged = bool(getattr(sink, "stages", False))
        """The sink stages each round itself (``receive_staged(session)``: sink=vllm sink.staged=true)."""
        options: dict[str, Any] = dict(
            buffer_size_bytes=s.refit.buffer_size_bytes,
            use_legacy_packing=s.refit.use_legacy_packing,
            num_buffers=s.refit.num_buffers,
            verify=self.verify,
            probe_tokens=probe_tokens,
            on_chunk=self._progress.on_chunk,
            mirror=storage in (MIRROR, MIRRORED_DELTAS) and not self._staged,
            accept_deltas=storage in (DELTAS, MIRRORED_DELTAS),
            rounds=s.refit.rounds,
        )
        if rg is None:  # refit.on_consumer_loss=continue (see ProducerRounds)
            self.session: ConsumerSessionLike = ElasticConsumerSession(s.group, **options)
            self.backend = ELASTIC_BACKEND
        else:
            self.session, self.backend = ConsumerSession(rg, **options), rg.backend
        self._progress.session = self.session
        self._on_round_end = _round_end(sink, probe_tokens)
        self._targets = sink.targets if storage == TARGETS else None
        self.rounds: list[Round] = []
        self._memories: list[PeakMemory] = []

    def receive(self) -> Round | None:
        """The next round, into the sink; None once the producer has ended the session."""
        sink = self._sink
        with PeakMemory() as memory:
            try:
                if self._staged:
                    r = sink.receive_staged(self.session)
                else:
                    r = self.session.receive(
                        sink.consume, on_manifest=sink.begin, on_round_end=self._on_round_end, targets=self._targets
                    )
            finally:
                self._progress.stop()
        if r is not None:
            self.rounds.append(r)
            self._memories.append(memory)
        return r

    def finish(self) -> dict[str, Any]:
        """After the session's end: the sink publishes (a checkpoint); this rank's metrics."""
        published = self._sink.close()
        rounds = self.rounds
        handshake_s = rounds[0].handshake_seconds if rounds else 0.0
        metrics = _run_metrics(self._s, self.backend, self.session.manifest, rounds, self._memories, handshake_s)
        metrics.sink = self._s.sink_name
        if self.verify:
            # Nothing received (an elastic consumer that joined after the last round) is nothing verified.
            metrics.verified = all(r.verified for r in rounds) if rounds else None
            metrics.verified_tensors = rounds[-1].facts.get("verified_tensors") if rounds else None
        metrics.saved_to = published.get("saved_to")
        metrics.saved_files = published.get("saved_files")
        return metrics.to_json()


def run_consumer(s: RunSettings, *, show_progress: bool = True) -> dict[str, Any]:
    """Receive every round of the producer's weights into the configured sink; returns this rank's metrics."""
    use_local_gpu(s.group.local_rank)  # before the sink: a model on device=cuda goes to this rank's GPU
    die_in_round = s.refit.die_in_round if s.group.rank == s.refit.die_rank else None
    sink = make_sink(s.sink.target, s.sink.params, corrupt_chunk=s.refit.corrupt_chunk, die_in_round=die_in_round)
    try:
        with contextlib.ExitStack() as stack:
            rg = None if s.refit.elastic else stack.enter_context(connect(s.group))
            rounds = ConsumerRounds(s, rg, sink, show_progress=show_progress)
            if rg is None:
                stack.enter_context(rounds.session)
            while rounds.receive() is not None:
                pass
            return rounds.finish()
    except BaseException:
        sink.abort()
        raise


def _round_end(sink: Sink, probe_tokens: int) -> Callable[[Round], dict[str, Any]]:
    """The consumer's end of a round: the sink completes it, and a model sink compares itself to the producer's."""

    def end(r: Round) -> dict[str, Any]:
        facts = dict(sink.finish(r.checksums) or {})
        if probe_tokens:
            from refit_app.models.probe import decode_probe

            if not r.extra:
                raise RefitError("the producer sent no model probe for this round")
            facts["model_check"] = sink.check(decode_probe(r.extra), probe_tokens)
        return facts

    return end


def run_role(s: RunSettings) -> dict[str, Any]:
    """Run this process's role (the producer or a consumer; of a sharded refit, one of its ranks) and return its
    metrics."""
    if s.sharded is not None:
        from refit_app.app.sharded_run import run_sharded

        return run_sharded(s)
    return (run_producer if s.role == "producer" else run_consumer)(s)
