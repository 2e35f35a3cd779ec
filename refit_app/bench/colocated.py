"""``python -m refit_app.bench --colocated``: the shared-memory backend against gloo over loopback and against one
memcpy of the model, and one consumer against several, all in one run with the modes interleaved.

One world of 1 + N processes on this machine joins three groups: ``shm`` with every rank (N consumers), ``shm`` of
ranks 0 and 1 and ``gloo`` of ranks 0 and 1 (each over loopback, one consumer). Each repetition times, in an order
that rotates from one repetition to the next:

- ``gloo``: one steady session round (``sink=discard``) over the gloo group, one consumer;
- ``shm``: the same over the two-rank shm group;
- ``shm_N``: the same over the shm group of every rank;
- ``memcpy``: the producer alone copies every tensor of the model into one buffer of the model's size (resident,
  by precomputed offsets: one memmove per tensor), the floor of the pack copy any transport pays.

A round's time is its slowest rank's. Ranks that are not in a mode's group sit idle in a socket wait meanwhile. The
ratios printed: gloo/shm (how much faster shared memory is), shm/memcpy (how close to the floor) and shm_N/shm
(what more consumers cost); ``--out`` gets ``colocated.json`` and ``colocated.md``.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from refit_app.app.rank_harness import free_port
from refit_app.bench.cases import Case, make_source, wire_metas
from refit_app.bench.measure import ListedSource
from refit_app.bench.modes import Session, barrier
from refit_app.bench.report import write_summary
from refit_app.bench.spawned import COLLECTIVE_TIMEOUT_S, run_local_ranks
from refit_app.common.sizes import format_decimal, format_size, gb_per_s
from refit_app.core.wire import pack_all
from refit_app.transport.groups import GroupSpec, RefitGroup, connect

logger = logging.getLogger(__name__)

COLOCATED_JSON = "colocated.json"
COLOCATED_MD = "colocated.md"
GOALS = {"gloo_over_shm": (">=", 2.5), "shm_over_memcpy": ("<=", 1.5), "shm_n_over_shm": ("<=", 1.5)}
"""Issue 23's speed goals for these ratios."""


class _Memcpy:
    """The model copied by the producer into one resident buffer, one memmove per tensor at its offset."""

    def __init__(self, source: ListedSource, total: int) -> None:
        self._tensors = [t for _, t in source.tensors()]
        self._spans = []
        offset = 0
        for t in self._tensors:
            n = t.numel() * t.element_size()
            self._spans.append((offset, n))
            offset += n
        self._buffer = torch.empty(total, dtype=torch.uint8)
        self._buffer.fill_(0)  # resident before the clock runs

    def run(self) -> int:
        pack_all(self._buffer, self._spans, self._tensors)
        return self._buffer.numel()


def _rank_main(rank: int, world_size: int, ports: dict[str, int], case: Case) -> dict[str, Any]:
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    source = make_source(case)
    if rank == 0:
        source = ListedSource(source)
    metas = wire_metas(source, case.post)
    total = sum(m.nbytes for m in metas)
    n = world_size - 1
    groups: dict[str, RefitGroup] = {}

    def join(name: str, backend: str, size: int) -> None:
        spec = GroupSpec(backend=backend, port=ports[name], world_size=size, rank=rank, timeout_s=COLLECTIVE_TIMEOUT_S)
        groups[name] = connect(spec)

    try:
        join(f"shm_{n}", "shm", world_size)
        if rank <= 1:
            join("shm", "shm", 2)
            join("gloo", "gloo", 2)
        runners: dict[str, Callable[[], int]] = {}
        sessions = {name: Session(rg, source, metas, case) for name, rg in groups.items()}  # untimed first rounds
        for name, session in sessions.items():
            runners[name] = session.run
        if rank == 0:
            runners["memcpy"] = _Memcpy(source, total).run
        modes = ["gloo", "shm", f"shm_{n}", "memcpy"]
        seconds: dict[str, list[float]] = {m: [] for m in modes}
        for rep in range(case.reps + 1):  # repetition 0 warms every path
            order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
            for mode in order:
                if mode not in runners:
                    continue
                if mode in groups:
                    barrier(groups[mode])
                started = time.perf_counter()
                moved = runners[mode]()
                elapsed = time.perf_counter() - started
                if moved != total:
                    raise RuntimeError(f"rank {rank}: {mode} moved {moved} bytes, expected {total}")
                if rep:
                    seconds[mode].append(elapsed)
        for session in sessions.values():
            session.close()
    finally:
        for rg in groups.values():
            rg.close()
    return {"seconds": seconds, "bytes": total, "tensors": len(metas), "model": source.describe()}


