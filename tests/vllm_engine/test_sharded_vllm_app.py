"""The application's sharded refit into a tensor-parallel vLLM engine (issue 33), as a user runs it:
``python -m refit_app group.producers=2 group.tp_size=2 source=model sink=vllm``. Two producer processes train the
tiny Llama under FSDP2 (AdamW steps between rounds) and send their shards; one engine process owns vLLM's offline
``LLM`` at ``tensor_parallel_size=2`` whose two workers are the refit's consumers, each receiving only what its
weight loaders load. Every round the engine's greedy tokens and log-probabilities on the trainer's probe must be
the trainer's (the run fails otherwise), and each worker's bytes are about half the model's; with
``group.replicas=2`` two such engines, each worker taking the same slice as its peer in the other engine.

Then what must fail, in one line on every rank: a ``group.tp_size`` the model's heads do not divide, sink=vllm
without a trainer (role=local, and producers of another source started on their own); and a lost engine process
or a lost producer, which must stop the other side within ``group.timeout_s``.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from cli_utils import assert_one_line_error, local_metrics
from failure_utils import Launcher
from mp_utils import free_port

K, TP, ROUNDS = 2, 2, 3
TIMEOUT_S = 600
"""group.timeout_s: it must cover the engine's start (two vLLM workers: 30-65 s on this 2-core machine, over 5
minutes at a load average near 20 from other test runs), which the producers wait for."""
APP_LIMIT_S = 900.0
"""Hard limit on one run past which it has hung."""
EXIT_MARGIN_S = 60.0
"""After a kill, the other side must exit within its deadline, group.timeout_s, and this margin (its teardown)."""
LAYOUT = [f"group.producers={K}", f"group.tp_size={TP}"]
LR = "source.lr=3e-2"
"""Large on purpose: each AdamW step changes the trainer's greedy tokens, or a stale engine would pass."""


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, float32, its LM head tied to the embedding (bf16 greedy tokens tie between vLLM and the
    trainer; a tied head is one checkpoint tensor for two of vLLM's layers)."""
    import torch

    from refit_app.models.hf import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), dtype=torch.float32, tie_word_embeddings=True)


def test_sharded_trainer_refits_a_tensor_parallel_engine(cli, tied_llama_dir: Path) -> None:
    # refit.delta=auto: its three rounds are the three kinds, each taken by the workers its own way: a dense round
    # of records that fills the producers' snapshots, a delta round (the workers patch the slices they keep and load
    # again only the tensors it wrote), then a plain round, sent as with refit.delta=off (the delta round's changes
    # took most of the bytes: AdamW at this rate changes most float32 elements).
    result = cli(
        *LAYOUT, "source=model", f"source.path={tied_llama_dir}", LR, "sink=vllm", f"refit.rounds={ROUNDS}",
        "refit.delta=auto", f"group.timeout_s={TIMEOUT_S}", timeout_s=APP_LIMIT_S,
    )  # fmt: skip
    # Not assert_ok: vLLM logs a traceback of its own at start-up (its chat template warm-up without a tokenizer).
    assert result.returncode == 0, result.describe()
    m = local_metrics(cli.cwd)
    assert m["status"] == "ok" and m["rounds_done"] == ROUNDS, m
    assert len(m["producers"]) == K and len(m["consumers"]) == 1
    engine = m["consumers"][0]
    assert engine["sink"] == "vllm" and engine["rank"] == K
    losses = [r["loss"] for r in m["producers"][0]["rounds"][1:]]
    assert len(set(losses)) == ROUNDS - 1, losses  # real optimizer steps: the weights change every round
    kinds = [r["auto_reason"].split(":")[0] for r in m["rounds"]]
    assert kinds == ["keep", "delta", "plain"], [r["auto_reason"] for r in m["rounds"]]
    loaded = {w["rank"]: w["loaded"] for w in engine["rounds"][0]["workers"]}
    tokens = []
    for n, (r, top) in enumerate(zip(engine["rounds"], m["rounds"]), start=1):
        check = r["model_check"]
        assert check["tokens_match"] is True and check["max_abs_logit_diff"] < 1e-4, (n, check)
        tokens.append(check["next_tokens"])
        workers = r["workers"]
        assert [w["rank"] for w in workers] == [K, K + 1], workers
        for w in workers:  # each worker receives only its part: about half of the tiny Llama (k, v, norms whole)
            if n == 2:  # changes: at most its part, and it loads again only the tensors they wrote
                assert w["delta"] is True and 0 < w["bytes"] / w["model_bytes"] < 0.6, (n, w)
                assert 0 < w["loaded"] <= loaded[w["rank"]], (n, w, loaded)
            else:
                assert w["delta"] is False and 0.5 < w["bytes"] / w["model_bytes"] < 0.6, (n, w)
                assert w["loaded"] == loaded[w["rank"]], (n, w, loaded)
        assert sum(w["bytes"] for w in workers) == top["bytes"] == top["wire_bytes"], (n, workers, top)
        assert f"round {n}/{ROUNDS}: " in result.stdout
    assert tokens[0] != tokens[-1], "the trainer's greedy tokens never changed: the check proves nothing"
    shares = "/".join(f"{w['bytes'] / w['model_bytes']:.0%}" for w in engine["rounds"][-1]["workers"])
    assert f"2 engine workers receiving {shares} of the model, models match" in result.stdout, result.stdout


