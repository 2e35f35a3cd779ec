"""Sharded refits of a real trainer from the application (source=model): K producer ranks train the tiny Llama under
FSDP2 (``fully_shard`` over a mesh of the producers alone, gloo, uneven shards: 256 rows over 3 ranks are 86 + 86 +
84), take an AdamW step between rounds, and send only their own DTensor shards to M x D tensor-parallel consumers,
which check each slice every round by keyed sums against the producers' shards (sink=verify).

The oracle the application cannot have: ranks run in processes of this test with a hook after every round, the
producers gather the trainer's full tensors (``full_tensor()``), the consumers hand over their slices, and the test
compares every slice of every round bit for bit; one consumer swaps two rows of one slice in the last round (a
misrouted region), which the test's comparison and the consumer's own check must both catch. Then the command line:
role=local with replicas and bf16 sending, ranks started one by one as role=producer/consumer, and a consumer told
that a trainer sends where the producers read source=synthetic (every rank stops in one line)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch
from cli_utils import COVER_STARTUP, assert_ok, assert_one_line_error, local_metrics
from conditions import needs_transformers
from mp_utils import STARTUP_LIMIT_S, free_port, run_ranks

from refit_app.common.errors import VerificationError
from refit_app.core.reshard.keyed_sum import keyed_sum
from refit_app.core.reshard.plan import Layout, Replicate, Shard, shard_box, whole
from refit_app.core.reshard.transfer import Held

pytestmark = needs_transformers

TOKEN = {"REFIT_APP_TOKEN": "sharded-model-test-token"}
ROUNDS = 3
TIMEOUT_S = STARTUP_LIMIT_S
"""group.timeout_s: the rendezvous waits for every rank to load the model and shard it (60 s was short on busy cores
with five ranks starting at once); no deadline is under test here."""
K, M = 3, 2
TAMPERED = "model.layers.0.mlp.up_proj.weight"
"""A column-parallel weight (128 rows, 64 per consumer) whose rows 0 and 1 one consumer swaps in the last round."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from refit_app.models.hf import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", seed=1))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def mismatches(fulls: list[dict], consumers: dict[int, list[dict]]) -> list[tuple[int, int, str]]:
    """(consumer rank, round, tensor) of every slice whose bytes are not the trainer's full tensor's, sliced; a
    consumer missing a tensor counts as a mismatch too."""
    bad = []
    for rank, rounds in consumers.items():
        assert len(rounds) == len(fulls), f"consumer rank {rank} saw {len(rounds)} rounds, not {len(fulls)}"
        for n, (full, slices) in enumerate(zip(fulls, rounds), start=1):
            for name, whole_tensor in full.items():
                got = slices.get(name)
                want = whole_tensor[tuple(slice(a, b) for a, b in got[1])] if got is not None else None
                if got is None or not torch.equal(_bits(got[0]), _bits(want)):
                    bad.append((rank, n, name))
    return bad


def test_keyed_sums_add_up_over_shards_and_change_where_rows_move_or_a_bit_flips():
    shape = (33, 7)
    for dtype in (torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.bool, torch.complex128):
        full = (torch.randn(shape) > 0) if dtype == torch.bool else (torch.randn(shape) * 9).to(dtype)
        box = shard_box(shape, 1, 2, 1)  # a row-parallel consumer's columns cut across the producers' rows
        parts = sum(
            keyed_sum(Held(full[slice(*b[0])], b), box, shape) for b in (shard_box(shape, 0, 3, p) for p in range(3))
        )
        held = Held(full[:, 4:].clone(), box)
        assert parts % 2**64 == keyed_sum(held, box, shape), dtype
        moved = held.tensor.clone()
        moved[[3, 20]] = moved[[20, 3]]
        if not torch.equal(moved, held.tensor):
            assert keyed_sum(Held(moved, box), box, shape) != keyed_sum(held, box, shape), dtype
        flipped = held.tensor.clone()
        flipped.view(torch.uint8).view(-1)[5] ^= 1
        assert keyed_sum(Held(flipped, box), box, shape) != keyed_sum(held, box, shape), dtype
    # The same values one place over (a region landed one row off) are another sum; a 0-dim and an empty tensor.
    column = torch.arange(8.0).reshape(8, 1)
    assert keyed_sum(Held(column[:4], ((0, 4), (0, 1))), whole((8, 1)), (8, 1)) != keyed_sum(
        Held(column[:4], ((1, 5), (0, 1))), whole((8, 1)), (8, 1)
    )
    assert keyed_sum(Held(torch.tensor(2.0), ()), (), ()) != keyed_sum(Held(torch.tensor(3.0), ()), (), ())
    assert keyed_sum(Held(torch.empty(0, 4), ((0, 0), (0, 4))), ((0, 0), (0, 4)), (0, 4)) == 0


