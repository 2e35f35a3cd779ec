"""Sharded refits from the command line (group.producers, group.tp_size, group.replicas): ``python -m refit_app``
starts K producers, each holding its rows of the synthetic model, and M x D tensor-parallel consumers, each checking
its slices bit for bit against the whole tensors sliced; ranks started one by one as role=producer/consumer (as on
separate hosts, over loopback) stop together, in one line, where one producer's model has another layout. And the
layout rules and the verification that these runs rely on, without processes."""

from __future__ import annotations

import pytest
import torch
from cli_utils import COVER_STARTUP, assert_ok, assert_one_line_error, local_metrics
from mp_utils import free_port

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


def test_a_sharded_refit_refuses_what_it_cannot_run_yet_in_one_line(cli):
    assert_one_line_error(
        cli("group.producers=2", "sink=save", "sink.path=out"),
        "a sharded refit feeds sink=verify or sink=discard only so far, not sink=save",
    )
