"""The plots, drawn from a ``bench.json`` document.

- ``throughput.png``: per case, each mode's throughput (the median, with the range of the repetitions) and the
  refit's and the session's fraction of the transport's limit;
- ``delta.png`` (``--delta-shares``): per case, the speed-up of delta ``on`` and ``auto`` rounds over dense ones
  against the share of elements changed (log scale), and what each sends per round as a share of the model.

:func:`plot_data` and :func:`delta_plot_data` extract what is drawn, so a test can hold it against the JSON;
:func:`figure` and :func:`delta_figure` draw it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from refit_app.common.sizes import format_decimal, format_size

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MODE_LABELS = {"refit": "refit", "session": "session", "limit": "limit", "per_tensor": "per-tensor"}
"""Drawing order and legend names; the keys are bench.json's mode names."""
MODE_COLORS = {"refit": "tab:blue", "session": "tab:orange", "limit": "tab:gray", "per_tensor": "tab:red"}
"""Fixed per mode, so that two plots compare at a glance; a ratio takes the colour of the mode it measures."""
RATIOS = {"refit_over_limit": ("refit/limit", "refit"), "session_over_limit": ("session/limit", "session")}
"""bench.json's ratio keys drawn, with their label and the mode whose colour they take."""


@dataclass(frozen=True)
class Bar:
    """One mode's throughput in one case, GB/s: the median repetition and the slowest and fastest."""

    median: float
    low: float
    high: float


@dataclass(frozen=True)
class PlotData:
    title: str
    """What every case shares (the model, buffers, consumers or post when they do not vary) and the machine."""
    labels: list[str]
    """One per case, in bench.json's order: what tells it apart from the others."""
    throughput: dict[str, list[Bar | None]]
    """Per mode that some case measured, one entry per case; None where the case did not time the mode."""
    ratios: dict[str, list[float | None]]
    """Per ratio label (``refit/limit``, ...) that some case has, one entry per case: limit time / mode time."""


def _fields(summary: dict[str, Any]) -> dict[str, str]:
    case = summary["case"]
    consumers = case["consumers"]
    return {
        "model": f"{case['preset']} {format_decimal(summary['bytes'])}",
        "buffers": f"{format_size(case['buffer_size_bytes'])} x {case['num_buffers']}",
        "consumers": f"{consumers} consumer{'' if consumers == 1 else 's'}",
        "post": f"post={case['post']}",
    }


def _bar(gb_per_s: dict[str, float | None]) -> Bar | None:
    # bench.json's min and max are of seconds: the fastest repetition is the "min" one.
    values = (gb_per_s["median"], gb_per_s["max"], gb_per_s["min"])
    return None if None in values else Bar(*values)


def _labels_and_title(doc: dict[str, Any], summaries: list[dict[str, Any]]) -> tuple[list[str], str]:
    """A label per case (what tells it apart from the others) and the title (what they share, and the machine)."""
    fields = [_fields(s) for s in summaries]
    varying = [key for key in fields[0] if len({f[key] for f in fields}) > 1] if fields else []
    shared = [value for key, value in fields[0].items() if key not in varying] if fields else []
    # A lone case (or cases alike in every field) is still named by its model.
    label_keys = varying or ["model"]
    labels = [", ".join(f[key] for key in label_keys) for f in fields]
    machine = doc.get("machine", {})
    load = [machine[k][0] for k in ("load_average_before", "load_average_after") if machine.get(k)]
    about = [doc.get("backend", ""), f"{machine['cpu_count']} cores" if machine.get("cpu_count") else ""]
    if load:
        low, high = f"{min(load):.1f}", f"{max(load):.1f}"
        about.append(f"load {low}" if low == high else f"load {low}-{high}")
    return labels, "\n".join(line for line in (", ".join(shared), "; ".join(a for a in about if a)) if line)


