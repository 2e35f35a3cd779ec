"""A sweep's results in one place: a table and a throughput plot, rebuilt in the sweep directory after every job.

Rebuilding after each job (not only at the end) matters: Hydra's basic sweeper raises as soon as a batch holds a
failed job, so ``on_multirun_end`` never runs for a sweep with a failure, and an interrupted sweep still leaves
the rows of the jobs that finished.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from refit_app.app.metrics import METRICS_FILE, STEADY_ROUND, WHOLE_RUN, Headline, headline, overall_verified
from refit_app.common.errors import one_line
from refit_app.common.files import write_atomic
from refit_app.common.sizes import format_decimal, format_size

logger = logging.getLogger(__name__)

SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
THROUGHPUT_PNG = "throughput.png"
JOB_STATUS_FILE = "job_status.json"
"""Written by the callback into each job's directory: how the job ended, for jobs that left no metrics."""

SUMMARY_COLUMNS = (
    "job",
    "overrides",
    "status",
    "error",
    "role",
    "backend",
    "buffer_size_bytes",
    "num_buffers",
    "use_legacy_packing",
    "bytes",
    "seconds",
    "gb_per_s",
    "peak_rss_bytes",
    "peak_extra_bytes",
    "verified",
    "rounds_done",
    "wire_bytes",
    "steady_round_seconds",
    "steady_gb_per_s",
    "steady_wire_bytes",
    "figure",
)
"""``bytes`` to ``verified``, ``rounds_done`` and ``wire_bytes`` are the run's metrics.json figures, as they are for
a one-round run; ``steady_*`` are one steady round's (:func:`~refit_app.app.metrics.headline`), empty with one
round; ``figure`` says which of the two the plot and the optuna objective use (``steady round`` or ``whole run``).
New columns go at the end, so that a script reading columns by position keeps working."""
_METRICS_COLUMNS = (
    "role",
    "backend",
    "buffer_size_bytes",
    "num_buffers",
    "use_legacy_packing",
    "bytes",
    "seconds",
    "gb_per_s",
    "peak_rss_bytes",
    "peak_extra_bytes",
    "rounds_done",
    "wire_bytes",
)
"""Columns copied from metrics.json as they are."""

# Overrides that place a job on the plot; the rest distinguish its lines (e.g. a sweep over model presets).
_PLOT_AXES_KEYS = ("refit.buffer_size_bytes", "refit.num_buffers", "refit.use_legacy_packing")
_LEADING_NUMBER = re.compile(r"^(\d+)")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return None
    return data if isinstance(data, dict) else None


def _job_number(job_dir: Path) -> int | None:
    """Hydra names job directories ``${hydra.job.num}`` by default; a custom subdir still records the number."""
    match = _LEADING_NUMBER.match(job_dir.name)
    if match:
        return int(match.group(1))
    hydra_yaml = job_dir / ".hydra" / "hydra.yaml"
    if not hydra_yaml.is_file():
        return None
    num = OmegaConf.select(OmegaConf.load(hydra_yaml), "hydra.job.num", default=None)
    return num if isinstance(num, int) else None


def _overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    return [str(o) for o in OmegaConf.to_container(OmegaConf.load(path))]


def _job_row(num: int, job_dir: Path) -> dict[str, Any]:
    metrics = _read_json(job_dir / METRICS_FILE)
    ended = _read_json(job_dir / JOB_STATUS_FILE) or {}
    overrides = _overrides(job_dir)
    row: dict[str, Any] = {column: None for column in SUMMARY_COLUMNS}
    row.update(job=num, overrides=" ".join(overrides), _headline=None)
    if metrics is not None:
        for column in _METRICS_COLUMNS:
            row[column] = metrics.get(column)
        row["verified"] = overall_verified(metrics)
        figures = headline(metrics)
        row["figure"] = figures.basis
        if figures.basis == STEADY_ROUND:
            row.update(
                steady_round_seconds=figures.seconds,
                steady_gb_per_s=figures.gb_per_s,
                steady_wire_bytes=figures.wire_bytes,
            )
        row["_headline"] = figures
    failed = metrics is None or metrics.get("status") != "ok" or ended.get("status") == "failed"
    row["status"] = "failed" if failed else "ok"
    if failed:
        row["error"] = (
            (metrics or {}).get("error")
            or ended.get("error")
            or (f"no {METRICS_FILE} in {job_dir.name}/ (the job did not finish)" if metrics is None else None)
            or "failed without an error message"
        )
    row["_overrides"] = overrides
    return row


