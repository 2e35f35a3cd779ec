"""The dense-against-delta comparison (``--delta-shares``) in the results: each case's ``delta`` entry of bench.json
from every rank's :func:`~refit_app.bench.measure.run_delta`, its markdown table, and its memory lines."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from refit_app.bench.cases import Case
from refit_app.common.sizes import format_decimal, format_size
from refit_app.protocol.defaults import DELTA_MODES

DELTA_DESCRIPTION = (
    "per share: one session pair per delta mode (off = dense, on, auto) on the same group, each round the whole "
    "send() / receive() with the consumer verifying every tensor (and, with deltas, patching its mirror); the model "
    "changed before each repetition, each element with probability `share`; modes rotate within repetitions"
)

FLAT_SLACK_BYTES = 4 * 2**20
"""How far a rank's RSS before a round may rise over many delta rounds above what it reached in the reference
rounds (see :data:`REFERENCE_CYCLES`); also how far what round 1 leaves held may differ from one copy of the model.
Measured over 50 rounds of a 16 MiB model: RSS creeps by about 20 KiB a round on the producer and 6 KiB on the
consumer (native memory: the Python heap stays flat), 1.1 MiB in all. A leak of 100 KiB a round, a sixth of a 1%
round's stream, fails it."""

PEAK_SLACK_BYTES = 8 * 2**20
"""How far a round's peak RSS may rise above the reference rounds' peaks. Looser than the retained slack because a
round's peak also moves with how its threads' scratch overlaps and where the allocator places it: under two busy
loops the producer's peak at one share stepped by up to 3.7 MiB between otherwise equal rounds and stayed there
(RSS before the round did not move), which a 4 MiB bound failed on. A leak shows in the retained figure first."""

REFERENCE_CYCLES = 2
"""Rounds 2 .. 1 + 2 x (number of shares): the first two rounds at every share are the reference. The first round
at a share peaks about 2 MiB below the later ones (the scratch of every share has been allocated once only after
the first cycle), so one cycle alone made later rounds look grown."""


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_delta(case: Case, per_rank: list[dict[str, Any]], model_bytes: int) -> dict[str, Any]:
    """The case's ``delta`` entry: per share, each mode's round time (the slowest rank's per repetition, then
    median, min and max), wire bytes per round and the producer's delta figures, with the speed-ups; per rank, the
    memory over the delta rounds."""
    shares = []
    for i, share in enumerate(case.delta_shares):
        ranks = [result["delta"]["shares"][i] for result in per_rank]
        assert all(r["share"] == share for r in ranks), "ranks measured different shares"
        modes = {mode: _mode_summary(mode, ranks, case.reps) for mode in DELTA_MODES}
        dense, on, auto = (modes[m]["seconds"]["median"] for m in ("off", "on", "auto"))
        shares.append(
            {
                "share": share,
                "changed_fraction": modes["on"]["changed_fraction"],
                "modes": modes,
                "speedup_on": dense / on,
                "auto_over_dense": auto / dense,
            }
        )
    flats = [result["delta"]["flat"] for result in per_rank]
    return {
        "shares": shares,
        "flat_slack_bytes": FLAT_SLACK_BYTES,
        "peak_slack_bytes": PEAK_SLACK_BYTES,
        "memory": None
        if flats[0] is None
        else [_memory(rank, flat, len(case.delta_shares), model_bytes) for rank, flat in enumerate(flats)],
    }


def _mode_summary(mode: str, ranks: list[dict[str, Any]], reps: int) -> dict[str, Any]:
    per_rep = [max(r["seconds"][mode][j] for r in ranks) for j in range(reps)]
    rounds = ranks[0]["rounds"][mode]  # the producer's figures; every consumer sees the same stream
    deltas = [r for r in rounds if r["base_round"]]
    consumer_delta = [statistics.median(x["delta_seconds"] for x in r["rounds"][mode]) for r in ranks[1:]]
    return {
        "seconds": _stats(per_rep),
        "per_rep_seconds": per_rep,
        "per_rank_seconds": [r["seconds"][mode] for r in ranks],
        "wire_bytes_per_round": statistics.median(r["wire_bytes"] for r in rounds),
        "delta_rounds": len(deltas),
        "plain_rounds": sum(bool(r.get("plain")) for r in rounds),
        "changed_fraction": statistics.median(r["changed_elements"] / r["total_elements"] for r in deltas)
        if deltas
        else None,
        "encodings": dict(sum((Counter(r["encodings"]) for r in deltas), Counter())),
        "delta_seconds_median": {
            "producer": statistics.median(r["delta_seconds"] for r in rounds),
            "consumers_max": max(consumer_delta, default=None),
        },
    }


