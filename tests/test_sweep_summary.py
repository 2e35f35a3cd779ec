"""The sweep summary: its table and plot from job directories, and the callback inside a real Hydra multirun."""

from __future__ import annotations

import csv
import logging
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_utils import hermetic_env
from matplotlib.axes import Axes
from matplotlib.image import imread
from mp_utils import STARTUP_LIMIT_S
from omegaconf import OmegaConf

from refit_app.app.metrics import write_metrics
from refit_app.app.sweep_summary import SUMMARY_COLUMNS, SweepSummary, write_summary

MiB = 2**20
REPO_ROOT = Path(__file__).resolve().parents[1]


def _job(sweep_dir: Path, num: int, overrides: list[str], **metrics: object) -> Path:
    job_dir = sweep_dir / str(num)
    (job_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), job_dir / ".hydra" / "overrides.yaml")
    if metrics:
        write_metrics(job_dir, {"role": "producer", "status": "ok", "error": None, **metrics})
    return job_dir


def _ok(buffer_mib: int, num_buffers: int, gbps: float, legacy: bool = False) -> dict[str, object]:
    return {
        "buffer_size_bytes": buffer_mib * MiB,
        "num_buffers": num_buffers,
        "use_legacy_packing": legacy,
        "bytes": 10**9,
        "seconds": 1 / gbps,
        "gb_per_s": gbps,
        "peak_rss_bytes": 900 * MiB,
        "peak_extra_bytes": 2 * buffer_mib * MiB,
        "verified": True,
        "backend": "gloo",
    }


def _overrides(buffer_mib: int, num_buffers: int) -> list[str]:
    return [f"refit.buffer_size_bytes={buffer_mib}MiB", f"refit.num_buffers={num_buffers}"]


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _channels = imread(path).shape
    assert height > 100 and width > 100


