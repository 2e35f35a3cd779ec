"""Which GPU a rank uses. Several ranks on one host (torchrun's ``--nproc-per-node``, SLURM tasks, ``role=local``)
must not all land on ``cuda:0``: each takes the GPU of its index on the host (``group.local_rank``). The choice is
a pure function, so that it is tested without a GPU; :func:`use_local_gpu` applies it to torch.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def local_cuda_device(local_rank: int | None, device_count: int) -> int | None:
    """The CUDA device index of the rank that is ``local_rank``-th on a host with ``device_count`` visible GPUs.

    None where there is nothing to choose: no GPU, or no local rank known (a hand-started producer or consumer,
    a library user who set the device already), and the current device stays. With more ranks than GPUs the
    ranks wrap around (rank k on GPU k mod count): gloo and a CUDA sink can share a GPU, and NCCL, which cannot,
    then says so itself when the group forms.
    """
    if local_rank is None or device_count <= 0:
        return None
    return local_rank % device_count


def use_local_gpu(local_rank: int | None) -> int | None:
    """Make ``cuda:<local_cuda_device(...)>`` the current device (where NCCL buffers and ``device=cuda`` models
    go) and return its index; None, and nothing changed, without a GPU or a local rank."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = local_cuda_device(local_rank, count)
    if index is not None:
        torch.cuda.set_device(index)
        logger.info("local rank %d: using cuda:%d of %d GPU(s)", local_rank, index, count)
    return index
