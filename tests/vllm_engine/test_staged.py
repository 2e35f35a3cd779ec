"""Staged refits on vLLM's offline ``LLM`` (this process) from a spawned trainer: each round is received on a side
thread in the worker while the engine keeps generating, then applied in a pause (:mod:`refit_app.integrations.vllm.
staged`).

Four rounds, one optimizer step each. Every round the engine steps generation requests while the worker stages (the
trainer sends only once the engine has produced tokens with the stage under way, and the engine counts the tokens it
produced until the stage ended); the apply pauses it with requests in flight (``mode=keep``). After each applied round
vLLM's greedy tokens equal transformers' on the trainer's weights, and the requests that were in flight at the pause
carry ``weight_versions`` spans that split there, from the version before to this round's; the tensors vLLM keeps in
the checkpoint's shape equal the trainer's bit for bit; and a prompt whose two KV blocks were cached with the weights
before (generated from during the stage) gives the new weights' greedy tokens: the prefix cache was reset (with
``prefix_cache="keep"`` this fails: the cached blocks give the old weights' tokens). Round 3's staged copy is
corrupted in the worker (a bit flipped in the session's staged copy, as tests/test_staging.py does): it fails the
session's verification, is never applied and never pauses the engine, which keeps generating round 2's tokens; round 4
comes dense and is applied. A second test SIGKILLs the trainer half-way through its round 2; another SIGKILLs the
engine's process between rounds and starts a new one: a dense round, then delta rounds again.
"""

from __future__ import annotations

import hashlib
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import RPC_TIMEOUT_S, PipeClient, trainer_message_error, trainer_process
from mp_utils import free_port

from refit_app.integrations.vllm.traffic import Traffic

ROUNDS = 4
CORRUPT_ROUND = 3
KILL_TIMEOUT_S = 10.0
"""The group's deadline in the kill test: the worker gives up on the dead trainer within it."""
TEST_DEADLINE_S = 600.0
TOKENS_BEFORE_SEND = 4
"""Tokens the engine must produce with the worker's stage under way before the trainer sends the round."""
BACKGROUND = [[11, 12, 13, 14, 15], [90, 91, 92]]
"""The generation requests kept in flight through each round."""
BACKGROUND_TOKENS = 48
BLOCK_SIZE = 32
"""vLLM's KV block (the CPU default, 128, leaves no full block to cache in a 128-token context)."""
CACHED_PROMPT = list(range(3, 3 + 2 * BLOCK_SIZE + 5))
"""Two full KV blocks, generated from while each round is staged: the prefix cache holds them at the pause."""
KEPT = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"]
"""Tensors vLLM keeps in the checkpoint's shape (its CPU linear layers keep a 0-element placeholder): compared bit for
bit with the trainer's every round."""


