"""Every rank on this machine: one spawned process per rank, one gloo group over loopback per consumer count, all
through :func:`refit_app.app.rank_harness.run_ranks` like the application's local ranks."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from refit_app.app.rank_harness import free_port, run_ranks
from refit_app.bench.cases import Case
from refit_app.bench.measure import run_case
from refit_app.bench.report import summarize, write_results
from refit_app.transport.groups import GroupSpec, connect

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 3600.0
COLLECTIVE_TIMEOUT_S = 600.0
"""Deadline of every collective: a 4 GB chunk list on a slow machine must not trip it, a hung peer must."""
BUSY_LOAD_PER_CORE = 0.5
"""Above this 1-minute load average per core at the start, the run warns that other work skews its timings."""
_CHILD_EXIT_S = 10.0


def _rank_main(rank: int, world_size: int, port: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Entry point of one spawned rank: every case of this world size on one group."""
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    spec = GroupSpec(backend="gloo", port=port, world_size=world_size, rank=rank, timeout_s=COLLECTIVE_TIMEOUT_S)
    with connect(spec) as rg:
        return [run_case(rg, case) for case in cases]


def run_local_ranks(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float) -> list[Any]:
    """Every rank's value of ``fn(rank, *args)``, one process per rank on this machine, in rank order; raises if a
    rank failed (TimeoutError past ``timeout_s``)."""
    # A failed rank breaks the others' collectives at once: no point waiting for them. run_ranks has the fork
    # server import fn's module (never __main__), and with it everything a rank imports, once for every rank.
    outcomes = run_ranks(fn, world_size, args, timeout_s=timeout_s, grace_s=_CHILD_EXIT_S, name="bench-rank")
    failed = next((o for o in outcomes if not o.ok), None)
    if failed is not None:
        if failed.exc_type == "Timeout":
            raise TimeoutError(f"the benchmark did not finish within --timeout-s={timeout_s:g}; raise it")
        raise RuntimeError(f"benchmark rank failed: {failed}\n{failed.traceback}")
    return [o.value for o in outcomes]


def _run_world(cases: list[Case], timeout_s: float) -> list[list[dict[str, Any]]]:
    """Run ``cases`` (all with the same consumer count) on one group; per-rank results, in rank order."""
    world_size = cases[0].consumers + 1
    return run_local_ranks(_rank_main, world_size, (world_size, free_port(), cases), timeout_s)


def run(cases: list[Case], out_dir: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Run every case (one group per consumer count), write bench.json, table.md and throughput.png, return the
    summaries."""
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
            summaries[case] = summarize(case, [rank[i] for rank in per_rank])
    ordered = [summaries[c] for c in cases]
    write_results(ordered, out_dir, load_before, "gloo (loopback, one process per rank)")
    return ordered
