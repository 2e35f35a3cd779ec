"""One rank of a sharded refit that goes on without a lost consumer (``refit.on_consumer_loss=continue``;
docs/sharded.md): the layouts of :mod:`refit_app.app.sharded` (each producer its rows, each consumer
:func:`~refit_app.app.sharded.tp_rule`'s slices, the replicas chained) over an
:class:`~refit_app.protocol.sharded_elastic.ElasticShardedSession`, which forms a group per generation of the ranks
there and makes the plan anew for each.

The producers send ``refit.rounds`` rounds and end the session; a consumer receives until they do, from the round it
joined at (a restarted one: the next round boundary, densely), and with ``sink=verify`` compares every slice of every
round it received bit for bit with its own copy of the synthetic source at that round. A consumer lost mid-round is
left out and the round sent again to the others; a producer lost ends every rank in one line. With ``refit.delta=on``
or ``auto`` every generation's first round is dense (the cut round sent again, the round a consumer joins at) and
the later ones are delta rounds (``on``) or of the kind every rank chooses (``auto``).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from refit_app.app.config import RunSettings
from refit_app.app.metrics import PeakMemory, RoundMetrics
from refit_app.app.sharded import (
    AGREE_KEYS,
    FaultyGroup,
    begin_model,
    check_slices,
    check_sums,
    consumer_verifies,
    delta_figures,
    dense_bytes,
    expected_tensors,
    is_trainer,
    probe_limit,
    probe_too_long,
    rank_metrics,
    round_metrics,
    slices_manifest,
    slices_path,
    source_shards,
    tp_rule,
    trainer_mesh,
    trainer_sums,
)
from refit_app.common.errors import ConfigError, PeerError, SinkError, one_line
from refit_app.core.reshard.plan import Need, TensorSpec
from refit_app.models.sinks import SaveSink, make_sink
from refit_app.models.sources import make_source
from refit_app.packed_tensor import get_target_packed_tensor_size
from refit_app.protocol.defaults import agreed_delta
from refit_app.protocol.sharded import Expected, allocate, tp_needs
from refit_app.protocol.sharded_elastic import ElasticShardedSession
from refit_app.transport.backends import masked_gloo_error

logger = logging.getLogger(__name__)


def _fault_wire(s: RunSettings) -> Any:
    """``refit.debug.die_in_round`` on ``refit.debug.die_rank``: the transfers of that round go over a
    :class:`~refit_app.app.sharded.FaultyGroup` that SIGKILLs this rank once its first send or receive completed."""
    if s.refit.die_in_round is None or s.rank != s.refit.die_rank:
        return None
    die = s.refit.die_in_round

    def wire(pg: Any, k: int) -> Any:
        if k != die:
            return pg
        faulty = FaultyGroup(pg, corrupt_chunk=None, die_in_round=die)
        faulty.start_round(k)
        return faulty

    return wire


def _figures(
    session: ElasticShardedSession,
    rank: int,
    n: int,
    seconds: float,
    moved: int,
    memory: PeakMemory,
    verify: bool,
    handshake_s: float,
    loss: float | None,
    check: dict[str, Any] | None,
) -> RoundMetrics:
    """Round ``n``'s metrics, from the generation that completed it. A function of its own: a reference to the
    generation left in the rounds' loop would keep its group's sockets open once it is dropped, and a member blocked
    on this rank would wait out its deadline instead of failing at once."""
    gen = session.generation
    assert gen is not None
    plan = gen.session.plan
    brought = dense_bytes(plan, gen.ranks.index(rank), session.producer) if plan.delta else moved
    r = round_metrics(n, seconds, brought, moved, memory, verify, handshake_s, loss, check)
    if plan.delta:
        state = gen.session.deltas if session.producer else gen.session.bases
        r = delta_figures(r, state, gen.session.auto, first=gen.first)
    return replace(r, members=session.members)


def _trainer_extra(
    source: Any,
    limit: int | None,
    specs: list[TensorSpec],
    shards: dict[str, Any],
    expects: list[Expected],
    rank: int,
    m: int,
) -> Any:
    """What a trainer's producer sends with each round (:meth:`ElasticShardedSession.send`'s ``extra``), as the
    consumers of the round's generation asked: its keyed sums of its parts of every slice where one verifies (a
    trainer's consumers cannot recompute its weights: each compares its slices' sums with the producers'), and the
    trainer's probe of the most positions one asked for (sink=model's ``probe_tokens``): every producer runs it
    (FSDP2 gathers each layer), producer 0's goes, of at most ``limit`` positions (the model's: a consumer that asks
    for more leaves once it knows the model). Nothing where every consumer discards."""

    def extra(asks: dict[int, dict[str, Any]]) -> dict[str, Any]:
        tokens = max((int(a.get("probe_tokens") or 0) for a in asks.values()), default=0)
        tokens = min(tokens, limit) if limit is not None else tokens
        with _trainer_group(rank):
            probe = source.probe(tokens) if tokens else None
        sums = trainer_sums(specs, shards, expects, rank, m) if any(a.get("sums") for a in asks.values()) else None
        return {"sums": sums, "probe": probe if rank == 0 else None, "probe_tokens": tokens}

    return extra


@contextmanager
def _trainer_group(rank: int) -> Iterator[None]:
    """What runs over the trainer's own process group (its step, its probe): a failure there is a lost producer,
    said in one line (the run cannot go on without its shards) rather than as gloo's text."""
    try:
        yield
    except (RuntimeError, dist.DistError, ValueError) as e:
        lost = masked_gloo_error(e) if isinstance(e, ValueError) else e
        if lost is None:
            raise
        raise PeerError(
            f"producer {rank}: the trainer's process group lost a producer ({one_line(lost)}); a sharded refit "
            "cannot go on without one (its shards exist nowhere else)"
        ) from None


