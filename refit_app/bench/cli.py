"""Benchmark: the packed refit against the transport's own limit and against one broadcast per tensor.

``python -m refit_app.bench`` starts one producer and N consumers as spawned processes on this machine, joined in
one gloo group over loopback, and times three ways of moving the same synthetic model over that same group:

- ``refit``: one call of :func:`packed_broadcast_producer` / :func:`packed_broadcast_consumer`, the one-shot
  library path (the consumer drops each batch, like ``sink=discard``);
- ``session``: one steady-state round of :class:`~refit_app.protocol.session.ProducerSession` /
  :class:`~refit_app.protocol.session.ConsumerSession`, as ``python -m refit_app refit.rounds=N`` and an RL loop run
  them (the manifest went in an untimed first round; each timed round is the whole ``send()`` / ``receive()``:
  round header, data and the all-ranks "done");
- ``limit``: the same chunks, packed before the clock starts into buffers both sides hold already, all broadcast
  asynchronously back to back and then waited for. No packing strategy can beat it on the same group;
- ``per_tensor``: one synchronous broadcast per tensor into a freshly allocated tensor, as several RL frameworks do.

Modes alternate within a repetition (A B C A B C ...) so that machine noise hits all of them alike; one untimed
repetition warms every path first. Each list-valued flag is a sweep axis; every combination is one case. Results go
to ``<out>/bench.json`` (machine, backend, settings, per-rank times and memory) and ``<out>/table.md``.

Across hosts: ``--rank R`` runs only rank R in this process, joining the producer at ``--host``/``--port`` (a
group of ``--world-size``, with ``REFIT_APP_TOKEN`` as on the application's ranks), so the limit is the one of the
link between real hosts. Rank 0's flags decide the cases; it prints and writes the results of every rank.

Memory: after the timed repetitions, ``--flat-refits`` consecutive refits (and as many session rounds) each
measure this rank's peak RSS above the RSS with the model alone, against ``num_buffers x max(target, largest
tensor)``.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import itertools
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from refit_app.app.launch import free_port, run_ranks
from refit_app.app.metrics import PeakMemory
from refit_app.common.errors import ConfigError, RefitError
from refit_app.common.files import write_atomic
from refit_app.common.sizes import format_decimal, format_size, gb_per_s, parse_size
from refit_app.core.meta import TensorMeta
from refit_app.models.presets import PRESETS
from refit_app.models.sources import SyntheticSource
from refit_app.packed_tensor import (
    chunk_ids,
    get_num_buffers,
    get_target_packed_tensor_size,
    pack_tensors,
    packed_broadcast_consumer,
    packed_broadcast_producer,
    release_buffers,
)
from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.auth import TOKEN_ENV
from refit_app.transport.groups import GroupSpec, RefitGroup, connect
from refit_app.transport.spec import DEFAULT_HOST, DEFAULT_PORT
from refit_app.transport.spec import DEFAULT_TIMEOUT_S as DEFAULT_GROUP_TIMEOUT_S

logger = logging.getLogger(__name__)

MODES = ("refit", "session", "limit", "per_tensor")
POSTS = ("none", "cast")
"""``post_iter_func`` on the producer: identity, or an fp32 model cast to bf16 as it is sent (real work per tensor)."""

DEFAULT_PRESETS = ("llama-1b", "lora")
DEFAULT_SIZES = {"llama-1b": ("1GB",), "lora": ("natural", "1GiB")}
"""Per preset without ``--size``: lora at its natural size (2240 matrices, 93 MB) and at 1 GiB (25,844 of them)."""
DEFAULT_REPS = 5
DEFAULT_FLAT_REFITS = 20
DEFAULT_TIMEOUT_S = 3600.0
COLLECTIVE_TIMEOUT_S = 600.0
"""Deadline of every collective: a 4 GB chunk list on a slow machine must not trip it, a hung peer must."""
MEMORY_SLACK = 0.10
"""Issue 5's bound on peak RSS above the model: num_buffers x max(buffer, largest tensor), plus this fraction."""
SEED = 0
BUSY_LOAD_PER_CORE = 0.5
"""Above this 1-minute load average per core at the start, the run warns that other work skews its timings."""
_CHILD_EXIT_S = 10.0
RANK_MODULES = ("refit_app.transport.groups", "refit_app.protocol.session", "refit_app.models.sources")
"""What the ranks import, once in the fork server (this module itself may be ``__main__``, which is not preloaded)."""


