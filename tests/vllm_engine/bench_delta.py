"""What vLLM's checkpoint-patch loader reaches on this vLLM build, and what a delta round costs the engine.

Not a test (pytest does not collect it): run it in the vLLM venv::

    python tests/vllm_engine/bench_delta.py [--layers 8 --hidden 1024 --repeat 3]

Part 1, on the tiny Llama (tied LM head, then untied): one element of one weight of each kind goes through
``load_checkpoint_weight_patches`` outside the layerwise reload (the loader's contract for sparse patches), and
vLLM's log-probabilities are compared with transformers patched the same way: ``reached`` (vLLM serves the change),
``refused`` (the loader raised; vLLM unchanged), ``stale`` (accepted, never served) or ``wrong``. A dense reload
puts the engine back after each. This is why :mod:`refit_app.integrations.vllm.loader` patches only layers that
compute from their parameters, and reloads the others.

Part 2, on a Llama of ``--layers`` x ``--hidden`` (float32, tied): the engine side of a round through
:class:`~refit_app.integrations.vllm.loader.EngineLoader` (the changes made up front, not timed; no transfer):
a dense round, and delta rounds of several shapes. Two Markdown tables go to stdout at the end (after vLLM's own
log lines).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness

import torch

CLOSE = 1e-4
"""Log-probabilities this close count as equal (float32 engines differ by about 1e-6)."""
PATCHED = [
    ("model.embed_tokens.weight", "embedding"),
    ("model.layers.0.input_layernorm.weight", "RMSNorm"),
    ("model.layers.0.self_attn.q_proj.weight", "q_proj (fused qkv_proj)"),
    ("model.layers.0.self_attn.o_proj.weight", "o_proj"),
    ("model.layers.1.mlp.gate_proj.weight", "gate_proj (fused gate_up_proj)"),
    ("model.layers.1.mlp.down_proj.weight", "down_proj"),
    ("lm_head.weight", "LM head (untied)"),
]


def _start(model_dir: str) -> Any:
    from vllm import LLM

    return LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True,
               seed=0, load_format="dummy")  # fmt: skip


def _worker(llm: Any) -> Any:
    return llm.llm_engine.model_executor.driver_worker.worker


def _weights(model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if tied:
        weights.pop("lm_head.weight", None)  # the checkpoint holds a tied weight once
    return weights


def reach(tied: bool) -> list[tuple[str, str, str]]:
    from harness import hf_logprobs, vllm_logprob_diff
    from transformers import LlamaForCausalLM
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    from refit_app.integrations.vllm.loader import EngineLoader
    from refit_app.models.hf import write_tiny_llama

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_llama(tmp, tie_word_embeddings=tied)
        hf = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        llm = _start(tmp)
        worker = _worker(llm)
        loader = EngineLoader(worker.get_model(), worker.model_config)

        def dense() -> None:
            with set_current_vllm_config(worker.vllm_config):
                loader.begin()
                loader.load(list(_weights(hf, tied).items()))
                loader.finish()

        dense()
        params = dict(hf.named_parameters())
        for name, label in PATCHED:
            if name not in params or (tied and name == "lm_head.weight"):
                continue
            flat = params[name].data.view(-1)
            index = 7 * 64 + 3 if "embed" in name or "lm_head" in name else 5  # row 7: a prompt token's
            old = float(flat[index])
            flat[index] = old + 1.5
            want = hf_logprobs(hf)
            patch = CheckpointWeightPatch(
                name, tuple(params[name].shape), torch.float32, torch.tensor([old + 1.5]), torch.tensor([index])
            )
            refused = ""
            try:
                with set_current_vllm_config(worker.vllm_config):
                    load_checkpoint_weight_patches(worker.get_model(), [patch])
            except Exception as e:
                refused = type(e).__name__
            to_patched = vllm_logprob_diff(llm, want)
            flat[index] = old
            to_unpatched = vllm_logprob_diff(llm, hf_logprobs(hf))
            if to_patched < CLOSE:
                verdict = "reached"
            elif to_unpatched < CLOSE:
                verdict = f"refused ({refused})" if refused else "stale: accepted, never served"
            else:
                verdict = "wrong"
            rows.append((f"{'tied' if tied else 'untied'} LM head", label, verdict))
            dense()
        llm.llm_engine.engine_core.shutdown()
    return rows


def costs(layers: int, hidden: int, repeat: int) -> list[tuple[str, float, dict]]:
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm.config import set_current_vllm_config

    from refit_app.integrations.vllm.loader import EngineLoader
    from refit_app.protocol.session import TensorDelta

    rows: list[tuple[str, float, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
            num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, head_dim=128,
            max_position_embeddings=512, tie_word_embeddings=True,
        )  # fmt: skip
        LlamaForCausalLM(config).save_pretrained(tmp)
        weights = _weights(LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32), tied=True)
        size = sum(t.numel() * t.element_size() for t in weights.values())
        print(
            f"model: {layers} layers, hidden {hidden}, {len(weights)} tensors, {size / 1e6:.0f} MB float32",
            file=sys.stderr,
        )
        llm = _start(tmp)
        worker = _worker(llm)
        loader = EngineLoader(worker.get_model(), worker.model_config)
        g = torch.Generator().manual_seed(1)

        def changed(names: list[str], share: float) -> list[tuple[str, TensorDelta]]:
            out = []
            for n in names:
                t = weights[n]
                if share >= 1:
                    out.append((n, TensorDelta(n, tuple(t.shape), t.dtype, None, t.view(-1), weights)))
                    continue
                positions = torch.randperm(t.numel(), generator=g)[: max(1, int(t.numel() * share))].sort().values
                out.append((n, TensorDelta(n, tuple(t.shape), t.dtype, positions, t.view(-1)[positions], weights)))
            return out

        def timed(label: str, make: Any, times: int = repeat) -> None:
            walls, facts = [], {}
            for _ in range(times):
                items = make()
                started = time.perf_counter()
                with set_current_vllm_config(worker.vllm_config):
                    loader.begin()
                    loader.load(items)
                    facts = loader.finish().facts()
                walls.append(time.perf_counter() - started)
            rows.append((label, statistics.median(walls), facts))

        everything = list(weights)
        norms = [n for n in weights if "norm" in n]
        timed("dense round, first (each tensor's layers observed)", lambda: list(weights.items()), times=1)
        timed("dense round", lambda: list(weights.items()))
        timed(f"delta: 1% of the {len(norms)} norms", lambda: changed(norms, 0.01))
        timed(
            "delta: 1% of one decoder layer's tensors",
            lambda: changed([n for n in weights if n.startswith("model.layers.1.")], 0.01),
        )
        timed("delta: 1% of every q_proj", lambda: changed([n for n in weights if "q_proj" in n], 0.01))
        timed("delta: 1% of every tensor", lambda: changed(everything, 0.01))
        timed("delta: every tensor whole", lambda: changed(everything, 1.0))
        llm.llm_engine.engine_core.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = reach(tied=True) + reach(tied=False)
    timings = costs(args.layers, args.hidden, args.repeat)
    # After every engine is gone: vLLM logs to stdout too.
    print()
    print("| model | weight patched (one element) | vLLM after the patch |")
    print("|---|---|---|")
    for model, label, verdict in rows:
        print(f"| {model} | {label} | {verdict} |")
    print()
    print("| round | engine s (median) | patched | reloaded | layers |")
    print("|---|---|---|---|---|")
    for label, seconds, facts in timings:
        print(
            f"| {label} | {seconds:.3f} | {facts.get('patched', '-')} | {facts['reloaded']} | "
            f"{facts.get('layers', '-')} |"
        )


if __name__ == "__main__":
    main()