def _memory(rank: int, flat: dict[str, Any], cycle: int, model_bytes: int) -> dict[str, Any]:
    """One rank's memory over the delta rounds: what round 1 left held (the snapshot or the mirror, and buffers),
    and how far RSS rose after the reference rounds (:data:`REFERENCE_CYCLES` rounds at every share from round
    2; ``cycle`` is the number of shares)."""
    rounds = flat["rounds"]
    before = {r["round"]: r["rss_before_bytes"] for r in rounds}
    model_rss = flat["model_rss_bytes"]
    entry: dict[str, Any] = {
        "rank": rank,
        "delta_rounds": sum(r["delta"] for r in rounds),
        "model_bytes": model_bytes,
        "model_rss_bytes": model_rss,
        "held_after_round_1_bytes": None if None in (before.get(2), model_rss) else before[2] - model_rss,
        "rss_before_round_bytes": {str(k): before[k] for k in (2, 10, 50) if k in before},
        "rss_after_bytes": flat["rss_after_bytes"],
        "rounds": rounds,
    }
    # Retained memory before rounds 2 .. 2 + n (the last of them: after the reference rounds), and peaks in rounds
    # 2 .. 1 + n, n = REFERENCE_CYCLES x cycle, are the reference; every later figure must stay within its slack.
    n = REFERENCE_CYCLES * cycle
    retained = [r["rss_before_bytes"] for r in rounds[1:]] + [flat["rss_after_bytes"]]
    peaks = [r["peak_rss_bytes"] for r in rounds[1:]]
    growth = {}
    for name, values, first in (("retained", retained, n + 1), ("peak", peaks, n)):
        if len(values) <= first or None in values:
            growth[name] = None
        else:
            growth[name] = max(values[first:]) - max(values[:first])
    entry["retained_growth_bytes"], entry["peak_growth_bytes"] = growth["retained"], growth["peak"]
    entry["flat"] = (
        None
        if None in growth.values()
        else growth["retained"] <= FLAT_SLACK_BYTES and growth["peak"] <= PEAK_SLACK_BYTES
    )
    held = entry["held_after_round_1_bytes"]
    # The snapshot (producer) or the mirror (consumer): one host copy of the model, as the docs say.
    entry["one_copy"] = None if held is None else abs(held - model_bytes) <= FLAT_SLACK_BYTES
    return entry


def _seconds(mode: dict[str, Any]) -> str:
    s = mode["seconds"]
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def _kinds(mode: dict[str, Any], reps: int) -> str:
    """A mode's timed rounds by kind: delta, plain dense (auto, deltas not paying) and dense filling the snapshot."""
    delta, plain = mode["delta_rounds"], mode.get("plain_rounds", 0)
    return f"{delta} / {plain} / {reps - delta - plain}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.3g}%"


def format_delta_table(summaries: list[dict[str, Any]]) -> str:
    """One row per case and share: each mode's round time, its wire bytes per round, and the speed-ups."""
    head = (
        "| model | size | consumers | share | changed | dense s | delta on s | auto s | dense/on | auto/dense "
        "| wire per round, dense / on / auto | auto's rounds: delta / plain / keep |\n"
    )
    rows = []
    for s in summaries:
        if "delta" not in s:
            continue
        case = s["case"]
        for entry in s["delta"]["shares"]:
            modes = entry["modes"]
            wire = " / ".join(format_decimal(int(modes[m]["wire_bytes_per_round"])) for m in ("off", "on", "auto"))
            rows.append(
                f"| {case['preset']} | {format_decimal(s['bytes'])} | {case['consumers']} | {_share(entry['share'])} "
                f"| {_share(entry['changed_fraction'])} | {_seconds(modes['off'])} | {_seconds(modes['on'])} "
                f"| {_seconds(modes['auto'])} | {entry['speedup_on']:.2f}x | {entry['auto_over_dense']:.2f} "
                f"| {wire} | {_kinds(modes['auto'], case['reps'])} |"
            )
    return head + "|" + "---|" * 12 + "\n" + "\n".join(rows) + "\n"


def delta_memory_lines(summaries: list[dict[str, Any]]) -> Iterator[str]:
    """One printed line per rank: what the delta rounds held and whether it stayed flat."""
    for s in summaries:
        memory = (s.get("delta") or {}).get("memory")
        if not memory:
            continue
        case = s["case"]
        for m in memory:
            who = "producer" if m["rank"] == 0 else f"consumer {m['rank']}"
            before = ", ".join(f"round {k} {format_size(v or 0)}" for k, v in m["rss_before_round_bytes"].items())
            verdict = {True: "flat", False: "NOT FLAT", None: "too few rounds to judge"}[m["flat"]]
            copies = {True: "one copy", False: "NOT one copy", None: "not measured"}[m["one_copy"]]
            held = m["held_after_round_1_bytes"]
            held_text = "-" if held is None else format_size(held)

            def grown(value: int | None) -> str:
                return "-" if value is None else ("+" if value >= 0 else "-") + format_size(abs(value))

            yield (
                f"{case['preset']} {format_decimal(s['bytes'])} {who}: {m['delta_rounds']} delta rounds: "
                f"held after round 1 {held_text} (model {format_size(m['model_bytes'])}: {copies}); "
                f"RSS before {before}, after the last {format_size(m['rss_after_bytes'] or 0)}; after the first "
                f"{REFERENCE_CYCLES} rounds at each share, retained {grown(m['retained_growth_bytes'])} (slack "
                f"{format_size(s['delta']['flat_slack_bytes'])}), peak {grown(m['peak_growth_bytes'])} (slack "
                f"{format_size(s['delta'].get('peak_slack_bytes', s['delta']['flat_slack_bytes']))}): {verdict}"
            )
