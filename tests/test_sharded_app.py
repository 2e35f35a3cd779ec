"""Sharded refits from the command line (group.producers, group.tp_size, group.replicas): ``python -m refit_app``
starts K producers, each holding its rows of the synthetic model, and M x D tensor-parallel consumers, each checking
its slices bit for bit against the whole tensors sliced; ranks started one by one as role=producer/consumer (as on
separate hosts, over loopback) stop together, in one line, where one producer's model has another layout. And the
layout rules and the verification that these runs rely on, without processes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from cli_utils import COVER_STARTUP, assert_ok, assert_one_line_error, local_metrics
from mp_utils import STARTUP_LIMIT_S, RankFailure, free_port, run_ranks

from refit_app.common.errors import VerificationError
from refit_app.core.reshard.plan import chunk_range
from refit_app.core.reshard.transfer import Held
from refit_app.models.sources import SyntheticSource

TOKEN = {"REFIT_APP_TOKEN": "sharded-app-test-token"}


def _expected(name: str, shape: tuple[int, ...]):
    from refit_app.protocol.sharded import Expected

    return Expected(name, "float32", shape)


def test_the_tp_rule_gives_rows_columns_or_the_whole_tensor():
    from refit_app.app.sharded import tp_rule
    from refit_app.protocol.sharded import tp_needs

    expects = [
        _expected("layers.0.mlp.up_proj.weight", (33, 8)),
        _expected("layers.0.mlp.down_proj.weight", (8, 33)),
        _expected("layers.0.self_attn.o_proj.weight", (8, 8)),
        _expected("layers.0.input_layernorm.weight", (8,)),
    ]
    boxes = {n.name: n.box for n in tp_needs(expects, 5, 1, 2, tp_rule(expects))}
    assert boxes == {
        "layers.0.mlp.up_proj.weight": ((17, 33), (0, 8)),  # column-parallel: its rows (torch.chunk: 17 + 16)
        "layers.0.mlp.down_proj.weight": ((0, 8), (17, 33)),  # row-parallel: its columns
        "layers.0.self_attn.o_proj.weight": ((0, 8), (4, 8)),
        "layers.0.input_layernorm.weight": ((0, 8),),  # 1-D: whole
    }


def test_each_producer_holds_its_rows_and_the_consumer_check_names_a_flipped_byte():
    from refit_app.app.sharded import check_slices, producer_shards

    full = {"w": torch.arange(33 * 4, dtype=torch.float32).reshape(33, 4), "scale": torch.tensor(2.0)}
    for rank in range(2):
        specs, shards = producer_shards(full.items(), rank, 2)
        a, b = chunk_range(33, 2, rank)
        assert torch.equal(shards["w"].tensor, full["w"][a:b]) and shards["w"].box == ((a, b), (0, 4))
        assert shards["scale"].box == () and [s.name for s in specs] == ["w", "scale"]
    slices = {"w": Held(full["w"][:, 2:].clone(), ((0, 33), (2, 4)))}
    assert check_slices(slices, full.items(), 3, 1) == 1
    slices["w"].tensor.view(torch.uint8)[0, 5] ^= 1
    with pytest.raises(VerificationError, match=r"consumer rank 3: round 2: tensor 'w' \[\(0, 33\), \(2, 4\)\]"):
        check_slices(slices, full.items(), 3, 2)


@pytest.mark.parametrize(("k", "m", "d"), [(2, 2, 1), (1, 2, 1), (2, 1, 2)])
def test_a_local_sharded_refit_verifies_every_consumer_slice_every_round(cli, tmp_path, k, m, d):
    result = cli(
        f"group.producers={k}",
        f"group.tp_size={m}",
        f"group.replicas={d}",
        "refit.rounds=2",
        "refit.buffer_size_bytes=256KiB",  # a tensor larger than a buffer goes as pieces
        COVER_STARTUP,
    )
    assert_ok(result)
    metrics = local_metrics(tmp_path)
    producers, consumers = metrics["producers"], metrics["consumers"]
    assert [p["rank"] for p in producers] == list(range(k))
    assert [c["rank"] for c in consumers] == list(range(k, k + m * d))
    assert metrics["status"] == "ok" and metrics["verified"] is True and metrics["world_size"] == k + m * d
    assert all(c["verified"] is True and c["verified_tensors"] == metrics["num_tensors"] for c in consumers)
    assert metrics["rounds_done"] == 2 and len(metrics["rounds"]) == 2
    for r in metrics["rounds"]:
        assert r["seconds"] > 0 and r["gb_per_s"] == pytest.approx(r["bytes"] / 1e9 / r["seconds"], rel=1e-3)
    # Each replica's consumers hold the model once, but the tensors under two dims whole on every one of its M
    # ranks; the producers send one replica's bytes, the replica before it sends the next one's.
    metas = SyntheticSource("tiny").manifest_tensors()
    one_replica = sum(t.nbytes for t in metas) + (m - 1) * sum(t.nbytes for t in metas if len(t.shape) < 2)
    sent = sum(p["bytes"] for p in producers) // 2
    received = sum(c["bytes"] for c in consumers) // 2
    assert (sent, received) == (one_replica, d * one_replica)
    assert received == d * sent and metrics["bytes"] == 2 * sent and metrics["wire_bytes"] == 2 * received
    assert f", {k} producer" in result.stderr + result.stdout and "verified" in result.stderr + result.stdout


def test_ranks_started_apart_stop_together_where_one_producer_has_another_layout(cli):
    port = free_port()
    common = ("group.producers=2", "group.world_size=3", f"group.port={port}", COVER_STARTUP)
    runs = [
        cli.start("role=producer", "group.rank=0", *common, env=TOKEN),
        cli.start("role=producer", "group.rank=1", "source.size=4MiB", *common, env=TOKEN),
        cli.start("role=consumer", "group.rank=2", *common, env=TOKEN),
    ]
    for run in runs:
        assert_one_line_error(run.wait(), "producers 0 and 1 disagree on the tensors", "on rank 1")


@pytest.mark.parametrize("on_loss", ["fail", "continue"])
def test_ranks_started_apart_name_the_setting_a_consumer_gave_otherwise(cli, on_loss):
    # A consumer's own refit.buffer_size_bytes (null takes the producers'): the plan's agreement names the key the
    # user set, on every rank, before any data byte (with continue too: a difference at the start is a layout's).
    port = free_port()
    common = ("group.tp_size=2", "group.world_size=3", f"group.port={port}", f"refit.on_consumer_loss={on_loss}")
    runs = [
        cli.start("role=producer", "group.rank=0", "refit.buffer_size_bytes=1MiB", *common, COVER_STARTUP, env=TOKEN),
        cli.start("role=consumer", "group.rank=1", *common, COVER_STARTUP, env=TOKEN),
        cli.start("role=consumer", "group.rank=2", "refit.buffer_size_bytes=2MiB", *common, COVER_STARTUP, env=TOKEN),
    ]
    for run in runs:
        assert_one_line_error(
            run.wait(),
            "ranks 0 and 2 disagree on refit.buffer_size_bytes: 1048576 and 2097152; give every rank the same "
            "refit.buffer_size_bytes",
        )


def test_a_sharded_refit_into_engines_without_a_trainer_is_refused_in_one_line(cli):
    # Engine replicas are a layout sink=vllm runs (tests/vllm_engine); the model they build comes from a trainer.
    line = assert_one_line_error(
        cli("group.producers=2", "group.replicas=2", "sink=vllm"),
        "a sharded refit into sink=vllm needs a trainer to build the engine's model from: source=model",
    )
    assert "group.replicas" not in line, line


# --- the fault hooks (refit.debug.*) in sharded runs ----------------------------------------------------------


@pytest.mark.parametrize(
    ("delta", "says"),
    [("off", "arrived other than it was sent (checksums differ)"), ("on", "arrived unreadable")],
)
def test_a_chunk_changed_in_transit_to_a_consumer_fails_every_rank_naming_it(cli, delta, says):
    # corrupt_chunk=0: each consumer flips the first byte of the first chunk it receives in a round (a delta
    # round's records: their header, which then names no piece it can take).
    result = cli("group.producers=2", "group.tp_size=2", "refit.rounds=2", f"refit.delta={delta}",
                 "refit.debug.corrupt_chunk=0", COVER_STARTUP)  # fmt: skip
    line = assert_one_line_error(result, says)
    assert "rank 2: " in line or "rank 3: " in line, line  # a consumer names what reached it


def test_a_corrupt_chunk_hook_that_never_fires_is_refused(cli):
    assert_one_line_error(
        cli("group.producers=2", "group.tp_size=2", "refit.debug.corrupt_chunk=1000", COVER_STARTUP),
        "refit.debug.corrupt_chunk=1000: this consumer received", "the hook never fired",
    )  # fmt: skip


@pytest.mark.parametrize("die_rank", [1, 3])  # a producer, a consumer
def test_a_rank_killed_mid_round_fails_the_run_naming_it(cli, die_rank):
    result = cli("group.producers=2", "group.tp_size=2", "refit.rounds=3", "refit.debug.die_in_round=2",
                 f"refit.debug.die_rank={die_rank}", COVER_STARTUP)  # fmt: skip
    assert_one_line_error(result, f"rank {die_rank} died (exit code -9)", "this rank kills itself now")
    # Round 2's other pairs may finish (producer 0's sends do not wait for producer 1); the run never starts round 3.
    assert "round 1/3" in result.stderr + result.stdout and "round 3/3" not in result.stderr + result.stdout


def test_a_die_rank_outside_the_layout_is_refused(cli):
    assert_one_line_error(
        cli("group.producers=2", "group.tp_size=2", "refit.debug.die_in_round=1", "refit.debug.die_rank=4"),
        "refit.debug.die_rank=4", "must be a rank in 1..3",
    )  # fmt: skip


# --- sink=save: each tensor-parallel consumer of replica 0 saves its slices ---------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_a_sharded_save_writes_each_tp_ranks_slices_once_and_they_reassemble_to_the_source_bit_for_bit(cli, tmp_path):
    from config_utils import settings

    from refit_app.checkpoint.slices import assemble_slices, read_slices
    from refit_app.models.sources import make_source

    out, rounds = tmp_path / "slices", 3
    layout = ("group.producers=2", "group.tp_size=2", "group.replicas=2")
    result = cli(*layout, "sink=save", f"sink.path={out}", f"refit.rounds={rounds}", COVER_STARTUP)
    assert_ok(result)
    # Replica 1's consumers hold replica 0's bytes: only replica 0's write, one directory per tensor-parallel rank.
    assert sorted(p.name for p in out.iterdir()) == ["tp0", "tp1"]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "tp0", "tp0/model.safetensors", "tp1", "tp1/model.safetensors",
    ]  # fmt: skip
    consumers = local_metrics(tmp_path)["consumers"]
    assert [c["saved_to"] for c in consumers] == [str(out / "tp0"), str(out / "tp1"), None, None]
    saved = [read_slices(out / f"tp{t}") for t in range(2)]
    assert {(s.run, s.round, s.tp_size) for s in saved} == {(saved[0].run, rounds, 2)}
    _, box, shape = saved[1].tensors["model.layers.0.mlp.up_proj.weight"]
    assert box == ((shape[0] - shape[0] // 2, shape[0]), (0, shape[1]))  # tp rank 1's rows
    # The source after the last round, built as the producers built it: the slices are its tensors, bit for bit.
    source = make_source(*(lambda s: (s.target, s.params))(settings(*layout).source))
    for n in range(2, rounds + 1):
        source.advance(n)
    whole = assemble_slices(out / f"tp{t}" for t in range(2))
    full = dict(source.tensors())
    assert sorted(whole) == sorted(full)
    assert [name for name, t in full.items() if not torch.equal(_bits(whole[name]), _bits(t))] == []


def _failing_rank(rank: int, world_size: int, port: int, s, fail_rank: int, fail_round: int):
    from refit_app.app.local import rank_settings
    from refit_app.app.sharded_run import run_sharded

    s = rank_settings(replace(s, group=replace(s.group, port=port)), rank, local_rank=None)

    def after_round(view) -> None:
        if rank == fail_rank and view.round == fail_round:
            raise VerificationError(f"rank {rank}: injected failure in round {view.round}")

    return run_sharded(s, after_round=after_round)


def test_a_failed_sharded_save_keeps_the_previous_slices_and_leaves_no_file_that_looks_complete(tmp_path):
    from config_utils import settings

    from refit_app.app.local import with_run_secret
    from refit_app.checkpoint.writer import save_tensors

    out = tmp_path / "slices"
    (out / "tp0").mkdir(parents=True)
    previous = save_tensors(out / "tp0" / "model.safetensors", {"earlier": torch.arange(4.0)})
    before = previous.read_bytes()
    s = with_run_secret(
        settings(
            "group.producers=2", "group.tp_size=2", "sink=save", f"sink.path={out}", "refit.rounds=2",
            "group.timeout_s=60",
        )
    )  # fmt: skip
    # tp rank 1 (rank 3) fails in the last round, after both consumers wrote round 1 into their staging directories;
    # tp rank 0 then finds it lost at the end, before publishing.
    results = run_ranks(_failing_rank, 4, s, 3, 2, timeout=STARTUP_LIMIT_S, return_exceptions=True)
    assert all(isinstance(r, RankFailure) for r in results), results
    assert "injected failure in round 2" in str(results[3]) and "rank 3" in str(results[2])
    assert previous.read_bytes() == before
    # No staging directory, no temporary file, no checkpoint in tp1: only what was there before and tp1's empty
    # directory (created before the transfer, so that an unusable path fails early).
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["tp0", "tp0/model.safetensors", "tp1"]
    assert sorted(p.name for p in out.iterdir()) == ["tp0", "tp1"]


def _failing_seal_rank(rank: int, world_size: int, port: int, s, fail_rank: int):
    from refit_app.app.local import rank_settings
    from refit_app.app.sharded_run import run_sharded
    from refit_app.common.errors import SinkError
    from refit_app.models.sinks import SaveSink

    s = rank_settings(replace(s, group=replace(s.group, port=port)), rank, local_rank=None)
    if rank == fail_rank:  # this consumer's disk fills up as it makes its last round durable

        def prepare(self) -> None:
            self.abort()
            raise SinkError(f"rank {rank}: injected: no space left sealing {self.path}")

        SaveSink.prepare = prepare
    return run_sharded(s, after_round=None)


def test_the_consumers_publish_their_slices_together_or_not_at_all(tmp_path):
    from config_utils import settings

    from refit_app.app.local import with_run_secret
    from refit_app.checkpoint.slices import read_slices

    out = tmp_path / "slices"
    s = with_run_secret(
        settings(
            "group.producers=2", "group.tp_size=2", "sink=save", f"sink.path={out}", "group.timeout_s=60",
        )
    )  # fmt: skip
    run_ranks(_failing_seal_rank, 4, s, -1, timeout=STARTUP_LIMIT_S)
    first = {read_slices(out / f"tp{t}").run for t in range(2)}
    assert len(first) == 1
    before = {t: (out / f"tp{t}" / "model.safetensors").read_bytes() for t in range(2)}
    # The next run: tp rank 1 (rank 3) cannot seal its directory, after tp rank 0 sealed its own. Neither publishes:
    # both directories stay the first run's, whole, and no staging directory is left.
    results = run_ranks(_failing_seal_rank, 4, s, 3, timeout=STARTUP_LIMIT_S, return_exceptions=True)
    assert all(isinstance(r, RankFailure) for r in results), results
    assert "injected: no space left" in str(results[3]) and "rank 3" in str(results[2])
    assert {read_slices(out / f"tp{t}").run for t in range(2)} == first
    assert {t: (out / f"tp{t}" / "model.safetensors").read_bytes() for t in range(2)} == before
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "tp0", "tp0/model.safetensors", "tp1", "tp1/model.safetensors",
    ]  # fmt: skip


def test_assembling_slices_refuses_a_mix_of_runs_and_slices_that_leave_a_gap(tmp_path):
    from refit_app.checkpoint.slices import assemble_slices, slices_metadata
    from refit_app.checkpoint.writer import save_tensors
    from refit_app.common.errors import SourceError

    full = torch.arange(12.0).reshape(4, 3)

    def save(t: int, run: str, box) -> None:
        (tmp_path / run / f"tp{t}").mkdir(parents=True)
        meta = slices_metadata([("w", (4, 3), box)], run=run, round_=1, tp_rank=t, tp_size=2)
        part = full[tuple(slice(a, b) for a, b in box)]
        save_tensors(tmp_path / run / f"tp{t}" / "model.safetensors", {"w": part}, meta)

    save(0, "a", ((0, 2), (0, 3)))
    save(1, "a", ((2, 4), (0, 3)))
    assert torch.equal(assemble_slices(tmp_path / "a" / f"tp{t}" for t in range(2))["w"], full)
    save(1, "b", ((3, 4), (0, 3)))
    with pytest.raises(SourceError, match=r"tp1 is from run b round 1, .*tp0 from run a round 1"):
        assemble_slices([tmp_path / "a" / "tp0", tmp_path / "b" / "tp1"])
    save(0, "b", ((0, 2), (0, 3)))
    with pytest.raises(SourceError, match=r"the slices do not cover tensor\(s\) 'w'"):
        assemble_slices(tmp_path / "b" / f"tp{t}" for t in range(2))
    # A box outside its tensor (metadata written by hand, or hostile) is named, not clipped.
    (tmp_path / "c" / "tp0").mkdir(parents=True)
    meta = slices_metadata([("w", (4, 3), ((2, 6), (0, 3)))], run="c", round_=1, tp_rank=0, tp_size=1)
    save_tensors(tmp_path / "c" / "tp0" / "model.safetensors", {"w": torch.zeros(4, 3)}, meta)
    with pytest.raises(SourceError, match=r"'w': box \[\(2, 6\), \(0, 3\)\] does not lie inside its shape \[4, 3\]"):
        assemble_slices([tmp_path / "c" / "tp0"])


def test_a_lost_engine_worker_is_named_with_the_engine_process_the_user_started():
    # sink=vllm: the data group numbers engine r's worker w K + rM + w, a rank nobody launched; the line says whose.
    from config_utils import settings

    from refit_app.app.sharded_engine import worker_named

    layout = settings("group.producers=2", "group.tp_size=2", "group.replicas=2").sharded
    said = worker_named("rank 0: lost rank 5 while sending to it: Connection reset by peer.", layout)
    assert said.endswith(": Connection reset by peer. (data-group rank 5 is worker 1 of the engine process at rank 3, "
                         "replica 1)")  # fmt: skip
    producer_lost = "rank 2: lost rank 1 while receiving from it: Connection reset by peer."
    assert worker_named(producer_lost, layout) == producer_lost


def test_a_local_sharded_save_fails_where_no_consumer_saved_a_tp_ranks_directory(tmp_path):
    # Under continue a saver lost after the last round (past the producers' end of the session, so nobody else
    # notices) publishes nothing while the others publish theirs: role=local's verdict checks every tp<t> was saved.
    from config_utils import settings

    from refit_app.app.local import LocalRunError, combine_outcomes
    from refit_app.app.rank_harness import RankOutcome

    s = settings("group.producers=2", "group.tp_size=2", "sink=save", f"sink.path={tmp_path}",
                 "refit.on_consumer_loss=continue")  # fmt: skip
    producers = [RankOutcome(p, True, {"role": "producer", "rank": p, "rounds": []}) for p in range(2)]
    saver = RankOutcome(2, True, {"role": "consumer", "rank": 2, "status": "ok", "saved_to": str(tmp_path / "tp0")})
    lost = RankOutcome(3, False, error="rank 3 died (exit code -9)", exc_type="Died")
    with pytest.raises(LocalRunError) as failed:
        combine_outcomes([*producers, saver, lost], s, "local")
    assert str(failed.value) == (
        f"no consumer saved tp1 to {tmp_path} in this run (its saver was lost after the last round); the directories "
        "there hold different runs now, which assemble_slices refuses"
    )
    assert failed.value.metrics["status"] == "failed"
