"""Smoke test of ``python -m refit_app.bench``: a tiny run end to end over real gloo ranks, its table and its JSON.

No timing is asserted: only that every mode ran, moved the model's bytes and was reported with the right keys.
"""

from __future__ import annotations

import json

import pytest

from refit_app import bench

SIZE = 2_000_000


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

    doc = json.loads((out / "bench.json").read_text())
    assert {"cpu_count", "cpu_model", "torch", "load_average_before"} <= doc["machine"].keys()
    assert doc["backend"].startswith("gloo")
    assert [c["case"]["preset"] for c in doc["cases"]] == ["llama-1b", "lora"]
    for case in doc["cases"]:
        assert case["case"]["buffer_size_bytes"] == 256 * 1024 and case["case"]["num_buffers"] == 2
        assert abs(case["bytes"] - SIZE) <= 0.1 * SIZE
        assert case["num_chunks"] >= 2 and case["num_tensors"] > case["num_chunks"]
        assert set(case["modes"]) == set(bench.MODES)
        for mode in case["modes"].values():
            s = mode["seconds"]
            assert 0 < s["min"] <= s["median"] <= s["max"]
            assert mode["gb_per_s"]["median"] == pytest.approx(case["bytes"] / 1e9 / s["median"])
            assert len(mode["per_rank_seconds"]) == 2
        assert set(case["ratios"]) == {"refit_over_limit", "refit_speedup_over_per_tensor", "session_over_limit",
                                       "session_speedup_over_per_tensor"}
        assert case["memory_buffers_bytes"] == 2 * max(256 * 1024, case["largest_tensor_bytes"])
        producer, consumer = case["memory"]
        for m in (producer, consumer):
            assert m["flat_refits"] == 2 and isinstance(m["within_bound"], bool)
            assert m["session"]["flat_refits"] == 2 and isinstance(m["session"]["within_bound"], bool)


@pytest.mark.parametrize(
    "args, message",
    [(["--num-buffers", "0"], "--num-buffers 0 must be >= 1"), (["--reps", "0"], "--reps 0 must be >= 1")],
)
def test_bad_flags_are_refused_before_any_process_starts(args, message):
    with pytest.raises(SystemExit, match=message):
        bench.cases_from_args(bench.build_parser().parse_args(args))