@dataclass(frozen=True)
class Case:
    """One benchmarked configuration; every mode of it runs on the same group and the same model."""

    preset: str
    size_bytes: int | None
    """Bytes on the wire (the model after ``post``); None for the preset's natural size."""
    buffer_size_bytes: int
    num_buffers: int
    consumers: int
    post: str
    reps: int
    modes: tuple[str, ...]
    flat_refits: int
    """Consecutive refits after the timed ones, each with its own peak-memory measurement (0: none)."""


# --------------------------------------------------------------------------------------------------------------
# The model as both sides see it.


def _source(case: Case) -> SyntheticSource:
    # A cast run starts from fp32 twice the wire size, so both posts move the same architecture and bytes.
    if case.post == "cast":
        size = None if case.size_bytes is None else 2 * case.size_bytes
        return SyntheticSource(case.preset, size, SEED, torch.float32)
    return SyntheticSource(case.preset, case.size_bytes, SEED, torch.bfloat16)


def _post_func(post: str) -> Callable[[tuple[str, torch.Tensor]], torch.Tensor]:
    if post == "cast":
        return lambda item: item[1].to(torch.bfloat16)
    return lambda item: item[1]


def _wire_metas(source: SyntheticSource, post: str) -> list[TensorMeta]:
    metas = source.manifest_tensors()
    if post == "cast":
        return [m._replace(dtype=torch.bfloat16) for m in metas]
    return metas


def _chunks(metas: list[TensorMeta], case: Case) -> list[list[int]]:
    """Tensor indices of each chunk, exactly as the packed broadcast plans them."""
    ids = chunk_ids((m.nbytes for m in metas), case.buffer_size_bytes)
    return [[i for i, _ in members] for _, members in itertools.groupby(enumerate(ids), key=lambda p: p[1])]


# --------------------------------------------------------------------------------------------------------------
# The three modes, one side each. Every function moves the whole model once.


class _Limit:
    """The model packed once, before any timing, into one buffer per chunk, on both sides.

    Receive buffers are written once, so their pages are resident and every repetition times the transport alone.
    The refit allocates its buffers anew in every call, so the ratio refit/limit includes what that costs.
    """

    def __init__(self, rank: int, source: SyntheticSource, metas: list[TensorMeta], case: Case) -> None:
        chunks = _chunks(metas, case)
        if rank == 0:
            post = _post_func(case.post)
            tensors = [post(item) for item in source.tensors()]
            self.buffers = [pack_tensors(tensors[i] for i in chunk) for chunk in chunks]
        else:
            self.buffers = [torch.zeros(sum(metas[i].nbytes for i in chunk), dtype=torch.uint8) for chunk in chunks]

    def run(self, rg: RefitGroup) -> int:
        works = [rg.group.broadcast_async(buffer, 0) for buffer in self.buffers if buffer.numel()]
        for work in works:
            work.wait()
        return sum(buffer.numel() for buffer in self.buffers)


def _refit(rg: RefitGroup, source: SyntheticSource, metas: list[TensorMeta], case: Case) -> int:
    moved = 0

    def count(nbytes: int, ntensors: int) -> None:
        nonlocal moved
        moved += nbytes

    settings = {"buffer_size_bytes": case.buffer_size_bytes, "num_buffers": case.num_buffers, "on_chunk": count}
    if rg.rank == 0:
        packed_broadcast_producer(source.tensors(), rg.group, 0, _post_func(case.post), **settings)
    else:
        packed_broadcast_consumer(((m.name, (m.shape, m.dtype)) for m in metas), rg.group, 0, _discard, **settings)
    return moved


