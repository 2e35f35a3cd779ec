"""Delta rounds of a sharded refit from the application (``refit.delta=on`` with group.producers, group.tp_size): the
first round dense, every later one only the elements whose bytes changed, each producer comparing only its own
shards, and each replica after the first getting its changes from the one before it. Every slice of every round is
still checked: bit for bit against the synthetic source's whole tensors (sink=verify), against a trainer's
``full_tensor()``s (a hook after every round) and by the consumers' keyed sums; a slice written since the last round
(behind torch's back) is sent again whole in the next round, never left wrong."""

from __future__ import annotations

from dataclasses import replace

import pytest
from cli_utils import COVER_STARTUP, assert_ok, assert_one_line_error, local_metrics
from conditions import needs_transformers
from mp_utils import free_port, run_ranks
from test_sharded_app_model import ROUNDS, TAMPERED, TIMEOUT_S, _as_bytes, _from_bytes, _rank, mismatches

from refit_app.models.sources import SyntheticSource


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from refit_app.models.hf import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", seed=1))


@pytest.mark.parametrize(("k", "m", "d"), [(2, 2, 1), (3, 1, 2)])
def test_a_local_sharded_refit_sends_delta_rounds_and_verifies_every_slice_every_round(cli, tmp_path, k, m, d):
    rounds = 3
    result = cli(
        f"group.producers={k}",
        f"group.tp_size={m}",
        f"group.replicas={d}",  # replica 1's consumers get their changes from replica 0's
        f"refit.rounds={rounds}",
        "refit.delta=on",
        "source.update=training",  # about 1% of the bf16 elements change a round
        "refit.buffer_size_bytes=256KiB",  # a tensor larger than a buffer goes as pieces
        COVER_STARTUP,
    )
    assert_ok(result)
    metrics = local_metrics(tmp_path)
    producers, consumers = metrics["producers"], metrics["consumers"]
    # sink=verify compared every consumer's slices with the source's whole tensors, sliced, after every round.
    assert metrics["verified"] is True and all(c["verified_tensors"] == metrics["num_tensors"] for c in consumers)
    assert metrics["delta"] == "on" and [r["delta"] for r in metrics["rounds"]] == [False] + [True] * (rounds - 1)
    metas = SyntheticSource("tiny").manifest_tensors()
    dense = sum(t.nbytes for t in metas) + (m - 1) * sum(t.nbytes for t in metas if len(t.shape) < 2)
    elements = sum(t.numel for t in metas)
    first, *later = metrics["rounds"]
    # Every round brings the whole model up to date in each replica; the first sends it whole (with its records'
    # headers) to each.
    assert all(r["bytes"] == dense for r in metrics["rounds"]) and d * dense <= first["wire_bytes"] < 1.01 * d * dense
    # The first round counts every element the producers compare: the model's, and a tensor every producer holds
    # whole (a 0-dim one) once more for each other producer that sends it to some consumer.
    assert elements <= first["changed_elements"] < 1.001 * elements and first["changed_fraction"] == 1.0
    for r in later:
        assert r["base_round"] == r["round"] - 1 and r["wire_bytes"] < d * dense / 10, r
        assert 0.002 < r["changed_fraction"] < 0.05 and r["changed_elements"] < elements / 20, r
        assert r["diff_seconds"] > 0 and r["apply_seconds"] > 0, r
    for n, r in enumerate(metrics["rounds"]):
        # The top level adds up the producers' own figures: each compared only its share, together all of it.
        assert r["changed_elements"] == sum(p["rounds"][n]["changed_elements"] for p in producers)
        assert r["diff_seconds"] == max(p["rounds"][n]["diff_seconds"] for p in producers)
        assert r["wire_bytes"] == sum(c["rounds"][n]["wire_bytes"] for c in consumers)
    shares = [p["rounds"][0]["changed_elements"] for p in producers]
    assert max(shares) < elements / k * 1.2  # each producer compares its own rows, a share of the model
    assert "on the wire" in result.stderr + result.stdout and "verified" in result.stderr + result.stdout


@pytest.mark.parametrize("update", ["training", "shuffle"])
def test_auto_sends_delta_rounds_while_few_elements_change_and_plain_rounds_where_all_do(cli, tmp_path, update):
    rounds = 4
    result = cli(
        "group.producers=2",
        "group.tp_size=2",
        f"refit.rounds={rounds}",
        "refit.delta=auto",
        f"source.update={update}",  # training: about 1% of the bf16 elements change a round; shuffle: every one
        COVER_STARTUP,
    )
    assert_ok(result)
    metrics = local_metrics(tmp_path)
    # sink=verify compared every consumer's slices with the source's whole tensors, sliced, after every round.
    assert metrics["delta"] == "auto" and metrics["verified"] is True
    assert all(r["verified"] for r in metrics["rounds"])
    reasons = [r["auto_reason"] for r in metrics["rounds"]]
    for rank in metrics["producers"] + metrics["consumers"]:  # one choice a round, the same on every rank
        assert [r["auto_reason"] for r in rank["rounds"]] == reasons
    kinds = [why.split(":")[0] for why in reasons]
    first, second, *later = metrics["rounds"]
    assert kinds[:2] == ["keep", "delta"], reasons  # the first fills the snapshots; nothing says deltas do not pay
    assert first["changed_fraction"] == 1.0 and second["delta"] and second["base_round"] == 1
    dense = first["bytes"]
    if update == "training":
        assert second["wire_bytes"] < dense / 10 and 0.002 < second["changed_fraction"] < 0.05, second
        # A warm dense round to time the delta round against; then as the times measured say.
        assert kinds[2] == "keep" and kinds[3] in ("delta", "plain"), reasons
    else:
        # The delta round's changes took all the dense bytes: plain rounds from then on, sent exactly as with
        # refit.delta=off (the dense bytes, no records), the producers' samples estimating every element changed.
        assert second["changed_fraction"] > 0.99 and second["wire_bytes"] >= dense, second
        assert kinds[2:] == ["plain"] * (rounds - 2), reasons
        assert all("of the dense bytes (50% or more)" in why for why in reasons[2:]), reasons
        assert all(r["plain"] and not r["delta"] and r["wire_bytes"] == dense for r in later), later
        assert later[-1]["changed_fraction"] > 0.99, later[-1]