def test_each_engine_replica_takes_its_workers_slices_and_serves_the_trainers_weights(cli, tied_llama_dir) -> None:
    # group.replicas=2: two engine processes, each an LLM of two workers (ranks K..K+1 and K+2..K+3 of the data
    # group); the producers send each region to every worker that loads it, and both engines' greedy tokens must be
    # the trainer's every round (the second a delta round each worker patches into its own slices).
    rounds = 2
    result = cli(
        *LAYOUT, "group.replicas=2", "source=model", f"source.path={tied_llama_dir}", LR, "sink=vllm",
        f"refit.rounds={rounds}", "refit.delta=on", f"group.timeout_s={TIMEOUT_S}", timeout_s=APP_LIMIT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.describe()
    m = local_metrics(cli.cwd)
    assert m["status"] == "ok" and m["rounds_done"] == rounds, m
    engines = m["consumers"]
    assert [e["rank"] for e in engines] == [K, K + 1] and all(e["sink"] == "vllm" for e in engines), engines
    tokens = []
    for n in range(rounds):
        workers = [r["rounds"][n]["workers"] for r in engines]
        assert [[w["rank"] for w in ws] for ws in workers] == [[K, K + 1], [K + 2, K + 3]], workers
        # One layout twice: the same slice to the same tensor-parallel rank of each engine, about half the model.
        assert [w["bytes"] for w in workers[0]] == [w["bytes"] for w in workers[1]], workers
        for w in workers[0] + workers[1]:
            assert w["delta"] is (n > 0) and 0 < w["bytes"] / w["model_bytes"] < 0.6, (n, w)
        assert m["rounds"][n]["bytes"] == sum(w["bytes"] for ws in workers for w in ws), (n, m["rounds"][n])
        checks = [e["rounds"][n]["model_check"] for e in engines]
        for check in checks:
            assert check["tokens_match"] is True and check["max_abs_logit_diff"] < 1e-4, (n, check)
        tokens.append(checks[0]["next_tokens"])
        assert f"round {n + 1}/{rounds}: " in result.stdout
        assert f"consumer {K + 1}: worker {K + 2} received" in result.stdout, result.stdout  # producer 0's line
    assert tokens[0] != tokens[-1], "the trainer's greedy tokens never changed: the check proves nothing"
    assert "4 engine workers receiving" in result.stdout and "models match" in result.stdout, result.stdout


def test_what_the_engine_cannot_run_stops_every_rank_in_one_line(cli, tied_llama_dir: Path) -> None:
    # The model's 2 heads over 4 workers: every rank refuses it at the settings exchange, before the engine starts.
    result = cli(
        *LAYOUT[:1], "group.tp_size=4", "source=model", f"source.path={tied_llama_dir}", "sink=vllm",
        timeout_s=APP_LIMIT_S,
    )  # fmt: skip
    why = "group.tp_size=4 does not divide the model's num_attention_heads=2"
    assert_one_line_error(result, why)
    m = local_metrics(cli.cwd)
    assert [r["status"] for r in m["producers"] + m["consumers"]] == ["failed"] * (K + 1), m
    assert all(why in r["error"] for r in m["producers"] + m["consumers"]), m
    # Without a trainer there is no model to build the engine from: refused before any rank starts.
    assert_one_line_error(cli(*LAYOUT, "sink=vllm"), "sink=vllm needs a trainer", "source=model")


def test_producers_of_another_source_stop_the_engine_process_at_the_exchange(tmp_path: Path) -> None:
    with Launcher(tmp_path) as launcher:
        group = [*LAYOUT, f"group.world_size={K + 1}", f"group.port={free_port()}", f"group.timeout_s={TIMEOUT_S}"]
        procs = [
            launcher.start(f"producer{p}", "role=producer", f"group.rank={p}", *group, "source=synthetic")
            for p in range(K)
        ]
        procs.append(launcher.start("engine", "role=consumer", f"group.rank={K}", *group, "sink=vllm"))
        why = "consumer rank 2 builds a model (sink=vllm) but the producers read synthetic"
        for proc in procs:
            out = proc.wait(APP_LIMIT_S)
            assert out.returncode != 0 and len(out.error_lines) == 1 and why in out.error, out.describe()


@pytest.mark.parametrize("killed", ["engine", "producer1"])
def test_a_lost_engine_process_or_producer_stops_the_other_side_within_the_deadline(
    tmp_path: Path, tied_llama_dir: Path, killed: str
) -> None:
    with Launcher(tmp_path) as launcher:
        group = [*LAYOUT, f"group.world_size={K + 1}", f"group.port={free_port()}", f"group.timeout_s={TIMEOUT_S}"]
        source = ["source=model", f"source.path={tied_llama_dir}", "refit.rounds=1000"]
        procs = {
            f"producer{p}": launcher.start(f"producer{p}", "role=producer", f"group.rank={p}", *group, *source)
            for p in range(K)
        }
        procs["engine"] = launcher.start("engine", "role=consumer", f"group.rank={K}", *group, "sink=vllm")
        procs["engine"].wait_for(r"round 2/1000: ", APP_LIMIT_S)  # the refit runs: the engine took two rounds
        procs[killed].signal(signal.SIGKILL)  # the process alone: vLLM's workers must notice their engine's death
        killed_at = time.monotonic()
        for name, proc in procs.items():
            if name == killed:
                continue
            out = proc.wait(TIMEOUT_S + EXIT_MARGIN_S, event_at=killed_at)
            # The engine process's stderr also has vLLM's and torch's warnings: one error line among them.
            errors = [line for line in out.error_lines if line.startswith("refit_app: error: ")]
            assert out.returncode != 0 and len(errors) == 1 and errors[0] == out.error, out.describe()
            assert "Traceback" not in out.stderr, out.describe()
            assert out.since_event_s is not None and out.since_event_s < TIMEOUT_S + EXIT_MARGIN_S, out.describe()
