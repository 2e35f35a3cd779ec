"""``python -m refit_app.bench``: a tiny run end to end over real gloo ranks, its table, JSON and plot; the summary
and the plot data from made-up rank results, where every figure is known.

No timing is asserted: only that every mode ran, moved the model's bytes and was reported with the right keys, and
that what is derived from the measurements (the memory verdict, the plotted bars) follows from them.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time

import pytest
from mp_utils import STARTUP_LIMIT_S, deadline_budget, free_port, run_ranks

from refit_app.bench import cli as bench
from refit_app.bench.cases import MODES, Case
from refit_app.bench.delta_report import FLAT_SLACK_BYTES, PEAK_SLACK_BYTES, REFERENCE_CYCLES, summarize_delta
from refit_app.bench.plot import DELTA_MODE_STYLES, PlotData, delta_figure, delta_plot_data, figure, plot_data
from refit_app.bench.report import MEMORY_SLACK, summarize
from refit_app.models.sources import SyntheticSource

SIZE = 2_000_000
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _bound(summary: dict) -> int:
    """The documented rule (README "Performance": ``num_buffers x max(target, largest tensor)`` + 10%, the 10% being
    report.MEMORY_SLACK), recomputed here from the summary's own figures."""
    case = summary["case"]
    return int(
        case["num_buffers"] * max(case["buffer_size_bytes"], summary["largest_tensor_bytes"]) * (1 + MEMORY_SLACK)
    )


def _assert_plot_follows_json(data: PlotData, doc: dict) -> None:
    """Every bar and ratio drawn is the JSON's figure for that case and mode, and the figure draws exactly those."""
    assert len(data.labels) == len(doc["cases"])
    for mode, bars in data.throughput.items():
        for bar, case in zip(bars, doc["cases"], strict=True):
            if mode not in case["modes"]:
                assert bar is None
                continue
            g = case["modes"][mode]["gb_per_s"]
            assert (bar.low, bar.median, bar.high) == (g["max"], g["median"], g["min"])
            assert bar.low <= bar.median <= bar.high
    for label, values in data.ratios.items():
        key = {"refit/limit": "refit_over_limit", "session/limit": "session_over_limit"}[label]
        assert values == [case["ratios"].get(key) for case in doc["cases"]]
    fig = figure(data)
    speed, *share = fig.axes
    assert len(speed.patches) == sum(bar is not None for bars in data.throughput.values() for bar in bars)
    assert [t.get_text() for t in speed.get_yticklabels()] == data.labels
    if data.ratios:
        (share,) = share
        assert len(share.patches) == sum(r is not None for rs in data.ratios.values() for r in rs)
    else:
        assert not share


