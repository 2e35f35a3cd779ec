"""The backend's glue over refit_app sessions and a real gloo group, without an engine: what the worker engine's
``update_weights`` runs (:func:`refit_app.integrations.vllm.backend.receive_round`) against what the trainer engine's
``send_weights`` runs, with a loader that keeps every tensor to the end of the round as vLLM's layerwise reload does.
"""

from __future__ import annotations

import torch
from mp_utils import run_ranks

TIMEOUT_S = 60.0
BUFFER_BYTES = 16 * 1024


def _weights(round_no: int, wide: bool = False) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(round_no)
    shapes = {"a.weight": (64, 32 if not wide else 48), "a.bias": (64,), "b.weight": (300, 200), "scale": ()}
    return [(name, torch.randn(shape, generator=g)) for name, shape in shapes.items()]


def _rank(
    rank: int, world_size: int, port: int, plan: list[str], packed: bool = True, bad_round: int | None = None,
    fail_loading: int | None = None, timeout_s: float = TIMEOUT_S,
) -> list:  # fmt: skip
    """Producer or consumer of len(plan) rounds; plan[k] is "same" or "wide" (the tensor list changes). At
    ``bad_round`` the worker is told another round number; at ``fail_loading`` its loader raises mid-round."""
    from refit_app.core.meta import TensorMeta
    from refit_app.integrations.vllm.backend import (
        RefitTrainerInitInfo,
        RefitUpdateInfo,
        consumer_session,
        producer_session,
        receive_round,
        worker_init_info,
    )

    init = RefitTrainerInitInfo(
        master_address="127.0.0.1", master_port=port, world_size=world_size, buffer_size_bytes=BUFFER_BYTES,
        num_buffers=2, group_backend="gloo", timeout_s=timeout_s, checksums=True, packed=packed, rank=0,
    )  # fmt: skip
    log = []
    if rank == 0:
        session = producer_session(init)
        try:
            for k, kind in enumerate(plan, start=1):
                named = _weights(k, wide=kind == "wide")
                metas = [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in named]
                r = session.send(iter(named), metas=metas)
                log.append((r.round, r.manifest_sent, r.bytes, r.num_broadcasts))
        finally:
            session.group.close()
        return log
    session = consumer_session(worker_init_info(init), rank)
    try:
        for k in range(1, len(plan) + 1):
            received: list[tuple[str, torch.Tensor]] = []

            def load(weights, k=k, received=received):
                for item in weights:
                    received.append(item)  # kept to the end of the round, as vLLM's layerwise reload does
                    if k == fail_loading and len(received) == 2:
                        raise ValueError("the model has no parameter 'a.bias'")

            r = receive_round(session, RefitUpdateInfo(round=k + (k == bad_round)), load)
            expected = _weights(k, wide=plan[k - 1] == "wide")
            assert [n for n, _ in received] == [n for n, _ in expected]
            for (_, got), (name, want) in zip(received, expected):
                assert torch.equal(got, want), f"round {k}: {name} differs"
            assert r.verified is True
            log.append((r.round, r.manifest_sent, r.bytes, r.num_broadcasts))
    finally:
        session.close()
        session.group.close()
    return log


def test_manifest_once_then_again_when_the_tensor_list_changes() -> None:
    producer, consumer = run_ranks(_rank, 2, ["same", "same", "wide", "wide"], timeout=TIMEOUT_S * 2)
    assert [m for _, m, _, _ in producer] == [True, False, True, False]
    assert producer == consumer
    assert all(chunks < 4 for *_, chunks in producer), "the small tensors share chunks"


def test_per_tensor_baseline_is_one_broadcast_per_tensor() -> None:
    producer, consumer = run_ranks(_rank, 2, ["same", "same"], False, timeout=TIMEOUT_S * 2)
    assert [chunks for *_, chunks in producer] == [4, 4]
    assert producer == consumer


def test_a_worker_out_of_step_stops_both_sides_with_the_reason() -> None:
    results = run_ranks(_rank, 2, ["same", "same", "same"], True, 2, None, 15.0, timeout=TIMEOUT_S,
                        return_exceptions=True)  # fmt: skip
    for failure in results:
        assert "round 2: the trainer's update_weights says round 3, this worker's session is in round 2" in (
            failure.message
        ), failure


def test_a_loader_failure_reaches_the_trainer_with_its_reason() -> None:
    results = run_ranks(_rank, 2, ["same", "same"], True, None, 2, 15.0, timeout=TIMEOUT_S,
                        return_exceptions=True)  # fmt: skip
    trainer, worker = results
    assert "round 2: ValueError: the model has no parameter 'a.bias'" in trainer.message, trainer
    assert (worker.exc_type, worker.message) == ("ValueError", "the model has no parameter 'a.bias'"), worker
