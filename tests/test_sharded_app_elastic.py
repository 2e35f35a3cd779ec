"""``refit.on_consumer_loss=continue`` in sharded refits from the command line, as a user runs them: a consumer
SIGKILLed mid-way through a delta round (``refit.debug.die_in_round``) is left out and every other rank goes on, the
cut round sent again dense, each round verified bit for bit by the consumers there; a producer SIGKILLed mid-round
stops every rank in one line; with the ranks started one by one, the killed consumer started again with the run's
token joins and verifies every round it receives.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import torch
from cli_utils import assert_ok, assert_one_line_error, local_metrics
from conditions import needs_transformers
from failure_utils import Launcher
from mp_utils import free_port

TOKEN = {"REFIT_APP_TOKEN": "sharded-elastic-app-test-token"}
LOCAL = ("refit.on_consumer_loss=continue", "group.timeout_s=6")
"""role=local starts its ranks together: the deadline never covers their start-up."""
TRAINER_TIMEOUT_S = 20.0
"""A trainer's producers load the model and shard it before their first plan, and the consumers wait for it within
two deadlines: 6 s is short for that on busy cores. A lost consumer costs about one."""
KILL_LIMIT_S = 240.0
"""Hang limits of the started-apart trainer's ranks (start-up included), not deadlines under test."""


def test_a_consumer_killed_mid_delta_round_is_left_out_and_the_others_verify_every_round(cli, tmp_path):
    # Rank 2 heads the chain of tensor-parallel rank 0 (replica 1's rank 4 took its slices from it): rank 4 is
    # re-planned to take them from the producers. Round 2 is a delta round; sent again without rank 2, dense.
    result = cli("group.producers=2", "group.tp_size=2", "group.replicas=2", "refit.rounds=4", "refit.delta=on",
                 "source.update=training", "refit.debug.die_in_round=2", "refit.debug.die_rank=2", *LOCAL)  # fmt: skip
    assert_ok(result)
    metrics = local_metrics(tmp_path)
    assert metrics["status"] == "ok" and metrics["verified"] is True, metrics
    lost, *survivors = metrics["consumers"]
    assert lost["rank"] == 2 and lost["status"] == "failed" and "died" in lost["error"], lost
    for c in survivors:  # every round once, each verified bit for bit against the source
        assert [(r["round"], r["verified"]) for r in c["rounds"]] == [(n, True) for n in range(1, 5)], c
    members = [r["members"] for r in metrics["rounds"]]
    assert members == [[2, 3, 4, 5], [3, 4, 5], [3, 4, 5], [3, 4, 5]], members
    # Every generation starts dense (round 1; round 2 again); then delta rounds, a small share of the elements each.
    for rank in (*metrics["producers"], *survivors):
        assert [r["delta"] for r in rank["rounds"]] == [False, False, True, True], rank
    for p in metrics["producers"]:
        shares = [r["changed_fraction"] for r in p["rounds"]]
        assert shares[:2] == [1.0, 1.0] and all(0 < f < 0.05 for f in shares[2:]), shares
    assert "(consumer 2 lost)" in result.stderr + result.stdout


def test_a_consumer_that_answers_a_producer_fails_at_once_when_the_round_is_cut(cli, tmp_path):
    # In a delta round each consumer answers every producer (its verdict on its bases). Rank 2 dies mid-round; rank 3,
    # blocked answering producer 0, must see producer 0 drop the generation at once: waiting out its own deadline, it
    # would ask to go on after producer 0 stopped waiting (both wait group.timeout_s), and be left out.
    result = cli("group.producers=2", "group.tp_size=2", "refit.rounds=4", "refit.delta=on", "source.update=training",
                 "refit.debug.die_in_round=3", "refit.debug.die_rank=2", *LOCAL)  # fmt: skip
    assert_ok(result)
    metrics = local_metrics(tmp_path)
    assert [r["members"] for r in metrics["rounds"]] == [[2, 3], [2, 3], [3], [3]], metrics["rounds"]
    lost, survivor = metrics["consumers"]
    assert lost["status"] == "failed" and survivor["status"] == "ok", metrics["consumers"]
    assert [(r["round"], r["verified"], r["delta"]) for r in survivor["rounds"]] == [
        (1, True, False),
        (2, True, True),
        (3, True, False),
        (4, True, True),
    ], survivor