def _ask(verify: bool, model: Any, saves: bool) -> dict[str, Any]:
    """What a consumer asks of a trainer's producers in every generation it is in: their keyed sums where it
    verifies, the trainer's probe of ``sink.probe_tokens`` positions where it loads a model that checks one; and
    what it tells the other consumers: whether it saves its slices (sink=save: who saves which at the end, and they
    finish together: :meth:`ElasticShardedSession.finish`)."""
    return {
        "sums": verify,
        "probe_tokens": model.probe_tokens if model is not None else 0,
        "saves": saves,
        "finish": saves,
    }


def _save_last_round(
    saver: SaveSink,
    session: ElasticShardedSession,
    manifest: Any,
    slices: dict[str, Any],
    rank: int,
    k: int,
    m: int,
) -> dict[str, Any]:
    """sink=save once the producers ended the session: of the last generation's consumers that save, the one of
    the lowest replica for each tensor-parallel rank writes its slices of the last round (``manifest(round)``) and
    seals them; the others save nothing. The savers then tell each other whether they sealed
    (:meth:`ElasticShardedSession.finish`), and publish only where every one did, as a sharded save does without a
    loss. Where no saving consumer of some tensor-parallel rank is left, none publishes (the last round's slices of
    that rank exist nowhere on disk), and each says so in one line."""
    where = saver.path
    if rank not in session.members:  # no generation at the end: it joined after the last round, or was let go
        saver.abort()
        if session.rounds == 0:
            logger.info("consumer rank %d received no round: it saves nothing", rank)
            return {}
        raise SinkError(
            f"consumer rank {rank}: nothing saved to {where}: it was not in the session's last generation (its last "
            f"round was {session.rounds})"
        )
    savers: dict[int, int] = {}
    for r in sorted(r for r, ask in session.asks.items() if r >= k and ask.get("saves")):
        savers.setdefault((r - k) % m, r)
    missing = [t for t in range(m) if t not in savers]
    tp = (rank - k) % m
    mine = not missing and savers[tp] == rank
    sealed: dict[str, Any] = {"sealed": None}  # this rank's word to the other savers: it saves nothing
    if mine:
        try:
            saver.begin(manifest(session.rounds))
            saver.consume([(name, held.tensor) for name, held in slices.items()])
            saver.finish(None)
            saver.prepare()
            sealed = {"sealed": True}
        except SinkError as e:
            sealed = {"sealed": False, "error": one_line(e)}
    try:
        said = session.finish(sealed)  # every saver's word, once each has written and sealed its slices
    except PeerError as e:
        saver.abort()
        why = one_line(e).removeprefix(f"rank {rank}: ")
        raise SinkError(f"consumer rank {rank}: nothing saved to {where.parent}: {why}") from None
    if missing:
        saver.abort()
        raise SinkError(
            f"consumer rank {rank}: nothing saved to {where.parent}: no consumer that saves "
            f"{', '.join(f'tp{t}' for t in missing)} was left at the end of the session (round {session.rounds}), "
            "so none publishes; every tp<t> there keeps its previous save"
        )
    if not mine:
        saver.abort()
        logger.info("consumer rank %d saves nothing: rank %d saves the same slices (tp%d)", rank, savers[tp], tp)
        return {}
    unsealed = sorted(r for r in savers.values() if said.get(r, {}).get("sealed") is not True)
    if unsealed:
        saver.abort()
        why = said.get(unsealed[0], {}).get("error") or "it said nothing"
        raise SinkError(
            f"consumer rank {rank}: nothing saved to {where.parent}: rank {unsealed[0]} could not seal its slices "
            f"({why}), so none publishes; every tp<t> there keeps its previous save"
        )
    return saver.close()