def plot_data(doc: dict[str, Any]) -> PlotData:
    """What :func:`figure` draws, from a bench.json document (as :func:`~refit_app.bench.report.write_results`
    writes it)."""
    summaries = doc["cases"]
    labels, title = _labels_and_title(doc, summaries)
    throughput = {
        mode: [_bar(s["modes"][mode]["gb_per_s"]) if mode in s["modes"] else None for s in summaries]
        for mode in MODE_LABELS
        if any(mode in s["modes"] for s in summaries)
    }
    ratios = {
        label: [s["ratios"].get(key) for s in summaries]
        for key, (label, _) in RATIOS.items()
        if any(key in s["ratios"] for s in summaries)
    }
    return PlotData(title, labels, throughput, ratios)


def figure(data: PlotData) -> Figure:
    """Horizontal bars, one group per case from top to bottom: throughput per mode with its range on the left, and
    on the right (when the limit was timed) each ratio against 1, the limit."""
    # Imported here: matplotlib costs a second to import and only the parent process draws. The object API with an
    # explicit Agg canvas leaves pyplot's global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(data.labels)
    fig = Figure(
        figsize=(11 if data.ratios else 7.5, 1.6 + n * (0.2 * len(data.throughput) + 0.3)), layout="constrained"
    )
    FigureCanvasAgg(fig)
    if data.ratios:
        speed, share = fig.subplots(1, 2, sharey=True, width_ratios=(2, 1))
    else:
        speed, share = fig.subplots(1, 1), None
    if data.title:
        fig.suptitle(data.title, fontsize="medium")

    _bars(
        speed,
        {MODE_LABELS[m]: bars for m, bars in data.throughput.items()},
        {MODE_LABELS[m]: MODE_COLORS[m] for m in data.throughput},
    )
    speed.set_yticks(range(n), data.labels)
    speed.set_ylim(n - 0.5, -0.5)  # the first case on top, as in table.md
    speed.set_xlim(left=0)
    speed.set_xlabel("throughput, GB/s (bar: median; line: slowest to fastest repetition)")
    speed.grid(True, axis="x", alpha=0.3)
    # One legend for both panels, under them where it hides no bar: a ratio takes its mode's colour.
    fig.legend(
        *speed.get_legend_handles_labels(),
        loc="outside lower center",
        ncol=len(data.throughput),
        fontsize="small",
        frameon=False,
    )
    if share is not None:
        _ratio_panel(share, data.ratios)
    return fig


def _bars(ax: Any, series: dict[str, list[Any]], colors: dict[str, str]) -> list[tuple[float, float, Any]]:
    """Grouped horizontal bars, one group per case; (y, width, entry) of every bar drawn."""
    height = 0.8 / max(len(series), 1)
    drawn = []
    for j, (name, entries) in enumerate(series.items()):
        rows = [(i + (j - (len(series) - 1) / 2) * height, e) for i, e in enumerate(entries) if e is not None]
        if not rows:
            continue
        ys = [y for y, _ in rows]
        widths = [e.median if isinstance(e, Bar) else e for _, e in rows]
        xerr = None
        if all(isinstance(e, Bar) for _, e in rows):
            xerr = [[e.median - e.low for _, e in rows], [e.high - e.median for _, e in rows]]
        ax.barh(
            ys,
            widths,
            height=height,
            xerr=xerr,
            color=colors[name],
            label=name,
            capsize=2,
            error_kw={"elinewidth": 0.8, "ecolor": "0.2"},
        )
        drawn += [(y, w, e) for (y, e), w in zip(rows, widths)]
    return drawn