class _Session:
    """One session per rank for the whole case: an untimed first round carries the manifest and records the plan,
    so every timed round is a steady-state one."""

    def __init__(self, rg: RefitGroup, source: SyntheticSource, metas: list[TensorMeta], case: Case) -> None:
        self._source, self._metas, self._post = source, metas, _post_func(case.post)
        if rg.rank == 0:
            self._side: ProducerSession | ConsumerSession = ProducerSession(
                rg, buffer_size_bytes=case.buffer_size_bytes, num_buffers=case.num_buffers)
        else:
            self._side = ConsumerSession(rg, num_buffers=case.num_buffers)
        self.run()

    def run(self) -> int:
        if isinstance(self._side, ProducerSession):
            named = ((name, self._post((name, t))) for name, t in self._source.tensors())
            return self._side.send(named, metas=self._metas).bytes
        return self._side.receive(_discard).bytes

    def close(self) -> None:
        """End the session on every rank (the consumers' last receive() sees the producer's end)."""
        if isinstance(self._side, ProducerSession):
            self._side.close()
        elif self._side.receive(_discard) is not None:
            raise RuntimeError("the producer's session did not end when expected")


def _discard(batch: list[tuple[str, torch.Tensor]]) -> None:
    """What ``sink=discard`` does: nothing, so the transfer alone is timed."""


def _per_tensor(rg: RefitGroup, source: SyntheticSource, metas: list[TensorMeta], case: Case) -> int:
    moved = 0
    if rg.rank == 0:
        post = _post_func(case.post)
        for item in source.tensors():
            t = post(item).contiguous()
            rg.group.broadcast(t, 0)
            moved += t.numel() * t.element_size()
    else:
        for m in metas:
            t = torch.empty(m.shape, dtype=m.dtype)
            rg.group.broadcast(t, 0)
            moved += m.nbytes
    return moved


def _barrier(rg: RefitGroup) -> None:
    """Every rank has finished what came before: each rank's tiny broadcast completes only once it has joined."""
    flag = torch.zeros(1, dtype=torch.uint8)
    for src in range(rg.world_size):
        rg.group.broadcast(flag, src)


# --------------------------------------------------------------------------------------------------------------
# One rank.


def _return_free_memory_to_os() -> None:
    """glibc keeps freed heap memory (and raises its mmap threshold after large frees), so RSS would still count
    buffers already released; trimming makes the model-only baseline honest. A no-op where glibc is absent."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _timed(rg: RefitGroup, run: Callable[[], int], expected: int, label: str) -> tuple[float, float, PeakMemory]:
    """(wall seconds, CPU seconds of every thread of this rank, its peak memory) of one transfer."""
    _barrier(rg)
    with PeakMemory() as memory:
        cpu = time.process_time()
        started = time.perf_counter()
        moved = run()
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu
    if moved != expected:
        raise RuntimeError(f"rank {rg.rank}: {label} moved {moved} bytes, expected {expected}")
    return seconds, cpu, memory


class _Listed:
    """The producer's model as a trainer holds it: ``(name, tensor)`` pairs in memory, listed once (views of the
    synthetic pools, no copies), so every mode times the library and the transport, not the synthetic generator
    (about 6 us a tensor, which would cap the 25k-tensor adapter at a fraction of the limit)."""

    def __init__(self, source: SyntheticSource) -> None:
        self._named = list(source.tensors())
        self.describe = source.describe
        self.manifest_tensors = source.manifest_tensors

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._named)


def _run_case(rg: RefitGroup, case: Case) -> dict[str, Any]:
    source = _source(case)
    if rg.rank == 0:
        source = _Listed(source)
    metas = _wire_metas(source, case.post)
    total = sum(m.nbytes for m in metas)
    runners: dict[str, Callable[[], int]] = {
        "refit": functools.partial(_refit, rg, source, metas, case),
        "per_tensor": functools.partial(_per_tensor, rg, source, metas, case),
    }
    # Every rank constructs the session at the same point (they exchange their needs there).
    session = _Session(rg, source, metas, case) if "session" in case.modes or case.flat_refits else None
    if session is not None:
        runners["session"] = session.run
    if "limit" in case.modes:
        runners["limit"] = functools.partial(_Limit(rg.rank, source, metas, case).run, rg)

    seconds: dict[str, list[float]] = {mode: [] for mode in case.modes}
    cpu_seconds: dict[str, list[float]] = {mode: [] for mode in case.modes}
    for rep in range(case.reps + 1):  # repetition 0 warms caches, connections and the limit's buffers
        for mode in case.modes:
            elapsed, cpu, _ = _timed(rg, runners[mode], total, mode)
            if rep:
                seconds[mode].append(elapsed)
                cpu_seconds[mode].append(cpu)
    del runners  # frees the limit's packed copy of the model before the memory is measured
    gc.collect()

    # Memory above the model, and its flatness: consecutive refits (then session rounds) in one process, nothing
    # else in between. Both keep their host buffers for the next call, so memory is measured against the RSS with
    # the model alone (buffers released), not against the RSS just before each call.
    release_buffers()
    _return_free_memory_to_os()
    probe = PeakMemory()
    probe.start()
    model_rss = probe.baseline_rss
    probe.stop()
    flat: dict[str, list[dict[str, int | None]]] = {"refit": [], "session": []}
    flat_runners = {"refit": functools.partial(_refit, rg, source, metas, case)}
    if session is not None:
        flat_runners["session"] = session.run
    for mode, run in flat_runners.items():
        for _ in range(case.flat_refits):
            _, _, memory = _timed(rg, run, total, mode)
            above = None if memory.peak_rss is None or model_rss is None else memory.peak_rss - model_rss
            flat[mode].append({"baseline_rss_bytes": memory.baseline_rss, "peak_extra_bytes": above})
    if session is not None:
        session.close()
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "flat": flat,
        "model": source.describe(),
        "bytes": total,
        "num_tensors": len(metas),
        "num_chunks": len(_chunks(metas, case)),
        "largest_tensor_bytes": max(m.nbytes for m in metas),
    }


def _rank_main(rank: int, world_size: int, port: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Entry point of one spawned rank: every case of this world size on one group."""
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    spec = GroupSpec(backend="gloo", port=port, world_size=world_size, rank=rank, timeout_s=COLLECTIVE_TIMEOUT_S)
    with connect(spec) as rg:
        return [_run_case(rg, case) for case in cases]


