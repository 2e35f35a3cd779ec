"""``source=model sink=vllm refit.rounds=3``: the trainer-to-engine loop of the application, a real vLLM engine on
the consumer side, as a user runs it (``python -m refit_app``, role=local).

The trainer takes real AdamW steps between rounds; the engine is built from the config.json the producer sends,
loaded every round through the backend's worker path with 16 KiB buffers (a layer spans several chunks, so buffers
are reused while vLLM's layerwise reload holds a layer's earlier tensors), checked bit for bit, and compared with
the trainer's model after every round through vLLM's own greedy generation and log-probabilities.
"""

from __future__ import annotations

from pathlib import Path

from cli_utils import local_metrics

ROUNDS = 3
STARTUP_COVER = "group.timeout_s=300"
"""The consumer starts a vLLM engine when the first manifest arrives, inside the handshake's deadline; on a loaded
2-core machine that takes tens of seconds."""
APP_TIMEOUT_S = 600.0


def test_trainer_to_vllm_engine_loop(cli, tiny_llama_dir: Path) -> None:
    from harness import BUFFER_BYTES

    result = cli(
        "source=model", f"source.path={tiny_llama_dir}", "sink=vllm", f"refit.rounds={ROUNDS}",
        f"refit.buffer_size_bytes={BUFFER_BYTES}", STARTUP_COVER, timeout_s=APP_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.describe()
    m = local_metrics(cli.cwd)
    assert m["status"] == "ok" and m["rounds_done"] == ROUNDS
    assert [r["manifest_sent"] for r in m["rounds"]] == [True] + [False] * (ROUNDS - 1)
    losses = [r["loss"] for r in m["rounds"][1:]]
    assert len(set(losses)) == ROUNDS - 1, losses  # real optimizer steps: the weights change every round
    consumer = m["consumers"][0]
    assert consumer["sink"] == "refit_app.integrations.vllm.sink.VllmSink"
    assert consumer["num_broadcasts"] > 4, "the buffers must be small enough to split the model into many chunks"
    assert len(consumer["rounds"]) == ROUNDS, consumer["rounds"]
    for r in consumer["rounds"]:
        assert r["verified"] is True, r
        check = r["model_check"]
        assert check["tokens_match"] is True, r
        assert check["max_abs_logit_diff"] < 1e-4, r
