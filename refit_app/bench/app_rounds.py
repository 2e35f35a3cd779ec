"""``python -m refit_app.bench --app``: a steady round of the application's own loop against the library's session
round, on gloo over loopback and on shared memory, interleaved in one run.

The application's round is what ``python -m refit_app source=synthetic sink=discard refit.rounds=N`` does per
round on each rank: :class:`~refit_app.app.roles.ProducerRounds` (the source advanced as a training step, its
manifest, the progress display, the peak-memory probe, the round's metrics) and
:class:`~refit_app.app.roles.ConsumerRounds` (the sink's hooks, the same probe and metrics), with settings composed
from the real ``conf/`` as the command line would (:func:`app_settings`). The session's round is the benchmark's
``session`` mode (:class:`~refit_app.bench.modes.Session`): a bare :class:`ProducerSession` /
:class:`ConsumerSession` pair sending a listed model. Same shape, buffers and packing; neither verifies (a discard
sink asks for no checksums).

Two processes join four groups: ``app`` and ``session`` on each backend (one session per group). Each backend in
turn: each repetition times one round of each kind, the app's first in one repetition and the session's in the next,
each after a barrier on its group; a round's time is the slower rank's wall time of the whole call (the app's:
everything its loop does for that round). Printed: the medians and app/session per backend, against issue 23's
goal (at most 1.10); ``--out`` gets ``app_rounds.json`` and ``app_rounds.md``.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from refit_app.app.config import RunSettings
from refit_app.app.rank_harness import free_port
from refit_app.bench.cases import Case, make_source, wire_metas
from refit_app.bench.measure import ListedSource, time_transfer
from refit_app.bench.modes import Session
from refit_app.bench.report import write_summary
from refit_app.bench.spawned import COLLECTIVE_TIMEOUT_S, run_local_ranks
from refit_app.common.sizes import format_decimal, format_size, gb_per_s
from refit_app.transport.auth import new_secret
from refit_app.transport.groups import GroupSpec, RefitGroup, connect

APP_ROUNDS_JSON = "app_rounds.json"
APP_ROUNDS_MD = "app_rounds.md"
BACKENDS = ("gloo", "shm")
KINDS = ("app", "session")
GOAL_APP_OVER_SESSION = 1.10
"""Issue 23: the application's steady round within 10% of the library's session round."""


def app_settings(case: Case, backend: str, rounds: int) -> RunSettings:
    """The settings ``python -m refit_app`` runs ``case`` with: its shape as ``source=synthetic`` (the app's default
    seed, dtype and update), ``sink=discard``, its buffers, ``rounds`` rounds; composed from the real ``conf/`` and
    checked by :func:`~refit_app.app.config.validate`, so every other key is the application's default."""
    from hydra import compose, initialize_config_module

    from refit_app.app.config import validate
    from refit_app.app.schema import CONF_MODULE, CONFIG_NAME

    overrides = [
        "sink=discard",
        f"source.preset={case.preset}",
        f"refit.buffer_size_bytes={case.buffer_size_bytes}",
        f"refit.num_buffers={case.num_buffers}",
        f"refit.rounds={rounds}",
        f"group.backend={backend}",
    ]
    if case.size_bytes is not None:
        overrides.append(f"source.size={case.size_bytes}")
    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        return validate(compose(config_name=CONFIG_NAME, overrides=overrides))


class _AppRounds:
    """One rank's side of the application's loop on ``rg``: round 1 (the manifest) at construction, untimed, like
    :class:`Session`'s; :meth:`run` is the next round."""

    def __init__(self, rg: RefitGroup, s: RunSettings) -> None:
        from refit_app.app.roles import ConsumerRounds, ProducerRounds
        from refit_app.models.sinks import make_sink
        from refit_app.models.sources import make_source as make_app_source

        self._k = 1
        if rg.rank == 0:
            # The producer of role=local draws the progress line, as here; consumers do not.
            self._producer: ProducerRounds | None = ProducerRounds(
                s, rg, make_app_source(s.source.target, s.source.params), show_progress=True
            )
            self._consumer: ConsumerRounds | None = None
        else:
            self._producer = None
            self._consumer = ConsumerRounds(s, rg, make_sink(s.sink.target, s.sink.params), show_progress=False)
        self.run()

    def run(self) -> int:
        if self._producer is not None:
            r = self._producer.send(self._k)
        else:
            r = self._consumer.receive()
            if r is None:
                raise RuntimeError("the producer's application rounds ended early")
        self._k += 1
        return r.bytes

    def close(self) -> None:
        """The producer ends the session, a consumer's last receive() sees it; both make their metrics, as a run."""
        if self._producer is not None:
            self._producer.finish()
        elif self._consumer.receive() is not None:
            raise RuntimeError("the producer's application rounds did not end when expected")
        else:
            self._consumer.finish()


