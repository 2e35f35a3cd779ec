"""The RL loop as a user runs it: ``refit.rounds`` over one group, a trainer (``source=model``) taking real optimizer
steps into a model on the consumer side (``sink=model``), the last round saved, and memory flat over 50 rounds."""

from __future__ import annotations

from pathlib import Path

import torch
from cli_utils import COVER_STARTUP, local_metrics
from conditions import needs_transformers

from refit_app.checkpoint.reader import Checkpoint
from refit_app.models.hf import write_tiny_llama
from refit_app.models.sources import SyntheticSource

pytestmark = needs_transformers
MiB = 2**20
BUFFER = 16 * MiB
NOISE = 4 * MiB
"""Allocator and page-cache noise between two rounds' peaks."""
SPARES = 2 * BUFFER
"""What the buffer-lifetime rule may add once: a receive buffer still referenced when its slot is refilled (a loop
variable holding the previous batch, at an unlucky moment on a loaded machine) makes the slot take a spare, and at
most num_buffers (2) spares are kept. Bounded, not growing: a buffer leaked per round would add 16 MiB x 48."""


def test_trainer_to_model_loop_matches_every_round(cli, tmp_path: Path) -> None:
    model_dir = write_tiny_llama(tmp_path / "tiny-llama")
    result = cli("source=model", f"source.path={model_dir}", "sink=model", "refit.rounds=5", COVER_STARTUP)
    assert result.returncode == 0, result.describe()
    m = local_metrics(cli.cwd)
    assert m["status"] == "ok" and m["rounds_done"] == 5
    producer_rounds = m["rounds"]
    losses = [r["loss"] for r in producer_rounds]
    assert losses[0] is None and all(isinstance(x, float) for x in losses[1:])
    assert len(set(losses[1:])) == 4, losses  # real optimizer steps: the loss moves every round
    assert [r["manifest_sent"] for r in producer_rounds] == [True, False, False, False, False]
    consumer = m["consumers"][0]
    assert consumer["verified"] is True
    assert [r["round"] for r in consumer["rounds"]] == [1, 2, 3, 4, 5], consumer["rounds"]
    for r in consumer["rounds"]:
        assert r["verified"] is True
        assert r["model_check"] == {"max_abs_logit_diff": 0.0, "tokens_match": True}, r
    assert m["handshake_seconds"] > 0 and all(r["handshake_seconds"] == 0 for r in producer_rounds[1:])
    assert "x 5 rounds" in result.stdout + result.stderr and "models match" in result.stdout + result.stderr


def test_mixed_precision_trainer_matches_every_round(cli, tmp_path: Path) -> None:
    # Trained in fp32, sent as bf16: the consumer builds a bf16 model from the manifest and matches the producer's
    # probe of the weights as sent, every round; rounds after the first send only what real AdamW steps changed,
    # patched into the consumer model's own parameters.
    model_dir = write_tiny_llama(tmp_path / "tiny-llama")
    result = cli(
        "source=model",
        f"source.path={model_dir}",
        "source.dtype=float32",
        "source.send_dtype=bfloat16",
        "source.lr=1e-6",
        "sink=model",
        "refit.rounds=6",
        "refit.delta=auto",
        COVER_STARTUP,
    )
    assert result.returncode == 0, result.describe()
    m = local_metrics(cli.cwd)
    assert m["status"] == "ok" and m["rounds_done"] == 6
    rounds = m["consumers"][0]["rounds"]
    assert len(rounds) == 6
    for r in rounds:
        assert r["verified"] is True
        assert r["model_check"] == {"max_abs_logit_diff": 0.0, "tokens_match": True}, r
    assert "bfloat16, trained in float32" in result.stdout + result.stderr
    # auto tries a delta round first; later rounds are delta or dense as they measure faster here, and every round
    # records the share of elements that real AdamW steps changed (counted, or sampled in a dense round).
    assert m["rounds"][0]["delta"] is False and m["rounds"][1]["delta"] is True
    for r in m["rounds"][1:]:
        # Real steps at lr 1e-6 change a few percent of the bf16 elements (Adam's first step the most).
        assert 0.001 < r["changed_fraction"] < 0.2, r
        if r["delta"]:
            assert r["wire_bytes"] < 0.5 * r["bytes"], r
            assert r["base_round"] == r["round"] - 1


def test_synthetic_training_rounds_send_what_a_rerun_computes(cli, tmp_path: Path) -> None:
    out = tmp_path / "saved"
    # Delta rounds: the save sink writes the whole model from the session's copy, the changes applied.
    result = cli(
        "source.update=training", "refit.rounds=3", "refit.delta=on", "sink=save", f"sink.path={out}", COVER_STARTUP
    )
    assert result.returncode == 0, result.describe()
    m = local_metrics(cli.cwd)
    assert "training-like steps at lr 1e-06" in m["source"]
    assert [r["delta"] for r in m["rounds"]] == [False, True, True]
    rerun = SyntheticSource("tiny", None, 0, "bfloat16", update="training")
    first = {n: t.clone() for n, t in rerun.tensors()}
    rerun.advance(3)
    saved = dict(Checkpoint(out).iter_tensors())
    changed = total = 0
    for name, t in rerun.tensors():
        assert torch.equal(saved[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
        changed += int((t != first[name]).sum())
        total += t.numel()
    assert 0.01 < changed / total < 0.03  # two rounds of ~1% each, a few elements moving back and forth


def test_model_sink_needs_a_model_source(cli) -> None:
    result = cli("sink=model", COVER_STARTUP)
    assert result.returncode == 1
    assert result.stderr_lines() == [
        "refit_app: error: a consumer checks its model against the producer's, but the producer's source (synthetic "
        "tiny (4 layers, 47 tensors, 7.63 MiB bfloat16, seed 0)) has no model; use source=model"
    ], result.describe()


def test_save_writes_the_last_rounds_weights(cli, tmp_path: Path) -> None:
    out = tmp_path / "saved"
    result = cli("refit.rounds=3", "sink=save", f"sink.path={out}", COVER_STARTUP)
    assert result.returncode == 0, result.describe()
    source = SyntheticSource("tiny", None, 0, "bfloat16")
    source.advance(3)
    expected = dict(source.tensors())
    saved = dict(Checkpoint(out).iter_tensors())
    assert sorted(saved) == sorted(expected)  # the file is laid out as the reference writer does, not in send order
    first = dict(SyntheticSource("tiny", None, 0, "bfloat16").tensors())
    changed = 0
    for name, t in expected.items():
        assert torch.equal(saved[name].view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
        changed += not torch.equal(first[name], t)
    assert changed > len(expected) // 2  # the rounds really sent different weights


def test_memory_is_flat_over_50_rounds(cli) -> None:
    result = cli("refit.rounds=50", "source.size=64MiB", "refit.buffer_size_bytes=16MiB", COVER_STARTUP)
    assert result.returncode == 0, result.describe()
    m = local_metrics(cli.cwd)
    for side in (m, m["consumers"][0]):
        peaks = [r["peak_rss_bytes"] for r in side["rounds"]]
        shown = (side["role"], [p // MiB for p in peaks])
        assert len(peaks) == 50
        # Bounded: never more than the spares above the second round (the first faults the buffers in).
        assert max(peaks[1:]) - peaks[1] <= SPARES + NOISE, shown