def test_a_producer_killed_mid_round_stops_every_rank_in_one_line(cli, tmp_path):
    result = cli("group.producers=2", "group.tp_size=2", "refit.rounds=3", "refit.debug.die_in_round=2",
                 "refit.debug.die_rank=1", *LOCAL)  # fmt: skip
    # role=local names the root cause, the rank that died; every other rank said why it stopped.
    assert_one_line_error(result, "rank 1 died (exit code -9)")
    others = [
        r for r in (*local_metrics(tmp_path)["producers"], *local_metrics(tmp_path)["consumers"]) if r["rank"] != 1
    ]
    for r in others:
        assert "lost producer rank 1" in r["error"] and "its shards exist nowhere else" in r["error"], r


def _metrics(result) -> dict:
    found = re.findall(r"metrics: (\S+metrics\.json)", result.stdout + result.stderr)
    assert found, result.describe()
    return json.loads(Path(found[-1]).read_text())


def test_ranks_started_apart_go_on_without_a_killed_consumer_and_take_it_back_restarted(cli):
    port = free_port()
    # Started one by one, the ranks' start-up is inside the rendezvous deadline: 20 s covers it on a busy machine.
    common = ("group.producers=2", "group.tp_size=2", "group.world_size=4", f"group.port={port}",
              "refit.on_consumer_loss=continue", "group.timeout_s=20", "source.size=2MiB")  # fmt: skip
    producers = [cli.start("role=producer", f"group.rank={p}", *common, "refit.rounds=40", env=TOKEN) for p in range(2)]
    survivor = cli.start("role=consumer", "group.rank=2", *common, env=TOKEN)
    killed = cli.start("role=consumer", "group.rank=3", *common, "refit.debug.die_in_round=2",
                       "refit.debug.die_rank=3", env=TOKEN).wait()  # fmt: skip
    assert killed.returncode == -9, killed.describe()
    restarted = cli.start("role=consumer", "group.rank=3", *common, env=TOKEN).wait()
    survived = survivor.wait()
    for run in (*(p.wait() for p in producers), survived, restarted):
        assert_ok(run)
    survived, back = _metrics(survived), _metrics(restarted)
    assert [(r["round"], r["verified"]) for r in survived["rounds"]] == [(n, True) for n in range(1, 41)]
    # The restarted consumer joined at a round boundary (or the cut round's repeat) and verified every round after.
    first = back["rounds"][0]["round"]
    assert 2 <= first <= 40 and 3 in back["rounds"][0]["members"], back["rounds"][0]
    assert [(r["round"], r["verified"]) for r in back["rounds"]] == [(n, True) for n in range(first, 41)]


@needs_transformers
def test_a_trainers_consumers_go_on_without_a_killed_one_each_round_checked_by_keyed_sums(cli, tmp_path):
    # Two producers train the tiny Llama under FSDP2 (their process group on the run's store, beside the
    # generations); the consumers cannot recompute its weights, so each round the producers' keyed sums of their
    # parts of every slice come with it. Consumer 2 dies mid-way through round 2, a delta round.
    from refit_app.models.hf import write_tiny_llama

    tiny = write_tiny_llama(tmp_path / "llama", seed=1)
    result = cli("group.producers=2", "group.tp_size=2", "refit.rounds=4", "refit.delta=on", "source=model",
                 f"source.path={tiny}", "source.lr=1e-2", "refit.debug.die_in_round=2", "refit.debug.die_rank=2",
                 "refit.on_consumer_loss=continue", f"group.timeout_s={TRAINER_TIMEOUT_S:g}")  # fmt: skip
    assert_ok(result)
    metrics = local_metrics(tmp_path)
    assert metrics["status"] == "ok" and metrics["verified"] is True, metrics
    lost, survivor = metrics["consumers"]
    assert lost["status"] == "failed" and "died" in lost["error"], lost
    # Every round once, its slices' sums equal to the trainer's: the 20 tensors' slices, dense then delta rounds.
    assert [(r["round"], r["verified"], r["delta"]) for r in survivor["rounds"]] == [
        (1, True, False),
        (2, True, False),
        (3, True, True),
        (4, True, True),
    ], survivor["rounds"]
    assert survivor["verified_tensors"] == 20, survivor
    assert [r["members"] for r in metrics["rounds"]] == [[2, 3], [3], [3], [3]], metrics["rounds"]
    losses = [r["loss"] for r in metrics["producers"][0]["rounds"]]  # the trainer stepped between rounds
    assert losses[0] is None and all(loss > 0 for loss in losses[1:]), losses


