"""Draw the docs' pictures as SVG from text and data in the repo. They are committed in docs/img/, so that the pages
show them on GitHub too; ``python docs/hooks.py`` redraws them, and the docs build and tests/test_docs.py fail while
one is stale (its source or this script changed since: :func:`digest`), so each picture is what its source file
says. To draw one elsewhere:

    python scripts/draw_figures.py session-round.svg     # any name of FIGURES, written into the current directory
    python scripts/draw_figures.py --all /tmp/figures     # every picture into a folder

Sources (docs/figures/ and docs/data/):

- ``*.seq``: a sequence diagram. ``actors: key=label | key=label`` names the lifelines, left to right; then one
  step a line: ``a -> b: text`` (a message; ``<-``, ``<->``; ``=>`` for the data itself), ``note a: text`` or
  ``note a..b: text`` (a box over one lifeline or across several), ``-- text --`` (a divider: a phase of the
  session). ``#`` starts a comment; ``\\n`` in a text breaks the line.
- ``*.flow``: a data flow. ``lane label: box | box | ...``, one lane a line, top to bottom; an arrow joins each box
  to the next, and a lane's last box to the next lane's first. ``note: text`` lines go under the picture.
- ``sharded-plan.txt``: producers, consumers and tensors whose sharded-refit plan (``refit_app.core.reshard``) is
  drawn as it is computed.
- ``*.csv``: measured figures, each file headed by ``#`` lines that say where they were measured and by which
  command (docs/results.md has the runs); the plots draw them as they are.

SVG with its text kept as text (searchable, no font files) and no JavaScript: the site shows it without a network,
which a Mermaid diagram (mermaid.js from a CDN) would not.
"""

from __future__ import annotations

import csv
import hashlib
import io
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
FIGURES_DIR = ROOT / "docs" / "figures"
DATA_DIR = ROOT / "docs" / "data"

_INK = "#1f2d3d"
_DATA = "#1f5fae"
_NOTE_FILL = "#fdf1dc"
_ACTOR_FILL = "#e2ebf8"
_DIVIDER_FILL = "#eef3fb"


def _setup() -> None:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams.update(
        {"svg.fonttype": "none", "svg.hashsalt": "refit_app", "font.size": 10, "font.family": "DejaVu Sans"}
    )


def _svg(fig: object) -> str:
    out = io.StringIO()
    fig.savefig(out, format="svg", metadata={"Date": None}, bbox_inches="tight")  # type: ignore[attr-defined]
    import matplotlib.pyplot as plt

    plt.close(fig)  # type: ignore[arg-type]
    return out.getvalue()


def _text(s: str) -> str:
    return s.strip().replace("\\n", "\n")


# Sequence diagrams ------------------------------------------------------------------------------------------------


class Step(NamedTuple):
    kind: str  # "msg", "note", "divider"
    a: str = ""
    b: str = ""
    arrow: str = ""
    text: str = ""


def parse_sequence(text: str) -> tuple[dict[str, str], list[Step]]:
    """``({key: label}, steps)`` of a ``.seq`` text; a line that is none of the forms above is an error."""
    actors: dict[str, str] = {}
    steps: list[Step] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        if line.startswith("actors:"):
            for part in line[len("actors:") :].split("|"):
                key, _, label = part.strip().partition("=")
                actors[key.strip()] = _text(label or key)
        elif m := re.fullmatch(r"--\s*(.*?)\s*--", line):
            steps.append(Step("divider", text=_text(m[1])))
        elif m := re.fullmatch(r"note\s+(\w+)(?:\.\.(\w+))?\s*:\s*(.*)", line):
            steps.append(Step("note", m[1], m[2] or m[1], text=_text(m[3])))
        elif m := re.fullmatch(r"(\w+)\s*(<->|->|<-|=>)\s*(\w+)\s*:\s*(.*)", line):
            steps.append(Step("msg", m[1], m[3], m[2], _text(m[4])))
        else:
            raise ValueError(f"line {n}: cannot read {raw!r}")
        for key in (steps[-1].a, steps[-1].b) if steps and steps[-1].kind != "divider" else ():
            if key not in actors:
                raise ValueError(f"line {n}: {key!r} is not in actors")
    return actors, steps