class StagedPipeClient(PipeClient):
    """The trainer's client across the pipe: vLLM's weight-sync calls plus the staged pair."""

    def start_weight_update(self) -> None:
        raise AssertionError("staged rounds never call start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        raise AssertionError("staged rounds never call update_weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        raise AssertionError("staged rounds never call finish_weight_update")

    def stage_weights(self, update_info: dict) -> None:
        self._call("stage_weights", round=update_info["round"])

    def apply_staged(self, weight_version: str | None) -> dict:
        return self._call("apply_staged", weight_version=weight_version)


def staged_trainer_main(conn: Any, model_dir: str, settings: dict, rounds: int = ROUNDS, kill_round: int = 0) -> None:
    """``rounds`` staged rounds, one optimizer step each; in ``kill_round`` the trainer SIGKILLs itself once
    :data:`harness.KILL_AFTER_TENSORS` tensors of the round went to the session (some chunks are on the wire)."""
    try:
        from harness import staged_trainer, train_step

        from refit_app.integrations.vllm.staged import send_staged

        model, optimizer, source, engine = staged_trainer(model_dir, settings, StagedPipeClient(conn))
        try:
            for step in range(rounds):
                source.armed = step + 1 == kill_round
                train_step(model, optimizer, step)
                send_staged(engine, weight_version=str(step + 1))
                _check(conn, step + 1, model)
        finally:
            engine.shutdown()
        conn.send(("done",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _check(conn: Any, k: int, model: torch.nn.Module, *, logprobs: bool = False) -> dict:
    """The trainer's side of round ``k``'s check: what the engine must now serve (transformers' greedy tokens, the
    cached prompt's, the kept tensors, and its log-probabilities where asked); returns the engine's record of the
    round (:func:`_serve_staged`)."""
    from harness import hf_greedy, hf_greedy_of, hf_logprobs

    kept = {n: p.detach().clone() for n, p in model.named_parameters() if n in KEPT}
    extra = (hf_logprobs(model),) if logprobs else ()
    conn.send(("check", k, hf_greedy(model), hf_greedy_of(model, CACHED_PROMPT), kept, *extra))
    if not conn.poll(RPC_TIMEOUT_S):
        raise TimeoutError("the engine process did not confirm the check")
    return conn.recv()[1]


def _sha256(tensors: dict) -> dict[str, str]:
    return {
        n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest() for n, t in tensors.items()
    }


class Background(Traffic):
    """Generation requests stepped on ``llm.llm_engine`` by hand (:data:`BACKGROUND`, topped up once none is left),
    their tokens counted and their final outputs (with ``weight_versions``) kept."""

    def __init__(self, llm: Any) -> None:
        super().__init__(llm, BACKGROUND, BACKGROUND_TOKENS, prefix="bg-")

    def add(self, *prompts: list[int]) -> list[str]:  # type: ignore[override]
        return [super(Background, self).add(prompt) for prompt in prompts or BACKGROUND]

    def step(self) -> None:
        if not self.engine.has_unfinished_requests():
            self.add()
        self._step()


def _serve_staged(
    llm: Any,
    conn: Any,
    deadline: float,
    monkeypatch: pytest.MonkeyPatch,
    *,
    prepare: bool = True,
    corrupt_round: int | None = CORRUPT_ROUND,
    on_check: Any = None,
    on_stage: Any = None,
) -> list[dict]:
    from harness import _weights_differing, greedy_of, vllm_greedy, vllm_logprob_diff

    from refit_app.integrations.vllm.staged import StagedLLM
    from refit_app.protocol import consumer_session

    driver = StagedLLM(llm, prefix_cache="reset", prepare=prepare)
    background = Background(llm)
    rounds: list[dict] = []
    record: dict = {}
    previous: dict = {}
    """The trainer's kept tensors of the round before."""

    def corrupting(*args, show, **kwargs):  # a bit flipped in the session's staged copy, once
        flipped: list[str] = []

        def corrupt_then_show(batch):
            if not flipped and batch[0][1].numel():
                batch[0][1].view(-1).view(torch.uint8)[0] ^= 0x01
                flipped.append(batch[0][0])
            return show(batch)

        return original(*args, show=corrupt_then_show, **kwargs)

    def corrupting_changes(records, metas, targets, *, show):  # a bit flipped in a changed tensor's staged copy
        flipped: list[str] = []

        def corrupt_then_show(batch):
            name, tensor = batch[0]
            if not flipped and tensor.numel() and tensor is not targets[name]:
                tensor.view(-1).view(torch.uint8)[0] ^= 0x01
                flipped.append(name)
            return show(batch)

        return original_changes(records, metas, targets, show=corrupt_then_show)

    def check(expected: Any, expected_cached: Any, kept: dict, logprobs: Any = None) -> None:
        background.drain(deadline)
        record["spans"] = {
            r: [(s.version, s.start, s.end) for s in background.finished[r].outputs[0].weight_versions or []]
            for r in record["at_pause"]
        }
        record["expected"] = expected
        record["vllm"] = vllm_greedy(llm)
        record["cached"] = greedy_of(llm, CACHED_PROMPT)
        record["expected_cached"] = expected_cached
        record["differ"] = llm.collective_rpc(_weights_differing, args=(kept,))[0]
        record["differ_from_before"] = llm.collective_rpc(_weights_differing, args=(previous,))[0]
        # What vLLM's /weight_checker returns (SHA-256 of each parameter's bytes as the engine holds it), for the
        # parameters kept in the checkpoint's shape, against the same digest of the trainer's tensors.
        digests = {k.rsplit(":", 1)[1]: v for k, v in llm.collective_rpc("compute_weight_checksums")[0].items()}
        record["weight_checker"] = {n: digests[n] for n in KEPT}
        record["trainer_digests"] = _sha256(kept)
        record["previous_digests"] = _sha256(previous)
        record["logprob_diff"] = None if logprobs is None else vllm_logprob_diff(llm, logprobs)
        if on_check is not None:
            on_check(record["round"])
        rounds.append(record)

    original = consumer_session.stage_dense
    original_changes = consumer_session.stage_changes
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("the staged test ran past its deadline")
        if background.engine.has_unfinished_requests() and not conn.poll(0):
            background.step()  # generation goes on between the trainer's calls
            continue
        if not conn.poll(1.0):
            continue
        try:
            message = conn.recv()
        except EOFError:  # the trainer died: apply its round as it would have (nothing to apply), then check
            record["at_pause"] = {rid: background.seen[rid] for rid in background.in_flight()}
            record["metrics"] = driver.apply(str(record["round"]))
            record["trainer_gone"] = True
            check(None, None, previous)
            return rounds
        kind = message[0]
        if kind == "rpc":
            _, method, kwargs = message
            try:
                if method == "stage_weights":
                    k = kwargs["round"]
                    corrupt = k == corrupt_round
                    monkeypatch.setattr(consumer_session, "stage_dense", corrupting if corrupt else original)
                    monkeypatch.setattr(
                        consumer_session, "stage_changes", corrupting_changes if corrupt else original_changes
                    )
                    record = {"round": k}
                    background.add()
                    background.add(CACHED_PROMPT)  # its blocks cached with round k-1's weights
                    tokens_before = background.tokens
                    if on_stage is not None:
                        on_stage(k, driver)
                    driver.stage(k)  # returns at once: the worker receives on a side thread
                    while background.tokens - tokens_before < TOKENS_BEFORE_SEND:
                        assert driver.staging(), "the stage ended before the trainer sent anything"
                        background.step()
                    conn.send(("ok", None))  # now the trainer sends the round
                    while driver.staging():
                        if time.monotonic() > deadline:
                            raise TimeoutError("the stage did not end")
                        background.step()
                    record["stage_tokens"] = background.tokens - tokens_before
                    monkeypatch.setattr(consumer_session, "stage_dense", original)
                    monkeypatch.setattr(consumer_session, "stage_changes", original_changes)
                elif method == "apply_staged":
                    record["at_pause"] = {rid: background.seen[rid] for rid in background.in_flight()}
                    record["metrics"] = driver.apply(kwargs["weight_version"])
                    conn.send(("ok", record["metrics"]))
                else:
                    getattr(llm, method)(**kwargs)
                    conn.send(("ok", None))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
                raise
        elif kind == "check":
            _, k, expected, expected_cached, kept, *logprobs = message
            check(expected, expected_cached, kept, *logprobs)
            previous = kept
            conn.send(("ok", rounds[-1]))
        elif kind == "done":
            return rounds
        else:
            raise trainer_message_error(message)


def _weighted_layers(worker: Any) -> int:
    """How many of the engine model's layers hold parameters of their own (what a dense round loads into; the
    rotary embedding's and the attention layers' buffers are computed, not loaded)."""
    return sum(1 for m in worker.get_model().modules() if m._parameters)


@pytest.mark.parametrize("prepare", [True, False], ids=["prepared", "reload-in-pause"])
def test_staged_rounds_apply_in_a_pause_while_the_engine_generates(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, prepare: bool
) -> None:
    from harness import BUFFER_BYTES, hf_greedy, load_trainer_model, start_llm, stop_llm, vllm_greedy

    deadline = time.monotonic() + TEST_DEADLINE_S
    llm = start_llm(tiny_llama_dir, block_size=BLOCK_SIZE)
    try:
        before = vllm_greedy(llm)
        assert before == hf_greedy(load_trainer_model(tiny_llama_dir)), "vLLM disagrees with transformers at start"
        settings = {
            "master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2,
            "buffer_size_bytes": BUFFER_BYTES, "num_buffers": 2, "group_backend": "gloo", "timeout_s": 120.0,
            "checksums": True,  # the worker verifies every staged round
        }  # fmt: skip
        with trainer_process(staged_trainer_main, str(tiny_llama_dir), settings, deadline=deadline) as conn:
            rounds = _serve_staged(llm, conn, deadline, monkeypatch, prepare=prepare)
        layers = llm.collective_rpc(_weighted_layers)[0]
    finally:
        stop_llm(llm)

    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    served = before
    version = "default"
    for r in rounds:
        k, m = r["round"], r["metrics"]
        print(
            f"round {k}: applied={m['applied']} stage tokens={r['stage_tokens']} "
            + (
                f"stage {m['stage_seconds']:.3f}s prepare {m.get('prepare_seconds', 0):.3f}s pause "
                f"{m['pause_seconds']:.4f}s (swap {m['swap_seconds']:.4f}s, reload {m['load_seconds']:.3f}s) "
                f"pause/stage {m['pause_seconds'] / m['stage_seconds']:.2f}"
                if m["applied"]
                else f"error: {m['error']}"
            )
        )
        assert r["stage_tokens"] >= TOKENS_BEFORE_SEND, r
        if k == CORRUPT_ROUND:
            assert m["applied"] is False and "verification" in m["error"], m
            assert r["vllm"] == served, f"round {k}: a corrupted round changed what the engine serves"
            assert r["vllm"] != r["expected"], "the corrupted round's weights gave the served tokens: proves nothing"
            # Round 2's weights, bit for bit.
            assert sorted(r["differ"]) == sorted(KEPT) and r["differ_from_before"] == [], r
            assert r["weight_checker"] == r["previous_digests"] != r["trainer_digests"], r
            for rid, spans in r["spans"].items():
                assert [s[0] for s in spans] == [version], (rid, spans)  # never paused, never relabelled
            continue
        assert m["applied"] is True and m["verified"] is True and m["version"] == k, m
        if prepare:  # every layer built beside generation, nothing reloaded in the pause
            assert m["prepared"] is True and m["fallback"] == {} and m["prepared_layers"] == layers, m
            assert m["load_seconds"] == 0.0, m
        else:
            assert m["prepared"] is False and m["load_seconds"] > 0, m
        assert r["vllm"] == r["expected"], f"round {k}: vLLM {r['vllm']} vs transformers {r['expected']}"
        assert r["differ"] == [], f"round {k}: vLLM's {r['differ']} differ from the trainer's"
        assert r["weight_checker"] == r["trainer_digests"], f"round {k}: vLLM's checksums are not the trainer's: {r}"
        # A prompt whose blocks were cached with the weights before: the new weights' tokens (the cache was reset).
        assert r["cached"] == r["expected_cached"], f"round {k}: {r['cached']} vs {r['expected_cached']}"
        assert any(r["at_pause"].values()), f"round {k}: no request was generating at the pause: {r['at_pause']}"
        for rid, spans in r["spans"].items():
            # Tokens before the pause from the version before, after it from this round's: one split, at the pause.
            n = r["at_pause"][rid]
            want = [(version, 0, n), (str(k), n, BACKGROUND_TOKENS)] if n else [(str(k), 0, BACKGROUND_TOKENS)]
            assert spans == want, (rid, spans, want)
        served, version = r["vllm"], str(k)
    assert rounds[-1]["expected"] != before, "training did not change the greedy tokens; the test proves nothing"


def test_a_trainer_killed_mid_stage_leaves_the_engine_serving_the_round_before(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 1 staged and applied; in round 2 the trainer SIGKILLs itself with half the round sent. The worker's
    stage fails within the group's deadline while the engine keeps generating; the apply applies nothing and never
    pauses; the engine serves round 1's tokens and weights, bit for bit."""
    from harness import BUFFER_BYTES, start_llm, stop_llm

    deadline = time.monotonic() + TEST_DEADLINE_S
    llm = start_llm(tiny_llama_dir, block_size=BLOCK_SIZE)
    try:
        settings = {
            "master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2,
            "buffer_size_bytes": BUFFER_BYTES, "num_buffers": 2, "group_backend": "gloo",
            "timeout_s": KILL_TIMEOUT_S, "checksums": True,
        }  # fmt: skip
        with trainer_process(
            staged_trainer_main, str(tiny_llama_dir), settings, 2, 2, deadline=deadline, exitcode=-signal.SIGKILL
        ) as conn:
            rounds = _serve_staged(llm, conn, deadline, monkeypatch)
    finally:
        stop_llm(llm)

    first, killed = rounds
    assert first["metrics"]["applied"] is True and first["vllm"] == first["expected"], first
    assert killed.get("trainer_gone") and killed["metrics"]["applied"] is False, killed
    error = killed["metrics"]["error"]
    assert error.startswith("round 2: ") and "\n" not in error, error
    print(f"round 2: {error}; stage tokens {killed['stage_tokens']}")
    assert killed["stage_tokens"] >= TOKENS_BEFORE_SEND, killed
    assert killed["vllm"] == first["vllm"] and killed["differ_from_before"] == [], killed  # round 1, bit for bit
    assert killed["weight_checker"] == first["trainer_digests"] == killed["previous_digests"], killed
    for rid, spans in killed["spans"].items():
        assert [s[0] for s in spans] == ["1"], (rid, spans)  # never paused, never relabelled


DELTA_PLAN: list[list[str] | None] = [
    None,  # 1: an AdamW step; dense (the session's first round)
    ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"],
    ["model.layers.1.mlp.gate_proj.weight"],  # 3: corrupted in the worker, never applied
    None,  # 4: an AdamW step; dense (round 3 was not applied)
    ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"],
]
"""Per round: None, an AdamW step; else a few elements of these tensors nudged (a delta round after a round the
worker holds)."""
DELTA_LAYERS = {
    2: {"model.layers.1.mlp.down_proj", "model.layers.0.self_attn.qkv_proj", "model.norm"},
    5: {"model.embed_tokens", "lm_head", "model.layers.0.mlp.gate_up_proj"},
}
"""The vLLM layers a delta round's changes load into, and so the only ones it prepares: k_proj's change rebuilds
the fused qkv_proj (from q and v as the worker holds them), the embedding's the LM head tied to it."""
NUDGE = 0.5
BOUND_ROUND = 4
"""Staged with ``max_prepared_bytes=1``."""
REFUSED_ROUND = 5
"""Its fused ``gate_up_proj`` refused by the swap check."""
REFUSAL = "refused by the test"


def staged_delta_trainer_main(conn: Any, model_dir: str, settings: dict) -> None:
    """:data:`DELTA_PLAN`'s rounds, staged, with ``delta="on"``; each check also carries transformers'
    log-probabilities."""
    try:
        from harness import SEED, TRAIN_LR, load_trainer_model, train_step
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        from refit_app.integrations.vllm import backend as vllm_backend
        from refit_app.integrations.vllm.staged import send_staged

        vllm_backend.register()
        torch.manual_seed(SEED + 1)
        model = load_trainer_model(Path(model_dir))
        params = dict(model.named_parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR)
        g = torch.Generator().manual_seed(SEED + 2)
        engine = WeightTransferTrainerFactory.trainer_init(
            vllm_backend.RefitTrainerInitInfo(**settings, staged=True, delta="on", rank=0),
            client=StagedPipeClient(conn),
            source=ModuleSource(model),
        )
        try:
            for step, names in enumerate(DELTA_PLAN):
                if names is None:
                    train_step(model, optimizer, step)
                else:
                    with torch.no_grad():
                        for name in names:
                            flat = params[name].data.view(-1)
                            flat[torch.randperm(flat.numel(), generator=g)[:8]] += NUDGE
                send_staged(engine, weight_version=str(step + 1))
                _check(conn, step + 1, model, logprobs=True)
        finally:
            engine.shutdown()
        conn.send(("done",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _prepared_names(worker: Any) -> list[str]:
    from refit_app.integrations.vllm.staged import _worker

    return sorted(_worker(worker).last_prepared)


def test_staged_delta_rounds_prepare_only_the_layers_they_change(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Delta rounds staged in the worker (``delta="on"``): each prepares, beside generation, only the layers its
    changes load into (with their other checkpoint tensors from the worker's copy), and the pause swaps those in.
    After every applied round vLLM's log-probabilities and greedy tokens are transformers' on the trainer's weights,
    the parameters vLLM keeps in the checkpoint's shape (and their /weight_checker digests) the trainer's, and the
    prefix cache was reset. Round 3 (a delta round) is corrupted in its staged copy: never applied, the engine keeps
    round 2; round 4 comes dense, over ``max_prepared_bytes``: nothing prepared, the whole model reloaded in the
    pause; round 5 is a delta round again, with one of its layers refused by the swap check: that layer alone is
    reloaded in the pause."""
    from harness import BUFFER_BYTES, start_llm, stop_llm

    from refit_app.integrations.vllm import prepare as prepare_module

    check_swap = prepare_module._swappable
    # One load_weights call per tensor once the routes are known (the 1 GB model's groups; the other test, one call).
    monkeypatch.setattr(prepare_module, "LOAD_GROUP_BYTES", 1)

    def on_stage(k: int, driver: Any) -> None:
        driver.max_prepared_bytes = 1 if k == BOUND_ROUND else None
        if k == REFUSED_ROUND:  # the fused gate_up_proj's shadow is refused: reloaded in the pause instead

            def refusing(layer: Any, shadow: Any) -> str | None:
                return REFUSAL if type(layer).__name__ == "MergedColumnParallelLinear" else check_swap(layer, shadow)

            monkeypatch.setattr(prepare_module, "_swappable", refusing)
        else:
            monkeypatch.setattr(prepare_module, "_swappable", check_swap)

    deadline = time.monotonic() + TEST_DEADLINE_S
    llm = start_llm(tiny_llama_dir, block_size=BLOCK_SIZE)
    prepared: dict[int, list[str]] = {}
    try:
        settings = {
            "master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2,
            "buffer_size_bytes": BUFFER_BYTES, "num_buffers": 2, "group_backend": "gloo", "timeout_s": 120.0,
            "checksums": True,
        }  # fmt: skip
        with trainer_process(staged_delta_trainer_main, str(tiny_llama_dir), settings, deadline=deadline) as conn:
            rounds = _serve_staged(
                llm,
                conn,
                deadline,
                monkeypatch,
                on_check=lambda k: prepared.update({k: llm.collective_rpc(_prepared_names)[0]}),
                on_stage=on_stage,
            )
        layers = llm.collective_rpc(_weighted_layers)[0]
    finally:
        stop_llm(llm)

    assert [r["round"] for r in rounds] == list(range(1, len(DELTA_PLAN) + 1))
    served = None
    for r in rounds:
        k, m = r["round"], r["metrics"]
        print(
            f"round {k}: "
            + (
                f"base {m['base_round']} prepared {m.get('prepared_layers', 0)} layers in "
                f"{m.get('prepare_seconds', 0):.3f}s, stage {m['stage_seconds']:.3f}s, pause {m['pause_seconds']:.4f}s "
                f"(swap {m['swap_seconds']:.4f}s, reload {m['load_seconds']:.4f}s), fallback {m['fallback']}, "
                f"log-prob diff {r['logprob_diff']:.2e}"
                if m["applied"]
                else f"not applied (log-prob diff to the trainer's {r['logprob_diff']:.2e}): {m['error']}"
            )
        )
        if k == CORRUPT_ROUND:
            assert m["applied"] is False and "verification" in m["error"], m
            assert r["vllm"] == served and r["differ_from_before"] == [], r  # round 2's tokens and weights
            assert r["weight_checker"] == r["previous_digests"], r
            # The round changed gate_proj alone: the engine's log-probabilities are not those of its weights.
            assert r["logprob_diff"] > 1e-4, f"round {k}: the corrupted round's log-probabilities are served: {r}"
            continue
        assert m["applied"] is True and m["verified"] is True and m["version"] == k, m
        assert m["base_round"] == (k - 1 if k in DELTA_LAYERS else 0), m
        want = DELTA_LAYERS.get(k)
        if k == BOUND_ROUND:  # over the bound: nothing prepared, the whole model reloaded in the pause
            assert m["prepared"] is False and list(m["fallback"]) == ["*"] and "over 1" in m["fallback"]["*"], m
            assert m["load_seconds"] > 0 and prepared[k] == [], m
        elif k == REFUSED_ROUND:  # the refused layer reloaded in the pause, the others swapped in
            refused = "model.layers.0.mlp.gate_up_proj"
            assert m["fallback"] == {refused: REFUSAL} and m["load_seconds"] > 0, m
            assert set(prepared[k]) == want - {refused} and m["prepared_layers"] == len(want) - 1, (m, prepared[k])
        else:
            assert m["fallback"] == {} and m["load_seconds"] == 0.0, m
            if want is None:
                assert m["prepared_layers"] == layers, m
            else:
                assert m["prepared_layers"] == len(want) and set(prepared[k]) == want, (m, prepared[k])
        assert r["logprob_diff"] < 1e-4, f"round {k}: log-probabilities differ by {r['logprob_diff']}"
        assert r["vllm"] == r["expected"], f"round {k}: vLLM {r['vllm']} vs transformers {r['expected']}"
        assert r["differ"] == [] and r["weight_checker"] == r["trainer_digests"], r
        assert r["cached"] == r["expected_cached"], f"round {k}: {r['cached']} vs {r['expected_cached']}"
        served = r["vllm"]


def staged_engine_main(conn: Any, model_dir: str, deadline_s: float) -> None:
    """An engine process: the tests' offline engine of ``model_dir`` serving staged rounds from the trainer at the
    other end of ``conn`` (:func:`_serve_staged`, generation in flight throughout), until the trainer says done."""
    from harness import start_llm, stop_llm

    patch = pytest.MonkeyPatch()
    llm = start_llm(Path(model_dir), block_size=BLOCK_SIZE)
    try:
        conn.send(("ready",))  # the trainer's group deadline starts once the engine is up
        _serve_staged(llm, conn, time.monotonic() + deadline_s, patch, corrupt_round=None)
    finally:
        stop_llm(llm)
        patch.undo()


RESTART_PLAN: list[list[str] | None] = [
    None,  # engine A, round 1: an AdamW step, dense
    ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"],  # engine A, round 2: a delta round
    # engine A SIGKILLed; engine B starts from the checkpoint in model_dir, not from round 2's weights
    None,  # engine B, the new session's round 1: an AdamW step, dense
    ["model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight"],  # engine B, a delta round
    ["model.layers.1.mlp.up_proj.weight"],  # engine B, a delta round
]
RESTART_AFTER = 2
"""Steps of :data:`RESTART_PLAN` engine A serves before it is SIGKILLed."""


def test_an_engine_restarted_between_rounds_gets_a_dense_round_then_deltas_again(tiny_llama_dir: Path) -> None:
    """The engine's process is SIGKILLed between two staged rounds (after a delta round) and a new one starts from
    the checkpoint on disk: the trainer (``delta="on"``) learns it from its next call, its shutdown returns within
    the group's deadline, and a new trainer engine towards the new engine sends a dense round (the new worker holds
    no base: a delta round would patch weights it does not hold), then delta rounds again. Every applied round:
    vLLM's log-probabilities and greedy tokens are transformers' on the trainer's weights, the parameters kept in
    the checkpoint's shape equal the trainer's by /weight_checker, the prefix cache was reset."""
    import multiprocessing as mp

    from harness import BUFFER_BYTES, SEED, TRAIN_LR, load_trainer_model, train_step
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from refit_app.integrations.vllm import backend as vllm_backend
    from refit_app.integrations.vllm.staged import send_staged

    deadline = time.monotonic() + TEST_DEADLINE_S
    ctx = mp.get_context("spawn")
    torch.manual_seed(SEED + 1)
    model = load_trainer_model(tiny_llama_dir)
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR)
    g = torch.Generator().manual_seed(SEED + 2)
    group_timeout_s = 30.0
    engines: list[Any] = []
    records: list[tuple[str, dict]] = []

    def start_engine() -> tuple[Any, Any]:
        ours, theirs = ctx.Pipe()
        process = ctx.Process(
            target=staged_engine_main, args=(theirs, str(tiny_llama_dir), TEST_DEADLINE_S), daemon=True
        )
        process.start()
        theirs.close()
        engines.append(process)
        if not ours.poll(max(1.0, deadline - time.monotonic())):
            raise TimeoutError("the engine process did not start by the test's deadline")
        assert ours.recv() == ("ready",)
        settings = {
            "master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2,
            "buffer_size_bytes": BUFFER_BYTES, "num_buffers": 2, "group_backend": "gloo",
            "timeout_s": group_timeout_s, "checksums": True,
        }  # fmt: skip
        trainer = WeightTransferTrainerFactory.trainer_init(
            vllm_backend.RefitTrainerInitInfo(**settings, staged=True, delta="on", rank=0),
            client=StagedPipeClient(ours),
            source=ModuleSource(model),
        )
        return ours, trainer

    def step(names: list[str] | None, n: int) -> None:
        if names is None:
            train_step(model, optimizer, n)
            return
        with torch.no_grad():
            for name in names:
                flat = params[name].data.view(-1)
                flat[torch.randperm(flat.numel(), generator=g)[:8]] += NUDGE

    vllm_backend.register()
    try:
        conn, trainer = start_engine()
        for n, names in enumerate(RESTART_PLAN[:RESTART_AFTER]):
            step(names, n)
            send_staged(trainer, weight_version=f"A{n + 1}")
            records.append(("A", _check(conn, n + 1, model, logprobs=True)))

        engines[0].kill()  # the engine's process dies between rounds, its worker's copy of round 2 with it
        engines[0].join(30)
        step(RESTART_PLAN[RESTART_AFTER], RESTART_AFTER)
        with pytest.raises((EOFError, BrokenPipeError, ConnectionError, OSError)):
            send_staged(trainer, weight_version="A3")  # the engine is gone: the trainer's call fails
        closed = time.monotonic()
        trainer.shutdown()  # towards a dead group: bounded by the group's deadline, never a hang
        assert time.monotonic() - closed < group_timeout_s + 15.0, "the trainer's shutdown waited on a dead engine"
        conn.close()

        conn, trainer = start_engine()  # engine B: the checkpoint's weights, a new worker, no base
        for i, names in enumerate(RESTART_PLAN[RESTART_AFTER:]):
            if i:
                step(names, RESTART_AFTER + i)
            send_staged(trainer, weight_version=f"B{i + 1}")
            records.append(("B", _check(conn, i + 1, model, logprobs=True)))
        trainer.shutdown()
        conn.send(("done",))
        engines[1].join(max(1.0, deadline - time.monotonic()))
        assert engines[1].exitcode == 0, f"engine B exit code {engines[1].exitcode}"
    finally:
        for process in engines:
            if process.is_alive():
                process.kill()
                process.join(10)

    assert [(e, r["round"]) for e, r in records] == [("A", 1), ("A", 2), ("B", 1), ("B", 2), ("B", 3)]
    for engine, r in records:
        k, m = r["round"], r["metrics"]
        print(
            f"engine {engine} round {k}: base {m['base_round']} stage {m['stage_seconds']:.3f}s pause "
            f"{m['pause_seconds']:.4f}s prepared {m.get('prepared_layers', 0)} layers, log-prob diff "
            f"{r['logprob_diff']:.2e}"
        )
        assert m["applied"] is True and m["verified"] is True and m["version"] == k, m
        assert m["base_round"] == k - 1, f"engine {engine} round {k}: built on round {m['base_round']}"
        assert m["fallback"] == {} and m["load_seconds"] == 0.0, m
        assert r["logprob_diff"] < 1e-4, f"engine {engine} round {k}: log-probabilities differ by {r['logprob_diff']}"
        assert r["vllm"] == r["expected"], f"engine {engine} round {k}: vLLM {r['vllm']} vs {r['expected']}"
        assert r["differ"] == [] and r["weight_checker"] == r["trainer_digests"], r
        assert r["cached"] == r["expected_cached"], r
