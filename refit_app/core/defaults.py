"""The packed broadcast's defaults and the environment variables that override them: the spec's
``get_num_buffers`` and ``get_target_packed_tensor_size``, read at every call.

Torch is imported only inside the functions, so that the application's config (which names
``NRL_REFIT_NUM_BUFFERS`` as ``refit.num_buffers``'s default) can import this module without loading torch.
"""

from __future__ import annotations

import os

NUM_BUFFERS_ENV = "NRL_REFIT_NUM_BUFFERS"
"""Buffers in flight (:func:`get_num_buffers`; the config's ``refit.num_buffers`` default)."""
DEFAULT_NUM_BUFFERS = 2
BUFFER_MEMORY_RATIO_ENV = "NRL_REFIT_BUFFER_MEMORY_RATIO"
"""Fraction of device (or host) memory for one packed buffer (:func:`get_target_packed_tensor_size`)."""
DEFAULT_BUFFER_MEMORY_RATIO = 0.02
MAX_TARGET_PACKED_TENSOR_SIZE = 5 * 1024**3
"""Cap on :func:`get_target_packed_tensor_size`, whatever the memory ratio."""
DEFAULT_HOST_TARGET_PACKED_TENSOR_SIZE = 16 * 1024**2
"""Default chunk target without a GPU (and without ``NRL_REFIT_BUFFER_MEMORY_RATIO``); see
:func:`get_target_packed_tensor_size` for the measurement behind it."""


# --------------------------------------------------------------------------------------------------------------
# Settings from the environment (the spec's helpers).


def get_num_buffers() -> int:
    """Number of rotating buffers: ``NRL_REFIT_NUM_BUFFERS``, default 2. Read at every call."""
    raw = os.environ.get(NUM_BUFFERS_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_NUM_BUFFERS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{NUM_BUFFERS_ENV}={raw!r} is not an integer; set it to a whole number >= 1") from None
    if value < 1:
        raise ValueError(f"{NUM_BUFFERS_ENV}={raw!r} is out of range; set it to a whole number >= 1")
    return value


def _total_device_memory() -> int:
    import torch  # here, not at the top: the config reads this module's names without loading torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def get_target_packed_tensor_size() -> int:
    """Target chunk size in bytes. Read at every call.

    - ``NRL_REFIT_BUFFER_MEMORY_RATIO`` set: that fraction of the current CUDA device's memory, or of physical
      memory without a GPU, capped at 5 GiB.
    - Unset, with a GPU: 0.02 of the current CUDA device's memory (the spec's default), capped at 5 GiB.
    - Unset, without a GPU: 16 MiB (:data:`DEFAULT_HOST_TARGET_PACKED_TENSOR_SIZE`), or 0.02 of physical memory
      where that is smaller.

    Why 16 MiB on the host: overlap needs many chunks. At 2% of RAM (482 MiB on a 24 GiB machine) a 1 GB model
    is two chunks, the second waits for the first, and the consumer holds two 482 MiB receive buffers. Measured
    with ``python -m refit_app.bench`` over gloo on a 2-core VM (1 GB Llama-shaped model, 2 buffers, refit and the
    transport limit interleaved, medians of 5, machine under load): 16 MiB x 2 reached 0.91x and 1.10x the limit
    in two runs (0.93-1.11x in earlier sweeps, docs/results.md), 32 MiB 0.75x, 64 MiB 0.63-0.91x, 482 MiB 0.82-0.94x;
    4-8 MiB did no better than 16 MiB (0.91-1.11x) while each chunk still costs a collective. A chunk
    of 16 MiB is about 5 ms on the wire at 3 GB/s, so the per-broadcast cost (tens of microseconds) stays under
    2%. The buffers' memory is ``num_buffers x max(target, largest tensor)``, which the largest tensor dominates.
    """
    raw = os.environ.get(BUFFER_MEMORY_RATIO_ENV)
    ratio = DEFAULT_BUFFER_MEMORY_RATIO
    explicit = raw is not None and raw.strip() != ""
    if explicit:
        try:
            ratio = float(raw)
        except ValueError:
            raise ValueError(
                f"{BUFFER_MEMORY_RATIO_ENV}={raw!r} is not a number; set it to a fraction in (0, 1], e.g. 0.02"
            ) from None
        if not 0.0 < ratio <= 1.0:  # also rejects nan
            raise ValueError(f"{BUFFER_MEMORY_RATIO_ENV}={raw!r} is out of range; set it to a fraction in (0, 1]")
    target = min(int(_total_device_memory() * ratio), MAX_TARGET_PACKED_TENSOR_SIZE)
    if not explicit and not _has_cuda():
        target = min(target, DEFAULT_HOST_TARGET_PACKED_TENSOR_SIZE)
    return max(1, target)