def test_bench_runs_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench"
    args = [
        "--preset",
        "llama-1b",
        "lora",
        "--size",
        "2MB",
        "--buffer-size",
        "256KiB",
        "--num-buffers",
        "2",
        "--reps",
        "1",
        "--flat-refits",
        "2",
        "--out",
        str(out),
    ]
    assert bench.main(args) == 0

    printed = capsys.readouterr().out
    table = (out / "table.md").read_text()
    assert table in printed
    header, rule, *rows = table.splitlines()
    assert "refit/limit" in header and "refit vs per-tensor" in header and "session/limit" in header
    assert set(rule) == {"|", "-"}
    assert [row.split("|")[1].strip() for row in rows] == ["llama-1b", "lora"]
    assert "peak above model over 2 refits" in printed
    assert "peak above model over 2 session rounds" in printed
    assert f"results: {out / 'bench.json'}\n" in printed and f"plot: {out / 'throughput.png'}\n" in printed

    doc = json.loads((out / "bench.json").read_text())
    assert {"cpu_count", "cpu_model", "torch", "load_average_before"} <= doc["machine"].keys()
    assert doc["backend"].startswith("gloo")
    assert [c["case"]["preset"] for c in doc["cases"]] == ["llama-1b", "lora"]
    for case in doc["cases"]:
        assert case["case"]["buffer_size_bytes"] == 256 * 1024 and case["case"]["num_buffers"] == 2
        assert abs(case["bytes"] - SIZE) <= 0.1 * SIZE
        assert case["num_chunks"] >= 2 and case["num_tensors"] > case["num_chunks"]
        assert set(case["modes"]) == set(MODES)
        for mode in case["modes"].values():
            s = mode["seconds"]
            assert 0 < s["min"] <= s["median"] <= s["max"]
            assert mode["gb_per_s"]["median"] == pytest.approx(case["bytes"] / 1e9 / s["median"])
            assert len(mode["per_rank_seconds"]) == 2
        assert set(case["ratios"]) == {
            "refit_over_limit",
            "refit_speedup_over_per_tensor",
            "session_over_limit",
            "session_speedup_over_per_tensor",
        }
        assert case["memory_buffers_bytes"] == 2 * max(256 * 1024, case["largest_tensor_bytes"])
        bound = _bound(case)
        assert case["memory_bound_bytes"] == bound
        producer, consumer = case["memory"]
        for m in (producer, consumer):
            assert m["flat_refits"] == 2 and m["session"]["flat_refits"] == 2
            session = m["session"]
            for entry, worst in ((m, m["refit_peak_extra_bytes_max"]), (session, session["peak_extra_bytes_max"])):
                # Linux measures every call, so the worst peak is the largest of them and the verdict follows.
                assert (
                    worst
                    == entry["max_peak_extra_bytes"]
                    >= max(entry["first_peak_extra_bytes"], entry["last_peak_extra_bytes"])
                )
                assert entry["within_bound"] is (worst <= bound)

    png = (out / "throughput.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    data = plot_data(doc)
    # The two cases differ only in their model, which therefore names them.
    assert [label.split()[0] for label in data.labels] == ["llama-1b", "lora"]
    assert list(data.throughput) == list(MODES) and list(data.ratios) == ["refit/limit", "session/limit"]
    _assert_plot_follows_json(data, doc)


MiB = 2**20


def _rank_result(
    seconds: dict[str, list[float]], refit_peaks: list[int | None], session_peaks: list[int | None]
) -> dict:
    """What measure.run_case returns on one rank, with chosen figures: a 10 MB model whose largest tensor is 3 MiB."""
    return {
        "seconds": seconds,
        "cpu_seconds": {mode: [t / 2 for t in times] for mode, times in seconds.items()},
        "flat": {
            mode: [{"baseline_rss_bytes": 100 * MiB, "peak_extra_bytes": p} for p in peaks]
            for mode, peaks in (("refit", refit_peaks), ("session", session_peaks))
        },
        "model": "made up",
        "bytes": 10_000_000,
        "num_tensors": 7,
        "num_chunks": 4,
        "largest_tensor_bytes": 3 * MiB,
    }


def test_the_summary_takes_the_slowest_rank_and_judges_memory_by_the_bound():
    """Against figures chosen on both sides of the bound: 2 buffers x max(1 MiB, the 3 MiB tensor) = 6 MiB, +10%."""
    case = Case("lora", None, MiB, 2, 1, "none", 2, ("refit", "limit"), 3)
    bound = int(6 * MiB * 1.1)
    assert MEMORY_SLACK == 0.10  # the README's figure, which the bound above writes out by hand
    producer = _rank_result({"refit": [1.0, 2.0], "limit": [0.5, 0.5]}, [MiB, 2 * MiB, None], [bound, bound, bound])
    consumer = _rank_result({"refit": [1.5, 1.0], "limit": [0.4, 1.0]}, [bound, bound + 1, 0], [None, None, None])
    s = summarize(case, [producer, consumer])

    assert s["modes"]["refit"]["per_rep_seconds"] == [1.5, 2.0]
    assert s["modes"]["refit"]["seconds"] == {"median": 1.75, "min": 1.5, "max": 2.0}
    assert s["modes"]["limit"]["per_rep_seconds"] == [0.5, 1.0]
    assert s["ratios"] == {"refit_over_limit": pytest.approx(0.75 / 1.75)}
    assert s["modes"]["refit"]["gb_per_s"]["median"] == pytest.approx(0.01 / 1.75)
    assert s["memory_buffers_bytes"] == 6 * MiB and s["memory_bound_bytes"] == bound

    mem_p, mem_c = s["memory"]
    # The producer: worst refit peak 2 MiB (an unmeasured call is no peak); its session peaks at the bound exactly.
    assert (mem_p["refit_peak_extra_bytes_max"], mem_p["within_bound"]) == (2 * MiB, True)
    assert (mem_p["session"]["peak_extra_bytes_max"], mem_p["session"]["within_bound"]) == (bound, True)
    # The consumer: one byte over the bound in its second refit; a session never measured has no verdict.
    assert (mem_c["refit_peak_extra_bytes_max"], mem_c["within_bound"]) == (bound + 1, False)
    assert (mem_c["first_peak_extra_bytes"], mem_c["last_peak_extra_bytes"]) == (bound, 0)
    assert mem_c["session"]["peak_extra_bytes_max"] is None and mem_c["session"]["within_bound"] is None


def _doc(summaries: list[dict]) -> dict:
    return {
        "machine": {"cpu_count": 2, "load_average_before": [1.5, 1, 1], "load_average_after": [2.5, 1, 1]},
        "backend": "gloo (loopback, one process per rank)",
        "cases": summaries,
    }


def test_the_plot_names_cases_by_what_differs_and_draws_only_measured_modes(tmp_path):
    both = {"refit": [1.0, 2.0, 3.0], "limit": [1.0, 1.0, 1.0], "per_tensor": [4.0, 5.0, 6.0]}
    cases = [Case("llama-1b", None, buf, 2, 1, "none", 3, tuple(both), 0) for buf in (MiB, 16 * MiB)]
    refit_only = Case("llama-1b", None, 64 * MiB, 1, 1, "none", 3, ("refit",), 0)
    summaries = [summarize(c, [_rank_result(both, [], [])] * 2) for c in cases]
    summaries.append(summarize(refit_only, [_rank_result({"refit": [1.0, 1.0, 1.0]}, [], [])] * 2))
    doc = _doc(summaries)

    data = plot_data(doc)
    assert data.labels == ["1 MiB x 2", "16 MiB x 2", "64 MiB x 1"]
    assert data.title.splitlines() == [
        "llama-1b 10 MB, 1 consumer, post=none",
        "gloo (loopback, one process per rank); 2 cores; load 1.5-2.5",
    ]
    assert list(data.throughput) == ["refit", "limit", "per_tensor"]  # session was timed nowhere
    assert data.throughput["limit"][2] is None and data.ratios == {"refit/limit": [0.5, 0.5, None]}
    assert (data.throughput["refit"][0].low, data.throughput["refit"][0].high) == (0.01 / 3.0, 0.01 / 1.0)
    _assert_plot_follows_json(data, doc)  # 7 bars of throughput, 2 ratios

    no_limit = plot_data(_doc(summaries[2:]))
    assert no_limit.labels == ["llama-1b 10 MB"] and not no_limit.ratios
    _assert_plot_follows_json(no_limit, _doc(summaries[2:]))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-buffers", "0"], "refit_app.bench: error: --num-buffers 0 must be >= 1"),
        (["--reps", "0"], "refit_app.bench: error: --reps 0 must be >= 1"),
        (["--delta-shares", "0.01", "0"], r"error: --delta-shares 0 must be above 0 and at most 1$"),
        (["--delta-shares", "1.5"], r"error: --delta-shares 1.5 must be above 0 and at most 1$"),
        (["--delta-shares", "nan"], r"error: --delta-shares nan must be above 0 and at most 1$"),
        (["--delta-shares", "0.1", "0.1"], r"error: --delta-shares has a share twice; give each once$"),
        (["--delta-rounds", "5"], r"error: --delta-rounds needs --delta-shares \(the shares its rounds change\)$"),
        (["--delta-shares", "0.1", "--delta-rounds", "-1"], r"error: --delta-rounds -1 must be >= 0$"),
    ],
)
def test_bad_flags_are_refused_before_any_process_starts(args, message):
    with pytest.raises(SystemExit, match=message):
        bench.cases_from_args(bench.build_parser().parse_args(args))