def test_producers_sums_count_a_replicated_tensor_once_and_name_a_slice_that_moved():
    from refit_app.app.sharded import check_sums, trainer_sums
    from refit_app.protocol.sharded import Declared, Expected, from_tensors

    full = {"up_proj.weight": torch.randn(33, 8), "norm.weight": torch.randn(8)}
    expects = [Expected(n, "float32", tuple(t.shape)) for n, t in full.items()]
    parts = []
    for rank in range(3):
        box = shard_box((33, 8), 0, 3, rank)
        specs, shards = from_tensors(
            [
                (
                    "up_proj.weight",
                    Declared(full["up_proj.weight"][slice(*box[0])], (33, 8), Layout.one_dim(range(3), Shard(0))),
                ),
                ("norm.weight", Declared(full["norm.weight"], (8,), Layout.one_dim(range(3), Replicate()))),
            ],
            rank=rank,
        )
        parts.append(trainer_sums(specs, shards, expects, rank, 2))
    assert [sorted(p[1]) for p in parts] == [["norm.weight", "up_proj.weight"], ["up_proj.weight"], ["up_proj.weight"]]
    slices = {
        "up_proj.weight": Held(full["up_proj.weight"][17:].clone(), ((17, 33), (0, 8))),
        "norm.weight": Held(full["norm.weight"].clone(), ((0, 8),)),
    }
    assert check_sums(slices, parts, expects, 1, 4, 2) == 2
    slices["up_proj.weight"].tensor[[0, 1]] = slices["up_proj.weight"].tensor[[1, 0]]
    with pytest.raises(
        VerificationError,
        match=r"consumer rank 4: round 2: tensor 'up_proj.weight' \[\(17, 33\), \(0, 8\)\] differs from the trainer's",
    ):
        check_sums(slices, parts, expects, 1, 4, 2)


def _rank(rank: int, world_size: int, port: int, s, tamper_rank: int) -> tuple[bytes, object]:
    """One rank of the application's sharded refit, with a hook that hands the test what it saw each round."""
    from refit_app.app.local import rank_settings
    from refit_app.app.sharded_run import run_sharded

    s = rank_settings(replace(s, group=replace(s.group, port=port)), rank, local_rank=None)
    seen: list[dict] = []

    def after_round(view) -> None:
        if view.source is not None:  # every producer takes part in gathering the trainer's full tensors
            full = {name: t.full_tensor().clone() for name, t in view.source.tensors()}
            if rank == 0:
                seen.append(full)
            return
        if rank == tamper_rank and view.round == ROUNDS:  # two rows landed in each other's place
            t = view.slices[TAMPERED].tensor
            t[[0, 1]] = t[[1, 0]]
        seen.append({name: (h.tensor.clone(), h.box) for name, h in view.slices.items()})

    try:
        outcome = run_sharded(s, after_round=after_round)
    except VerificationError as e:
        outcome = str(e)
    return _as_bytes(seen), outcome


