"""``group.backend=shm`` where every rank has a GPU: the producer's segments are its device memory, consumers open
them by CUDA IPC handle and copy device to device (:mod:`refit_app.transport.shm.cuda`). Three processes share GPU
0: every packing mode round trips exactly, a consumer's broadcast reaches the others, the ring is reused across
calls, and a killed consumer fails the others within the deadline.

Marked ``gpu`` and skipped without a CUDA device; ``scripts/gpu_check.sh`` runs them on the device machine.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conditions import needs_cuda
from mp_utils import RankFailure, deadline_budget, gloo_spec, run_ranks
from tensor_utils import IDENTITY, awkward_tensors, digest, metas

from refit_app.common.errors import RefitError
from refit_app.packed_tensor import packed_broadcast_consumer, packed_broadcast_producer
from refit_app.transport.groups import connect

pytestmark = [pytest.mark.gpu, needs_cuda]

WORLD = 3
TARGET = 4096
TIMEOUT_S = 20.0


def _model(dev: torch.device, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    weights = [(f"layer{i}.w", torch.randn(33, 17, generator=g).to(torch.bfloat16)) for i in range(24)]
    tensors = awkward_tensors() + weights + [("huge", torch.randn(5000, generator=g))]
    return [(n, t.to(dev)) for n, t in tensors]


def _connect(rank: int, port: int):
    torch.cuda.set_device(0)
    return connect(gloo_spec(rank, WORLD, port, timeout_s=TIMEOUT_S, backend="shm"))


def _round_trips(rank: int, world_size: int, port: int) -> list:
    out = []
    with _connect(rank, port) as rg:
        dev = rg.group.device
        out.append(dev.type)
        for call, legacy in enumerate((False, True, False, True)):
            tensors = _model(dev, seed=call)
            settings = dict(buffer_size_bytes=TARGET, use_legacy_packing=legacy, num_buffers=2)
            if rank == 0:
                packed_broadcast_producer(iter(tensors), rg.group, 0, IDENTITY, **settings)
                out.append(digest((n, t.cpu()) for n, t in tensors))
                continue
            got = packed_broadcast_consumer(iter(metas(tensors)), rg.group, 0, None, True, **settings)
            received = [(n, t.clone()) for n, t in got]
            out.append(([t.device.type for _, t in received][:1], digest((n, t.cpu()) for n, t in received)))
        # A broadcast from a consumer: uploaded to the producer, published to the other consumer.
        value = torch.arange(300_000, dtype=torch.int32, device=dev)
        t = value.clone() if rank == 1 else torch.zeros_like(value)
        rg.group.broadcast(t, 1)
        out.append(bool(torch.equal(t, value)))
    return out


def test_every_mode_round_trips_device_to_device():
    results = run_ranks(_round_trips, WORLD, timeout=180)
    producer, consumers = results[0], results[1:]
    assert producer[0] == "cuda"
    for consumer in consumers:
        assert consumer[0] == "cuda"
        for sent, (devices, got) in zip(producer[1:-1], consumer[1:-1]):
            assert devices == ["cuda"]
            assert got == sent
    assert all(r[-1] for r in results)


def _killed(rank: int, world_size: int, port: int) -> tuple[str, float] | None:
    with _connect(rank, port) as rg:
        dev = rg.group.device
        tensors = _model(dev, seed=5)
        try:
            for call in range(1000):
                if rank == 0:
                    packed_broadcast_producer(iter(tensors), rg.group, 0, IDENTITY, buffer_size_bytes=TARGET)
                else:
                    if rank == 2 and call == 3:
                        os.kill(os.getpid(), signal.SIGKILL)
                    list(packed_broadcast_consumer(iter(metas(tensors)), rg.group, 0, None, True))
        except RefitError as e:
            return str(e), time.time()
    return None


def test_a_killed_consumer_fails_the_others_within_the_deadline():
    start = time.time()
    results = run_ranks(_killed, WORLD, timeout=120, return_exceptions=True)
    assert isinstance(results[2], RankFailure)
    for rank in (0, 1):  # the kill comes a few calls after the start: the start bounds it from below
        line, at = results[rank]
        assert "\n" not in line
        assert at - start < deadline_budget(TIMEOUT_S) + 30