def _one_rank(rank: int, world_size: int, port: int, out: str, extra: list[str]) -> tuple[int, str, str]:
    printed, errors = io.StringIO(), io.StringIO()
    args = [
        "--preset",
        "lora",
        "--size",
        "1MB",
        "--buffer-size",
        "256KiB",
        "--reps",
        "1",
        "--flat-refits",
        "1",
        "--out",
        f"{out}/rank{rank}",
        "--rank",
        str(rank),
        "--world-size",
        str(world_size),
        "--port",
        str(port),
        *(extra if rank == 0 else []),
    ]
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        try:
            code = bench.main(args)
        except SystemExit as e:
            code = e.code
    return code, printed.getvalue(), errors.getvalue()


def test_the_delta_comparison_replaces_the_default_modes_unless_they_are_asked_for():
    parse = bench.build_parser().parse_args
    (plain,) = bench.cases_from_args(parse([]))[:1]
    assert (plain.modes, plain.flat_refits, plain.delta_shares, plain.delta_rounds) == (MODES, 20, (), 0)
    (delta,) = bench.cases_from_args(parse(["--preset", "llama-1b", "--delta-shares", "0.001", "0.5"]))
    assert (delta.modes, delta.flat_refits, delta.delta_shares, delta.delta_rounds) == ((), 0, (0.001, 0.5), 50)
    (both,) = bench.cases_from_args(
        parse(
            [
                "--preset",
                "llama-1b",
                "--delta-shares",
                "0.1",
                "--modes",
                "limit",
                "--flat-refits",
                "3",
                "--delta-rounds",
                "0",
            ]
        )
    )
    assert (both.modes, both.flat_refits, both.delta_shares, both.delta_rounds) == (("limit",), 3, (0.1,), 0)


