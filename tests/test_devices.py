"""The GPU each rank of a host takes (:mod:`refit_app.app.devices`): a pure choice tested on CPU with the device count
as a parameter, and applied on a GPU machine (marker ``gpu``; ``scripts/gpu_check.sh`` runs it). Imports neither Hydra
nor the application, which the GPU machine may lack."""

from __future__ import annotations

import pytest
import torch
from conditions import needs_cuda, needs_no_cuda

from refit_app.app.devices import local_cuda_device, use_local_gpu

# --- The GPU of a rank ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "local_rank,count,expected",
    [
        (None, 8, None),  # nothing known: the current device stays
        (0, 0, None),  # no GPU
        (3, 0, None),
        (0, 1, 0),
        (1, 4, 1),
        (3, 4, 3),
        (5, 4, 1),  # more ranks than GPUs: they wrap around
        (1, 1, 0),  # role=local on a one-GPU host: the consumer shares cuda:0
    ],
)
def test_local_cuda_device(local_rank, count, expected):
    assert local_cuda_device(local_rank, count) == expected


def test_ranks_of_one_host_spread_over_its_gpus():
    count = 4
    assert [local_cuda_device(r, count) for r in range(count)] == list(range(count))


@pytest.mark.gpu
@needs_cuda
def test_use_local_gpu_sets_the_current_device():
    count = torch.cuda.device_count()
    before = torch.cuda.current_device()
    try:
        for local_rank in range(count + 1):
            index = use_local_gpu(local_rank)
            assert index == local_rank % count
            assert torch.cuda.current_device() == index
            assert torch.empty(1, device="cuda").device.index == index
    finally:
        torch.cuda.set_device(before)
    assert use_local_gpu(None) is None and torch.cuda.current_device() == before


@needs_no_cuda
def test_use_local_gpu_without_a_gpu_changes_nothing():
    assert use_local_gpu(0) is None and use_local_gpu(3) is None and use_local_gpu(None) is None
