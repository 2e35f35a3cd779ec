"""One rank's measurements of one case, on a group every rank has joined: the timed repetitions of each mode,
then the memory flatness over consecutive refits and session rounds. Spawned ranks (:mod:`.spawned`) and ranks on
other hosts (:mod:`.ranks`) both run :func:`run_case`; :mod:`.report` turns every rank's results into the summary."""

from __future__ import annotations

import ctypes
import functools
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from refit_app.app.metrics import PeakMemory
from refit_app.bench.cases import Case, chunks, make_source, wire_metas
from refit_app.bench.modes import Limit, Session, barrier, per_tensor, refit
from refit_app.models.sources import SyntheticSource
from refit_app.packed_tensor import release_buffers
from refit_app.transport.groups import RefitGroup


def _return_free_memory_to_os() -> None:
    """glibc keeps freed heap memory (and raises its mmap threshold after large frees), so RSS would still count
    buffers already released; trimming makes the model-only baseline honest. A no-op where glibc is absent."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _timed(rg: RefitGroup, run: Callable[[], int], expected: int, label: str) -> tuple[float, float, PeakMemory]:
    """(wall seconds, CPU seconds of every thread of this rank, its peak memory) of one transfer."""
    barrier(rg)
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


def run_case(rg: RefitGroup, case: Case) -> dict[str, Any]:
    """This rank's side of ``case``: per-mode wall and CPU seconds of every timed repetition, the peak memory
    above the model of every flatness call, and the model's figures. Every rank of the group must call it."""
    source = make_source(case)
    if rg.rank == 0:
        source = _Listed(source)
    metas = wire_metas(source, case.post)
    total = sum(m.nbytes for m in metas)
    runners: dict[str, Callable[[], int]] = {
        "refit": functools.partial(refit, rg, source, metas, case),
        "per_tensor": functools.partial(per_tensor, rg, source, metas, case),
    }
    # Every rank constructs the session at the same point (they exchange their needs there).
    session = Session(rg, source, metas, case) if "session" in case.modes or case.flat_refits else None
    if session is not None:
        runners["session"] = session.run
    if "limit" in case.modes:
        runners["limit"] = functools.partial(Limit(rg.rank, source, metas, case).run, rg)

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
    flat_runners = {"refit": functools.partial(refit, rg, source, metas, case)}
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
        "num_chunks": len(chunks(metas, case)),
        "largest_tensor_bytes": max(m.nbytes for m in metas),
    }