def test_ranks_started_apart_stop_together_where_one_producer_sends_dense_rounds(cli):
    port = free_port()
    common = ("group.producers=2", "group.world_size=3", f"group.port={port}", COVER_STARTUP)
    token = {"REFIT_APP_TOKEN": "sharded-delta-test-token"}
    runs = [
        cli.start("role=producer", "group.rank=0", "refit.delta=on", *common, env=token),
        cli.start("role=producer", "group.rank=1", *common, env=token),
        cli.start("role=consumer", "group.rank=2", *common, env=token),  # it adopts producer 0's refit.delta
    ]
    for run in runs:
        assert_one_line_error(run.wait(), "producers 0 and 1 disagree on refit.delta: on and off")


def _settings(k: int, m: int, tiny: str, *more: str):
    from config_utils import settings

    from refit_app.app.local import with_run_secret

    return with_run_secret(
        settings(
            f"group.producers={k}",
            f"group.tp_size={m}",
            "source=model",
            f"source.path={tiny}",
            "source.send_dtype=bfloat16",
            "source.lr=1e-5",  # AdamW steps that change a share of the bf16 elements, not all
            f"refit.rounds={ROUNDS}",
            "refit.delta=on",
            "refit.buffer_size_bytes=16KiB",  # the embedding goes as pieces
            f"group.timeout_s={TIMEOUT_S:g}",
            *more,
        )
    )


@needs_transformers
def test_fsdp_trainer_ranks_send_delta_rounds_of_their_shards_and_every_slice_is_the_trainers(tiny):
    k, m = 3, 2
    tamper_rank = k + 1
    results = run_ranks(_rank, k + m, _settings(k, m, tiny), tamper_rank, timeout=2 * TIMEOUT_S)
    fulls = _from_bytes(results[0][0])
    consumers = {k + c: _from_bytes(results[k + c][0]) for c in range(m)}
    # Every slice of every round is the trainer's, bit for bit, but the one a consumer swapped two rows of in the
    # last round, which that consumer's keyed sums name by themselves.
    assert mismatches(fulls, consumers) == [(tamper_rank, ROUNDS, TAMPERED)]
    assert results[tamper_rank][1].startswith(f"consumer rank {tamper_rank}: round {ROUNDS}: tensor {TAMPERED!r}")
    other = results[k][1]
    assert other["verified"] is True and other["rounds_done"] == ROUNDS
    for p in range(k):
        rounds = results[p][1]["rounds"]
        assert [r["delta"] for r in rounds] == [False] + [True] * (ROUNDS - 1)
        assert rounds[0]["changed_fraction"] == 1.0 and all(0 < r["changed_fraction"] < 1 for r in rounds[1:])
        assert all(r["wire_bytes"] < r["bytes"] for r in rounds[1:]), rounds  # only the changes went
    assert all(r["loss"] > 0 for r in results[0][1]["rounds"][1:])  # trained between rounds


def _scribbling_rank(rank: int, world_size: int, port: int, s, scribble_rank: int, scribble_round: int):
    """A rank that hands the test what it saw each round; consumer ``scribble_rank`` then overwrites its embedding
    slice through ``.data`` (as an engine's load may: torch's version counter does not see it) after round
    ``scribble_round``."""
    from refit_app.app.local import rank_settings
    from refit_app.app.sharded_run import run_sharded

    s = rank_settings(replace(s, group=replace(s.group, port=port)), rank, local_rank=None)
    seen: list[dict] = []

    def after_round(view) -> None:
        if view.source is not None:
            full = {name: t.full_tensor().clone() for name, t in view.source.tensors()}
            if rank == 0:
                seen.append(full)
            return
        seen.append({name: (h.tensor.clone(), h.box) for name, h in view.slices.items()})
        if rank == scribble_rank and view.round == scribble_round:
            view.slices["model.embed_tokens.weight"].tensor.data.fill_(7.0)

    metrics = run_sharded(s, after_round=after_round)
    return _as_bytes(seen), metrics


@needs_transformers
def test_a_slice_written_since_the_last_round_is_sent_again_whole_and_ends_exact(tiny):
    k, m, scribbled = 2, 2, 3
    # sink=discard: no consumer check would stop the round the slice is written in; the test's comparison checks.
    s = _settings(k, m, tiny, "sink=discard")
    results = run_ranks(_scribbling_rank, k + m, s, scribbled, 2, timeout=2 * TIMEOUT_S)
    fulls = _from_bytes(results[0][0])
    consumers = {k + c: _from_bytes(results[k + c][0]) for c in range(m)}
    assert mismatches(fulls, consumers) == []  # round 3 repaired what was written after round 2
    embedding = consumers[scribbled][0]["model.embed_tokens.weight"][0]
    wire = [r["wire_bytes"] for r in results[scribbled][1]["rounds"]]
    other = [r["wire_bytes"] for r in results[k][1]["rounds"]]
    # Round 3 brought the scribbled consumer the whole embedding slice again; the other consumer only the changes.
    assert wire[2] > other[2] + embedding.nbytes // 2, (wire, other, embedding.nbytes)