def run_colocated(case: Case, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Run the comparison on 1 + ``case.consumers`` local processes; write and return its summary."""
    load_before = os.getloadavg()
    world_size = case.consumers + 1
    ports = {name: free_port() for name in ("gloo", "shm", f"shm_{case.consumers}")}
    per_rank = run_local_ranks(_rank_main, world_size, (world_size, ports, case), timeout_s)
    summary = summarize(per_rank, case)
    write_summary(out_dir, summary, load_before, (COLOCATED_JSON, COLOCATED_MD), format_colocated)
    return summary


def summarize(per_rank: list[dict[str, Any]], case: Case) -> dict[str, Any]:
    """Per mode: the slowest participating rank's time of each repetition, its median, min and max; the ratios of
    the medians, each against its goal."""
    total = per_rank[0]["bytes"]
    n = case.consumers
    modes = {}
    for mode in ("gloo", "shm", f"shm_{n}", "memcpy"):
        ranks = [r["seconds"][mode] for r in per_rank if r["seconds"].get(mode)]
        per_rep = [max(times[i] for times in ranks) for i in range(case.reps)]
        modes[mode] = {
            "median_s": statistics.median(per_rep),
            "min_s": min(per_rep),
            "max_s": max(per_rep),
            "per_rep_s": per_rep,
            "gb_per_s": gb_per_s(total, statistics.median(per_rep)),
        }
    med = {m: v["median_s"] for m, v in modes.items()}
    ratios = {
        "gloo_over_shm": med["gloo"] / med["shm"],
        "shm_over_memcpy": med["shm"] / med["memcpy"],
        "shm_n_over_shm": med[f"shm_{n}"] / med["shm"],
    }
    met = {k: (v >= GOALS[k][1] if GOALS[k][0] == ">=" else v <= GOALS[k][1]) for k, v in ratios.items()}
    return {
        "case": {"preset": case.preset, "size_bytes": total, "buffer_size_bytes": case.buffer_size_bytes},
        "num_buffers": case.num_buffers,
        "consumers": n,
        "reps": case.reps,
        "model": per_rank[0]["model"],
        "tensors": per_rank[0]["tensors"],
        "modes": modes,
        "ratios": ratios,
        "goals": {k: f"{op} {v}" for k, (op, v) in GOALS.items()},
        "goals_met": met,
        "timing": "per repetition: the slowest participating rank's wall time; modes rotate within repetitions",
    }


def format_colocated(s: dict[str, Any]) -> str:
    """The summary as markdown: one row per mode, then the ratios against their goals."""
    n = s["consumers"]
    lines = [
        f"{s['case']['preset']}, {format_decimal(s['case']['size_bytes'])} in {s['tensors']} tensors, buffer "
        f"{format_size(s['case']['buffer_size_bytes'])} x {s['num_buffers']}, {s['reps']} repetitions",
        "",
        "| mode | median s | min-max s | GB/s |",
        "|---|---|---|---|",
    ]
    labels = {"gloo": "gloo, 1 consumer", "shm": "shm, 1 consumer", f"shm_{n}": f"shm, {n} consumers"}
    for mode, m in s["modes"].items():
        label = labels.get(mode, "memcpy (producer alone)")
        lines.append(f"| {label} | {m['median_s']:.3f} | {m['min_s']:.3f}-{m['max_s']:.3f} | {m['gb_per_s']:.2f} |")
    lines += ["", "| ratio | value | goal | met |", "|---|---|---|---|"]
    names = {"gloo_over_shm": "gloo / shm", "shm_over_memcpy": "shm / memcpy", "shm_n_over_shm": f"shm {n} / shm 1"}
    for key, value in s["ratios"].items():
        lines.append(f"| {names[key]} | {value:.2f}x | {s['goals'][key]} | {'yes' if s['goals_met'][key] else 'NO'} |")
    return "\n".join(lines) + "\n"