def _as_bytes(obj: object) -> bytes:
    """Tensors as torch.save's bytes: a tensor returned from a rank travels as a shared-memory handle that dies with
    the rank's process."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> list[dict]:
    return torch.load(io.BytesIO(data))


def test_fsdp_trainer_ranks_send_their_shards_and_every_slice_of_every_round_is_the_trainers(tiny):
    from config_utils import settings

    from refit_app.app.local import with_run_secret

    s = with_run_secret(
        settings(
            f"group.producers={K}",
            f"group.tp_size={M}",
            "source=model",
            f"source.path={tiny}",
            "source.lr=1e-2",  # every round moves every weight
            f"refit.rounds={ROUNDS}",
            "refit.buffer_size_bytes=16KiB",  # the embedding goes as pieces
            f"group.timeout_s={TIMEOUT_S:g}",
        )
    )
    tamper_rank = K + 1
    results = run_ranks(_rank, K + M, s, tamper_rank, timeout=2 * TIMEOUT_S)
    fulls = _from_bytes(results[0][0])
    assert len(fulls) == ROUNDS and all(not torch.equal(fulls[0][n], fulls[-1][n]) for n in fulls[0])  # trained
    consumers = {K + c: _from_bytes(results[K + c][0]) for c in range(M)}
    assert mismatches(fulls, consumers) == [(tamper_rank, ROUNDS, TAMPERED)]
    # The consumer that swapped the rows finds it by itself; the other ranks finish every round, verified.
    assert results[tamper_rank][1].startswith(
        f"consumer rank {tamper_rank}: round {ROUNDS}: tensor {TAMPERED!r} [(64, 128), (0, 64)] differs from the "
        "trainer's (keyed sum "
    )
    other = results[K][1]
    assert other["verified"] is True and other["verified_tensors"] == len(fulls[0]) and other["rounds_done"] == ROUNDS
    losses = [r["loss"] for r in results[0][1]["rounds"]]  # the producers' training loss before each round
    assert losses[0] is None and all(loss > 0 for loss in losses[1:])
    # Each producer sent only its shards, split as torch.chunk splits (256 embedding rows over 3: 86 + 86 + 84).
    sent = [results[p][1]["bytes"] for p in range(K)]
    assert sent[0] == sent[1] > sent[2]
    assert "under FSDP2 over 3 rank(s)" in results[0][1]["source"]


def test_fsdp_trainer_ranks_sink_save_slices_that_reassemble_to_the_trainers_last_tensors(tiny, tmp_path):
    from config_utils import settings

    from refit_app.app.local import with_run_secret
    from refit_app.checkpoint.slices import assemble_slices

    k, m, out = 2, 2, tmp_path / "slices"
    s = with_run_secret(
        settings(
            f"group.producers={k}",
            f"group.tp_size={m}",
            "source=model",
            f"source.path={tiny}",
            "source.lr=1e-2",  # every round moves every weight: a stale round's slices would show
            "refit.rounds=2",
            "sink=save",
            f"sink.path={out}",
            f"group.timeout_s={TIMEOUT_S:g}",
        )
    )
    results = run_ranks(_rank, k + m, s, -1, timeout=2 * TIMEOUT_S)
    fulls = _from_bytes(results[0][0])
    assert [results[k + t][1]["saved_to"] for t in range(m)] == [str(out / f"tp{t}") for t in range(m)]
    whole = assemble_slices(out / f"tp{t}" for t in range(m))
    assert sorted(whole) == sorted(fulls[-1]) and not torch.equal(fulls[0][TAMPERED], fulls[-1][TAMPERED])
    assert [n for n, t in fulls[-1].items() if not torch.equal(_bits(whole[n]), _bits(t))] == []


def test_a_local_sharded_refit_trains_and_verifies_with_replicas_sending_bf16(cli, tmp_path, tiny):
    result = cli(
        "group.producers=3",
        "group.replicas=2",
        "source=model",
        f"source.path={tiny}",
        "source.send_dtype=bfloat16",
        "refit.rounds=2",
        COVER_STARTUP,
    )
    assert_ok(result)
    metrics = local_metrics(tmp_path)
    assert metrics["status"] == "ok" and metrics["verified"] is True and metrics["world_size"] == 5
    assert [c["verified_tensors"] for c in metrics["consumers"]] == [metrics["num_tensors"]] * 2
    assert metrics["rounds"][1]["loss"] is not None and "trained in float32" in metrics["source"]
    sent = sum(p["bytes"] for p in metrics["producers"]) // 2
    assert sent == sum(c["bytes"] for c in metrics["consumers"]) // 4  # bf16, and the second replica from the first
    assert ", 3 producers, 2 consumers" in result.stdout + result.stderr


def test_ranks_started_apart_train_and_verify_with_a_consumer_that_has_no_model(cli, tiny):
    port = free_port()
    common = ("group.producers=2", "group.world_size=3", f"group.port={port}", COVER_STARTUP)
    model = ("source=model", f"source.path={tiny}", "refit.rounds=2")
    runs = [
        cli.start("role=producer", "group.rank=0", *model, *common, env=TOKEN),
        cli.start("role=producer", "group.rank=1", *model, *common, env=TOKEN),
        cli.start("role=consumer", "group.rank=2", *common, env=TOKEN),  # it learns the tensors from producer 0
    ]
    results = [run.wait() for run in runs]
    for result in results:
        assert_ok(result)
    assert "consumer 2: " in results[2].stdout + results[2].stderr
    assert "x 2 rounds" in results[2].stdout + results[2].stderr and "verified" in results[2].stdout + results[2].stderr


def _synthetic_producers_and(cli, *consumer: str) -> list:
    """Two producers of source=synthetic and a consumer with ``consumer``'s settings, started apart; their runs."""
    common = ("group.producers=2", "group.world_size=3", f"group.port={free_port()}", COVER_STARTUP)
    return [
        cli.start("role=producer", "group.rank=0", *common, env=TOKEN),
        cli.start("role=producer", "group.rank=1", *common, env=TOKEN),
        cli.start("role=consumer", "group.rank=2", *consumer, *common, env=TOKEN),
    ]