def _rank_main(
    rank: int, ports: dict[str, int], token: str, case: Case, settings: dict[str, RunSettings]
) -> dict[str, Any]:
    source = make_source(case)
    if rank == 0:
        source = ListedSource(source)
    metas = wire_metas(source, case.post)
    total = sum(m.nbytes for m in metas)
    groups: dict[str, RefitGroup] = {}
    try:
        for backend in BACKENDS:
            for kind in KINDS:
                name = f"{backend}/{kind}"
                spec = GroupSpec(
                    backend=backend,
                    port=ports[name],
                    world_size=2,
                    rank=rank,
                    timeout_s=COLLECTIVE_TIMEOUT_S,
                    token=token,
                )
                groups[name] = connect(spec)
        runs: dict[str, _AppRounds | Session] = {}
        for backend in BACKENDS:  # first rounds, untimed
            runs[f"{backend}/app"] = _AppRounds(groups[f"{backend}/app"], settings[backend])
            runs[f"{backend}/session"] = Session(groups[f"{backend}/session"], source, metas, case)
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        cpu_seconds: dict[str, list[float]] = {name: [] for name in runs}
        for backend in BACKENDS:
            # One backend after the other: whatever one backend's round leaves behind lands on the round after
            # it, and rotating all four rounds put the same kind there every time. (An shm round once emptied the
            # host buffer pool, so the gloo round after it faulted ~530 MB in again: app/session read 1.26.)
            for rep in range(case.reps + 1):  # repetition 0 warms both
                kinds = KINDS if rep % 2 else KINDS[::-1]  # ABBA: neither kind always follows the other
                for name in (f"{backend}/{kind}" for kind in kinds):
                    elapsed, cpu, _ = time_transfer(groups[name], runs[name].run, total, name)
                    if rep:
                        seconds[name].append(elapsed)
                        cpu_seconds[name].append(cpu)
        for run in runs.values():
            run.close()
    finally:
        for rg in groups.values():
            rg.close()
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "bytes": total, "tensors": len(metas)}


def run_app_rounds(case: Case, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Run the comparison on two local processes; write and return its summary."""
    load_before = os.getloadavg()
    # Round 1 at construction, repetition 0 to warm up, then the timed ones.
    settings = {backend: app_settings(case, backend, case.reps + 2) for backend in BACKENDS}
    ports = {f"{backend}/{kind}": free_port() for backend in BACKENDS for kind in KINDS}
    # A secret of this run's own, as role=local gives its ranks (every group: the four differ in nothing else).
    token = new_secret()
    summary = summarize(run_local_ranks(_rank_main, 2, (ports, token, case, settings), timeout_s), case)
    write_summary(out_dir, summary, load_before, (APP_ROUNDS_JSON, APP_ROUNDS_MD), format_app_rounds)
    return summary


def summarize(per_rank: list[dict[str, Any]], case: Case) -> dict[str, Any]:
    """Per backend and kind: the slower rank's time of each repetition, its median, min and max, and each rank's
    median CPU seconds per round (both ranks' together: how many cores a round keeps busy); app/session per
    backend against the goal."""
    total = per_rank[0]["bytes"]
    rounds: dict[str, Any] = {}
    for name in per_rank[0]["seconds"]:
        per_rep = [max(r["seconds"][name][i] for r in per_rank) for i in range(case.reps)]
        rounds[name] = {
            "median_s": statistics.median(per_rep),
            "min_s": min(per_rep),
            "max_s": max(per_rep),
            "per_rep_s": per_rep,
            "gb_per_s": gb_per_s(total, statistics.median(per_rep)),
            "cpu_s_per_rank": [statistics.median(r["cpu_seconds"][name]) for r in per_rank],
        }
    ratios = {b: rounds[f"{b}/app"]["median_s"] / rounds[f"{b}/session"]["median_s"] for b in BACKENDS}
    return {
        "case": {"preset": case.preset, "size_bytes": total, "buffer_size_bytes": case.buffer_size_bytes},
        "num_buffers": case.num_buffers,
        "reps": case.reps,
        "tensors": per_rank[0]["tensors"],
        "rounds": rounds,
        "app_over_session": ratios,
        "goal": f"<= {GOAL_APP_OVER_SESSION}",
        "goal_met": {b: r <= GOAL_APP_OVER_SESSION for b, r in ratios.items()},
        "timing": "per repetition: the slower rank's wall time of one round; app and session alternate, one backend "
        "after the other",
    }


def format_app_rounds(s: dict[str, Any]) -> str:
    """The summary as markdown: one row per backend and kind, then app/session per backend against the goal."""
    lines = [
        f"{s['case']['preset']}, {format_decimal(s['case']['size_bytes'])} in {s['tensors']} tensors, buffer "
        f"{format_size(s['case']['buffer_size_bytes'])} x {s['num_buffers']}, sink=discard, {s['reps']} repetitions",
        "",
        "| backend | round | median s | min-max s | GB/s | CPU s per round (producer + consumer) |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in s["rounds"].items():
        backend, kind = name.split("/")
        cpu = " + ".join(f"{c:.3f}" for c in m["cpu_s_per_rank"])
        lines.append(
            f"| {backend} | {kind} | {m['median_s']:.3f} | {m['min_s']:.3f}-{m['max_s']:.3f} | {m['gb_per_s']:.2f} "
            f"| {cpu} |"
        )
    lines += ["", "| backend | app / session | goal | met |", "|---|---|---|---|"]
    for backend, ratio in s["app_over_session"].items():
        lines.append(f"| {backend} | {ratio:.3f}x | {s['goal']} | {'yes' if s['goal_met'][backend] else 'NO'} |")
    return "\n".join(lines) + "\n"