def run_elastic(s: RunSettings) -> dict[str, Any]:
    """This rank's part of an elastic sharded refit; its metrics (each round with the consumers that took part)."""
    layout = s.sharded
    assert layout is not None
    rank, k, m = s.rank, layout.producers, layout.tp_size
    producer = rank < k
    chains = [[k + r * m + c for r in range(layout.replicas)] for c in range(m)] if layout.replicas > 1 else []
    # A producer's source; a consumer's copy of a synthetic one (what it verifies against). A consumer of a trainer
    # has none (its settings name none it could recompute): it takes the producers' tensors and checks keyed sums.
    recomputes = s.source is not None and (producer or s.source.kind == "synthetic")
    source = make_source(s.source.target, s.source.params) if recomputes else None
    trainer = producer and is_trainer(source)
    spec = replace(s.group, backend="gloo")
    options: dict[str, Any] = {
        "chains": chains,
        "num_buffers": s.refit.num_buffers,
        "wire": _fault_wire(s),
        "names": AGREE_KEYS,
    }
    # A consumer takes the producers' refit.delta, as in any refit.
    delta = agreed_delta(s.refit.delta) if producer else None
    model = None  # a consumer's sink=model
    verify = not producer and consumer_verifies(s)
    started = time.perf_counter()
    with ExitStack() as stack:
        if producer:
            assert source is not None

            def specs(store: Any) -> list[TensorSpec]:
                if trainer:  # the producers' FSDP2 mesh, on the run's store: it outlives every generation
                    source.fully_shard(stack.enter_context(trainer_mesh(store, s, k)))
                return source_shards(source, rank, k, trainer)[0]

            buffer = s.refit.buffer_size_bytes or get_target_packed_tensor_size()
            config = source.model_config() if trainer else None  # what a consumer's sink=model builds
            limit = probe_limit(config) if config is not None else None
            # What every consumer learns of the run with the generation it joins: sink=save's slice files carry
            # the run's id and producer 0's source; sink=model builds the trainer's config.
            context = {"run": secrets.token_hex(8), "source": source.describe()}
            session = ElasticShardedSession(
                spec,
                producers=k,
                specs=specs,
                buffer_size_bytes=buffer,
                delta=delta,
                extras=trainer,
                context={**context, "config": config} if config is not None else context,
                **options,
            )
        else:
            tp = (rank - k) % m

            def needs(expects: list[Expected]) -> list[Need]:
                return tp_needs(expects, rank, tp, m, tp_rule(expects))

            model = make_sink(s.sink.target, s.sink.params) if s.sink is not None and s.sink_name == "model" else None
            saves = s.sink_name == "save"
            # Null takes the producers' buffer size, as in any refit.
            session = ElasticShardedSession(
                spec,
                producers=k,
                needs=needs,
                expects=expected_tensors(source) if source is not None else None,
                buffer_size_bytes=s.refit.buffer_size_bytes,
                delta=delta,
                extras=source is None,
                ask=_ask(verify, model, saves),
                **options,
            )
        stack.enter_context(session)
        handshake_s = time.perf_counter() - started
        # The buffer size every rank agreed on (a consumer's null took the producers'); 0: joined after the last round.
        agreed_buffer = session.generation.session.plan.buffer_size_bytes if session.generation is not None else 0
        expects = expected_tensors(source) if producer else session.expects or []
        slices = {} if producer else allocate(expects, session.needs)
        if model is not None and session.generation is not None:
            stack.callback(model.close)
            if "config" not in session.context:
                raise ConfigError(
                    f"consumer rank {rank}: sink=model builds the producers' model, but they train none: give every "
                    "rank source=model (the producers with its source.path)"
                )
            limit = probe_limit(session.context["config"])
            if limit is not None and (model.probe_tokens or 0) > limit:
                raise ConfigError(probe_too_long(rank, model.probe_tokens, limit))
            begin_model(model, session.context["config"], agreed_buffer, slices)
        saver = None  # a consumer's sink=save: its slices of the last round, once the session ended
        if not producer and saves and session.generation is not None:

            def manifest(n: int) -> Any:
                return slices_manifest(
                    expects,
                    slices,
                    run=session.context.get("run", ""),
                    round_=n,
                    tp=(rank - k) % m,
                    tp_size=m,
                    buffer_size_bytes=agreed_buffer,
                    source=session.context.get("source", "the producers' source"),
                )

            saver = SaveSink(str(slices_path(s, layout)))
            stack.callback(saver.abort)  # a failed run removes its staging directory (after close(): nothing to do)
            saver.begin(manifest(0))  # an unusable path fails here, before any transfer
        done: list[RoundMetrics] = []
        checked = None
        saved: dict[str, Any] = {}
        n = 0
        while True:
            facts: dict[str, Any] = {}  # a trainer's step before the round (its loss)
            if producer:
                assert source is not None
                if n == s.refit.rounds:
                    break
                n += 1
                with _trainer_group(rank):
                    facts = (source.advance(n) or {}) if n > 1 else {}
                specs_now, shards = source_shards(source, rank, k, trainer)  # this round's values, views
                with PeakMemory() as memory:
                    t0 = time.perf_counter()
                    extra = _trainer_extra(source, limit, specs_now, shards, expects, rank, m) if trainer else None
                    moved = session.send(shards, extra=extra)
                    seconds = time.perf_counter() - t0
            else:
                with PeakMemory() as memory:
                    t0 = time.perf_counter()
                    got = session.receive(slices)
                    seconds = time.perf_counter() - t0
                if got is None:
                    if saver is not None:
                        saved = _save_last_round(saver, session, manifest, slices, rank, k, m)
                    break
                moved, n = got, session.rounds
                if verify and source is None:
                    parts = [session.extras[p]["sums"] for p in range(k)]
                    checked = check_sums(slices, parts, expects, (rank - k) % m, rank, n)
                elif verify:
                    source.advance(n)
                    checked = check_slices(slices, source.tensors(), rank, n)
                if model is not None:  # every tensor whole (group.tp_size=1), copied into the model
                    model.consume([(name, held.tensor) for name, held in slices.items()])
                    model.finish(None)
                    probe = session.extras[0]
                    if probe["probe"] is not None and model.probe_tokens:
                        facts["check"] = model.check(probe["probe"], probe["probe_tokens"])
            handshake = handshake_s if not done else 0.0
            done.append(
                _figures(
                    session,
                    rank,
                    n,
                    seconds,
                    moved,
                    memory,
                    verify,
                    handshake,
                    facts.get("loss"),
                    facts.get("check"),
                )
            )
    return rank_metrics(
        s,
        source.describe() if source is not None else "the producers' trainer",
        agreed_buffer,
        done,
        handshake_s,
        producer,
        verify,
        checked,
        len(expects),
        saved,
    )
