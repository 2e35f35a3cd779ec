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
from refit_app.bench.plot import PlotData, figure, plot_data
from refit_app.bench.report import MEMORY_SLACK, summarize

SIZE = 2_000_000
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _bound(summary: dict) -> int:
    """The documented rule (README "Performance": ``num_buffers x max(target, largest tensor)`` + 10%, the 10% being
    report.MEMORY_SLACK), recomputed here from the summary's own figures."""
    case = summary["case"]
    return int(case["num_buffers"] * max(case["buffer_size_bytes"], summary["largest_tensor_bytes"])
               * (1 + MEMORY_SLACK))


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
    args = ["--preset", "llama-1b", "lora", "--size", "2MB", "--buffer-size", "256KiB", "--num-buffers", "2",
            "--reps", "1", "--flat-refits", "2", "--out", str(out)]
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
        assert set(case["ratios"]) == {"refit_over_limit", "refit_speedup_over_per_tensor", "session_over_limit",
                                       "session_speedup_over_per_tensor"}
        assert case["memory_buffers_bytes"] == 2 * max(256 * 1024, case["largest_tensor_bytes"])
        bound = _bound(case)
        assert case["memory_bound_bytes"] == bound
        producer, consumer = case["memory"]
        for m in (producer, consumer):
            assert m["flat_refits"] == 2 and m["session"]["flat_refits"] == 2
            session = m["session"]
            for entry, worst in ((m, m["refit_peak_extra_bytes_max"]), (session, session["peak_extra_bytes_max"])):
                # Linux measures every call, so the worst peak is the largest of them and the verdict follows.
                assert worst == entry["max_peak_extra_bytes"] >= max(entry["first_peak_extra_bytes"],
                                                                     entry["last_peak_extra_bytes"])
                assert entry["within_bound"] is (worst <= bound)

    png = (out / "throughput.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    data = plot_data(doc)
    # The two cases differ only in their model, which therefore names them.
    assert [label.split()[0] for label in data.labels] == ["llama-1b", "lora"]
    assert list(data.throughput) == list(MODES) and list(data.ratios) == ["refit/limit", "session/limit"]
    _assert_plot_follows_json(data, doc)


MiB = 2**20


def _rank_result(seconds: dict[str, list[float]], refit_peaks: list[int | None],
                 session_peaks: list[int | None]) -> dict:
    """What measure.run_case returns on one rank, with chosen figures: a 10 MB model whose largest tensor is 3 MiB."""
    return {
        "seconds": seconds,
        "cpu_seconds": {mode: [t / 2 for t in times] for mode, times in seconds.items()},
        "flat": {mode: [{"baseline_rss_bytes": 100 * MiB, "peak_extra_bytes": p} for p in peaks]
                 for mode, peaks in (("refit", refit_peaks), ("session", session_peaks))},
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
    return {"machine": {"cpu_count": 2, "load_average_before": [1.5, 1, 1], "load_average_after": [2.5, 1, 1]},
            "backend": "gloo (loopback, one process per rank)", "cases": summaries}


def test_the_plot_names_cases_by_what_differs_and_draws_only_measured_modes(tmp_path):
    both = {"refit": [1.0, 2.0, 3.0], "limit": [1.0, 1.0, 1.0], "per_tensor": [4.0, 5.0, 6.0]}
    cases = [Case("llama-1b", None, buf, 2, 1, "none", 3, tuple(both), 0) for buf in (MiB, 16 * MiB)]
    refit_only = Case("llama-1b", None, 64 * MiB, 1, 1, "none", 3, ("refit",), 0)
    summaries = [summarize(c, [_rank_result(both, [], [])] * 2) for c in cases]
    summaries.append(summarize(refit_only, [_rank_result({"refit": [1.0, 1.0, 1.0]}, [], [])] * 2))
    doc = _doc(summaries)

    data = plot_data(doc)
    assert data.labels == ["1 MiB x 2", "16 MiB x 2", "64 MiB x 1"]
    assert data.title.splitlines() == ["llama-1b 10 MB, 1 consumer, post=none",
                                       "gloo (loopback, one process per rank); 2 cores; load 1.5-2.5"]
    assert list(data.throughput) == ["refit", "limit", "per_tensor"]  # session was timed nowhere
    assert data.throughput["limit"][2] is None and data.ratios == {"refit/limit": [0.5, 0.5, None]}
    assert (data.throughput["refit"][0].low, data.throughput["refit"][0].high) == (0.01 / 3.0, 0.01 / 1.0)
    _assert_plot_follows_json(data, doc)  # 7 bars of throughput, 2 ratios

    no_limit = plot_data(_doc(summaries[2:]))
    assert no_limit.labels == ["llama-1b 10 MB"] and not no_limit.ratios
    _assert_plot_follows_json(no_limit, _doc(summaries[2:]))


@pytest.mark.parametrize(
    "args, message",
    [(["--num-buffers", "0"], "refit_app.bench: error: --num-buffers 0 must be >= 1"),
     (["--reps", "0"], "refit_app.bench: error: --reps 0 must be >= 1")],
)
def test_bad_flags_are_refused_before_any_process_starts(args, message):
    with pytest.raises(SystemExit, match=message):
        bench.cases_from_args(bench.build_parser().parse_args(args))


def _one_rank(rank: int, world_size: int, port: int, out: str, extra: list[str]) -> tuple[int, str, str]:
    printed, errors = io.StringIO(), io.StringIO()
    args = ["--preset", "lora", "--size", "1MB", "--buffer-size", "256KiB", "--reps", "1", "--flat-refits", "1",
            "--out", f"{out}/rank{rank}", "--rank", str(rank), "--world-size", str(world_size), "--port", str(port),
            *(extra if rank == 0 else [])]
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        try:
            code = bench.main(args)
        except SystemExit as e:
            code = e.code
    return code, printed.getvalue(), errors.getvalue()


def test_one_rank_per_host_rank_0_runs_its_cases_and_reports_every_rank(tmp_path):
    """``--rank``: each rank in its own process joins the producer's address as the application's ranks do; the
    consumers take rank 0's cases (here: modes they were not given) and rank 0 alone writes every rank's results."""
    results = run_ranks(_one_rank, 3, str(tmp_path), ["--modes", "refit", "limit"], timeout=120)
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
        f"refit_app.bench: error: rank 1: could not reach the producer at 127.0.0.1:{port} within 2s"), errors


def test_a_consumer_killed_mid_run_ends_rank_0_with_one_line_within_its_deadline(tmp_path):
    """No hang across hosts: rank 0 notices the lost consumer within --group-timeout-s and says so in one line."""
    port, timeout_s = free_port(), 5.0
    common = [sys.executable, "-m", "refit_app.bench", "--port", str(port), "--group-timeout-s", str(timeout_s)]
    logs = [tmp_path / "rank0.err", tmp_path / "rank1.err"]
    with open(logs[0], "w") as err0, open(logs[1], "w") as err1:
        producer = subprocess.Popen([*common, "--rank", "0", "--preset", "llama-1b", "--size", "1GB", "--reps", "50",
                                     "--modes", "refit", "limit", "--out", str(tmp_path / "out")],
                                    stdout=subprocess.DEVNULL, stderr=err0)
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


@pytest.mark.parametrize("args, message", [
    (["--size", "0"], r"^refit_app.bench: error: --size: '0' is not a size"),
    (["--buffer-size", "0"], r"^refit_app.bench: error: --buffer-size: '0' is not a size"),
])
def test_a_bad_size_is_one_line(args, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(args)


def test_an_out_that_cannot_take_the_results_is_refused_before_the_run(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    with pytest.raises(SystemExit, match=r"^refit_app.bench: error: --out '.*a-file' cannot take the results: "):
        bench.main(["--reps", "1", "--out", str(taken)])