@needs_transformers
def test_a_trainers_model_consumers_go_on_without_a_killed_one_each_round_checked_against_its_probe(cli, tmp_path):
    # sink=model: each consumer builds the trainer's model from producer 0's config.json (the session's context)
    # and loads every round into it; it asks the producers for the probe (sink.probe_tokens), which they run each
    # round (FSDP2 gathers each layer) and send with their keyed sums. Two replicas of one consumer; replica 0's
    # (the head of the chain) dies mid-way through round 2, and replica 1 takes its tensors from the producers.
    from refit_app.models.hf import write_tiny_llama

    tiny = write_tiny_llama(tmp_path / "llama", seed=1)
    result = cli("group.producers=2", "group.tp_size=1", "group.replicas=2", "refit.rounds=4", "refit.delta=on",
                 "source=model", f"source.path={tiny}", "source.lr=1e-2", "sink=model", "refit.debug.die_in_round=2",
                 "refit.debug.die_rank=2", "refit.on_consumer_loss=continue",
                 f"group.timeout_s={TRAINER_TIMEOUT_S:g}")  # fmt: skip
    assert_ok(result)
    metrics = local_metrics(tmp_path)
    assert metrics["status"] == "ok" and metrics["verified"] is True, metrics
    lost, survivor = metrics["consumers"]
    assert lost["status"] == "failed" and "died" in lost["error"], lost
    # Every round once, its tensors' sums equal to the trainer's and the model's logits on the trainer's probe
    # equal to the trainer's to the bit (the same float32 forward on the same CPU), dense then delta rounds.
    assert [(r["round"], r["verified"], r["delta"], r["model_check"]) for r in survivor["rounds"]] == [
        (n, True, n > 2, {"max_abs_logit_diff": 0.0, "tokens_match": True}) for n in range(1, 5)
    ], survivor["rounds"]
    assert [r["members"] for r in metrics["rounds"]] == [[2, 3], [3], [3], [3]], metrics["rounds"]
    assert "models match (max logit diff 0)" in result.stderr + result.stdout


@needs_transformers
def test_a_trainers_ranks_started_apart_drop_a_consumer_that_expects_no_trainer_and_take_it_back(cli, tmp_path):
    from refit_app.models.hf import write_tiny_llama

    tiny = write_tiny_llama(tmp_path / "llama", seed=1)
    rounds = 60  # a few seconds of rounds: time for the consumer to be started again and join
    common = ("group.producers=2", "group.tp_size=2", "group.world_size=4", f"group.port={free_port()}",
              "refit.on_consumer_loss=continue", f"group.timeout_s={TRAINER_TIMEOUT_S:g}", "source=model")  # fmt: skip
    producers = [
        cli.start(
            "role=producer", f"group.rank={p}", *common, f"source.path={tiny}", f"refit.rounds={rounds}", env=TOKEN
        )
        for p in range(2)
    ]
    survivor = cli.start("role=consumer", "group.rank=2", *common, env=TOKEN)
    # Told it reads a synthetic source: it would check its slices against its own copy, but a trainer sends keyed sums.
    wrong = cli.start("role=consumer", "group.rank=3", *common[:-1], env=TOKEN).wait()
    assert_one_line_error(
        wrong, "rank 3: producer 0's rounds carry keyed sums (a trainer's, source=model) and this rank checks"
    )
    back = cli.start("role=consumer", "group.rank=3", *common, env=TOKEN).wait()
    survived = survivor.wait()
    for run in (*(p.wait() for p in producers), survived, back):
        assert_ok(run)
    survived, back = _metrics(survived), _metrics(back)
    assert [(r["round"], r["verified"]) for r in survived["rounds"]] == [(n, True) for n in range(1, rounds + 1)]
    # Started again with the trainer's settings, it took the tensors from the plan record of the generation it joined
    # and checked every round from there by keyed sums.
    first = back["rounds"][0]["round"]
    assert 1 <= first <= rounds and 3 in back["rounds"][0]["members"], back["rounds"][0]
    assert [(r["round"], r["verified"]) for r in back["rounds"]] == [(n, True) for n in range(first, rounds + 1)]


