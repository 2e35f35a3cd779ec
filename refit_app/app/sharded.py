"""A sharded refit's ranks in the application (``group.producers``, ``group.tp_size``, ``group.replicas``; see
docs/sharded.md): ranks ``0..K-1`` are producers, each holding its rows of every tensor, ranks ``K..`` are ``D``
engine replicas of ``M`` tensor-parallel consumers, each needing only its slice; the plan and the transfer are
:mod:`refit_app.protocol.sharded`'s.

Every rank, as ``role=local`` starts it or as ``role=producer``/``consumer`` on its own host::

    connect (the application's rendezvous: token, run id, world size; gloo)
    ->  the ranks compare their layout settings and rounds (a consumer adopts producer 0's rounds and buffer size)
    ->  agree: the plan, the same on every rank, or one line naming the first difference on every rank
    ->  round 1..N: the source changes (from round 2), send / receive, a consumer checks its slices (sink=verify)
        or writes them into its staging directory (sink=save) or its model (sink=model: then the producers' probe)
    ->  sink=save: once every rank has finished every round, each saving consumer publishes its directory

The layouts, chosen here: producer ``p`` holds ``Shard(0)`` of every tensor over the K producers (``torch.chunk``'s
rows, uneven where they do not divide; a 0-dim tensor whole on every producer); a consumer needs, by
:func:`tp_rule`, the rows of a 2-D weight (column-parallel), the columns of ``o_proj``, ``down_proj`` and
``out_proj`` (row-parallel) and every other tensor (1-D: norms, biases) whole.

Two kinds of source. ``source=synthetic``: each producer takes its rows of the whole synthetic model, and a consumer
that verifies builds the same model and compares its slices with the whole tensors sliced. ``source=model`` (a
trainer, any source with ``fully_shard``): the K producers are an FSDP2 trainer, torch's default process group over
the K producers alone (on the run's signed store), ``fully_shard`` over a mesh of all of them, an AdamW step between
rounds; each sends its DTensors' local shards as their placements say. A consumer cannot recompute a trainer's
weights: it takes the tensor list from producer 0, and with ``sink=verify`` compares, every round, the keyed sum of
each slice it holds (:mod:`refit_app.core.reshard.keyed_sum`) with the sum of the producers' sums over their parts
of the same box, a check that depends on neither the plan nor the transfer.

``refit.delta=on``: the plan is agreed with delta rounds: the first round dense, every later one per-pair delta
records (:mod:`refit_app.core.reshard.delta`), each producer comparing only its own shards with what it sent last
round, a replica's relay doing the same for the next replica; the checks above run every round as in dense rounds.
``refit.delta=auto``: every rank chooses each round's kind alike in the collective that starts the round
(:class:`~refit_app.protocol.delta.auto.AgreedAuto`): a delta round, a dense one into the producers' snapshots, or
a plain one sent as with ``off``; each round's metrics say which and why (``auto_reason``).

``sink=save``: each consumer of replica 0 writes its slices into ``sink.path/tp<t>`` through the one-producer
``sink=save`` (:class:`~refit_app.models.sinks.SaveSink`: a staging directory every round overwrites, swapped in
whole after the last), with their boxes in the file's metadata (:mod:`refit_app.checkpoint.slices`); the other
replicas hold the same bytes and write nothing. It publishes only once every rank has finished every round.

``sink=model`` (``group.tp_size=1``, a trainer's producers): each consumer builds the model from producer 0's
config.json and copies every round's tensors, received whole, into it; its ``sink.verify`` checks the keyed sums as
sink=verify does, and with ``sink.probe_tokens`` the producers run the fixed probe through the trainer's model
(together: FSDP2 gathers each layer) and every consumer compares its model's logits and greedy tokens with it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from refit_app.app.config import ENGINE_SINKS, RunSettings, ShardedSpec
from refit_app.app.metrics import PeakMemory, RoundMetrics, RunMetrics, round_times
from refit_app.checkpoint.slices import slices_metadata
from refit_app.common.errors import ConfigError, HandshakeError, VerificationError
from refit_app.common.sizes import gb_per_s
from refit_app.core.meta import TensorMeta
from refit_app.core.reshard.delta import ConsumerBases, ProducerDeltas
from refit_app.core.reshard.keyed_sum import keyed_sum
from refit_app.core.reshard.plan import (
    Layout,
    Placement,
    Replicate,
    Shard,
    TensorSpec,
    held_boxes,
    shard_box,
    volume,
)
from refit_app.core.reshard.transfer import Held
from refit_app.models.sinks import SaveSink, make_sink
from refit_app.models.sources import make_source
from refit_app.packed_tensor import get_target_packed_tensor_size
from refit_app.protocol.delta.auto import DELTA, KEEP, PLAIN, AgreedAuto
from refit_app.protocol.manifest import Manifest
from refit_app.protocol.sharded import (
    COLUMN,
    ROW,
    WHOLE,
    Declared,
    Expected,
    ShardedPlan,
    agree,
    allocate,
    choose_round,
    from_tensors,
    receive,
    send,
    tp_needs,
)
from refit_app.transport.groups import RefitGroup

logger = logging.getLogger(__name__)

AGREE_KEYS = {
    "buffer_size_bytes": "refit.buffer_size_bytes",
    "delta": "refit.delta",
    "chains": "group.tp_size and group.replicas",
}
"""The settings the ranks' plan agreement compares, by the configuration keys a user sets them with (its messages
name these)."""
ROW_PARALLEL = ("o_proj", "down_proj", "out_proj")
"""Names of the weights a tensor-parallel engine splits by columns (vLLM's ``RowParallelLinear``)."""


def tp_rule(expects: Iterable[Expected]) -> Callable[[str], Placement]:
    """Which part of each tensor a tensor-parallel consumer needs: 1-dim and 0-dim tensors whole; a weight of a
    :data:`ROW_PARALLEL` layer its columns; every other tensor its rows."""
    dims = {e.name: len(e.shape) for e in expects}

    def rule(name: str) -> Placement:
        if dims[name] < 2:
            return WHOLE
        return ROW if any(part in name for part in ROW_PARALLEL) else COLUMN

    return rule


def producer_shards(
    tensors: Iterable[tuple[str, torch.Tensor]], rank: int, producers: int
) -> tuple[list[TensorSpec], dict[str, Held]]:
    """Producer ``rank``'s rows of every tensor (views, no copy), ``Shard(0)`` over ``producers`` (a 0-dim tensor
    whole on each), as :func:`~refit_app.protocol.sharded.from_tensors` gives them: the specs and the shards."""
    declared = []
    for name, t in tensors:
        shape = tuple(t.shape)
        layout = Layout.one_dim(range(producers), Shard(0) if shape else Replicate())
        local = t[slice(*shard_box(shape, 0, producers, rank)[0])] if shape else t
        declared.append((name, Declared(local, shape, layout)))
    return from_tensors(declared, rank=rank)


def expected_tensors(source: Any) -> list[Expected]:
    """What every tensor of the source is: the consumer's engine expects it so."""
    return [Expected(m.name, str(m.dtype).removeprefix("torch."), tuple(m.shape)) for m in source.manifest_tensors()]


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def check_slices(slices: dict[str, Held], tensors: Iterable[tuple[str, torch.Tensor]], rank: int, k: int) -> int:
    """Compare every slice a consumer holds bit for bit with the source's whole tensor, sliced (the oracle); the
    tensors checked. Raises VerificationError naming the first slice that differs."""
    checked = 0
    for name, full in tensors:
        held = slices.get(name)
        if held is None:
            continue
        want = full[tuple(slice(a, b) for a, b in held.box)]
        if not torch.equal(_raw(held.tensor), _raw(want)):
            raise VerificationError(
                f"consumer rank {rank}: round {k}: tensor {name!r} {list(held.box)} differs from the source's"
            )
        checked += 1
    return checked


def is_trainer(source: Any) -> bool:
    """A source that shards itself over the producers (``fully_shard(mesh)``: ``source=model``), rather than one
    whose rows each producer takes and which a consumer can recompute (``source=synthetic``)."""
    return callable(getattr(source, "fully_shard", None))


def trainer_sums(
    specs: Iterable[TensorSpec], shards: dict[str, Held], expects: list[Expected], rank: int, tp_size: int
) -> dict[int, dict[str, int]]:
    """Producer ``rank``'s keyed sum of its part of every box each tensor-parallel rank needs (tp rank -> tensor ->
    sum). Where ranks hold the same box (``Replicate``) only the lowest counts it, so the producers' sums add up to
    the sum over the box."""
    rule = tp_rule(expects)
    counted = {}
    for spec in specs:
        boxes = held_boxes(spec)
        if not any(q < rank and box == boxes[rank] for q, box in boxes.items()):
            counted[spec.name] = spec.shape
    return {
        tp: {
            n.name: keyed_sum(shards[n.name], n.box, counted[n.name])
            for n in tp_needs(expects, rank, tp, tp_size, rule)
            if n.name in counted
        }
        for tp in range(tp_size)
    }


def check_sums(
    slices: dict[str, Held], parts: list[dict[int, dict[str, int]]], expects: list[Expected], tp: int, rank: int, k: int
) -> int:
    """Compare the keyed sum of every slice a consumer holds with the sum of the producers' ``parts`` of its box
    (``trainer_sums``, one per producer); the tensors checked. Raises VerificationError naming the first slice
    whose bytes are not the trainer's, where they lie."""
    shapes = {e.name: e.shape for e in expects}
    for name, held in slices.items():
        theirs = sum(p[tp].get(name, 0) for p in parts) % (1 << 64)
        mine = keyed_sum(held, held.box, shapes[name])
        if mine != theirs:
            raise VerificationError(
                f"consumer rank {rank}: round {k}: tensor {name!r} {list(held.box)} differs from the trainer's "
                f"(keyed sum {mine:#018x} here, {theirs:#018x} over the producers' shards)"
            )
    return len(slices)


@dataclass(frozen=True)
class Agreed:
    """What every rank runs with, from the settings exchange before the plan."""

    rounds: int
    buffer_size_bytes: int
    expects: list[Expected]
    """Producer 0's tensors: what a trainer's consumers expect (a synthetic source's consumers build their own)."""
    trainer: bool
    """The producers are a trainer (:func:`is_trainer`): consumers verify by keyed sums."""
    sums: bool
    """Some consumer verifies a trainer's rounds: every rank takes part in the keyed sums' gather each round."""
    source: str
    """Producer 0's source, described."""
    run: str
    """This run's id, from rank 0: every saved slice file of the run carries it."""
    saves: bool
    """Some consumer saves its slices (sink=save): every rank waits for every other at the end, before it publishes."""
    model_config: str | None
    """Producer 0's config.json text, where the producers are a trainer: what a consumer's sink=model builds."""
    probe_tokens: int
    """The most probe positions a consumer's sink=model asks for (0: none): the producers probe every round."""
    delta: bool
    """Producer 0's ``refit.delta`` is on or auto: every round after the first a delta round (``on``) or of the
    kind ``auto`` chooses (a consumer adopts it)."""
    engines: bool = False
    """The consumers are engine processes whose workers take the slices (sink=vllm,
    :mod:`refit_app.app.sharded_engine`)."""
    auto: bool = False
    """Producer 0's ``refit.delta=auto``: every rank chooses each round's kind together (the plan is agreed so)."""

    @property
    def delta_mode(self) -> bool | str:
        """What :func:`~refit_app.protocol.sharded.agree` takes as ``delta``."""
        return "auto" if self.auto else self.delta


@dataclass(frozen=True)
class RoundView:
    """One rank's state after a round's transfer, before a consumer's check (``run_sharded``'s ``after_round``, for
    tests and tools): a producer's source (a trainer's DTensors) or a consumer's slices."""

    round: int
    rank: int
    source: Any = None
    slices: dict[str, Held] | None = None


def agree_settings(pg: Any, s: RunSettings, layout: ShardedSpec, source: Any) -> Agreed:
    """The rounds and buffer size every rank runs with (a consumer's null adopts producer 0's) and what the
    producers' source is; a rank whose layout or rounds differ from rank 0's, or producers of two kinds of source,
    stop every rank with the same line."""
    producer = source is not None
    buffer = s.refit.buffer_size_bytes
    if buffer is None and producer:
        buffer = get_target_packed_tensor_size()
    mine = {"rank": s.rank, "layout": layout, "rounds": s.refit.rounds, "buffer": buffer}
    if producer:
        mine.update(
            expects=expected_tensors(source),
            trainer=is_trainer(source),
            source=source.describe(),
            delta=s.refit.delta,
            config=source.model_config() if is_trainer(source) else None,
        )
    else:
        mine.update(
            verify=consumer_verifies(s),
            saves=s.sink_name == "save",
            recomputes=s.source is not None,
            builds=s.sink_name in ("model", *ENGINE_SINKS),
            engine=s.sink_name in ENGINE_SINKS,
            sink=s.sink_name,
            probe=int(s.sink.params.get("probe_tokens") or 0)
            if s.sink_name in ("model", *ENGINE_SINKS) and s.sink
            else 0,
        )
    if s.rank == 0:
        mine.update(run=secrets.token_hex(8))
    every: list[Any] = [None] * s.group.world_size
    dist.all_gather_object(every, mine, group=pg)
    first = every[0]
    for other in every:
        if other["layout"] != first["layout"]:
            raise HandshakeError(
                f"ranks 0 and {other['rank']} disagree on the layout: {first['layout'].describe()} and "
                f"{other['layout'].describe()}"
            )
        if other["rounds"] not in (None, first["rounds"]):
            raise HandshakeError(
                f"ranks 0 and {other['rank']} disagree on refit.rounds: {first['rounds']} and {other['rounds']}"
            )
        if other.get("delta", first["delta"]) != first["delta"]:
            raise HandshakeError(
                f"producers 0 and {other['rank']} disagree on refit.delta: {first['delta']} and {other['delta']}"
            )
        if other.get("trainer", first["trainer"]) != first["trainer"]:
            kinds = {True: "a trainer (source=model)", False: "a source each takes its rows of"}
            raise HandshakeError(
                f"producers 0 and {other['rank']} read different sources: {kinds[first['trainer']]} and "
                f"{kinds[other['trainer']]}"
            )
        if other.get("config", first["config"]) != first["config"]:  # what a consumer's sink=model builds
            raise HandshakeError(
                f"producers 0 and {other['rank']} train models of different config.json: every producer of a trainer "
                "needs the same model (source.path)"
            )
    consumers = every[layout.producers :]
    for other in consumers:
        if other["builds"] and not first["trainer"]:
            raise HandshakeError(
                f"consumer rank {other['rank']} builds a model (sink={other['sink']}) but the producers read "
                f"{first['source']}: sink={other['sink']} needs the producers to train one (source=model)"
            )
        if other["engine"] != consumers[0]["engine"]:
            raise HandshakeError(
                f"consumer ranks {consumers[0]['rank']} and {other['rank']} differ: sink={consumers[0]['sink']} and "
                f"sink={other['sink']}; an engine's workers (sink=vllm) and other consumers cannot share a refit yet"
            )
    probes = [(e["probe"], e["rank"]) for e in consumers if e.get("probe")]
    if probes and first["config"] is not None:
        tokens, who = max(probes)
        limit = probe_limit(first["config"])
        if limit is not None and tokens > limit:
            raise HandshakeError(probe_too_long(who, tokens, limit))
    if not first["trainer"]:
        for other in every[layout.producers :]:
            if not other["recomputes"]:
                raise HandshakeError(
                    f"consumer rank {other['rank']} has no source=synthetic to build, but the producers read "
                    f"{first['source']}, which each consumer builds too: give it the producers' source settings"
                )
    return Agreed(
        rounds=first["rounds"],
        buffer_size_bytes=buffer if buffer is not None else first["buffer"],
        expects=first["expects"],
        trainer=first["trainer"],
        sums=first["trainer"] and any(e.get("verify") for e in every),
        source=first["source"],
        run=first["run"],
        saves=any(e.get("saves") for e in every),
        model_config=first["config"],
        probe_tokens=max((e.get("probe", 0) for e in every), default=0),
        delta=first["delta"] != "off",
        engines=bool(consumers) and consumers[0]["engine"],
        auto=first["delta"] == "auto",
    )


def probe_limit(config_json: str) -> int | None:
    """The most positions a probe of the trainer's model may have: its ``max_position_embeddings`` (None where the
    config gives none)."""
    limit = json.loads(config_json).get("max_position_embeddings")
    return limit if isinstance(limit, int) and limit > 0 else None


def probe_too_long(rank: int, tokens: int, limit: int) -> str:
    return (
        f"consumer rank {rank}: sink.probe_tokens={tokens} is more positions than the trainer's model has "
        f"(max_position_embeddings={limit}): give at most {limit}"
    )


def consumer_verifies(s: RunSettings) -> bool:
    """sink=verify, or sink=model with its ``sink.verify`` (the default): the consumer checks every slice."""
    if s.sink_name == "model":
        return s.sink is not None and s.sink.params.get("verify") is not False
    return s.sink_name == "verify"


@contextmanager
def trainer_mesh(store: dist.Store, s: RunSettings, producers: int) -> Iterator[Any]:
    """The trainer's device mesh over the K producers: torch's default process group made of them alone (the
    consumers are engines, not part of the trainer's world), set up over ``store`` (the run's signed store, under a
    prefix of its own: ``RefitGroup.store``), every wait bounded by ``group.timeout_s``; destroyed on the way out."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise HandshakeError(
            f"rank {s.rank}: torch's default process group is already set up here; a sharded refit's trainer makes "
            "its own over the producers"
        )
    dist.init_process_group(
        "gloo",
        store=store,
        rank=s.rank,
        world_size=producers,
        timeout=timedelta(seconds=s.group.timeout_s),
    )
    try:
        yield init_device_mesh("cpu", (producers,))
    finally:
        dist.destroy_process_group()


class FaultyGroup:
    """The test-only fault hooks of a sharded refit (``refit.debug.*``), around the process group its transfers use
    (every other call passes through): ``corrupt_chunk`` flips the first byte of each consumer's chunk of that index
    (counting the byte buffers it receives in a round) after it arrived, before its region checksums are compared;
    ``die_in_round`` SIGKILLs rank ``die_rank`` (a producer's as well as a consumer's) once its first send or receive
    of that round has completed, mid-transfer, as a crash would end it."""

    def __init__(self, pg: Any, *, corrupt_chunk: int | None, die_in_round: int | None) -> None:
        self._pg = pg
        self._corrupt_chunk = corrupt_chunk
        self._die_in_round = die_in_round
        self._round = 0
        self._received = 0

    def start_round(self, n: int) -> None:
        self._round, self._received = n, 0

    def end_round(self) -> None:
        """A corrupt_chunk this consumer never received would let a test pass without its fault: refuse it."""
        if self._corrupt_chunk is not None and self._received <= self._corrupt_chunk:
            raise ConfigError(
                f"refit.debug.corrupt_chunk={self._corrupt_chunk}: this consumer received {self._received} chunk(s) "
                f"in round {self._round}: the hook never fired (give a smaller index)"
            )

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return _Hooked(self._pg.send(tensors, dst, tag), self._dying(), None)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        flip = None
        if self._corrupt_chunk is not None and tensors[0].dtype == torch.uint8 and tensors[0].numel():
            if self._received == self._corrupt_chunk:
                flip = tensors[0]
            self._received += 1
        return _Hooked(self._pg.recv(tensors, src, tag), self._dying(), flip)

    def _dying(self) -> bool:
        return self._die_in_round == self._round

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)


class _Hooked:
    """One send or receive of a :class:`FaultyGroup`: its fault, once it completed."""

    def __init__(self, work: Any, die: bool, flip: torch.Tensor | None) -> None:
        self._work, self._die, self._flip = work, die, flip

    def wait(self, *args: Any) -> Any:
        done = self._work.wait(*args)
        if self._die:
            logger.warning("refit.debug.die_in_round: this rank kills itself now, mid-transfer")
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        if self._flip is not None:
            logger.warning("refit.debug.corrupt_chunk: flipping the first byte of a received chunk")
            self._flip[0] ^= 0x01
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _fault_hooks(s: RunSettings, layout: ShardedSpec, pg: Any) -> FaultyGroup | None:
    """The group with this rank's fault hooks, or None where it has none (every real run)."""
    corrupt = s.refit.corrupt_chunk if s.rank >= layout.producers else None
    die = s.refit.die_in_round if s.rank == s.refit.die_rank else None
    if corrupt is None and die is None:
        return None
    return FaultyGroup(pg, corrupt_chunk=corrupt, die_in_round=die)


def _consumer_source(s: RunSettings) -> Any:
    """What a consumer of a source it can recompute (synthetic) builds, from its own settings, to verify against
    (every consumer has one: :func:`agree_settings` checked)."""
    assert s.source is not None
    return make_source(s.source.target, s.source.params)


def run_rounds(
    s: RunSettings,
    layout: ShardedSpec,
    agreed: Agreed,
    rg: RefitGroup,
    pg: Any,
    source: Any,
    started: float,
    stack: ExitStack,
    after_round: Callable[[RoundView], None] | None,
) -> dict[str, Any]:
    rank, k, m = s.rank, layout.producers, layout.tp_size
    producer = source is not None
    chains = [[k + r * m + c for r in range(layout.replicas)] for c in range(m)] if layout.replicas > 1 else []
    buffer = agreed.buffer_size_bytes
    verify = not producer and consumer_verifies(s)
    oracle = None  # a consumer's own copy of a source it can recompute
    saver = None  # a consumer's sink=save
    model = None  # a consumer's sink=model
    if producer:
        if agreed.trainer:
            source.fully_shard(stack.enter_context(trainer_mesh(rg.store("trainer"), s, k)))
        specs, _ = source_shards(source, rank, k, agreed.trainer)
        plan = agree(
            pg, rank, specs=specs, chains=chains, buffer_size_bytes=buffer, delta=agreed.delta_mode, names=AGREE_KEYS
        )
        deltas, bases = ProducerDeltas() if agreed.delta else None, None
        expects = agreed.expects
    else:
        if not agreed.trainer:
            oracle = _consumer_source(s)
        expects = expected_tensors(oracle) if oracle is not None else agreed.expects
        needs = tp_needs(expects, rank, (rank - k) % m, m, tp_rule(expects))
        plan = agree(
            pg,
            rank,
            needs=needs,
            expects=expects,
            chains=chains,
            buffer_size_bytes=buffer,
            delta=agreed.delta_mode,
            names=AGREE_KEYS,
        )
        deltas, bases = None, ConsumerBases() if agreed.delta else None
        slices = allocate(expects, needs)
        saver = _slice_saver(s, layout, agreed, expects, slices)
        model = _model_sink(s, agreed, slices)
        if saver is not None:
            stack.callback(saver.abort)  # a failed run removes its staging directory (after close(): nothing to do)
    auto = AgreedAuto() if agreed.auto else None
    handshake_s = time.perf_counter() - started
    dense = dense_bytes(plan, rank, producer) if agreed.delta else None
    faults = _fault_hooks(s, layout, pg)
    wire = pg if faults is None else faults  # what the transfers go over
    done: list[RoundMetrics] = []
    checked = None
    for n in range(1, agreed.rounds + 1):
        facts: dict[str, Any] = {}
        changing = source if producer else oracle  # a trainer's step, or the consumer's copy following it
        if n > 1 and changing is not None and hasattr(changing, "advance"):
            facts = changing.advance(n) or {}
        # Every rank starts the round together: its seconds are the transfer's. Under refit.delta=auto the same
        # collective carries every rank's facts about the last round, and every rank chooses this one's kind.
        if auto is not None:
            choose_round(pg, auto)
        else:
            dist.barrier(group=pg)
        if faults is not None:
            faults.start_round(n)
        with PeakMemory() as memory:
            t0 = time.perf_counter()
            if producer:
                specs, shards = source_shards(source, rank, k, agreed.trainer)  # this round's values, live
                moved = send(wire, rank, plan, shards, num_buffers=s.refit.num_buffers, delta=deltas, auto=auto)
            else:
                moved = receive(wire, rank, plan, slices, num_buffers=s.refit.num_buffers, bases=bases, auto=auto)
            seconds = time.perf_counter() - t0
        if faults is not None:
            faults.end_round()
        if after_round is not None:
            after_round(RoundView(n, rank, source=source) if producer else RoundView(n, rank, slices=slices))
        if agreed.sums:
            parts: list[Any] = [None] * layout.world_size
            mine = trainer_sums(specs, shards, expects, rank, m) if producer else None
            dist.all_gather_object(parts, mine, group=pg)
            if verify:
                checked = check_sums(slices, parts[:k], expects, (rank - k) % m, rank, n)
        elif verify:
            checked = check_slices(slices, oracle.tensors(), rank, n)
        if saver is not None:  # into the staging files, which the next round overwrites
            saver.consume([(name, held.tensor) for name, held in slices.items()])
            saver.finish(None)
        if bases is not None and bases.repaired:
            logger.warning(
                "consumer %d: round %d: %d piece(s) held other bytes than the round before left there (written "
                "since) and went again whole",
                rank,
                n,
                bases.repaired,
            )
        brought = moved if dense is None else dense
        check = None
        if model is not None:  # every tensor whole (group.tp_size=1), copied into the model
            model.consume([(name, held.tensor) for name, held in slices.items()])
            model.finish(None)
        if agreed.probe_tokens:
            probe = _probe(pg, layout, rank, source, agreed.probe_tokens)
            if model is not None and model.probe_tokens:  # the producers' probe: the most any consumer asked for
                check = model.check(probe, agreed.probe_tokens)
        r = round_metrics(
            n, seconds, brought, moved, memory, verify, handshake_s if n == 1 else 0.0, facts.get("loss"), check
        )
        done.append(delta_figures(r, deltas if producer else bases, auto) if agreed.delta else r)
        if rank == 0 and agreed.rounds > 1:
            loss = f", loss {facts['loss']:.4f}" if "loss" in facts else ""
            logger.info("round %d/%d: %.3f s%s", n, agreed.rounds, seconds, loss)
    if agreed.saves:
        # The consumers publish the last round's slices together: once every rank has finished (and checked) every
        # round, each makes its staging directory durable (all that can fail: a full disk, an I/O error), and only
        # once every saver has, each swaps its directory in. A rank that fails before is a lost peer at one of the
        # barriers, and every saver aborts instead; what is left between the two is one rename per directory.
        dist.barrier(group=pg)
        if saver is not None:
            saver.prepare()
        dist.barrier(group=pg)
    saved = saver.close() if saver is not None else {}
    described = source.describe() if producer else agreed.source  # a trainer's as it is now, sharded
    return rank_metrics(
        s, described, plan.buffer_size_bytes, done, handshake_s, producer, verify, checked, len(expects), saved
    )


def _slice_saver(
    s: RunSettings, layout: ShardedSpec, agreed: Agreed, expects: list[Expected], slices: dict[str, Held]
) -> SaveSink | None:
    """sink=save's writer of this consumer's slices, ``sink.path/tp<t>``, opened (an unusable path fails here,
    before any transfer); None where this consumer saves nothing (another sink, or a replica after the first, whose
    slices are replica 0's bytes)."""
    replica, tp = divmod(s.rank - layout.producers, layout.tp_size)
    if s.sink_name != "save":
        return None
    if replica > 0:
        logger.info("replica %d saves nothing: replica 0's consumers save the same slices", replica)
        return None
    saver = SaveSink(str(slices_path(s, layout)))
    saver.begin(
        slices_manifest(
            expects,
            slices,
            run=agreed.run,
            round_=agreed.rounds,
            tp=tp,
            tp_size=layout.tp_size,
            buffer_size_bytes=agreed.buffer_size_bytes,
            source=agreed.source,
        )
    )
    return saver


def slices_path(s: RunSettings, layout: ShardedSpec) -> Path:
    """Where a consumer's sink=save writes its slices: ``sink.path/tp<t>``, t its tensor-parallel rank."""
    assert s.sink is not None
    return Path(s.sink.params["path"]) / f"tp{(s.rank - layout.producers) % layout.tp_size}"


def slices_manifest(
    expects: list[Expected],
    slices: dict[str, Held],
    *,
    run: str,
    round_: int,
    tp: int,
    tp_size: int,
    buffer_size_bytes: int,
    source: str,
) -> Manifest:
    """What a consumer's sink=save writes: each of its slices under the tensor's name, with which part of the tensor
    it is, the run and the round in the file's metadata (:func:`~refit_app.checkpoint.slices.slices_metadata`)."""
    shapes = {e.name: e.shape for e in expects}
    metadata = slices_metadata(
        ((name, shapes[name], held.box) for name, held in slices.items()),
        run=run,
        round_=round_,
        tp_rank=tp,
        tp_size=tp_size,
    )
    metas = [TensorMeta(name, tuple(held.tensor.shape), held.tensor.dtype) for name, held in slices.items()]
    return Manifest(
        metas,
        buffer_size_bytes=buffer_size_bytes,
        use_legacy_packing=False,
        metadata=metadata,
        source=source,
    )


def _model_sink(s: RunSettings, agreed: Agreed, slices: dict[str, Held]) -> Any:
    """sink=model's model, built from producer 0's config.json for the tensors it sends (every one whole:
    group.tp_size=1); None for another sink."""
    if s.sink_name != "model":
        return None
    assert s.sink is not None and agreed.model_config is not None  # config and the agreement checked both
    sink = make_sink(s.sink.target, s.sink.params)
    begin_model(sink, agreed.model_config, agreed.buffer_size_bytes, slices)
    return sink


def begin_model(sink: Any, config_json: str, buffer_size_bytes: int, slices: dict[str, Held]) -> None:
    """Build sink=model's model from producer 0's ``config_json`` for the tensors of ``slices`` (each whole)."""
    metas = [TensorMeta(name, tuple(held.tensor.shape), held.tensor.dtype) for name, held in slices.items()]
    sink.begin(Manifest(metas, buffer_size_bytes=buffer_size_bytes, use_legacy_packing=False), config_json)


def _probe(pg: Any, layout: ShardedSpec, rank: int, source: Any, probe_tokens: int) -> dict[str, Any]:
    """The trainer's probe of ``probe_tokens`` positions, on every rank: the producers run it together (FSDP2
    gathers each layer's weights for the forward), producer 0's goes to everyone."""
    mine = source.probe(probe_tokens) if source is not None else None
    every: list[Any] = [None] * layout.world_size
    dist.all_gather_object(every, mine if rank == 0 else None, group=pg)
    return every[0]


def source_shards(source: Any, rank: int, k: int, trainer: bool) -> tuple[list[TensorSpec], dict[str, Held]]:
    """This producer's specs and shards of the source's current values: a trainer's DTensors as they lie, else its
    rows of every tensor."""
    if trainer:
        return from_tensors(source.tensors(), rank=rank)
    return producer_shards(source.tensors(), rank, k)


def dense_bytes(plan: ShardedPlan, rank: int, producer: bool) -> int:
    """The bytes of the regions of ``plan`` that this producer sends or this consumer receives: what a round brings
    up to date, whether it goes dense or as deltas."""
    mine = [t for t in plan.transfers if (t.src if producer else t.dst) == rank]
    return sum(volume(t.box) * getattr(torch, t.dtype).itemsize for t in mine)


def delta_figures(
    r: RoundMetrics, state: ProducerDeltas | ConsumerBases | None, auto: AgreedAuto | None = None, *, first: int = 1
) -> RoundMetrics:
    """A round of a plan agreed with delta rounds, with what this rank's side of it did: with ``on`` the first round
    (``first``: a later one where the session started again, :mod:`refit_app.app.sharded_elastic`) is dense (every
    piece whole, each counted as changed), the later ones delta rounds; with ``auto`` the round is of the kind every
    rank chose, with the reason (a plain round: sent as without deltas, its changes estimated from the producer's
    sample of its shards where it has the last round's; a later dense round into the snapshot counts none)."""
    kind = (DELTA if r.round > first else KEEP) if auto is None else auto.last
    delta = kind == DELTA
    if auto is not None:
        r = replace(r, plain=kind == PLAIN, auto_reason=f"{kind}: {auto.reason}")
    if isinstance(state, ProducerDeltas):
        counted = kind == DELTA or r.round == first or (kind == PLAIN and auto is not None and auto.measured)
        if not counted:
            return r
        total = state.total_elements
        return replace(
            r,
            delta=delta,
            base_round=r.round - 1 if delta else None,
            changed_elements=state.changed_elements,
            changed_fraction=state.changed_elements / total if total else None,
            diff_seconds=state.compare_seconds,
        )
    assert isinstance(state, ConsumerBases)
    if kind == PLAIN:
        return r
    return replace(r, delta=delta, base_round=r.round - 1 if delta else None, apply_seconds=state.apply_seconds)


def round_metrics(
    n: int,
    seconds: float,
    dense: int,
    moved: int,
    memory: PeakMemory,
    verify: bool,
    handshake_s: float,
    loss: float | None,
    model_check: dict[str, Any] | None = None,
) -> RoundMetrics:
    """A round's figures on one rank: ``dense`` the bytes it brought up to date, ``moved`` those that crossed the
    group."""
    return RoundMetrics(
        round=n,
        seconds=seconds,
        gb_per_s=gb_per_s(dense, seconds),
        bytes=dense,
        verified=True if verify else None,
        manifest_sent=n == 1,
        handshake_seconds=handshake_s,
        peak_extra_bytes=memory.peak_extra_bytes,
        peak_rss_bytes=memory.peak_rss,
        wire_bytes=moved,
        loss=loss,
        model_check=model_check,
    )


def rank_metrics(
    s: RunSettings,
    source: str,
    buffer_size_bytes: int,
    rounds: list[RoundMetrics],
    handshake_s: float,
    producer: bool,
    verify: bool,
    checked: int | None,
    num_tensors: int,
    saved: dict[str, Any],
) -> dict[str, Any]:
    total = sum(r.bytes for r in rounds)
    times = round_times([r.seconds for r in rounds])
    metrics = RunMetrics(
        role="producer" if producer else "consumer",
        rank=s.rank,
        bytes=total,
        wire_bytes=sum(r.wire_bytes or 0 for r in rounds),
        delta=s.refit.delta if producer else None,
        num_tensors=num_tensors,
        gb_per_s=gb_per_s(total, times["seconds"]),
        handshake_seconds=handshake_s,
        buffer_size_bytes=buffer_size_bytes,
        num_buffers=s.refit.num_buffers,
        use_legacy_packing=False,
        backend="gloo",
        world_size=s.group.world_size,
        peak_rss_bytes=max((r.peak_rss_bytes for r in rounds if r.peak_rss_bytes is not None), default=None),
        peak_extra_bytes=max((r.peak_extra_bytes for r in rounds if r.peak_extra_bytes is not None), default=None),
        verified=(all(r.verified for r in rounds) if rounds else None) if verify else None,
        verified_tensors=checked,
        source=source,
        sink=None if producer else s.sink_name,
        saved_to=saved.get("saved_to"),
        saved_files=saved.get("saved_files"),
        rounds=rounds,
        **times,
    )
    return metrics.to_json()