def test_a_consumer_without_the_synthetic_source_its_producers_read_stops_every_rank_in_one_line(cli):
    for run in _synthetic_producers_and(cli, "source=model"):  # told a trainer sends
        assert_one_line_error(run.wait(), "consumer rank 2 has no source=synthetic to build, but the producers read")


def test_sink_model_builds_the_trainers_model_on_each_replica_and_matches_its_probe_every_round(cli, tmp_path, tiny):
    result = cli(
        "group.producers=2", "group.replicas=2", "source=model", f"source.path={tiny}", "sink=model",
        "sink.probe_tokens=8", "refit.rounds=2", COVER_STARTUP,
    )  # fmt: skip
    assert_ok(result)
    metrics = local_metrics(tmp_path)
    assert metrics["status"] == "ok" and metrics["verified"] is True and metrics["world_size"] == 4
    consumers = metrics["consumers"]
    assert [c["verified_tensors"] for c in consumers] == [metrics["num_tensors"]] * 2
    # Each consumer's model, built from producer 0's config.json and loaded with every tensor whole, gives the
    # trainer's logits (the producers' FSDP2 forward) exactly, after the first round and after a training step.
    checks = [r["model_check"] for c in consumers for r in c["rounds"]]
    assert checks == [{"max_abs_logit_diff": 0.0, "tokens_match": True}] * 4
    assert metrics["rounds"][1]["loss"] is not None


def test_a_consumer_building_a_model_from_producers_without_one_stops_every_rank_in_one_line(cli):
    for run in _synthetic_producers_and(cli, "sink=model", "sink.probe_tokens=0"):
        assert_one_line_error(run.wait(), "consumer rank 2 builds a model (sink=model) but the producers read")


def test_consumers_asking_for_probes_of_different_lengths_each_check_the_probe_the_producers_ran(cli, tiny):
    # The producers probe the most positions any consumer asks for; one that asked for fewer checks that probe too.
    common = ("group.producers=2", "group.replicas=2", "group.world_size=4", f"group.port={free_port()}", COVER_STARTUP)
    model = ("source=model", f"source.path={tiny}", "refit.rounds=1")
    runs = [
        cli.start("role=producer", "group.rank=0", *model, *common, env=TOKEN),
        cli.start("role=producer", "group.rank=1", *model, *common, env=TOKEN),
        cli.start("role=consumer", "group.rank=2", "sink=model", "sink.probe_tokens=4", *common, env=TOKEN),
        cli.start("role=consumer", "group.rank=3", "sink=model", "sink.probe_tokens=8", *common, env=TOKEN),
    ]
    for result in [run.wait() for run in runs]:
        assert_ok(result)


def test_a_probe_longer_than_the_trainers_model_stops_every_rank_in_one_line(cli, tiny):
    # Past max_position_embeddings (256 here) the producers' forward would take minutes that no deadline covers.
    assert_one_line_error(
        cli("group.producers=2", "source=model", f"source.path={tiny}", "sink=model", "sink.probe_tokens=100000",
            COVER_STARTUP),
        "consumer rank 2: sink.probe_tokens=100000 is more positions than the trainer's model has "
        "(max_position_embeddings=256): give at most 256",
    )  # fmt: skip


def test_producers_whose_config_json_differs_stop_every_rank_in_one_line(cli, tiny, tmp_path):
    # Producer 1 trains from a copy of the checkpoint whose config.json differs in what no tensor's shape shows: the
    # consumers' models, built from producer 0's, would not be the model producer 1 trains.
    import json
    import shutil

    other = shutil.copytree(tiny, tmp_path / "llama")
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10
    (other / "config.json").write_text(json.dumps(config))
    common = ("group.producers=2", "group.world_size=3", f"group.port={free_port()}", COVER_STARTUP)
    runs = [
        cli.start("role=producer", "group.rank=0", "source=model", f"source.path={tiny}", *common, env=TOKEN),
        cli.start("role=producer", "group.rank=1", "source=model", f"source.path={other}", *common, env=TOKEN),
        cli.start("role=consumer", "group.rank=2", "sink=model", "sink.probe_tokens=4", *common, env=TOKEN),
    ]
    for run in runs:
        assert_one_line_error(run.wait(), "producers 0 and 1 train models of different config.json")