@needs_transformers
def test_a_trainers_producer_killed_between_rounds_stops_every_rank_naming_the_loss(tmp_path):
    # SIGKILLed at any moment, mostly in its AdamW step or the probe, which run over the trainer's own process group
    # (not a generation's): producer 0 says it lost a producer of its trainer, in one line, and every rank stops.
    from refit_app.models.hf import write_tiny_llama

    tiny = write_tiny_llama(tmp_path / "llama", seed=1)
    common = ("group.producers=2", "group.tp_size=1", "group.replicas=2", "group.world_size=4",
              f"group.port={free_port()}", "refit.on_consumer_loss=continue", f"group.timeout_s={TRAINER_TIMEOUT_S:g}",
              "source=model")  # fmt: skip
    with Launcher(tmp_path) as launcher:
        trains = (f"source.path={tiny}", "refit.rounds=100000")
        producers = [
            launcher.start(f"producer{p}", "role=producer", f"group.rank={p}", *common, *trains, env=TOKEN)
            for p in range(2)
        ]
        consumers = [
            launcher.start("consumer2", "role=consumer", "group.rank=2", *common, "sink=model", env=TOKEN),
            launcher.start("consumer3", "role=consumer", "group.rank=3", *common, env=TOKEN),
        ]
        consumers[0].wait_for(r"generation of ranks 0, 1, 2, 3 from round 1", KILL_LIMIT_S)
        producers[1].signal(signal.SIGKILL)
        killed_at = time.monotonic()
        outcomes = [run.wait(KILL_LIMIT_S, event_at=killed_at) for run in (producers[0], *consumers)]
    for out in outcomes:
        assert out.returncode != 0 and len(out.error_lines) == 1 and "Traceback" not in out.stderr, out.describe()
        # A lost producer is noticed at once (its sockets close); two deadlines bound the worst case.
        assert out.since_event_s is not None and out.since_event_s < 2 * TRAINER_TIMEOUT_S + 10, out.describe()
    said = outcomes[0].error
    assert "the trainer's process group lost a producer" in said or "lost producer 1" in said, said


# --- sink=save under continue: the last generation's saving consumers, the lowest replica of each tp rank ---------


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_a_killed_first_replicas_slices_are_saved_by_the_next_replica_bit_for_bit(cli, tmp_path):
    # Rank 2 (replica 0's tp0) dies mid-way through round 2 of a delta session: at the end rank 4 (replica 1's tp0)
    # saves tp0, rank 3 tp1, and rank 5 nothing; the slices reassemble to the source after the last round.
    from config_utils import settings

    from refit_app.checkpoint.slices import assemble_slices, read_slices
    from refit_app.models.sources import make_source

    out, rounds = tmp_path / "slices", 4
    layout = ("group.producers=2", "group.tp_size=2", "group.replicas=2", "refit.delta=on", "source.update=training")
    result = cli(*layout, "sink=save", f"sink.path={out}", f"refit.rounds={rounds}", "refit.debug.die_in_round=2",
                 "refit.debug.die_rank=2", *LOCAL)  # fmt: skip
    assert_ok(result)
    metrics = local_metrics(tmp_path)
    assert metrics["status"] == "ok", metrics
    lost, *survivors = metrics["consumers"]
    assert lost["status"] == "failed" and "died" in lost["error"], lost
    assert [(c["rank"], c["saved_to"]) for c in survivors] == [(3, str(out / "tp1")), (4, str(out / "tp0")), (5, None)]
    # The killed rank's staging directory was taken away by the save that replaced it: only the two checkpoints.
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "tp0", "tp0/model.safetensors", "tp1", "tp1/model.safetensors",
    ]  # fmt: skip
    saved = [read_slices(out / f"tp{t}") for t in range(2)]
    assert {(s.run, s.round, s.tp_size) for s in saved} == {(saved[0].run, rounds, 2)}
    source = make_source(*(lambda s: (s.target, s.params))(settings(*layout).source))
    for n in range(2, rounds + 1):
        source.advance(n)
    whole, full = assemble_slices(out / f"tp{t}" for t in range(2)), dict(source.tensors())
    assert sorted(whole) == sorted(full)
    assert [name for name, t in full.items() if not torch.equal(_bits(whole[name]), _bits(t))] == []