def _ratio_panel(share: Any, ratios: dict[str, list[float | None]]) -> None:
    """The right panel: each ratio against 1 (the limit, a dashed line), its figure written after its bar."""
    colors = {label: MODE_COLORS[mode] for label, mode in RATIOS.values()}
    for y, width, _ in _bars(share, ratios, colors):
        share.annotate(
            f"{width:.2f}x", (width, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize="small"
        )
    share.axvline(1.0, color=MODE_COLORS["limit"], linestyle="--", linewidth=1)
    share.annotate(
        "limit",
        (1.0, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(0, 2),
        textcoords="offset points",
        ha="center",
        va="bottom",
        fontsize="small",
        color=MODE_COLORS["limit"],
    )
    top = max((r for rs in ratios.values() for r in rs if r is not None), default=1.0)
    share.set_xlim(0, max(1.0, top) * 1.25)  # room for the figures written after each bar
    share.set_xlabel("fraction of the limit (medians)")
    share.grid(True, axis="x", alpha=0.3)


def throughput_png(doc: dict[str, Any]) -> bytes:
    """The plot of a bench.json document, as PNG bytes."""
    out = io.BytesIO()
    figure(plot_data(doc)).savefig(out, format="png", dpi=100)
    return out.getvalue()


DELTA_MODE_STYLES = {"on": ("delta on", "-", "o"), "auto": ("auto", "--", "s")}
"""The delta modes drawn (bench.json's names) with their legend name, line style and marker; dense is the line at
1."""


@dataclass(frozen=True)
class DeltaLine:
    """One case's delta mode across the shares."""

    case: str
    """The case's label (what tells it apart from the other cases that compared dense with delta)."""
    mode: str
    """``on`` or ``auto``."""
    shares: list[float]
    speedup: list[float]
    """Dense round time over this mode's, medians, per share."""
    wire_fraction: list[float]
    """This mode's wire bytes per round (median) over the model's bytes, per share."""


@dataclass(frozen=True)
class DeltaPlotData:
    title: str
    lines: list[DeltaLine]


def delta_plot_data(doc: dict[str, Any]) -> DeltaPlotData:
    """What :func:`delta_figure` draws, from a bench.json document."""
    summaries = [s for s in doc["cases"] if "delta" in s]
    labels, title = _labels_and_title(doc, summaries)
    lines = []
    for label, s in zip(labels, summaries):
        rows = s["delta"]["shares"]
        for mode in DELTA_MODE_STYLES:
            lines.append(
                DeltaLine(
                    label,
                    mode,
                    [r["share"] for r in rows],
                    [r["modes"]["off"]["seconds"]["median"] / r["modes"][mode]["seconds"]["median"] for r in rows],
                    [r["modes"][mode]["wire_bytes_per_round"] / s["bytes"] for r in rows],
                )
            )
    return DeltaPlotData(title, lines)


def delta_figure(data: DeltaPlotData) -> Figure:
    """Speed-up over dense against the share changed (log x) on the left, the bytes sent per round as a share of
    the model on the right (log-log); one colour per case, one line style per mode."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullLocator

    fig = Figure(figsize=(11, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    speed, wire = fig.subplots(1, 2, width_ratios=(3, 2))
    if data.title:
        fig.suptitle(data.title, fontsize="medium")
    cases = list(dict.fromkeys(line.case for line in data.lines))
    many = len(cases) > 1
    for line in data.lines:
        name, style, marker = DELTA_MODE_STYLES[line.mode]
        color = f"C{cases.index(line.case)}"
        label = f"{line.case}, {name}" if many else name
        percent = [100 * share for share in line.shares]
        speed.plot(percent, line.speedup, style, marker=marker, color=color, label=label)
        wire.plot(percent, line.wire_fraction, style, marker=marker, color=color, label=label)
        if line.mode == "on":
            for x, y in zip(percent, line.speedup):
                speed.annotate(
                    f"{y:.2f}x",
                    (x, y),
                    xytext=(6, 4),
                    textcoords="offset points",
                    ha="left",
                    fontsize="small",
                    color=color,
                )
    speed.axhline(1.0, color="tab:gray", linestyle=":", linewidth=1, label="dense")
    shares = sorted({share for line in data.lines for share in line.shares})
    for ax in (speed, wire):
        # Log on both axes: shares span decades, and a speed-up of 2x and a slow-down of 2x sit alike about 1.
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([100 * share for share in shares], [f"{100 * share:g}%" for share in shares])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("elements changed since the last round")
        ax.grid(True, which="major", alpha=0.3)
    speed.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    speed.set_ylabel("speed-up over dense rounds (dense time / time)")
    wire.set_ylabel("bytes sent per round / model bytes")
    speed.legend(fontsize="small")
    return fig


def delta_png(doc: dict[str, Any]) -> bytes:
    """The dense-against-delta plot of a bench.json document, as PNG bytes."""
    out = io.BytesIO()
    delta_figure(delta_plot_data(doc)).savefig(out, format="png", dpi=100)
    return out.getvalue()