def _assert_delta_plot_follows_json(doc: dict) -> None:
    """Every point drawn is the JSON's: dense median / mode median against the share, and wire bytes / model."""
    data = delta_plot_data(doc)
    cases = [c for c in doc["cases"] if "delta" in c]
    assert len(data.lines) == len(cases) * len(DELTA_MODE_STYLES)
    labels = list(dict.fromkeys(line.case for line in data.lines))  # one per case, in the JSON's order
    by_label = dict(zip(labels, cases, strict=True))
    for line in data.lines:
        case = by_label[line.case]
        rows = case["delta"]["shares"]
        assert line.shares == [r["share"] for r in rows]
        assert line.speedup == [
            r["modes"]["off"]["seconds"]["median"] / r["modes"][line.mode]["seconds"]["median"] for r in rows
        ]
        assert line.wire_fraction == [r["modes"][line.mode]["wire_bytes_per_round"] / case["bytes"] for r in rows]
    speed, wire = delta_figure(data).axes
    assert speed.get_xscale() == "log" and wire.get_xscale() == "log"
    drawn = [ln for ln in speed.get_lines() if ln.get_label() != "dense"]
    assert [list(ln.get_xdata()) for ln in drawn] == [[100 * x for x in line.shares] for line in data.lines]
    assert [list(ln.get_ydata()) for ln in drawn] == [line.speedup for line in data.lines]


