"""A sharded refit's ranks in the application (``group.producers``, ``group.tp_size``, ``group.replicas``; see
docs/sharded.md): ranks ``0..K-1`` are producers, each holding its rows of every tensor, ranks ``K..`` are ``D``
engine replicas of ``M`` tensor-parallel consumers, each needing only its slice; the plan and the transfer are
:mod:`refit_app.protocol.sharded`'s.

Every rank, as ``role=local`` starts it or as ``role=producer``/``consumer`` on its own host::

    connect (the application's rendezvous: token, run id, world size; gloo)
    ->  the ranks compare their layout settings and rounds (a consumer adopts producer 0's rounds and buffer size)
    ->  agree: the plan, the same on every rank, or one line naming the first difference on every rank
    ->  round 1..N: the source changes (from round 2), send / receive, a consumer checks its slices (sink=verify)

The layouts, chosen here: producer ``p`` holds ``Shard(0)`` of every tensor over the K producers (``torch.chunk``'s
rows, uneven where they do not divide; a 0-dim tensor whole on every producer); a consumer needs, by
:func:`tp_rule`, the rows of a 2-D weight (column-parallel), the columns of ``o_proj``, ``down_proj`` and
``out_proj`` (row-parallel) and every other tensor (1-D: norms, biases) whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from refit_app.app.config import RunSettings, ShardedSpec
from refit_app.app.metrics import PeakMemory, RoundMetrics, RunMetrics, round_times
from refit_app.common.errors import HandshakeError, PeerError, VerificationError
from refit_app.common.sizes import gb_per_s
from refit_app.core.reshard.plan import Layout, Placement, Replicate, Shard, TensorSpec, shard_box
from refit_app.core.reshard.transfer import Held, RegionMismatch
from refit_app.models.sources import make_source
from refit_app.packed_tensor import get_target_packed_tensor_size
from refit_app.protocol.sharded import (
    COLUMN,
    ROW,
    WHOLE,
    Declared,
    Expected,
    ShardedPlan,
    agree,
    allocate,
    from_tensors,
    receive,
    send,
    tp_needs,
)
from refit_app.transport.groups import connect

logger = logging.getLogger(__name__)

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


def _agree_settings(pg: Any, s: RunSettings, layout: ShardedSpec, producer: bool) -> tuple[int, int]:
    """The rounds and buffer size every rank runs with: a consumer's null adopts producer 0's; a rank whose layout
    or rounds differ from rank 0's stops every rank with the same line."""
    buffer = s.refit.buffer_size_bytes
    if buffer is None and producer:
        buffer = get_target_packed_tensor_size()
    mine = {"rank": s.rank, "layout": layout, "rounds": s.refit.rounds, "buffer": buffer}
    every: list[Any] = [None] * layout.world_size
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
    return first["rounds"], buffer if buffer is not None else first["buffer"]


def run_sharded(s: RunSettings) -> dict[str, Any]:
    """This rank's part of a sharded refit, ``refit.rounds`` rounds; its metrics."""
    layout = s.sharded
    assert layout is not None, "run_sharded needs a sharded layout (group.producers, tp_size, replicas)"
    producer = s.rank < layout.producers
    source = make_source(s.source.target, s.source.params)
    verify = not producer and s.sink_name == "verify"
    started = time.perf_counter()
    with connect(replace(s.group, backend="gloo")) as rg:
        pg = rg.group.process_group()
        try:
            return _rounds(s, layout, pg, source, producer, verify, started)
        except RegionMismatch as e:  # bytes that arrived other than their source hashed them
            raise VerificationError(f"rank {s.rank}: {e}") from e
        except RuntimeError as e:  # gloo's own error: a peer lost; say whose and why, where it said
            raise PeerError(rg.control.explain(e)) from e
        finally:
            del pg


def _rounds(
    s: RunSettings, layout: ShardedSpec, pg: Any, source: Any, producer: bool, verify: bool, started: float
) -> dict[str, Any]:
    rank, k, m = s.rank, layout.producers, layout.tp_size
    rounds, buffer = _agree_settings(pg, s, layout, producer)
    expects = expected_tensors(source)
    chains = [[k + r * m + c for r in range(layout.replicas)] for c in range(m)] if layout.replicas > 1 else []
    if producer:
        specs, _ = producer_shards(source.tensors(), rank, k)
        plan = agree(pg, rank, specs=specs, chains=chains, buffer_size_bytes=buffer)
    else:
        needs = tp_needs(expects, rank, (rank - k) % m, m, tp_rule(expects))
        plan = agree(pg, rank, needs=needs, expects=expects, chains=chains, buffer_size_bytes=buffer)
        slices = allocate(expects, needs)
    handshake_s = time.perf_counter() - started
    done: list[RoundMetrics] = []
    checked = None
    for n in range(1, rounds + 1):
        if n > 1 and hasattr(source, "advance"):
            source.advance(n)
        dist.barrier(group=pg)  # every rank starts the round together: its seconds are the transfer's
        with PeakMemory() as memory:
            t0 = time.perf_counter()
            if producer:
                _, shards = producer_shards(source.tensors(), rank, k)  # views of this round's values
                moved = send(pg, rank, plan, shards, num_buffers=s.refit.num_buffers)
            else:
                moved = receive(pg, rank, plan, slices, num_buffers=s.refit.num_buffers)
            seconds = time.perf_counter() - t0
        if verify:
            checked = check_slices(slices, source.tensors(), rank, n)
        done.append(_round(n, seconds, moved, memory, verify, handshake_s if n == 1 else 0.0))
        if rank == 0 and rounds > 1:
            logger.info("round %d/%d: %.3f s", n, rounds, seconds)
    return _metrics(s, source, plan, done, handshake_s, producer, verify, checked, len(expects))


def _round(n: int, seconds: float, moved: int, memory: PeakMemory, verify: bool, handshake_s: float) -> RoundMetrics:
    return RoundMetrics(
        round=n,
        seconds=seconds,
        gb_per_s=gb_per_s(moved, seconds),
        bytes=moved,
        verified=True if verify else None,
        manifest_sent=n == 1,
        handshake_seconds=handshake_s,
        peak_extra_bytes=memory.peak_extra_bytes,
        peak_rss_bytes=memory.peak_rss,
        wire_bytes=moved,
    )


def _metrics(
    s: RunSettings,
    source: Any,
    plan: ShardedPlan,
    rounds: list[RoundMetrics],
    handshake_s: float,
    producer: bool,
    verify: bool,
    checked: int | None,
    num_tensors: int,
) -> dict[str, Any]:
    total = sum(r.bytes for r in rounds)
    times = round_times([r.seconds for r in rounds])
    metrics = RunMetrics(
        role="producer" if producer else "consumer",
        rank=s.rank,
        bytes=total,
        wire_bytes=total,
        num_tensors=num_tensors,
        gb_per_s=gb_per_s(total, times["seconds"]),
        handshake_seconds=handshake_s,
        buffer_size_bytes=plan.buffer_size_bytes,
        num_buffers=s.refit.num_buffers,
        use_legacy_packing=False,
        backend="gloo",
        world_size=s.group.world_size,
        peak_rss_bytes=max((r.peak_rss_bytes for r in rounds if r.peak_rss_bytes is not None), default=None),
        peak_extra_bytes=max((r.peak_extra_bytes for r in rounds if r.peak_extra_bytes is not None), default=None),
        verified=(all(r.verified for r in rounds) if rounds else None) if verify else None,
        verified_tensors=checked,
        source=source.describe(),
        sink=None if producer else s.sink_name,
        rounds=rounds,
        **times,
    )
    return metrics.to_json()
