"""One rank's measurements of one case, on a group every rank has joined: the timed repetitions of each mode,
then the memory flatness over consecutive refits and session rounds, then (``--delta-shares``) dense against delta
session rounds at each share of changed elements and the memory over many delta rounds. Spawned ranks
(:mod:`.spawned`) and ranks on other hosts (:mod:`.ranks`) both run :func:`run_case`; :mod:`.report` turns every
rank's results into the summary."""

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
from refit_app.bench.delta import ChangingModel, DeltaSessions
from refit_app.bench.modes import Limit, Session, barrier, per_tensor, refit
from refit_app.core.meta import TensorMeta
from refit_app.models.sources import SyntheticSource
from refit_app.packed_tensor import release_buffers
from refit_app.protocol.defaults import DELTA_MODES
from refit_app.protocol.session import Round
from refit_app.transport.groups import RefitGroup


def _return_free_memory_to_os() -> None:
    """glibc keeps freed heap memory (and raises its mmap threshold after large frees), so RSS would still count
    buffers already released; trimming makes the model-only baseline honest. A no-op where glibc is absent."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss() -> int | None:
    """This rank's resident memory now."""
    probe = PeakMemory()
    probe.start()
    probe.stop()
    return probe.baseline_rss


def time_transfer(rg: RefitGroup, run: Callable[[], int], expected: int, label: str) -> tuple[float, float, PeakMemory]:
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


class ListedSource:
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
        source = ListedSource(source)
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
            elapsed, cpu, _ = time_transfer(rg, runners[mode], total, mode)
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
    model_rss = _rss()
    flat: dict[str, list[dict[str, int | None]]] = {"refit": [], "session": []}
    flat_runners = {"refit": functools.partial(refit, rg, source, metas, case)}
    if session is not None:
        flat_runners["session"] = session.run
    for mode, run in flat_runners.items():
        for _ in range(case.flat_refits):
            _, _, memory = time_transfer(rg, run, total, mode)
            above = None if memory.peak_rss is None or model_rss is None else memory.peak_rss - model_rss
            flat[mode].append({"baseline_rss_bytes": memory.baseline_rss, "peak_extra_bytes": above})
    if session is not None:
        session.close()
    del flat_runners, session
    delta = run_delta(rg, case, source if rg.rank == 0 else None, metas) if case.delta_shares else None
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "flat": flat,
        "model": source.describe(),
        "bytes": total,
        "num_tensors": len(metas),
        "num_chunks": len(chunks(metas, case)),
        "largest_tensor_bytes": max(m.nbytes for m in metas),
        **({"delta": delta} if delta is not None else {}),
    }


def _round_figures(r: Round) -> dict[str, Any]:
    return {
        "wire_bytes": r.wire_bytes,
        "base_round": r.base_round,
        "plain": r.plain,
        "changed_elements": r.changed_elements,
        "total_elements": r.total_elements,
        "encodings": r.encodings,
        "delta_seconds": r.delta_seconds,
    }


def run_delta(rg: RefitGroup, case: Case, source: ListedSource | None, metas: list[TensorMeta]) -> dict[str, Any]:
    """This rank's side of the dense-against-delta comparison: at each of ``case.delta_shares``, ``case.reps``
    timed rounds of each delta mode's session, the model changed at that share before each repetition; then the
    memory over ``case.delta_rounds`` delta rounds. Every rank of the group must call it; ``source`` is the
    producer's (None elsewhere)."""
    model = None if source is None else ChangingModel(source.tensors(), metas, case.post)
    total = sum(m.nbytes for m in metas)
    sessions = DeltaSessions(rg, model, metas, case)
    for mode in DELTA_MODES:  # round 1: the manifest, dense in every mode
        sessions.run(mode)
    round_index = 1
    shares = []
    for share in case.delta_shares:
        seconds: dict[str, list[float]] = {mode: [] for mode in DELTA_MODES}
        cpu_seconds: dict[str, list[float]] = {mode: [] for mode in DELTA_MODES}
        rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in DELTA_MODES}
        # Repetition 0 is the first round at this share, untimed: auto's estimate is still the last share's, and
        # the first delta round of a session allocates its stream buffers.
        for rep in range(case.reps + 1):
            round_index += 1
            if model is not None:
                model.change(share, round_index)
                _return_free_memory_to_os()
            # Each repetition starts with the next mode, so that no mode always runs first after the change (the
            # model's pages cold in cache) or right after another's allocations.
            order = DELTA_MODES[rep % len(DELTA_MODES) :] + DELTA_MODES[: rep % len(DELTA_MODES)]
            for mode in order:
                run = _SessionRound(sessions, mode)
                elapsed, cpu, _ = time_transfer(rg, run, total, mode)
                if rep:
                    seconds[mode].append(elapsed)
                    cpu_seconds[mode].append(cpu)
                    rounds[mode].append(_round_figures(run.last))
        shares.append({"share": share, "seconds": seconds, "cpu_seconds": cpu_seconds, "rounds": rounds})
    sessions.close()
    gc.collect()
    return {"shares": shares, "flat": _delta_flatness(rg, case, model, metas, total, round_index)}


class _SessionRound:
    """One round of a delta mode's session, as :func:`time_transfer` runs it (returning its bytes); keeps its
    figures."""

    def __init__(self, sessions: DeltaSessions, mode: str) -> None:
        self._sessions, self._mode = sessions, mode
        self.last = Round(round=0)

    def __call__(self) -> int:
        self.last = self._sessions.run(self._mode)
        return self.last.bytes


def _delta_flatness(
    rg: RefitGroup, case: Case, model: ChangingModel | None, metas: list[TensorMeta], total: int, round_index: int
) -> dict[str, Any] | None:
    """Memory over ``case.delta_rounds`` delta rounds of one fresh ``delta="on"`` session pair, nothing else in
    between: this rank's RSS with the model alone, then before and at the peak of every round (round 1 dense,
    filling the snapshot or the mirror; each later round at the next share of ``case.delta_shares`` in turn)."""
    if not case.delta_rounds:
        return None
    release_buffers()
    _return_free_memory_to_os()
    model_rss = _rss()
    sessions = DeltaSessions(rg, model, metas, case, ("on",))
    rounds = []
    for k in range(1, case.delta_rounds + 2):
        share = None if k == 1 else case.delta_shares[(k - 2) % len(case.delta_shares)]
        if model is not None and share is not None:
            round_index += 1
            model.change(share, round_index)
        # What the session holds, not what the allocator keeps of freed scratch (the changes', or a 50% round's
        # positions): RSS before a round would otherwise follow the largest round before it.
        _return_free_memory_to_os()
        run = _SessionRound(sessions, "on")
        _, _, memory = time_transfer(rg, run, total, "delta flatness")
        rounds.append(
            {
                "round": k,
                "share": share,
                "delta": run.last.delta,
                "rss_before_bytes": memory.baseline_rss,
                "peak_rss_bytes": memory.peak_rss,
            }
        )
    _return_free_memory_to_os()
    rss_after = _rss()
    sessions.close()
    return {"model_rss_bytes": model_rss, "rounds": rounds, "rss_after_bytes": rss_after}
