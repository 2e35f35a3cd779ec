"""vLLM's offline ``LLM`` in this process as the consumer, a spawned trainer process as the producer.

The trainer takes an optimizer step and refits the engine through the ``refit_app`` backend, three rounds, with
16 KiB buffers (a layer spans several chunks, so buffers are reused while vLLM's layerwise reload holds a layer's
earlier tensors); after every round vLLM's greedy
tokens must equal transformers' greedy tokens on the trainer's updated weights. Round 2 is driven through
``llm.collective_rpc``, the others through ``LLM``'s RL methods.

With ``delta="on"`` (:func:`harness.delta_trainer_main`), rounds after the first carry only the changes: each round
the engine's tokens and log-probabilities must equal transformers' and the weights vLLM keeps whole must equal the
trainer's bit for bit, whichever way each change went in (patched in place, or its layers reloaded).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest
from conditions import needs_cuda
from mp_utils import free_port

ROUNDS = 3
TEST_DEADLINE_S = 600.0
"""Whole-test deadline: engine start (~25 s here), the trainer's start-up and three rounds, on a loaded 2-core box."""


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_offline_llm_serves_the_trainers_weights_every_round(tiny_llama_dir: Path, backend: str) -> None:
    """Over sockets, and through shared memory (trainer and engine on one host: the engine's worker loads views of
    the trainer's segments, vLLM's layerwise reload holding them until a layer is complete)."""
    _refit_offline_llm(tiny_llama_dir, backend)


@pytest.mark.gpu
@needs_cuda  # the NCCL path of the backend (vllm extra)
@pytest.mark.parametrize("backend", ["nccl", "pynccl"])
def test_offline_llm_on_a_gpu(tiny_llama_dir: Path, backend: str) -> None:
    """The same loop on a GPU with vLLM 0.33 (`pip install -e '.[vllm]'`): trainer and engine on one device, the
    group over NCCL or vLLM's PyNcclCommunicator. Never run here (no GPU was lent); it runs wherever CUDA is."""
    _refit_offline_llm(tiny_llama_dir, backend)


def test_delta_rounds_patch_what_vllm_serves_in_place_and_reload_the_rest(tiny_llama_dir: Path) -> None:
    from harness import BUFFER_BYTES, DELTA_PLAN, delta_trainer_main, serve, start_llm, stop_llm

    deadline = time.monotonic() + TEST_DEADLINE_S
    llm = start_llm(tiny_llama_dir)
    trainer = None
    try:
        settings = {
            "master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2,
            "buffer_size_bytes": BUFFER_BYTES, "num_buffers": 2, "group_backend": "gloo", "timeout_s": 120.0,
            "checksums": True,  # the worker's copy of the model, checked against the trainer's every round
        }  # fmt: skip
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        trainer = ctx.Process(target=delta_trainer_main, args=(theirs, str(tiny_llama_dir), settings), daemon=True)
        trainer.start()
        rounds = serve(llm, ours, deadline=deadline, collective_rpc_rounds={3})
        trainer.join(max(1.0, deadline - time.monotonic()))
        assert trainer.exitcode == 0, f"trainer exit code {trainer.exitcode}"
    finally:
        if trainer is not None and trainer.is_alive():
            trainer.kill()
            trainer.join(10)
        stop_llm(llm)

    assert [r["round"] for r in rounds] == list(range(1, len(DELTA_PLAN) + 1))
    for kind, r in zip(DELTA_PLAN, rounds):
        assert r["differ"] == [], f"round {r['round']} ({kind}): vLLM's {r['differ']} differ from the trainer's"
        if kind != "nan":
            assert r["vllm"] == r["expected"], f"round {r['round']} ({kind}): {r}"
            assert r["logprob_diff"] < 1e-4, f"round {r['round']} ({kind}): {r}"
    loads = dict(zip(DELTA_PLAN, (r["load"] for r in rounds)))
    assert loads["first"]["delta"] is False and all(r["load"]["delta"] for r in rounds[1:]), loads
    # Four float norms patched in place; q_proj reloads the fused qkv_proj with k and v, the embedding reloads
    # (its tied LM head computes from a prepacked copy).
    assert (loads["sparse"]["patched"], loads["sparse"]["reloaded"], loads["sparse"]["layers"]) == (4, 4, 2), loads
    # The NaN goes in by the reload (the patch loader would read it as "unchanged"), the other change in place.
    assert (loads["nan"]["patched"], loads["nan"]["reloaded"]) == (1, 1), loads
    # The NaN taken out in place; the int64 norm (no NaN to mark "unchanged") reloaded.
    assert (loads["denan+int"]["patched"], loads["denan+int"]["reloaded"]) == (1, 1), loads
    assert rounds[-1]["expected"] != rounds[0]["expected"], "training did not change the tokens: proves nothing"


def _refit_offline_llm(tiny_llama_dir: Path, backend: str) -> None:
    from harness import (
        BUFFER_BYTES,
        hf_greedy,
        load_trainer_model,
        serve,
        start_llm,
        stop_llm,
        trainer_main,
        vllm_greedy,
    )

    deadline = time.monotonic() + TEST_DEADLINE_S
    llm = start_llm(tiny_llama_dir)
    trainer = None
    try:
        before = vllm_greedy(llm)
        assert before == hf_greedy(load_trainer_model(tiny_llama_dir)), (
            "vLLM disagrees with transformers before any refit"
        )

        settings = {
            "master_address": "127.0.0.1",
            "master_port": free_port(),
            "world_size": 2,
            "buffer_size_bytes": BUFFER_BYTES,
            "num_buffers": 2,
            "group_backend": backend,
            "timeout_s": 120.0,
            "checksums": True,  # every worker checks every tensor it received against the trainer's checksums
        }
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        trainer = ctx.Process(target=trainer_main, args=(theirs, str(tiny_llama_dir), settings, ROUNDS), daemon=True)
        trainer.start()
        rounds = serve(llm, ours, deadline=deadline, collective_rpc_rounds={2})
        trainer.join(max(1.0, deadline - time.monotonic()))
        assert trainer.exitcode == 0, f"trainer exit code {trainer.exitcode}"
    finally:
        if trainer is not None and trainer.is_alive():
            trainer.kill()
            trainer.join(10)
        stop_llm(llm)

    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    mismatched = [r for r in rounds if r["vllm"] != r["expected"]]
    assert not mismatched, "vLLM served other weights than the trainer's after " + "; ".join(
        f"round {r['round']}: vLLM {r['vllm']} vs transformers {r['expected']}" for r in mismatched
    )
    # A refit that changed nothing would also match; the trainer's steps must show in the tokens.
    assert rounds[-1]["expected"] != before, "training did not change the greedy tokens; the test proves nothing"
    assert len({r["loss"] for r in rounds}) == ROUNDS