def test_write_summary_over_a_sweep_directory(tmp_path: Path) -> None:
    sweep = tmp_path / "multirun"
    _job(sweep, 0, _overrides(16, 1), **_ok(16, 1, 1.2))
    _job(sweep, 1, _overrides(64, 1), **_ok(64, 1, 1.6))
    _job(sweep, 2, _overrides(16, 2), **_ok(16, 2, 1.5))
    _job(sweep, 3, _overrides(64, 2), status="failed", error="PeerError: consumer 1 died", num_buffers=2)
    _job(sweep, 10, _overrides(256, 2))  # started but left no metrics
    _job(sweep, 4, _overrides(256, 1), **_ok(256, 1, 1.8))
    (sweep / "notes").mkdir()  # not a job: no .hydra, no metrics
    (sweep / "multirun.yaml").write_text("{}\n")

    rows = write_summary(sweep)

    assert [r["job"] for r in rows] == [0, 1, 2, 3, 4, 10]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "failed", "ok", "failed"]
    assert rows[3]["error"] == "PeerError: consumer 1 died"
    assert "no metrics.json" in rows[5]["error"]
    assert rows[5]["overrides"] == "refit.buffer_size_bytes=256MiB refit.num_buffers=2"
    assert rows[1]["buffer_size_bytes"] == 64 * MiB and rows[1]["gb_per_s"] == 1.6 and rows[1]["verified"] is True
    assert all(set(r) == set(SUMMARY_COLUMNS) for r in rows)

    with open(sweep / "summary.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [row["job"] for row in table] == ["0", "1", "2", "3", "4", "10"]
    assert tuple(table[0]) == SUMMARY_COLUMNS
    assert table[3]["status"] == "failed" and table[3]["error"] == "PeerError: consumer 1 died"
    assert table[4]["buffer_size_bytes"] == str(256 * MiB) and table[4]["num_buffers"] == "1"

    # Files without per-round figures (one-round runs): the whole run's figures, as before rounds existed.
    assert {r["figure"] for r in rows if r["status"] == "ok"} == {"whole run"}
    assert all(r["steady_gb_per_s"] is None for r in rows)

    md = (sweep / "summary.md").read_text().splitlines()
    assert len(md) == 2 + 6
    assert md[1 + 2].startswith("| 1 | refit.buffer_size_bytes=64MiB refit.num_buffers=1 | ok | 64 MiB | 1 | bounded")
    assert "| whole run | 1 GB | 0.625 | 1.600 |" in md[1 + 2]
    assert "| failed |" in md[2 + 5] and "no metrics.json" in md[2 + 5]

    _assert_png(sweep / "throughput.png")
    assert sorted(p.name for p in sweep.iterdir() if p.name.startswith(".")) == []  # no temp files left


def _rounds(model_bytes: int, seconds: list[float], wire: list[int] | None) -> dict[str, object]:
    """A run's metrics with its per-round entries, as roles.py writes them; ``wire=None``: a file written before
    wire bytes were counted (no ``wire_bytes`` anywhere)."""
    entries = []
    for i, s in enumerate(seconds):
        entry: dict[str, object] = {"round": i + 1, "seconds": s, "bytes": model_bytes}
        if wire is not None:
            entry["wire_bytes"] = wire[i]
        entries.append(entry)
    metrics: dict[str, object] = {
        "bytes": model_bytes * len(seconds),
        "seconds": sum(seconds),
        "gb_per_s": model_bytes * len(seconds) / 1e9 / sum(seconds),
        "rounds_done": len(seconds),
        "first_round_seconds": seconds[0],
        "steady_round_seconds": statistics.median(seconds[1:]) if len(seconds) > 1 else None,
        "rounds": entries,
    }
    if wire is not None:
        metrics["wire_bytes"] = sum(wire)
    return metrics


def test_multi_round_jobs_are_shown_and_plotted_by_their_steady_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sweep = tmp_path / "multirun"
    # Four rounds of a 1 GB model: a slow first round (handshake, cold buffers), then delta rounds that send little.
    # Whole run: 4 GB in 6 s = 0.667 GB/s; steady: 1 GB in the median 1.0 s = 1.0 GB/s, median wire 200 MB.
    _job(
        sweep,
        0,
        _overrides(16, 1),
        **{**_ok(16, 1, 1.0), **_rounds(10**9, [3.0, 1.0, 1.25, 0.75], wire=[10**9, 2 * 10**8, 10**8, 3 * 10**8])},
    )
    # The same, in a metrics file from before wire bytes were counted.
    _job(sweep, 1, _overrides(64, 1), **{**_ok(64, 1, 1.0), **_rounds(10**9, [2.0, 0.5, 0.5], wire=None)})
    # One round: today's figures, whole run.
    _job(sweep, 2, _overrides(256, 1), **{**_ok(256, 1, 1.0), **_rounds(10**9, [0.8], wire=[10**9])})

    plotted: list[tuple[list[float], list[float]]] = []
    real_plot = Axes.plot

    def record_plot(self: Axes, x: list[float], y: list[float], *args: object, **kwargs: object) -> object:
        plotted.append((list(x), list(y)))
        return real_plot(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", record_plot)
    rows = write_summary(sweep)

    steady, old, single = rows
    assert steady["figure"] == old["figure"] == "steady round" and single["figure"] == "whole run"
    # The run's own columns keep their meaning: the whole run, first round included.
    assert steady["seconds"] == 6.0 and steady["gb_per_s"] == pytest.approx(4 / 6, rel=1e-4)
    assert steady["wire_bytes"] == 16 * 10**8 and steady["rounds_done"] == 4
    assert steady["steady_round_seconds"] == 1.0 and steady["steady_gb_per_s"] == pytest.approx(1.0)
    assert steady["steady_wire_bytes"] == 2 * 10**8
    assert old["steady_gb_per_s"] == pytest.approx(2.0) and old["steady_wire_bytes"] is None
    assert old["wire_bytes"] is None
    assert single["steady_round_seconds"] is single["steady_gb_per_s"] is single["steady_wire_bytes"] is None
    assert single["seconds"] == 0.8 and single["gb_per_s"] == pytest.approx(1.25) and single["wire_bytes"] == 10**9

    with open(sweep / "summary.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [(r["figure"], r["steady_round_seconds"], r["steady_wire_bytes"]) for r in table] == [
        ("steady round", "1.0", str(2 * 10**8)), ("steady round", "0.5", ""), ("whole run", "", ""),
    ]  # fmt: skip

    md = (sweep / "summary.md").read_text().splitlines()
    header = [c.strip() for c in md[0].strip("|").split("|")]
    cells = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in md[2:]]
    figures = [{k: c[k] for k in ("rounds", "figure", "bytes", "seconds", "GB/s", "wire bytes")} for c in cells]
    assert figures == [
        {"rounds": "4", "figure": "steady round (median of rounds 2-4)", "bytes": "1 GB", "seconds": "1.000",
         "GB/s": "1.000", "wire bytes": "200 MB"},
        {"rounds": "3", "figure": "steady round (median of rounds 2-3)", "bytes": "1 GB", "seconds": "0.500",
         "GB/s": "2.000", "wire bytes": ""},
        {"rounds": "1", "figure": "whole run", "bytes": "1 GB", "seconds": "0.800", "GB/s": "1.250",
         "wire bytes": "1 GB"},
    ]  # fmt: skip

    # One line (1 buffer) through the three buffer sizes, at each job's headline throughput.
    assert plotted == [([16.0, 64.0, 256.0], [pytest.approx(1.0), pytest.approx(2.0), pytest.approx(1.25)])]
    _assert_png(sweep / "throughput.png")


def test_job_number_comes_from_hydra_yaml_when_the_directory_is_not_named_by_it(tmp_path: Path) -> None:
    sweep = tmp_path / "multirun"
    job_dir = _job(sweep, 0, _overrides(16, 1), **_ok(16, 1, 1.2)).rename(sweep / "producer_rank0")
    OmegaConf.save(OmegaConf.create({"hydra": {"job": {"num": 7}}}), job_dir / ".hydra" / "hydra.yaml")
    assert [(r["job"], r["status"]) for r in write_summary(sweep)] == [(7, "ok")]


def test_plot_splits_by_packing_and_survives_a_sweep_with_no_successes(tmp_path: Path) -> None:
    sweep = tmp_path / "multirun"
    _job(sweep, 0, ["refit.use_legacy_packing=false"], **_ok(64, 2, 1.6))
    _job(sweep, 1, ["refit.use_legacy_packing=true"], **_ok(64, 2, 1.1, legacy=True))
    write_summary(sweep)
    _assert_png(sweep / "throughput.png")
    # Two subplots side by side make the figure about twice as wide as it is tall.
    height, width, _ = imread(sweep / "throughput.png").shape
    assert width > 1.8 * height

    only_failures = tmp_path / "failed_sweep"
    _job(only_failures, 0, ["refit.num_buffers=1"], status="failed", error="ConfigError: bad")
    rows = write_summary(only_failures)
    assert [r["status"] for r in rows] == ["failed"]
    assert (only_failures / "summary.csv").is_file()
    assert not (only_failures / "throughput.png").exists()


def test_callback_logs_instead_of_raising(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = OmegaConf.create({"hydra": {"sweep": {"dir": "missing"}, "runtime": {"cwd": str(tmp_path)}}})
    with caplog.at_level(logging.WARNING, logger="refit_app.app.sweep_summary"):
        SweepSummary().on_multirun_end(config)
    assert "could not write the sweep summary" in caplog.text
    assert "missing" in caplog.text


APP = """
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from refit_app.app.metrics import write_metrics

    @hydra.main(version_base="1.3", config_path=".", config_name="config")
    def main(cfg):
        if cfg.buffer_mib == 64 and cfg.num_buffers == 2:
            raise RuntimeError("buffer 64 MiB with 2 buffers\\nexploded")
        write_metrics(HydraConfig.get().runtime.output_dir, {
            "role": "producer", "status": "ok", "error": None, "bytes": 10**9, "seconds": 0.5, "gb_per_s": 2.0,
            "buffer_size_bytes": cfg.buffer_mib * 2**20, "num_buffers": cfg.num_buffers,
            "use_legacy_packing": False, "verified": None,
        })

    if __name__ == "__main__":
        main()
"""

CONFIG = """
    buffer_mib: 16
    num_buffers: 1
    hydra:
      job:
        chdir: true
      callbacks:
        summary:
          _target_: refit_app.app.sweep_summary.SweepSummary
"""


def _run_app(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "app.py").write_text(textwrap.dedent(APP))
    (tmp_path / "config.yaml").write_text(textwrap.dedent(CONFIG))
    env = hermetic_env({"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))})
    return subprocess.run(
        [sys.executable, "app.py", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=STARTUP_LIMIT_S,  # one Hydra application's start-up and two tiny jobs: only a hang gets near it
    )


def test_real_multirun_summarises_every_job_including_the_failed_one(tmp_path: Path) -> None:
    # A relative sweep dir with chdir=true: the callback must not resolve it against the job's directory.
    proc = _run_app(tmp_path, "-m", "buffer_mib=16,64", "num_buffers=1,2", "hydra.sweep.dir=sweep")
    assert proc.returncode != 0, proc.stdout + proc.stderr  # Hydra reports the failed job after the batch
    assert "exploded" in proc.stderr

    sweep = tmp_path / "sweep"
    with open(sweep / "summary.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [row["job"] for row in table] == ["0", "1", "2", "3"]
    assert [row["overrides"] for row in table] == [
        "buffer_mib=16 num_buffers=1",
        "buffer_mib=16 num_buffers=2",
        "buffer_mib=64 num_buffers=1",
        "buffer_mib=64 num_buffers=2",
    ]
    assert [row["status"] for row in table] == ["ok", "ok", "ok", "failed"]
    assert table[3]["error"] == "RuntimeError: buffer 64 MiB with 2 buffers; exploded"
    assert table[2]["buffer_size_bytes"] == str(64 * MiB) and table[2]["gb_per_s"] == "2.0"
    assert "| failed |" in (sweep / "summary.md").read_text()
    _assert_png(sweep / "throughput.png")
    assert not list(tmp_path.glob("*/*/sweep"))  # nothing written relative to a job directory


def test_single_run_writes_no_summary(tmp_path: Path) -> None:
    proc = _run_app(tmp_path, "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "run" / "metrics.json").is_file()
    assert not list(tmp_path.rglob("summary.*")) and not list(tmp_path.rglob("job_status.json"))
