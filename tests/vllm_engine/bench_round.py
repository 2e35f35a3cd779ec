"""Time one refit round into a real vLLM engine: packed (refit_app) against one broadcast per tensor.

Not a test (pytest does not collect it): run it in the vLLM venv, on an otherwise idle machine::

    python tests/vllm_engine/bench_round.py [--layers 4 --hidden 1024 --rounds 4]

The engine is vLLM's offline ``LLM`` in this process (the worker in this process too); the trainer is a spawned
process with the ``refit_app`` trainer engine, as in ``test_offline_llm.py``. A round is what the trainer's
``send_weights`` takes: ``start_weight_update`` (layerwise reload set-up), the transfer with every chunk loaded
by ``model.load_weights`` as it arrives, the final agreement, and ``finish_weight_update`` (layerwise finalize),
so the engine-side load is included. The first round of a setting includes the manifest and the first touch of
the buffers; the table gives it apart from the median and the best of the others (on a shared machine the best is
the least disturbed). One line of JSON per setting goes to stdout, with every round's time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: mp_utils

from mp_utils import free_port

MiB = 1 << 20
SETTINGS = [
    {"label": "packed, default buffer", "packed": True, "buffer_size_bytes": None},
    {"label": "packed, 64 MiB", "packed": True, "buffer_size_bytes": 64 * MiB},
    {"label": "packed, 16 MiB", "packed": True, "buffer_size_bytes": 16 * MiB},
    {"label": "packed, 1 MiB", "packed": True, "buffer_size_bytes": 1 * MiB},
    # packed=False: the same session with a 1-byte chunk target, so every tensor travels alone in its own broadcast.
    {"label": "per-tensor broadcast", "packed": False, "buffer_size_bytes": None},
]


def make_model(path: Path, layers: int, hidden: int, vocab: int = 8192) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
        max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def trainer(conn: Any, model_dir: str, rounds: int) -> None:
    try:
        from harness import PipeClient, hf_greedy, load_trainer_model
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        from refit_app.integrations.vllm import backend as vllm_backend

        vllm_backend.register()
        model = load_trainer_model(Path(model_dir))
        client = PipeClient(conn)
        for setting in SETTINGS:
            init = vllm_backend.RefitTrainerInitInfo(
                master_address="127.0.0.1", master_port=free_port(), world_size=2, num_buffers=2,
                group_backend="gloo", timeout_s=300.0, packed=setting["packed"],
                buffer_size_bytes=setting["buffer_size_bytes"], rank=0,
            )  # fmt: skip
            engine = WeightTransferTrainerFactory.trainer_init(init, client=client, source=ModuleSource(model))
            walls, sessions = [], []
            try:
                for _ in range(rounds):
                    started = time.perf_counter()
                    engine.send_weights()
                    walls.append(time.perf_counter() - started)
                    sessions.append(engine.last_round.seconds)
                stats = engine.last_round
            finally:
                engine.shutdown()
            conn.send(("result", {**setting, "walls": walls, "sessions": sessions, "bytes": stats.bytes,
                                  "tensors": stats.num_tensors, "chunks": stats.num_broadcasts,
                                  "buffer_size_bytes": engine_buffer(init)}))  # fmt: skip
            conn.recv()
        conn.send(("check", hf_greedy(model), 0.0))
        conn.recv()
        conn.send(("done",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def engine_buffer(init: Any) -> int:
    from refit_app.integrations.vllm.backend import worker_init_info

    return worker_init_info(init).buffer_size_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    from harness import vllm_greedy
    from vllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        size = make_model(Path(tmp), args.layers, args.hidden)
        print(f"model: {args.layers} layers, hidden {args.hidden}, {size / 1e6:.1f} MB float32", file=sys.stderr)
        llm = LLM(model=tmp, skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True,
                  seed=0, weight_transfer_config={"backend": "refit_app"})  # fmt: skip
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=trainer, args=(theirs, tmp, args.rounds), daemon=True)
        proc.start()
        rows = []
        try:
            while True:
                if not ours.poll(900):
                    raise TimeoutError("trainer silent for 900 s")
                message = ours.recv()
                if message[0] == "rpc":
                    _, method, kwargs = message
                    try:
                        getattr(llm, method)(**kwargs)
                        ours.send(("ok", None))
                    except Exception as e:
                        ours.send(("error", repr(e)))
                elif message[0] == "result":
                    rows.append(message[1])
                    print(json.dumps(message[1]), flush=True)
                    ours.send(("ok", None))
                elif message[0] == "check":
                    match = vllm_greedy(llm) == message[1]
                    print(f"greedy tokens after the last round match transformers: {match}", file=sys.stderr)
                    ours.send(("ok", None))
                elif message[0] == "done":
                    break
                else:
                    raise RuntimeError(message[1])
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
    print("| setting | buffer | chunks | first round s | later rounds s (median) | later rounds s (best) | GB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        steady = statistics.median(r["walls"][1:]) if len(r["walls"]) > 1 else r["walls"][0]
        best = min(r["walls"][1:] or r["walls"])
        buffer = "-" if not r["packed"] else f"{r['buffer_size_bytes'] / MiB:g} MiB"
        print(f"| {r['label']} | {buffer} | {r['chunks']} | {r['walls'][0]:.3f} | {steady:.3f} | "
              f"{best:.3f} | {r['bytes'] / steady / 1e9:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
