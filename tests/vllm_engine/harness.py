"""What the vLLM tests share: a trainer that improves the tiny Llama, greedy decoding on both sides, and the
engine's control plane across a pipe (the trainer in a spawned process, the engine in the test's).

The model is :func:`refit_app.models.hf.write_tiny_llama`'s (float32: bf16 greedy tokens diverge between vLLM and
transformers on ties; ``head_dim`` 32, the least vLLM's CPU attention accepts), made in the test.
"""

from __future__ import annotations

import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

SEED = 0
BUFFER_BYTES = 16 * 1024
"""Small on purpose: the tiny Llama's layers span several chunks, so receive buffers are reused while vLLM's
layerwise reload still holds a layer's earlier tensors."""
PROMPTS = [[1, 7, 42, 99, 3], [200, 17, 5], [64, 65, 66, 67, 68, 69, 70]]
"""Token-id prompts: the engine runs with ``skip_tokenizer_init``, so no tokenizer is needed."""
NEW_TOKENS = 8
VOCAB = 256
TRAIN_LR = 3e-2
"""Large on purpose: each optimizer step must change the greedy tokens, or a stale engine would pass."""
RPC_TIMEOUT_S = 180.0
"""Deadline of one control-plane call between the trainer process and the process that owns the engine."""


def load_trainer_model(path: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    """One AdamW step on a seeded random token batch; returns the loss."""
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, VOCAB, (4, 16), generator=generator)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    model.eval()
    return float(loss.detach())


@torch.no_grad()
def hf_greedy(model: torch.nn.Module) -> list[list[int]]:
    """transformers' greedy continuation of every prompt (no EOS stop, like ``ignore_eos`` in vLLM)."""
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=ids).logits[0, -1]
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
        out.append(ids[0, len(prompt) :].tolist())
    return out


def vllm_greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


# ---------------------------------------------------------------------------------------------------------------
# The engine's control plane across a pipe: the trainer process calls, the process that owns the LLM serves.


class PipeClient:
    """A ``VLLMWeightSyncClient`` whose calls run on an ``LLM`` in another process (see :func:`serve`)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def _call(self, method: str, **kwargs: Any) -> None:
        with self._lock:
            self._conn.send(("rpc", method, kwargs))
            if not self._conn.poll(RPC_TIMEOUT_S):
                raise TimeoutError(f"{method} got no answer within {RPC_TIMEOUT_S:g}s")
            status, detail = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"{method} failed in the engine process: {detail}")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", request={"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._call("update_weights", request={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version=weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown_weight_transfer_engine")


def serve(llm: Any, conn: Any, *, deadline: float, collective_rpc_rounds: set[int]) -> list[dict]:
    """Run the trainer's calls on ``llm`` until it says it is done; compare greedy tokens after every round.

    Rounds in ``collective_rpc_rounds`` are driven through ``llm.collective_rpc`` (what ``LLM``'s RL methods do
    underneath) instead of the ``LLM`` methods, so both ways are exercised. Returns one record per round.
    """
    rounds: list[dict] = []
    round_no = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not conn.poll(left):
            raise TimeoutError("the trainer process went silent before finishing its rounds")
        message = conn.recv()
        kind = message[0]
        if kind == "rpc":
            _, method, kwargs = message
            if method == "start_weight_update":
                round_no += 1
            try:
                if round_no in collective_rpc_rounds and method in (
                    "start_weight_update",
                    "update_weights",
                    "finish_weight_update",
                ):
                    rpc_kwargs = (
                        {"update_info": kwargs["request"]["update_info"]} if method == "update_weights" else None
                    )
                    llm.collective_rpc(method, kwargs=rpc_kwargs)
                else:
                    getattr(llm, method)(**kwargs)
                conn.send(("ok", None))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        elif kind == "check":
            _, expected, loss = message
            rounds.append({"round": round_no, "expected": expected, "vllm": vllm_greedy(llm), "loss": loss})
            conn.send(("ok", None))
        elif kind == "done":
            return rounds
        elif kind == "error":
            raise AssertionError(f"the trainer process failed:\n{message[1]}")
        else:
            raise AssertionError(f"unexpected message from the trainer: {message!r}")


def trainer_main(conn: Any, model_dir: str, settings: dict, rounds: int) -> None:
    """The trainer process: ``rounds`` times, one optimizer step, one refit, then the expected greedy tokens."""
    try:
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        from refit_app.integrations.vllm import backend as vllm_backend

        vllm_backend.register()  # a plain trainer process: vLLM's plugin loader never ran here
        torch.manual_seed(SEED + 1)
        model = load_trainer_model(Path(model_dir))
        optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR)
        engine = WeightTransferTrainerFactory.trainer_init(
            vllm_backend.RefitTrainerInitInfo(**settings, rank=0), client=PipeClient(conn), source=ModuleSource(model)
        )
        try:
            for step in range(rounds):
                loss = train_step(model, optimizer, step)
                engine.send_weights()
                conn.send(("check", hf_greedy(model), loss))
                if not conn.poll(RPC_TIMEOUT_S):
                    raise TimeoutError("the engine process did not confirm the check")
                conn.recv()
        finally:
            engine.shutdown()
        conn.send(("done",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