def sequence_svg(text: str) -> str:
    _setup()
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    actors, steps = parse_sequence(text)
    col = 3.3  # inches between lifelines
    xs = {key: 0.6 + col * (0.5 + i) for i, key in enumerate(actors)}
    width = 1.2 + col * len(actors)
    heights = [0.3 + 0.2 * s.text.count("\n") + (0.25 if s.kind != "msg" else 0.15) for s in steps]
    height = 0.9 + sum(heights) + 0.3
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")
    for key, label in actors.items():
        ax.add_patch(
            FancyBboxPatch((xs[key] - 1.2, 0.15), 2.4, 0.5, boxstyle="round,pad=0.02", fc=_ACTOR_FILL, ec=_INK)
        )
        ax.text(xs[key], 0.4, label, ha="center", va="center", fontweight="bold")
        ax.plot([xs[key], xs[key]], [0.65, height - 0.1], color="#8a99ab", lw=1, ls=(0, (4, 3)), zorder=0)
    y = 0.9
    for step, h in zip(steps, heights):
        if step.kind == "divider":
            ax.add_patch(plt.Rectangle((0.1, y), width - 0.2, h - 0.1, fc=_DIVIDER_FILL, ec="none", zorder=1))
            ax.text(width / 2, y + (h - 0.1) / 2, step.text, ha="center", va="center", style="italic", zorder=2)
        elif step.kind == "note":
            x0, x1 = sorted((xs[step.a], xs[step.b]))
            half = max(x1 - x0 + 2.4, 0.072 * max(len(t) for t in step.text.split("\n")) + 0.3) / 2
            mid = min(max((x0 + x1) / 2, 0.1 + half), width - 0.1 - half)  # within the picture
            ax.add_patch(
                FancyBboxPatch(
                    (mid - half, y + 0.02),
                    2 * half,
                    h - 0.14,
                    boxstyle="round,pad=0.02",
                    fc=_NOTE_FILL,
                    ec="#c99a4a",
                    zorder=2,
                )
            )
            ax.text(mid, y + (h - 0.1) / 2, step.text, ha="center", va="center", fontsize=9, zorder=3)
        else:
            xa, xb = xs[step.a], xs[step.b]
            if step.arrow == "<-":
                xa, xb = xb, xa
            style = {"->": "-|>", "<-": "-|>", "=>": "-|>", "<->": "<|-|>"}[step.arrow]
            data = step.arrow == "=>"
            ya = y + h - 0.12
            ax.annotate(
                "",
                (xb, ya),
                (xa, ya),
                arrowprops={
                    "arrowstyle": style,
                    "color": _DATA if data else _INK,
                    "lw": 3 if data else 1.2,
                    "shrinkA": 0,
                    "shrinkB": 0,
                },
            )
            ax.text(
                (xa + xb) / 2, ya - 0.07, step.text, ha="center", va="bottom", fontsize=9, color=_DATA if data else _INK
            )
        y += h
    return _svg(fig)


# Data flow ------------------------------------------------------------------------------------------------------