def collect_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory (those Hydra created, with ``.hydra/``, or holding metrics), by job number."""
    rows = []
    for job_dir in sweep_dir.iterdir():
        if not job_dir.is_dir() or not ((job_dir / ".hydra").is_dir() or (job_dir / METRICS_FILE).is_file()):
            continue
        num = _job_number(job_dir)
        if num is None:
            logger.warning("skipping %s: cannot tell its job number", job_dir)
            continue
        rows.append(_job_row(num, job_dir))
    rows.sort(key=lambda r: r["job"])
    return rows


def _csv_text(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=SUMMARY_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row[k] is None else row[k]) for k in SUMMARY_COLUMNS})
    return out.getvalue()


def _md_cell(value: Any, fmt: Any = str) -> str:
    if value is None:
        return ""
    return fmt(value).replace("|", "\\|").replace("\n", " ")


def _basis_label(figures: Headline, rounds_done: int | None) -> str:
    if figures.basis == STEADY_ROUND and rounds_done:
        return f"steady round (median of rounds 2-{rounds_done})" if rounds_done > 2 else "steady round (round 2)"
    return figures.basis


def _md_text(rows: list[dict[str, Any]]) -> str:
    # One set of figure columns whose row says what they are ("figure"): a reader compares one column down the
    # sweep, and a sweep over refit.rounds mixes one-round and multi-round jobs.
    header = [
        "job", "overrides", "status", "buffer", "buffers", "packing", "rounds",
        "figure", "bytes", "seconds", "GB/s", "wire bytes", "peak RSS", "peak extra", "verified", "error",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        packing = None if r["use_legacy_packing"] is None else ("legacy" if r["use_legacy_packing"] else "bounded")
        f: Headline | None = r["_headline"]
        basis, nbytes, seconds, rate, wire = (
            (None,) * 5
            if f is None
            else (_basis_label(f, r["rounds_done"]), f.bytes, f.seconds, f.gb_per_s, f.wire_bytes)
        )
        cells = [
            _md_cell(r["job"]),
            _md_cell(r["overrides"]),
            _md_cell(r["status"]),
            _md_cell(r["buffer_size_bytes"], format_size),
            _md_cell(r["num_buffers"]),
            _md_cell(packing),
            _md_cell(r["rounds_done"]),
            _md_cell(basis),
            _md_cell(nbytes, format_decimal),
            _md_cell(seconds, lambda s: f"{s:.3f}"),
            _md_cell(rate, lambda g: f"{g:.3f}"),
            _md_cell(wire, format_decimal),
            _md_cell(r["peak_rss_bytes"], format_size),
            _md_cell(r["peak_extra_bytes"], format_size),
            _md_cell(r["verified"], lambda v: "yes" if v else "NO"),
            _md_cell(r["error"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _throughput(row: dict[str, Any]) -> float | None:
    """What the plot shows for a job: its headline throughput (one steady round's when it had several)."""
    figures: Headline | None = row["_headline"]
    if figures is None or figures.gb_per_s is None or not math.isfinite(figures.gb_per_s):
        return None
    return figures.gb_per_s


def _plot_png(rows: list[dict[str, Any]]) -> bytes | None:
    """Throughput against buffer size, one line per buffer count; None when no job finished with figures."""
    points = [r for r in rows if r["status"] == "ok" and r["buffer_size_bytes"] and _throughput(r) is not None]
    if not points:
        return None
    bases = {r["_headline"].basis for r in points}
    ylabel = {
        frozenset({STEADY_ROUND}): "steady-round throughput (GB/s)",
        frozenset({WHOLE_RUN}): "throughput (GB/s)",
    }.get(frozenset(bases), "throughput (GB/s): the steady round's where rounds > 1")
    # Imported here: matplotlib costs a second to import and only sweeps need it. The object API with an
    # explicit Agg canvas leaves pyplot's global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    packings = sorted({bool(r["use_legacy_packing"]) for r in points})
    fig = Figure(figsize=(6.4 * len(packings), 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(packings), squeeze=False)[0]
    # Overrides every job shares say nothing about a line: they go into the title, not each legend entry.
    shared = set.intersection(*(set(r["_overrides"]) for r in points))
    if shared:
        fig.suptitle(" ".join(sorted(shared)), fontsize="small")
    for ax, legacy in zip(axes, packings):
        lines: dict[tuple[Any, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in points:
            if bool(r["use_legacy_packing"]) != legacy:
                continue
            others = " ".join(
                o for o in r["_overrides"] if o not in shared and o.split("=", 1)[0].lstrip("+~") not in _PLOT_AXES_KEYS
            )
            lines[(r["num_buffers"], others)][r["buffer_size_bytes"] / 2**20].append(_throughput(r))
        for (num_buffers, others), by_size in sorted(lines.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])):
            sizes = sorted(by_size)
            # Repeated settings (e.g. a sweep over seeds) plot as their mean.
            rates = [sum(by_size[s]) / len(by_size[s]) for s in sizes]
            label = f"{num_buffers} buffer{'s' if num_buffers != 1 else ''}" + (f", {others}" if others else "")
            ax.plot(sizes, rates, marker="o", label=label)
        mib = sorted({r["buffer_size_bytes"] / 2**20 for r in points if bool(r["use_legacy_packing"]) == legacy})
        ax.set_xscale("log", base=2)
        ax.set_xticks(mib, [f"{m:g}" for m in mib])
        ax.minorticks_off()
        ax.set_xlabel("buffer size (MiB)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{'legacy' if legacy else 'bounded'} packing")
        ax.legend()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    return out.getvalue()


def write_summary(sweep_dir: Path) -> list[dict[str, Any]]:
    """Rebuild summary.csv, summary.md and throughput.png in ``sweep_dir`` from its job directories.

    Returns the rows, with the keys in SUMMARY_COLUMNS. The table is written before the plot, so a plotting
    problem cannot cost the table.
    """
    sweep_dir = Path(sweep_dir)
    rows = collect_rows(sweep_dir)
    write_atomic(sweep_dir / SUMMARY_CSV, _csv_text(rows).encode())
    write_atomic(sweep_dir / SUMMARY_MD, _md_text(rows).encode())
    png = _plot_png(rows)
    if png is not None:
        write_atomic(sweep_dir / THROUGHPUT_PNG, png)
    return [{k: r[k] for k in SUMMARY_COLUMNS} for r in rows]


def _sweep_dir(config: DictConfig) -> Path:
    sweep_dir = Path(str(config.hydra.sweep.dir))
    # With hydra.job.chdir=true the job's directory is still the cwd when on_job_end runs.
    return sweep_dir if sweep_dir.is_absolute() else Path(str(config.hydra.runtime.cwd)) / sweep_dir


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks``) that keeps a multirun's summary current; does nothing in a single run.

    It never raises: a summary problem is logged as a warning and cannot fail the sweep or hide a job's error.
    """

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        try:
            if config.hydra.mode != RunMode.MULTIRUN:
                return
            self._record_job_end(config, job_return)
            write_summary(_sweep_dir(config))
        except Exception as e:
            logger.warning("could not update the sweep summary: %s", one_line(e, with_type=True))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            sweep_dir = _sweep_dir(config)
            rows = write_summary(sweep_dir)
            failed = sum(r["status"] != "ok" for r in rows)
            logger.info("sweep summary: %d jobs, %d failed, in %s", len(rows), failed, sweep_dir / SUMMARY_MD)
        except Exception as e:
            logger.warning("could not write the sweep summary: %s", one_line(e, with_type=True))

    @staticmethod
    def _record_job_end(config: DictConfig, job_return: JobReturn) -> None:
        """Leave how the job ended beside it, since a job that failed early writes no metrics."""
        status: dict[str, Any] = {"status": "ok", "error": None}
        if job_return.status == JobStatus.FAILED:
            # The public `return_value` re-raises the exception and prints to stderr; Hydra reports the
            # failure itself later, so read the stored exception instead.
            exc = getattr(job_return, "_return_value", None)
            status = {
                "status": "failed",
                "error": one_line(exc, with_type=True) if isinstance(exc, BaseException) else "the job failed",
            }
        job_dir = Path(str(config.hydra.runtime.output_dir))
        write_atomic(job_dir / JOB_STATUS_FILE, (json.dumps(status) + "\n").encode())
