"""``-m hparams_search=buffers_optuna``: the optuna sweeper searches buffer size and count, maximizing the value each
trial's task returns: the run's headline throughput, a steady round's when the run had several rounds."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from cli_utils import CLI_TIMEOUT_S
from conditions import needs_optuna_sweeper
from omegaconf import OmegaConf

from refit_app.app.cli import CPP_LOG_LEVEL_ENV
from refit_app.app.metrics import STEADY_ROUND, WHOLE_RUN, headline

TRIALS = 3
ROUNDS = 3


def _round(n: int, seconds: float, nbytes: int = 10**9, wire_bytes: int | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"round": n, "seconds": seconds, "bytes": nbytes, "gb_per_s": nbytes / 1e9 / seconds}
    if wire_bytes is not None:
        entry["wire_bytes"] = wire_bytes
    return entry


# Three rounds of a 1 GB model, the first one slow (manifest handshake, cold buffers), the others delta rounds.
THREE_ROUNDS = {
    "status": "ok", "bytes": 3 * 10**9, "seconds": 4.0, "gb_per_s": 0.75, "rounds_done": 3,
    "first_round_seconds": 2.0, "steady_round_seconds": 1.0, "wire_bytes": 10**9 + 3 * 10**8,
    "rounds": [
        _round(1, 2.0, wire_bytes=10**9), _round(2, 0.8, wire_bytes=10**8), _round(3, 1.2, wire_bytes=2 * 10**8),
    ],
}  # fmt: skip
ONE_ROUND = {
    "status": "ok", "bytes": 10**9, "seconds": 2.0, "gb_per_s": 0.5, "rounds_done": 1,
    "first_round_seconds": 2.0, "steady_round_seconds": None, "wire_bytes": 10**9,
    "rounds": [_round(1, 2.0, wire_bytes=10**9)],
}  # fmt: skip


def _without_wire_bytes(metrics: dict[str, Any]) -> dict[str, Any]:
    """A metrics file written before wire bytes were counted."""
    old = {k: v for k, v in metrics.items() if k != "wire_bytes"}
    old["rounds"] = [{k: v for k, v in r.items() if k != "wire_bytes"} for r in metrics["rounds"]]
    return old


def test_headline_of_a_multi_round_run_is_its_steady_round() -> None:
    h = headline(THREE_ROUNDS)
    # The model's bytes over the median of rounds 2..N: 1 GB / 1.0 s, not the whole run's 3 GB / 4.0 s.
    assert (h.basis, h.bytes, h.seconds, h.gb_per_s) == (STEADY_ROUND, 10**9, 1.0, pytest.approx(1.0))
    assert h.wire_bytes == 150_000_000  # median of 100 MB and 200 MB: the first round's full send is not in it
    old = headline(_without_wire_bytes(THREE_ROUNDS))
    assert (old.basis, old.gb_per_s, old.wire_bytes) == (STEADY_ROUND, pytest.approx(1.0), None)


def test_headline_of_a_one_round_run_is_the_whole_run() -> None:
    h = headline(ONE_ROUND)
    assert (h.basis, h.bytes, h.seconds, h.gb_per_s, h.wire_bytes) == (WHOLE_RUN, 10**9, 2.0, 0.5, 10**9)
    assert headline(_without_wire_bytes(ONE_ROUND)).wire_bytes is None
    # A file without per-round entries (written before rounds existed) is judged as today.
    assert headline({"bytes": 10**9, "seconds": 4.0, "gb_per_s": 0.25}).gb_per_s == 0.25


@pytest.fixture
def objective(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, Any]], float | None]:
    """The value ``python -m refit_app`` returns to the sweeper for a run that produced ``metrics``."""
    # Importing the entry point sets this variable for torch; keep it out of the other tests' environment.
    monkeypatch.setenv(CPP_LOG_LEVEL_ENV, "ERROR")
    entry = importlib.import_module("refit_app.__main__")

    def value(metrics: dict[str, Any]) -> float | None:
        monkeypatch.setattr(entry, "run", lambda cfg: metrics)
        # hydra.main calls the task function directly when given a config (no job, no output directory).
        return entry._main(OmegaConf.create({}))

    return value


def test_objective_is_the_steady_rounds_throughput_with_several_rounds(objective) -> None:
    assert objective(THREE_ROUNDS) == pytest.approx(1.0)
    assert objective(_without_wire_bytes(THREE_ROUNDS)) == pytest.approx(1.0)


def test_objective_of_a_one_round_run_is_its_gb_per_s(objective) -> None:
    assert objective(ONE_ROUND) == 0.5


@pytest.mark.slow
@needs_optuna_sweeper
def test_a_short_search_maximizes_the_steady_rounds_throughput(cli, tmp_path):
    result = cli(
        "-m",
        "hparams_search=buffers_optuna",
        "sink=discard",
        f"refit.rounds={ROUNDS}",
        f"hydra.sweeper.n_trials={TRIALS}",
        timeout_s=(1 + TRIALS) * CLI_TIMEOUT_S,
    )
    assert result.returncode == 0, result.describe()
    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*_local")
    trials = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/metrics.json"))]
    assert len(trials) == TRIALS and all(t["status"] == "ok" and t["rounds_done"] == ROUNDS for t in trials), trials
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert set(best["best_params"]) == {"refit.buffer_size_bytes", "refit.num_buffers"}, best
    # Each trial returned one steady round's throughput: the model's bytes over the median of rounds 2..N.
    steady = [t["rounds"][-1]["bytes"] / 1e9 / t["steady_round_seconds"] for t in trials]
    assert best["best_value"] == pytest.approx(max(steady), rel=1e-3), (best, trials)
    chosen = trials[steady.index(max(steady))]
    assert chosen["num_buffers"] == best["best_params"]["refit.num_buffers"]