def test_a_tp_rank_with_no_saving_consumer_left_publishes_nothing_and_the_run_fails_in_one_line(cli, tmp_path):
    # One replica: rank 3 (tp1) dies, the session goes on with rank 2 alone, and at the end no consumer holds tp1's
    # slices of the last round. Rank 2 publishes nothing either (tp0 of this run beside tp1 of an earlier one would
    # be no checkpoint): the earlier save stays byte for byte, and the run fails naming why.
    from refit_app.checkpoint.writer import save_tensors

    out = tmp_path / "slices"
    for t in range(2):
        (out / f"tp{t}").mkdir(parents=True)
    earlier = {t: save_tensors(out / f"tp{t}" / "model.safetensors", {"w": torch.arange(4.0) + t}) for t in range(2)}
    before = {t: p.read_bytes() for t, p in earlier.items()}
    result = cli("group.producers=2", "group.tp_size=2", "sink=save", f"sink.path={out}", "refit.rounds=3",
                 "refit.debug.die_in_round=2", "refit.debug.die_rank=3", *LOCAL)  # fmt: skip
    assert_one_line_error(
        result, f"consumer rank 2: nothing saved to {out}: no consumer that saves tp1 was left at the end"
    )
    assert {t: p.read_bytes() for t, p in earlier.items()} == before
    metrics = local_metrics(tmp_path)
    saver, lost = metrics["consumers"]
    assert metrics["status"] == "failed" and "died" in lost["error"] and "nothing saved" in saver["error"], metrics
    assert all(p["status"] == "ok" and p["rounds_done"] == 3 for p in metrics["producers"]), metrics["producers"]
    # Rank 2's staging directory went with its refusal; the killed rank's may stay (the next save removes it).
    assert {p.name for p in out.iterdir() if not p.name.startswith(".tp1.")} == {"tp0", "tp1"}


# --- role=auto under continue: srun's tasks, one lost and started again -------------------------------------------