def test_delta_shares_time_dense_on_and_auto_rounds_and_report_each_share(tmp_path, capsys):
    out = tmp_path / "delta"
    args = [
        "--preset",
        "llama-1b",
        "--size",
        "2MB",
        "--buffer-size",
        "256KiB",
        "--reps",
        "2",
        "--delta-shares",
        "0.01",
        "0.5",
        "--delta-rounds",
        "5",
        "--out",
        str(out),
    ]
    assert bench.main(args) == 0

    printed = capsys.readouterr().out
    table = (out / "table.md").read_text()
    assert table in printed
    header, rule, *rows = table.splitlines()
    assert "dense/on" in header and "auto/dense" in header and set(rule) == {"|", "-"}
    assert [row.split("|")[4].strip() for row in rows] == ["1%", "50%"]
    assert f"plot: {out / 'delta.png'}\n" in printed and "throughput.png" not in printed
    assert not (out / "throughput.png").exists()  # no mode was timed
    assert printed.count(" delta rounds: held after round 1 ") == 2  # producer and consumer

    doc = json.loads((out / "bench.json").read_text())
    assert "delta" in doc  # what the figures mean
    (case,) = doc["cases"]
    assert case["modes"] == {} and case["case"]["delta_shares"] == [0.01, 0.5]
    total = case["bytes"]
    shares = case["delta"]["shares"]
    assert [entry["share"] for entry in shares] == [0.01, 0.5]
    for entry in shares:
        modes = entry["modes"]
        assert set(modes) == {"off", "on", "auto"}
        for mode in modes.values():
            s = mode["seconds"]
            assert len(mode["per_rep_seconds"]) == 2 and 0 < s["min"] <= s["median"] <= s["max"]
            assert s["median"] == pytest.approx(sum(mode["per_rep_seconds"]) / 2)
            # A repetition is over when its slowest rank is.
            assert mode["per_rep_seconds"] == [max(r[i] for r in mode["per_rank_seconds"]) for i in range(2)]
        assert entry["speedup_on"] == modes["off"]["seconds"]["median"] / modes["on"]["seconds"]["median"]
        assert entry["auto_over_dense"] == modes["auto"]["seconds"]["median"] / modes["off"]["seconds"]["median"]
        # Dense rounds send the model; every "on" round is a delta round, which measures the share it was given.
        assert modes["off"]["wire_bytes_per_round"] == total and modes["off"]["delta_rounds"] == 0
        assert modes["on"]["delta_rounds"] == 2 and entry["changed_fraction"] == modes["on"]["changed_fraction"]
        assert entry["changed_fraction"] == pytest.approx(entry["share"], rel=0.2)
        if modes["auto"]["delta_rounds"] == 0:
            assert modes["auto"]["wire_bytes_per_round"] == total
    assert shares[0]["modes"]["on"]["wire_bytes_per_round"] < 0.1 * total  # 1%: positions and values only
    for m in case["delta"]["memory"]:
        # Two shares: rounds 2..5 are the reference (two at each share), round 6 the one judged against them.
        assert m["delta_rounds"] == 5 and len(m["rounds"]) == 6 and m["flat"] is not None

    png = (out / "delta.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    _assert_delta_plot_follows_json(doc)


def test_memory_stays_flat_over_50_delta_rounds_with_one_copy_of_the_model_on_each_side(tmp_path):
    """The issue's bound: over 50 delta rounds (shares 0.1%, 3% and 30% in turn: each positions encoding), the
    producer's and the consumer's RSS before each round stays within FLAT_SLACK_BYTES, and its peak within
    PEAK_SLACK_BYTES, of what it reached in the first two rounds at every share; round 1 leaves one host copy of the
    model held on each side (the producer's snapshot, the consumer's mirror), as the docs say."""
    out = tmp_path / "flat"
    args = [
        "--preset",
        "llama-1b",
        "--size",
        "16MiB",
        "--buffer-size",
        "1MiB",
        "--reps",
        "1",
        "--delta-shares",
        "0.001",
        "0.03",
        "0.3",
        "--delta-rounds",
        "50",
        "--out",
        str(out),
    ]
    assert bench.main(args) == 0
    (case,) = json.loads((out / "bench.json").read_text())["cases"]
    memory = case["delta"]["memory"]
    assert [m["rank"] for m in memory] == [0, 1]
    for m in memory:
        figures = (m["held_after_round_1_bytes"], m["retained_growth_bytes"], m["peak_growth_bytes"])
        assert m["delta_rounds"] == 50 and all(r["delta"] for r in m["rounds"][1:]), m["rounds"]
        assert abs(m["held_after_round_1_bytes"] - case["bytes"]) <= FLAT_SLACK_BYTES, figures
        assert m["retained_growth_bytes"] <= FLAT_SLACK_BYTES and m["peak_growth_bytes"] <= PEAK_SLACK_BYTES, figures
        assert m["flat"] is True and m["one_copy"] is True
        assert set(m["rss_before_round_bytes"]) == {"2", "10", "50"}


def _delta_rank(rss_before: list[int], peaks: list[int], shares: tuple[float, ...]) -> dict:
    """What measure.run_delta returns on one rank, with chosen memory figures (MiB) and one repetition per share."""
    figures = {
        "wire_bytes": 10,
        "base_round": 1,
        "changed_elements": 1,
        "total_elements": 100,
        "encodings": {},
        "delta_seconds": 0.0,
    }
    modes = ("off", "on", "auto")
    return {
        "delta": {
            "shares": [
                {
                    "share": s,
                    "seconds": {m: [1.0] for m in modes},
                    "cpu_seconds": {m: [1.0] for m in modes},
                    "rounds": {m: [figures] for m in modes},
                }
                for s in shares
            ],
            "flat": {
                "model_rss_bytes": 100 * MiB,
                "rss_after_bytes": rss_before[-1] * MiB,
                "rounds": [
                    {
                        "round": k + 1,
                        "share": None,
                        "delta": k > 0,
                        "rss_before_bytes": b * MiB,
                        "peak_rss_bytes": p * MiB,
                    }
                    for k, (b, p) in enumerate(zip(rss_before, peaks))
                ],
            },
        }
    }


def test_the_delta_memory_verdict_follows_its_figures():
    """Two shares, two reference cycles: rounds 2..5 (retained: before rounds 2..6) are the reference; later rounds'
    RSS before a round may exceed it by FLAT_SLACK_BYTES, their peaks by PEAK_SLACK_BYTES, and no more. The model is
    10 MiB, held after round 1 = RSS before round 2 - 100 MiB."""
    assert REFERENCE_CYCLES == 2
    case = Case("llama-1b", None, MiB, 2, 1, "none", 1, (), 0, (0.01, 0.5), 7)
    slack, peak_slack = FLAT_SLACK_BYTES // MiB, PEAK_SLACK_BYTES // MiB
    assert slack >= 2 and peak_slack > slack

    def verdict(rss_before: list[int], peaks: list[int], model_mib: int = 10) -> dict:
        producer = _delta_rank(rss_before, peaks, case.delta_shares)
        return summarize_delta(case, [producer, producer], model_mib * MiB)["memory"][0]

    before = [100, 110, 111, 112, 112, 112, 112, 112, 112]
    peaks = [110, 120, 130, 120, 130, 120, 130, 120, 130]
    flat = verdict(before, peaks)
    assert (flat["held_after_round_1_bytes"], flat["flat"], flat["one_copy"]) == (10 * MiB, True, True)
    assert (flat["retained_growth_bytes"], flat["peak_growth_bytes"]) == (0, 0)
    # A second-cycle figure is part of the reference: a peak there does not count as growth.
    second_cycle = verdict(before, [*peaks[:4], 130 + slack, *peaks[5:]])
    assert (second_cycle["peak_growth_bytes"], second_cycle["flat"]) == (-slack * MiB, True)
    at_slack = verdict([*before[:7], 112 + slack, 112], [*peaks[:7], 130 + peak_slack, 130])
    assert at_slack["flat"] is True
    grows = verdict([*before[:8], 113 + slack], peaks)
    assert (grows["retained_growth_bytes"], grows["flat"]) == ((1 + slack) * MiB, False)
    peak_grows = verdict(before, [*peaks[:7], 131 + peak_slack, 130])
    assert (peak_grows["peak_growth_bytes"], peak_grows["flat"]) == ((1 + peak_slack) * MiB, False)
    two_copies = verdict([100, 120, 121, 122, 122, 122, 122, 122, 122], [130] * 9, model_mib=10)
    assert two_copies["one_copy"] is False and two_copies["flat"] is True
    too_few = summarize_delta(
        Case("llama-1b", None, MiB, 2, 1, "none", 1, (), 0, (0.01, 0.5), 2),
        [_delta_rank([100, 110, 111], [110, 120, 130], (0.01, 0.5))] * 2,
        10 * MiB,
    )
    assert too_few["memory"][0]["flat"] is None


def test_one_rank_per_host_rank_0_runs_its_cases_and_reports_every_rank(tmp_path):
    """``--rank``: each rank in its own process joins the producer's address as the application's ranks do; the
    consumers take rank 0's cases (here: modes and delta shares they were not given) and rank 0 alone writes every
    rank's results."""
    results = run_ranks(
        _one_rank,
        3,
        str(tmp_path),
        ["--modes", "refit", "limit", "--delta-shares", "0.01", "--delta-rounds", "2"],
        timeout=120,
    )
    for code, _, errors in results:
        assert code == 0, errors
    table = (tmp_path / "rank0" / "table.md").read_text()
    assert table in results[0][1]
    assert not (tmp_path / "rank1").exists() and not (tmp_path / "rank2").exists()
    assert "rank 1: done; rank 0 prints and writes the results" in results[1][1]
    doc = json.loads((tmp_path / "rank0" / "bench.json").read_text())
    assert doc["backend"].startswith("gloo across hosts (producer at 127.0.0.1:")
    (case,) = doc["cases"]
    assert case["case"]["consumers"] == 2 and case["case"]["modes"] == ["refit", "limit"]
    assert set(case["modes"]) == {"refit", "limit"}
    for mode in case["modes"].values():
        assert len(mode["per_rank_seconds"]) == 3 and all(len(r) == 1 for r in mode["per_rank_seconds"])
    assert [m["rank"] for m in case["memory"]] == [0, 1, 2]
    (share,) = case["delta"]["shares"]
    assert share["share"] == 0.01 and share["modes"]["on"]["delta_rounds"] == 1
    for mode in share["modes"].values():
        assert len(mode["per_rank_seconds"]) == 3 and all(len(r) == 1 for r in mode["per_rank_seconds"])
    assert [m["rank"] for m in case["delta"]["memory"]] == [0, 1, 2]
    assert "dense/on" in table and (tmp_path / "rank0" / "delta.png").exists()


def test_across_hosts_refuses_consumers_and_a_rank_outside_the_world_and_gives_up_on_a_missing_producer(capsys):
    with pytest.raises(SystemExit, match=r"refit_app.bench: error: --consumers is --world-size - 1 across hosts"):
        bench.main(["--rank", "0", "--consumers", "2"])
    with pytest.raises(SystemExit, match=r"error: --world-size 1 must be >= 2 \(the producer and at least one"):
        bench.main(["--rank", "0", "--world-size", "1"])
    with pytest.raises(SystemExit, match=r"error: .*group.timeout_s=inf is invalid"):
        bench.main(["--rank", "1", "--group-timeout-s", "inf", "--reps", "1"])
    with pytest.raises(SystemExit, match=r"refit_app.bench: error: .*group.rank.*must be in 0..1"):
        bench.main(["--rank", "2", "--world-size", "2", "--reps", "1"])
    port = free_port()
    code = bench.main(["--rank", "1", "--port", str(port), "--group-timeout-s", "2", "--reps", "1"])
    assert code == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(
        f"refit_app.bench: error: rank 1: could not reach the producer at 127.0.0.1:{port} within 2s"
    ), errors


def test_a_consumer_killed_mid_run_ends_rank_0_with_one_line_within_its_deadline(tmp_path):
    """No hang across hosts: rank 0 notices the lost consumer within --group-timeout-s and says so in one line."""
    port, timeout_s = free_port(), 5.0
    common = [sys.executable, "-m", "refit_app.bench", "--port", str(port), "--group-timeout-s", str(timeout_s)]
    logs = [tmp_path / "rank0.err", tmp_path / "rank1.err"]
    with open(logs[0], "w") as err0, open(logs[1], "w") as err1:
        producer = subprocess.Popen(
            [
                *common,
                "--rank",
                "0",
                "--preset",
                "llama-1b",
                "--size",
                "1GB",
                "--reps",
                "50",
                "--modes",
                "refit",
                "limit",
                "--out",
                str(tmp_path / "out"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=err0,
        )
        consumer = subprocess.Popen([*common, "--rank", "1"], stdout=subprocess.DEVNULL, stderr=err1)
        try:
            deadline = time.monotonic() + STARTUP_LIMIT_S
            while "accepted the manifest" not in logs[0].read_text():  # the timed repetitions start next
                assert producer.poll() is None and time.monotonic() < deadline, logs[0].read_text()[-2000:]
                time.sleep(0.05)
            consumer.kill()
            killed = time.monotonic()
            code = producer.wait(deadline_budget(timeout_s))
            took = time.monotonic() - killed
        finally:
            for p in (producer, consumer):
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    errors = [line for line in logs[0].read_text().splitlines() if line.startswith("refit_app.bench: error:")]
    print(f"rank 0 exited {code} {took:.1f}s after the consumer was killed: {errors}")
    assert code == 1 and len(errors) == 1 and "rank 0:" in errors[0], logs[0].read_text()[-2000:]
    assert "Traceback" not in logs[0].read_text()
    assert not list((tmp_path / "out").iterdir())  # no results of a run that did not finish


@pytest.mark.parametrize(
    "args, message",
    [
        (["--size", "0"], r"^refit_app.bench: error: --size: '0' is not a size"),
        (["--buffer-size", "0"], r"^refit_app.bench: error: --buffer-size: '0' is not a size"),
    ],
)
def test_a_bad_size_is_one_line(args, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(args)


def test_an_out_that_cannot_take_the_results_is_refused_before_the_run(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    with pytest.raises(SystemExit, match=r"^refit_app.bench: error: --out '.*a-file' cannot take the results: "):
        bench.main(["--reps", "1", "--out", str(taken)])


def _one_case_run(flags: list[str], out, name: str, capsys) -> tuple[str, dict]:
    """A one-case comparison (``--colocated``, ``--app``) of a 4 MB Llama shape: its markdown, printed and written,
    and its JSON."""
    args = [*flags, "--preset", "llama-1b", "--size", "4MB", "--buffer-size", "512KiB", "--out", str(out)]
    assert bench.main(args) == 0
    printed = capsys.readouterr().out
    table = (out / f"{name}.md").read_text()
    assert table in printed and f"results: {out / f'{name}.json'}" in printed
    return table, json.loads((out / f"{name}.json").read_text())


def test_colocated_compares_shm_with_gloo_and_memcpy_and_one_consumer_with_three(tmp_path, capsys):
    out = tmp_path / "colocated"
    table, doc = _one_case_run(["--colocated", "--reps", "2"], out, "colocated", capsys)
    for label in ("gloo, 1 consumer", "shm, 1 consumer", "shm, 3 consumers", "memcpy (producer alone)"):
        assert f"| {label} |" in table
    for ratio in ("gloo / shm", "shm / memcpy", "shm 3 / shm 1"):
        assert f"| {ratio} |" in table
    assert doc["consumers"] == 3 and doc["reps"] == 2
    modes = doc["modes"]
    assert set(modes) == {"gloo", "shm", "shm_3", "memcpy"}
    assert all(len(m["per_rep_s"]) == 2 and m["median_s"] > 0 for m in modes.values())
    # The ratios are the medians' (no timing is asserted: only that they follow from the figures).
    assert doc["ratios"]["gloo_over_shm"] == pytest.approx(modes["gloo"]["median_s"] / modes["shm"]["median_s"])
    assert doc["ratios"]["shm_over_memcpy"] == pytest.approx(modes["shm"]["median_s"] / modes["memcpy"]["median_s"])
    assert doc["ratios"]["shm_n_over_shm"] == pytest.approx(modes["shm_3"]["median_s"] / modes["shm"]["median_s"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--colocated", "--consumers", "1"], "--colocated takes one --consumers of at least 2"),
        (["--colocated", "--preset", "llama-1b", "lora"], "--colocated takes one --preset and one --size"),
        (["--colocated", "--rank", "1"], "--colocated runs every rank on this machine; drop --rank"),
        (["--app", "--consumers", "2"], "--app compares one consumer; drop --consumers"),
        (["--app", "--post", "cast"], "--app sends the application's source as it is; drop --post"),
        (["--app", "--preset", "llama-1b", "lora"], "--app takes one --preset and one --size"),
        (["--app", "--buffer-size", "1MiB", "4MiB"], "--app takes one --buffer-size"),
        (["--app", "--rank", "1"], "--app runs every rank on this machine; drop --rank"),
        (["--app", "--colocated"], "--colocated and --app are two runs; give one"),
    ],
)
def test_colocated_and_app_refuse_what_they_cannot_compare(args, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(args)


def test_app_times_the_applications_round_against_the_sessions_on_gloo_and_shm(tmp_path, capsys):
    table, doc = _one_case_run(["--app", "--reps", "3"], tmp_path / "app", "app_rounds", capsys)
    for backend in ("gloo", "shm"):
        for kind in ("app", "session"):
            assert f"| {backend} | {kind} |" in table
        assert f"| {backend} | " in table.split("app / session")[1]
    assert doc["reps"] == 3 and doc["goal"] == "<= 1.1"
    assert doc["case"]["size_bytes"] == SyntheticSource("llama-1b", 4_000_000).total_bytes  # what every round moved
    rounds = doc["rounds"]
    assert set(rounds) == {"gloo/app", "gloo/session", "shm/app", "shm/session"}
    for m in rounds.values():
        assert len(m["per_rep_s"]) == 3 and m["median_s"] > 0 and len(m["cpu_s_per_rank"]) == 2
    # The ratios are the medians' (no timing is asserted: only that they follow from the figures).
    for backend, ratio in doc["app_over_session"].items():
        expected = rounds[f"{backend}/app"]["median_s"] / rounds[f"{backend}/session"]["median_s"]
        assert ratio == pytest.approx(expected)
        assert doc["goal_met"][backend] == (ratio <= 1.1)