def parse_flow(text: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    lanes: list[tuple[str, list[str]]] = []
    notes: list[str] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if m := re.fullmatch(r"lane\s+(.*?):\s*(.*)", line):
            lanes.append((_text(m[1]), [_text(b) for b in m[2].split("|")]))
        elif line.startswith("note:"):
            notes.append(_text(line[len("note:") :]))
        else:
            raise ValueError(f"line {n}: cannot read {raw!r}")
    return lanes, notes


def flow_svg(text: str) -> str:
    _setup()
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    lanes, notes = parse_flow(text)
    per_lane = max(len(boxes) for _, boxes in lanes)
    box_w, gap, lane_h, label_w = 2.5, 0.55, 1.35, 1.5
    width = label_w + per_lane * box_w + (per_lane - 1) * gap + 0.3
    height = len(lanes) * lane_h + 0.25 * sum(n.count("\n") + 1 for n in notes) + 0.3
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")
    prev: tuple[float, float] | None = None
    for i, (label, boxes) in enumerate(lanes):
        top = 0.15 + i * lane_h
        ax.add_patch(plt.Rectangle((0.05, top), width - 0.1, lane_h - 0.2, fc=("#eef3fb", "#f6f8fc")[i % 2], ec="none"))
        ax.text(0.15, top + (lane_h - 0.2) / 2, label, ha="left", va="center", fontweight="bold")
        for j, box in enumerate(boxes):
            x = label_w + j * (box_w + gap)
            by, bh = top + 0.15, lane_h - 0.5
            ax.add_patch(FancyBboxPatch((x, by), box_w, bh, boxstyle="round,pad=0.03", fc="white", ec=_INK))
            ax.text(x + box_w / 2, by + bh / 2, box, ha="center", va="center", fontsize=9)
            if prev is not None:
                px, py = prev
                same_lane = abs(py - (by + bh / 2)) < 1e-6
                start = (px, py) if same_lane else (px - box_w / 2, py + bh / 2)
                end = (x, by + bh / 2) if same_lane else (x + box_w / 2, by)
                ax.annotate(
                    "",
                    end,
                    start,
                    arrowprops={
                        "arrowstyle": "-|>",
                        "color": _DATA,
                        "lw": 2.2,
                        "shrinkA": 2,
                        "shrinkB": 2,
                        "connectionstyle": "arc3" if same_lane else "angle,angleA=-90,angleB=180,rad=0",
                    },
                )
            prev = (x + box_w, by + bh / 2)
    y = 0.2 + len(lanes) * lane_h
    for note in notes:
        ax.text(0.15, y, note, ha="left", va="top", fontsize=9, style="italic")
        y += 0.25 * (note.count("\n") + 1)
    return _svg(fig)


# Plots from measured data ---------------------------------------------------------------------------------------


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """``(the # header lines, the rows)``."""
    lines = path.read_text().splitlines()
    header = [line[1:].strip() for line in lines if line.startswith("#")]
    rows = list(csv.DictReader(line for line in lines if line and not line.startswith("#")))
    return header, rows


def buffer_sweep_svg() -> str:
    _setup()
    import matplotlib.pyplot as plt

    _, rows = read_csv(DATA_DIR / "buffer-sweep.csv")
    fig, ax = plt.subplots(figsize=(7.2, 4.0))
    series: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        series.setdefault(row["series"], []).append((float(row["buffer_mib"]), float(row["gb_per_s"])))
    markers = iter("osD^v<>")
    for name, points in series.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=next(markers), label=name)
    ax.set_xscale("log", base=2)
    sizes = sorted({float(r["buffer_mib"]) for r in rows})
    ax.set_xticks(sizes, [f"{s:g} MiB" for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel("buffer size (refit.buffer_size_bytes)")
    ax.set_ylabel("GB/s (1 GB llama-1b shape, 1 consumer)")
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _svg(fig)


def delta_speedup_svg() -> str:
    _setup()
    import matplotlib.pyplot as plt

    _, rows = read_csv(DATA_DIR / "delta-speedup.csv")
    fig, ax = plt.subplots(figsize=(7.2, 4.0))
    dense = {(r["where"], r["share_pct"]): float(r["seconds"]) for r in rows if r["delta"] == "off"}
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in rows:
        if r["delta"] != "off":
            speedup = dense[(r["where"], r["share_pct"])] / float(r["seconds"])
            series.setdefault((r["where"], r["delta"]), []).append((float(r["share_pct"]), speedup))
    styles = {"on": "-o", "auto": "--s"}
    colors = {}
    for (where, mode), points in series.items():
        points.sort()
        color = colors.setdefault(where, f"C{len(colors)}")
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            styles[mode],
            color=color,
            label=f"{where}, refit.delta={mode}",
        )
    ax.axhline(1, color="gray", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    shares = sorted({float(r["share_pct"]) for r in rows if r["where"] == "loopback"})
    ax.set_xticks(shares, [f"{s:g}%" for s in shares])
    ticks = [0.5, 1, 2, 5, 10, 20]
    ax.set_yticks(ticks, [f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("elements changed since the last round")
    ax.set_ylabel("speed-up over a dense round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _svg(fig)


# The plan of a sharded refit ----------------------------------------------------------------------------------------

_RANK_FILLS = ("#9ec3ea", "#f6c28b", "#b5dfa9", "#e9a9c7", "#cdbdf0")


def sharded_plan_svg() -> str:
    """Each tensor of docs/figures/sharded-plan.txt as a grid of its elements: every region of the plan filled with
    its source producer's colour and labelled source -> destination, each consumer's box outlined."""
    _setup()
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    sys.path.insert(0, str(ROOT))
    from refit_app.core.reshard.plan import Layout, Need, Shard, TensorSpec, plan, shard_box

    k = m = 0
    tensors: list[tuple[str, int, int, str]] = []
    for line in (FIGURES_DIR / "sharded-plan.txt").read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words[:1] == ["producers:"]:
            k = int(words[1])
        elif words[:1] == ["consumers:"]:
            m = int(words[1])
        elif words[:1] == ["tensor"]:
            tensors.append((words[1], int(words[2]), int(words[3]), words[4]))
    fig, axes = plt.subplots(1, len(tensors), figsize=(3.6 * len(tensors), 4.2))
    for ax, (name, rows, cols, how) in zip(axes, tensors):
        spec = TensorSpec(name, "bfloat16", (rows, cols), 2, Layout.one_dim(list(range(k)), Shard(0)))
        dim = 0 if how == "column" else 1
        needs = [Need(k + c, name, shard_box((rows, cols), dim, m, c)) for c in range(m)]
        for t in plan([spec], needs):
            (r0, r1), (c0, c1) = t.box
            ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=_RANK_FILLS[t.src], edgecolor=_INK, lw=0.6))
            ax.text((c0 + c1) / 2, (r0 + r1) / 2, f"{t.src} \u2192 {t.dst}", ha="center", va="center", fontsize=9)
        for need in needs:
            (r0, r1), (c0, c1) = need.box
            ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, fill=False, edgecolor=_DATA, lw=2.2))
        ax.set_xlim(-0.5, cols + 0.5)
        ax.set_ylim(rows + 0.5, -0.5)
        ax.set_aspect("equal")
        ax.set_title(f"{name} [{rows}, {cols}], {how}-parallel", fontsize=9)
        ax.set_xlabel("columns")
        ax.set_ylabel("rows")
    handles = [Rectangle((0, 0), 1, 1, facecolor=_RANK_FILLS[r], edgecolor=_INK) for r in range(k)]
    handles.append(Rectangle((0, 0), 1, 1, fill=False, edgecolor=_DATA, lw=2.2))
    labels = [f"sent by producer rank {r}" for r in range(k)] + ["one consumer rank's box"]
    fig.legend(handles, labels, loc="lower center", ncol=k + 1, fontsize=8, frameon=False)
    fig.subplots_adjust(bottom=0.2)
    return _svg(fig)


def _from(source: str, draw: Callable[[str], str]) -> Callable[[], str]:
    return lambda: draw((FIGURES_DIR / source).read_text())


FIGURES: dict[str, Callable[[], str]] = {
    "round-dataflow.svg": _from("round-dataflow.flow", flow_svg),
    "session-rounds.svg": _from("session-rounds.seq", sequence_svg),
    "elastic-generation.svg": _from("elastic-generation.seq", sequence_svg),
    "shm-ring.svg": _from("shm-ring.seq", sequence_svg),
    "staged-round.svg": _from("staged-round.seq", sequence_svg),
    "staged-serve.svg": _from("staged-serve.seq", sequence_svg),
    "buffer-sweep.svg": buffer_sweep_svg,
    "delta-speedup.svg": delta_speedup_svg,
    "sharded-plan.svg": sharded_plan_svg,
}
"""The site's img/<name> -> what draws it."""

SOURCES: dict[str, tuple[Path, ...]] = {
    "round-dataflow.svg": (FIGURES_DIR / "round-dataflow.flow",),
    "session-rounds.svg": (FIGURES_DIR / "session-rounds.seq",),
    "elastic-generation.svg": (FIGURES_DIR / "elastic-generation.seq",),
    "shm-ring.svg": (FIGURES_DIR / "shm-ring.seq",),
    "staged-round.svg": (FIGURES_DIR / "staged-round.seq",),
    "staged-serve.svg": (FIGURES_DIR / "staged-serve.seq",),
    "buffer-sweep.svg": (DATA_DIR / "buffer-sweep.csv",),
    "delta-speedup.svg": (DATA_DIR / "delta-speedup.csv",),
    "sharded-plan.svg": (FIGURES_DIR / "sharded-plan.txt", ROOT / "refit_app" / "core" / "reshard" / "plan.py"),
}
"""The site's img/<name> -> the files it is drawn from (the plan's picture: its layouts and the planner)."""


def digest(name: str) -> str:
    """What picture ``name`` is drawn from, as one hash: its source files and this script. docs/hooks.py keeps it in
    the committed picture, so a picture whose source or drawing changed is found stale without drawing it (and
    without depending on the matplotlib version that drew it)."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    for source in SOURCES[name]:
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--all":
        out = Path(argv[1])
        out.mkdir(parents=True, exist_ok=True)
        for name, draw in FIGURES.items():
            (out / name).write_text(draw())
        return 0
    if len(argv) == 1 and Path(argv[0]).name in FIGURES:
        Path(argv[0]).write_text(FIGURES[Path(argv[0]).name]())
        return 0
    print(f"usage: draw_figures.py NAME.svg | --all DIR   (names: {', '.join(FIGURES)})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
