"""Per-tensor checksums over the exact bytes that travel, so a consumer can prove it got what was sent."""

from __future__ import annotations

import zlib

import torch

from refit_app.core.wire import tensor_bytes


def host_bytes(t: torch.Tensor) -> memoryview:
    """:func:`~refit_app.core.wire.tensor_bytes` on the host, as a buffer ``zlib`` and ``os.pwrite`` accept.

    Copies only when it must: to CPU for device tensors, and where ``tensor_bytes`` copies.
    """
    return memoryview(tensor_bytes(t.cpu()).numpy())


def tensor_checksum(t: torch.Tensor) -> int:
    """CRC32 of the tensor's bytes (:func:`host_bytes`).

    CRC32 rather than a cryptographic hash: it catches the corruption refit can cause (a reused buffer, a
    flipped or shifted byte) at memory speed, and ``zlib`` releases the GIL so it overlaps communication.
    """
    return zlib.crc32(host_bytes(t))
