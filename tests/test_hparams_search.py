"""``-m hparams_search=buffers_optuna``: the optuna sweeper searches buffer size and count, maximizing the
``gb_per_s`` that each trial's task returns."""

from __future__ import annotations

import json

import pytest
import yaml
from cli_utils import CLI_TIMEOUT_S
from conditions import needs_optuna_sweeper

pytestmark = [pytest.mark.slow, needs_optuna_sweeper]

TRIALS = 3


def test_a_short_search_maximizes_the_runs_throughput(cli, tmp_path):
    result = cli("-m", "hparams_search=buffers_optuna", "sink=discard", f"hydra.sweeper.n_trials={TRIALS}",
                 timeout_s=(1 + TRIALS) * CLI_TIMEOUT_S)
    assert result.returncode == 0, result.describe()
    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*_local")
    trials = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/metrics.json"))]
    assert len(trials) == TRIALS and all(t["status"] == "ok" for t in trials), trials
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert set(best["best_params"]) == {"refit.buffer_size_bytes", "refit.num_buffers"}, best
    # The value each trial returned is its run's gb_per_s, and the search reports the highest one.
    assert best["best_value"] == pytest.approx(max(t["gb_per_s"] for t in trials), rel=1e-3), (best, trials)
    chosen = next(t for t in trials if t["gb_per_s"] == pytest.approx(best["best_value"], rel=1e-3))
    assert chosen["num_buffers"] == best["best_params"]["refit.num_buffers"]
