"""Every rank's results turned into one summary per case, and what a run leaves in ``--out``: ``bench.json`` (the
machine, the backend and the summaries), ``table.md`` (the markdown tables it also prints), ``throughput.png`` where
some case timed the modes and ``delta.png`` where some case compared dense with delta rounds (:mod:`.plot`; the
delta comparison's own figures: :mod:`.delta_report`)."""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from refit_app.bench.cases import Case
from refit_app.bench.delta_report import DELTA_DESCRIPTION, delta_memory_lines, format_delta_table, summarize_delta
from refit_app.bench.plot import delta_png, throughput_png
from refit_app.common.files import write_atomic
from refit_app.common.sizes import format_decimal, format_size, gb_per_s

BENCH_JSON = "bench.json"
TABLE_MD = "table.md"
PLOT_PNG = "throughput.png"
DELTA_PNG = "delta.png"

MEMORY_SLACK = 0.10
"""Issue 5's bound on peak RSS above the model: num_buffers x max(buffer, largest tensor), plus this fraction."""

MODE_DESCRIPTIONS = {
    "refit": "packed_broadcast_producer/consumer, one call each, consumer drops each batch",
    "session": "one steady-state round of ProducerSession.send / ConsumerSession.receive (manifest sent in "
    "an untimed first round), consumer drops each batch",
    "limit": "the same chunks pre-packed on both sides, all broadcast async back to back, then waited",
    "per_tensor": "one synchronous broadcast per tensor into a freshly allocated tensor",
}


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(case: Case, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's entry of bench.json from every rank's :func:`~refit_app.bench.measure.run_case` result, in rank
    order: per mode the slowest rank's time per repetition and its median, min and max; the ratios between modes'
    medians; per rank the peak memory above the model against the bound."""
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
        **({"delta": summarize_delta(case, per_rank, total)} if case.delta_shares else {}),
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


def _row(s: dict[str, Any]) -> str:
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
        values = [
            m["refit_peak_extra_bytes_max"] if mode == "refit" else (m["session"] or {}).get("peak_extra_bytes_max")
            for m in s["memory"]
        ]
        producer, consumers = values[0], [v for v in values[1:] if v is not None]
        return (
            f"{'-' if producer is None else format_size(producer)} / "
            f"{format_size(max(consumers)) if consumers else '-'}"
        )

    return (
        f"| {case['preset']} | {_size_label(s)} | {s['num_tensors']} | {s['num_chunks']} "
        f"| {format_size(case['buffer_size_bytes'])} x {case['num_buffers']} | {case['consumers']} "
        f"| {case['post']} | {cell('refit')} | {cell('session')} | {cell('limit')} | {cell('per_tensor')} "
        f"| {ratio('refit_over_limit')} | {ratio('session_over_limit')} "
        f"| {ratio('refit_speedup_over_per_tensor')} | {ratio('session_speedup_over_per_tensor')} "
        f"| {peaks('refit')} | {peaks('session')} | {format_size(s['memory_buffers_bytes'])} |"
    )


def format_table(summaries: list[dict[str, Any]]) -> str:
    """The results as markdown: the modes' table (one row per case that timed them: throughput medians with min-max,
    and the ratios), then the dense-against-delta table where some case has one."""
    timed = [s for s in summaries if s["modes"]]
    parts = [_modes_table(timed)] if timed or not summaries else []
    if any("delta" in s for s in summaries):
        parts.append(format_delta_table(summaries))
    return "\n".join(parts)


def plot_files(summaries: list[dict[str, Any]]) -> list[str]:
    """The plots a run with these results writes, in ``--out``."""
    return ([PLOT_PNG] if any(s["modes"] for s in summaries) else []) + (
        [DELTA_PNG] if any("delta" in s for s in summaries) else []
    )


def _modes_table(summaries: list[dict[str, Any]]) -> str:
    head = (
        "| model | size | tensors | chunks | buffer x n | consumers | post | refit GB/s | session GB/s | limit GB/s "
        "| per-tensor GB/s | refit/limit | session/limit | refit vs per-tensor | session vs per-tensor "
        "| peak RSS above model, refit (P / C max) | session (P / C max) | bound n x max(buffer, largest) |\n"
    )
    rule = "|" + "---|" * 18 + "\n"
    return head + rule + "\n".join(_row(s) for s in summaries) + "\n"


def memory_lines(summaries: list[dict[str, Any]]) -> Iterator[str]:
    """One printed line per rank and flatness mode: peak memory above the model against the bound; then the delta
    rounds' memory."""
    yield from _flat_lines(summaries)
    yield from delta_memory_lines(summaries)


def _flat_lines(summaries: list[dict[str, Any]]) -> Iterator[str]:
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


def write_results(ordered: list[dict[str, Any]], out_dir: Path, load_before: Sequence[float], backend: str) -> None:
    """bench.json, table.md and the plots (:func:`plot_files`) in ``out_dir``; the plots last, so a plotting problem
    cannot cost the figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "machine": {**machine_info(), "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "backend": backend,
        "modes": MODE_DESCRIPTIONS,
        **({"delta": DELTA_DESCRIPTION} if any("delta" in s for s in ordered) else {}),
        "timing": "per repetition: the slowest rank's wall time; median, min and max over repetitions",
        "cases": ordered,
    }
    write_atomic(out_dir / BENCH_JSON, (json.dumps(doc, indent=2, default=str) + "\n").encode())
    write_atomic(out_dir / TABLE_MD, format_table(ordered).encode())
    draw = {PLOT_PNG: throughput_png, DELTA_PNG: delta_png}
    for name in plot_files(ordered):
        write_atomic(out_dir / name, draw[name](doc))


def write_summary(
    out_dir: Path,
    summary: dict[str, Any],
    load_before: Sequence[float],
    names: tuple[str, str],
    markdown: Callable[[dict[str, Any]], str],
) -> None:
    """A one-case comparison's files in ``out_dir`` (``names``: the JSON's and the markdown's), the machine and its
    load before and after the run added to ``summary``."""
    summary["machine"] = {**machine_info(), "load_average_before": load_before, "load_average_after": os.getloadavg()}
    out_dir.mkdir(parents=True, exist_ok=True)
    json_name, md_name = names
    write_atomic(out_dir / json_name, (json.dumps(summary, indent=2, default=str) + "\n").encode())
    write_atomic(out_dir / md_name, markdown(summary).encode())