def _run_world(cases: list[Case], timeout_s: float) -> list[list[dict[str, Any]]]:
    """Run ``cases`` (all with the same consumer count) on one group; per-rank results, in rank order."""
    world_size = cases[0].consumers + 1
    # A failed rank breaks the others' collectives at once: no point waiting for them.
    outcomes = run_ranks(_rank_main, world_size, (world_size, free_port(), cases), timeout_s=timeout_s,
                         grace_s=_CHILD_EXIT_S, name="bench-rank", preload=RANK_MODULES)
    failed = next((o for o in outcomes if not o.ok), None)
    if failed is not None:
        if failed.exc_type == "Timeout":
            raise TimeoutError(f"the benchmark did not finish within --timeout-s={timeout_s:g}; raise it")
        raise RuntimeError(f"benchmark rank failed: {failed}\n{failed.traceback}")
    return [o.value for o in outcomes]


# --------------------------------------------------------------------------------------------------------------
# Summaries.


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _summarize(case: Case, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    model = per_rank[0]
    total, largest = model["bytes"], model["largest_tensor_bytes"]
    modes: dict[str, Any] = {}
    for mode in case.modes:
        # A transfer is over when its slowest rank is: the wall time of a repetition is the longest per-rank time.
        per_rep = [max(rank["seconds"][mode][i] for rank in per_rank) for i in range(case.reps)]
        seconds = _stats(per_rep)
        modes[mode] = {
            "seconds": seconds,
            "gb_per_s": {k: gb_per_s(total, v) for k, v in seconds.items()},
            "per_rep_seconds": per_rep,
            "per_rank_seconds": [rank["seconds"][mode] for rank in per_rank],
            # CPU time of all of a rank's threads (gloo's included) over wall time: cores kept busy.
            "cores_busy_median": [
                statistics.median(c / w for c, w in zip(rank["cpu_seconds"][mode], rank["seconds"][mode]))
                for rank in per_rank
            ],
        }
    ratios = {}
    for mode in ("refit", "session"):
        if mode in modes and "limit" in modes:
            ratios[f"{mode}_over_limit"] = modes["limit"]["seconds"]["median"] / modes[mode]["seconds"]["median"]
        if mode in modes and "per_tensor" in modes:
            ratios[f"{mode}_speedup_over_per_tensor"] = (
                modes["per_tensor"]["seconds"]["median"] / modes[mode]["seconds"]["median"]
            )
    buffers_bytes = case.num_buffers * max(case.buffer_size_bytes, largest)
    bound = int(buffers_bytes * (1 + MEMORY_SLACK))
    memory = []
    for rank, result in enumerate(per_rank):
        entry: dict[str, Any] = {"rank": rank, **_flat_summary(result["flat"]["refit"], bound)}
        entry["refit_peak_extra_bytes_max"] = entry.pop("peak_extra_bytes_max")
        session = _flat_summary(result["flat"]["session"], bound)
        entry["session"] = session if "flat_refits" in session else None
        memory.append(entry)
    return {
        "case": asdict(case),
        **{key: model[key] for key in ("model", "bytes", "num_tensors", "num_chunks", "largest_tensor_bytes")},
        "modes": modes,
        "ratios": ratios,
        "memory_buffers_bytes": buffers_bytes,
        "memory_bound_bytes": bound,
        "memory": memory,
    }


def _flat_summary(flat: list[dict[str, int | None]], bound: int) -> dict[str, Any]:
    """Peak memory above the model over consecutive calls of one mode, and whether it stayed flat and bounded."""
    peaks = [f["peak_extra_bytes"] for f in flat if f["peak_extra_bytes"] is not None]
    entry: dict[str, Any] = {"peak_extra_bytes_max": max(peaks) if peaks else None}
    if flat:
        entry.update(
            flat_refits=len(flat),
            first_peak_extra_bytes=flat[0]["peak_extra_bytes"],
            last_peak_extra_bytes=flat[-1]["peak_extra_bytes"],
            max_peak_extra_bytes=max((f["peak_extra_bytes"] or 0) for f in flat),
            # Call 1 allocates the buffers that later calls reuse: flatness is judged from call 2 on.
            second_baseline_rss_bytes=flat[min(1, len(flat) - 1)]["baseline_rss_bytes"],
            last_baseline_rss_bytes=flat[-1]["baseline_rss_bytes"],
        )
    worst = max(peaks, default=None)
    entry["within_bound"] = None if worst is None else worst <= bound
    return entry


def machine_info() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _size_label(summary: dict[str, Any]) -> str:
    return format_decimal(summary["bytes"])


def format_table(summaries: list[dict[str, Any]]) -> str:
    """The results as a markdown table: one row per case, throughput medians with min-max, and the ratios."""
    head = (
        "| model | size | tensors | chunks | buffer x n | consumers | post | refit GB/s | session GB/s | limit GB/s "
        "| per-tensor GB/s | refit/limit | session/limit | refit vs per-tensor | session vs per-tensor "
        "| peak RSS above model, refit (P / C max) | session (P / C max) | bound n x max(buffer, largest) |\n"
    )
    rule = "|" + "---|" * 18 + "\n"
    rows = []
    for s in summaries:
        case = s["case"]

        def cell(mode: str) -> str:
            if mode not in s["modes"]:
                return "-"
            g = s["modes"][mode]["gb_per_s"]
            # min time is max throughput: the range is written low-high.
            return f"{g['median']:.2f} ({g['max']:.2f}-{g['min']:.2f})"

        def ratio(key: str) -> str:
            return f"{s['ratios'][key]:.2f}x" if key in s["ratios"] else "-"

        def peaks(mode: str) -> str:
            # Measured by the --flat-refits runs; without them there is no figure.
            mem = s["memory"]
            values = [m["refit_peak_extra_bytes_max"] if mode == "refit" else (m["session"] or {}).get(
                "peak_extra_bytes_max") for m in mem]
            producer, consumers = values[0], [v for v in values[1:] if v is not None]
            return (f"{'-' if producer is None else format_size(producer)} / "
                    f"{format_size(max(consumers)) if consumers else '-'}")

        rows.append(
            f"| {case['preset']} | {_size_label(s)} | {s['num_tensors']} | {s['num_chunks']} "
            f"| {format_size(case['buffer_size_bytes'])} x {case['num_buffers']} | {case['consumers']} "
            f"| {case['post']} | {cell('refit')} | {cell('session')} | {cell('limit')} | {cell('per_tensor')} "
            f"| {ratio('refit_over_limit')} | {ratio('session_over_limit')} "
            f"| {ratio('refit_speedup_over_per_tensor')} | {ratio('session_speedup_over_per_tensor')} "
            f"| {peaks('refit')} | {peaks('session')} | {format_size(s['memory_buffers_bytes'])} |"
        )
    return head + rule + "\n".join(rows) + "\n"


# --------------------------------------------------------------------------------------------------------------
# Command line.


def _parse_sizes(values: Sequence[str]) -> list[int | None]:
    return [None if v == "natural" else parse_size(v, "--size") for v in values]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m refit_app.bench",
        description="Time the packed refit against the transport limit and per-tensor broadcast over gloo.",
    )
    p.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=list(DEFAULT_PRESETS),
                   help="synthetic model shapes (default: %(default)s)")
    p.add_argument("--size", nargs="+", default=None,
                   help="bytes on the wire, e.g. 256MB 1GB 4GB, or 'natural' for the preset's own size "
                        "(default: 1GB for llama presets, natural and 1GiB for lora)")
    p.add_argument("--buffer-size", nargs="+", default=None,
                   help="packed buffer target, e.g. 64MiB (default: get_target_packed_tensor_size(), "
                        f"{format_size(get_target_packed_tensor_size())} here)")
    p.add_argument("--num-buffers", nargs="+", type=int, default=None,
                   help=f"buffers in flight (default: get_num_buffers(), {get_num_buffers()} here)")
    p.add_argument("--consumers", nargs="+", type=int, default=None,
                   help="consumer processes (default: 1; across hosts: --world-size - 1)")
    p.add_argument("--post", nargs="+", choices=POSTS, default=["none"],
                   help="producer post_iter_func: none, or cast (fp32 model sent as bf16) (default: none)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="what to time (default: all)")
    p.add_argument("--reps", type=int, default=DEFAULT_REPS, help="timed repetitions per mode (default: %(default)s)")
    p.add_argument("--flat-refits", type=int, default=DEFAULT_FLAT_REFITS,
                   help="consecutive refits after the timed ones, for the memory flatness check (default: %(default)s)")
    p.add_argument("--out", default="outputs/bench",
                   help="directory for bench.json and table.md (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                   help="deadline for each group of cases (default: %(default)s)")
    hosts = p.add_argument_group(
        "across hosts", "run one rank per host (the same --host, --port and --world-size on each; REFIT_APP_TOKEN "
                        "set alike on every host for non-loopback addresses); rank 0's other flags pick the cases, "
                        "and rank 0 prints and writes every rank's results")
    hosts.add_argument("--rank", type=int, default=None,
                       help="this process's rank: 0 is the producer, 1..world-size-1 the consumers (default: spawn "
                            "every rank on this machine over loopback)")
    hosts.add_argument("--world-size", type=int, default=2, help="ranks in all, producer included (default: 2)")
    hosts.add_argument("--host", default=DEFAULT_HOST,
                       help="the producer's address; rank 0 listens on it (0.0.0.0: every interface) "
                            "(default: %(default)s)")
    hosts.add_argument("--port", type=int, default=DEFAULT_PORT, help="the producer's port (default: %(default)s)")
    hosts.add_argument("--interface", default=None, help="the NIC gloo uses (default: the route to the producer)")
    hosts.add_argument("--group-timeout-s", type=float, default=DEFAULT_GROUP_TIMEOUT_S,
                       help="deadline of the rendezvous and of every collective, as group.timeout_s: a rank that dies "
                            "ends the others within about that (default: %(default)s)")
    return p


def cases_from_args(args: argparse.Namespace) -> list[Case]:
    buffer_sizes = (
        [get_target_packed_tensor_size()]
        if args.buffer_size is None
        else [parse_size(v, "--buffer-size") for v in args.buffer_size]
    )
    num_buffers = [get_num_buffers()] if args.num_buffers is None else args.num_buffers
    problems = [f"--num-buffers {n} must be >= 1" for n in num_buffers if n < 1]
    if args.rank is None:
        consumers = args.consumers or [1]
        problems += [f"--consumers {n} must be >= 1" for n in consumers if n < 1]
    else:
        consumers = [args.world_size - 1]
        if args.consumers is not None:
            problems.append("--consumers is --world-size - 1 across hosts; drop it")
        if args.world_size < 2:
            problems.append(f"--world-size {args.world_size} must be >= 2 (the producer and at least one consumer)")
    if args.reps < 1:
        problems.append(f"--reps {args.reps} must be >= 1")
    if args.flat_refits < 0:
        problems.append(f"--flat-refits {args.flat_refits} must be >= 0")
    if problems:
        raise SystemExit("refit_app.bench: error: " + "; ".join(problems))
    cases = []
    for preset in args.preset:
        sizes = _parse_sizes(args.size if args.size is not None else DEFAULT_SIZES.get(preset, ("1GB",)))
        for size, buf, nb, n, post in itertools.product(sizes, buffer_sizes, num_buffers, consumers, args.post):
            cases.append(Case(preset, size, buf, nb, n, post, args.reps, tuple(args.modes), args.flat_refits))
    return cases


def run(cases: list[Case], out_dir: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Run every case (one group per consumer count), write bench.json and table.md, return the summaries."""
    load_before = os.getloadavg()
    if load_before[0] > BUSY_LOAD_PER_CORE * (os.cpu_count() or 1):
        logger.warning(
            "this machine is busy (load average %.1f on %d cores): timings will be noisy; ratios between modes, which "
            "alternate within each repetition, suffer least",
            load_before[0],
            os.cpu_count(),
        )
    summaries: dict[Case, dict[str, Any]] = {}
    for consumers, group in itertools.groupby(sorted(cases, key=lambda c: c.consumers), key=lambda c: c.consumers):
        batch = list(group)
        logger.info("running %d case(s) with %d consumer(s)", len(batch), consumers)
        per_rank = _run_world(batch, timeout_s)
        for i, case in enumerate(batch):
            summaries[case] = _summarize(case, [rank[i] for rank in per_rank])
    ordered = [summaries[c] for c in cases]
    _write_results(ordered, out_dir, load_before, "gloo (loopback, one process per rank)")
    return ordered


def _write_results(ordered: list[dict[str, Any]], out_dir: Path, load_before: Sequence[float], backend: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "machine": {**machine_info(), "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "backend": backend,
        "modes": {
            "refit": "packed_broadcast_producer/consumer, one call each, consumer drops each batch",
            "session": "one steady-state round of ProducerSession.send / ConsumerSession.receive (manifest sent in "
                       "an untimed first round), consumer drops each batch",
            "limit": "the same chunks pre-packed on both sides, all broadcast async back to back, then waited",
            "per_tensor": "one synchronous broadcast per tensor into a freshly allocated tensor",
        },
        "timing": "per repetition: the slowest rank's wall time; median, min and max over repetitions",
        "cases": ordered,
    }
    write_atomic(out_dir / "bench.json", (json.dumps(doc, indent=2, default=str) + "\n").encode())
    write_atomic(out_dir / "table.md", format_table(ordered).encode())


# --------------------------------------------------------------------------------------------------------------
# Across hosts: one rank in this process.


def _broadcast_json(rg: RefitGroup, value: Any, src: int) -> Any:
    """``value`` (JSON-able) from rank ``src`` to every rank, over the group itself: its length, then its bytes."""
    data = json.dumps(value, default=str).encode() if rg.rank == src else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    rg.group.broadcast(length, src)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(length), dtype=torch.uint8)
    rg.group.broadcast(payload, src)
    return value if rg.rank == src else json.loads(payload.numpy().tobytes())


def _spec_from_args(args: argparse.Namespace) -> GroupSpec:
    return GroupSpec(backend="gloo", host=args.host, port=args.port, world_size=args.world_size, rank=args.rank,
                     timeout_s=args.group_timeout_s, interface=args.interface, token=os.environ.get(TOKEN_ENV))


def run_rank(spec: GroupSpec, cases: list[Case], out_dir: Path) -> list[dict[str, Any]] | None:
    """Run rank ``spec.rank`` of a benchmark whose ranks are on other hosts. Rank 0's ``cases`` are everyone's; it
    gathers every rank's results, writes bench.json and table.md and returns the summaries (None elsewhere)."""
    load_before = os.getloadavg()
    with connect(spec) as rg:
        cases = [Case(**{**c, "modes": tuple(c["modes"])}) for c in _broadcast_json(rg, [asdict(c) for c in cases], 0)]
        mine = [_run_case(rg, case) for case in cases]
        per_rank = [_broadcast_json(rg, mine if rg.rank == r else None, r) for r in range(rg.world_size)]
    if spec.rank != 0:
        return None
    ordered = [_summarize(case, [rank[i] for rank in per_rank]) for i, case in enumerate(cases)]
    _write_results(ordered, out_dir, load_before,
                   f"gloo across hosts (producer at {spec.host}:{spec.port}, {spec.world_size} ranks, one per process)")
    return ordered


def _memory_lines(summaries: list[dict[str, Any]]) -> Iterator[str]:
    for s in summaries:
        case = s["case"]
        for m in s["memory"]:
            who = "producer" if m["rank"] == 0 else f"consumer {m['rank']}"
            for mode, entry in (("refits", m), ("session rounds", m.get("session"))):
                if not entry or "flat_refits" not in entry:
                    continue
                yield (
                    f"{case['preset']} {_size_label(s)} {who}: peak above model over {entry['flat_refits']} {mode}: "
                    f"first {format_size(entry['first_peak_extra_bytes'] or 0)}, "
                    f"last {format_size(entry['last_peak_extra_bytes'] or 0)}, "
                    f"max {format_size(entry['max_peak_extra_bytes'])} "
                    f"(num_buffers x max(buffer, largest tensor) = {case['num_buffers']} x "
                    f"{format_size(s['memory_buffers_bytes'] // case['num_buffers'])} = "
                    f"{format_size(s['memory_buffers_bytes'])}; bound +{MEMORY_SLACK:.0%} "
                    f"{format_size(s['memory_bound_bytes'])}); "
                    f"RSS before call 2 {format_size(entry['second_baseline_rss_bytes'] or 0)}, "
                    f"before call {entry['flat_refits']} {format_size(entry['last_baseline_rss_bytes'] or 0)}"
                )


CASE_FLAGS = ("preset", "size", "buffer_size", "num_buffers", "post", "modes", "reps", "flat_refits")
"""The flags that make the cases: across hosts, rank 0's decide and a consumer's own are not used."""


def _check_out(out_dir: Path) -> None:
    """Refuse an --out that cannot take the results before the run, not after it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".bench-probe-"):
            pass
    except OSError as e:
        raise SystemExit(f"refit_app.bench: error: --out {str(out_dir)!r} cannot take the results: "
                         f"{e.strerror or e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cases = cases_from_args(args)
    except ConfigError as e:
        raise SystemExit(f"refit_app.bench: error: {e}") from None
    out, out_dir = sys.stdout, Path(args.out)
    writes = args.rank in (None, 0)
    if writes:
        _check_out(out_dir)
    elif ignored := [f"--{f.replace('_', '-')}" for f in CASE_FLAGS if getattr(args, f) != parser.get_default(f)]:
        logger.warning("rank %d runs rank 0's cases: its own %s not used", args.rank, ", ".join(ignored))
    try:
        if args.rank is None:
            summaries = run(cases, out_dir, args.timeout_s)
        else:
            summaries = run_rank(_spec_from_args(args), cases, out_dir)
    except ConfigError as e:
        raise SystemExit(f"refit_app.bench: error: {e}") from None
    except RefitError as e:
        print(f"refit_app.bench: error: rank {args.rank}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if not writes:
            raise
        print(f"refit_app.bench: error: could not write the results to {str(out_dir)!r}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("refit_app.bench: interrupted; no results written", file=sys.stderr)
        return 130
    if summaries is None:
        out.write(f"rank {args.rank}: done; rank 0 prints and writes the results\n")
        return 0
    out.write(format_table(summaries))
    for line in _memory_lines(summaries):
        out.write(line + "\n")
    out.write(f"results: {out_dir / 'bench.json'}\n")
    return 0