def _slurm_task(rank: int, tasks: int) -> dict[str, str]:
    """The environment srun gives task ``rank`` of ``tasks`` on this host (it keeps the others when one dies:
    ``--kill-on-bad-exit`` is off by default)."""
    return {**TOKEN, "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(tasks), "SLURM_LOCALID": str(rank),
            "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "4242"}  # fmt: skip


def test_role_auto_tasks_go_on_without_a_killed_consumer_and_take_it_back_started_again(cli):
    # Each task is a producer or a consumer by its SLURM_PROCID; the port is given (the job id's would be shared
    # with other tests on this machine).
    common = ("role=auto", "group.producers=2", "group.tp_size=2", f"group.port={free_port()}", "refit.rounds=40",
              "refit.on_consumer_loss=continue", "group.timeout_s=20", "source.size=2MiB")  # fmt: skip
    producers = [cli.start(*common, env=_slurm_task(p, 4)) for p in range(2)]
    survivor = cli.start(*common, env=_slurm_task(2, 4))
    killed = cli.start(*common, "refit.debug.die_in_round=2", "refit.debug.die_rank=3", env=_slurm_task(3, 4)).wait()
    assert killed.returncode == -9, killed.describe()
    restarted = cli.start(*common, env=_slurm_task(3, 4)).wait()
    runs = [p.wait() for p in producers] + [survivor.wait(), restarted]
    for run in runs:
        assert_ok(run)
    figures = [_metrics(run) for run in runs]
    assert [(m["rank"], m["role"]) for m in figures] == [(r, "producer" if r < 2 else "consumer") for r in range(4)]
    survived, back = figures[2], figures[3]
    assert [(r["round"], r["verified"]) for r in survived["rounds"]] == [(n, True) for n in range(1, 41)]
    first = back["rounds"][0]["round"]
    assert 2 <= first <= 40 and 3 in back["rounds"][0]["members"], back["rounds"][0]
    assert [(r["round"], r["verified"]) for r in back["rounds"]] == [(n, True) for n in range(first, 41)]


@needs_transformers
def test_a_model_consumer_of_producers_that_train_nothing_leaves_in_one_line_and_the_others_go_on(cli):
    # sink=model builds the trainer's model from producer 0's config.json: producers of a synthetic source train none.
    common = ("group.producers=2", "group.tp_size=1", "group.replicas=2", "group.world_size=4",
              f"group.port={free_port()}", "refit.on_consumer_loss=continue", "group.timeout_s=20")  # fmt: skip
    small = ("source.size=2MiB",)
    producers = [
        cli.start("role=producer", f"group.rank={p}", *common, *small, "refit.rounds=20", env=TOKEN) for p in range(2)
    ]
    survivor = cli.start("role=consumer", "group.rank=2", *common, *small, env=TOKEN)
    wrong = cli.start("role=consumer", "group.rank=3", *common, "source=model", "sink=model", env=TOKEN).wait()
    assert_one_line_error(wrong, "rank 3: this rank expects a trainer's rounds (source=model: keyed sums, its model's")
    for run in (*(p.wait() for p in producers), survivor.wait()):
        assert_ok(run)


def _failing_seal_rank(rank: int, world_size: int, port: int, s, fail_rank: int):
    from dataclasses import replace

    from refit_app.app.local import rank_settings
    from refit_app.app.sharded_run import run_sharded
    from refit_app.common.errors import SinkError
    from refit_app.models.sinks import SaveSink

    s = rank_settings(replace(s, group=replace(s.group, port=port)), rank, local_rank=None)
    if rank == fail_rank:  # this consumer's disk fills up as it makes its last round durable

        def prepare(self) -> None:
            raise SinkError(f"rank {rank}: injected: no space left sealing {self.path}")

        SaveSink.prepare = prepare
    return run_sharded(s)


def test_savers_that_went_on_without_a_lost_consumer_still_publish_together_or_not_at_all(tmp_path):
    # Under continue the savers (the lowest replica's of each tp rank in the last generation) tell each other
    # whether they sealed their slices before any publishes: one that cannot (its disk full) and none publishes.
    from config_utils import settings
    from mp_utils import STARTUP_LIMIT_S, RankFailure, run_ranks

    from refit_app.app.local import with_run_secret
    from refit_app.checkpoint.slices import read_slices

    out = tmp_path / "slices"
    s = with_run_secret(
        settings(
            "group.producers=2",
            "group.tp_size=2",
            "group.replicas=2",
            "sink=save",
            f"sink.path={out}",
            "refit.rounds=2",
            "refit.on_consumer_loss=continue",
            "group.timeout_s=60",
        )
    )
    first = run_ranks(_failing_seal_rank, 6, s, -1, timeout=STARTUP_LIMIT_S)
    assert [m.get("saved_to") for m in first[2:]] == [str(out / "tp0"), str(out / "tp1"), None, None]
    runs = {read_slices(out / f"tp{t}").run for t in range(2)}
    before = {t: (out / f"tp{t}" / "model.safetensors").read_bytes() for t in range(2)}
    # tp1's saver (rank 3) cannot seal; tp0's (rank 2) sealed its own and hears of it: neither publishes.
    results = run_ranks(_failing_seal_rank, 6, s, 3, timeout=STARTUP_LIMIT_S, return_exceptions=True)
    failed = [r for r, result in enumerate(results) if isinstance(result, RankFailure)]
    assert failed == [2, 3], results
    assert "rank 3 could not seal its slices (rank 3: injected: no space left sealing" in str(results[2])
    assert {read_slices(out / f"tp{t}").run for t in range(2)} == runs
    assert {t: (out / f"tp{t}" / "model.safetensors").read_bytes() for t in range(2)} == before
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "tp0", "tp0/model.safetensors", "tp1", "tp1/model.safetensors",
    ]  # fmt: skip
