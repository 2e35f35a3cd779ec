"""Per-tensor checksums over the exact bytes that travel, so a consumer can prove it got what was sent."""

from __future__ import annotations

import zlib

import torch


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's raw bytes in row-major order, as a buffer ``zlib`` and ``os.pwrite`` accept.

    Copies only when it must: to CPU for device tensors, to a dense layout for strided views, and to
    materialise a lazy conjugate or negation (their bits differ from the values they represent).
    """
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    # reshape(-1) because a 0-dim tensor cannot be viewed as bytes of a different element size.
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def tensor_checksum(t: torch.Tensor) -> int:
    """CRC32 of ``tensor_bytes(t)``.

    CRC32 rather than a cryptographic hash: it catches the corruption refit can cause (a reused buffer, a
    flipped or shifted byte) at memory speed, and ``zlib`` releases the GIL so it overlaps communication.
    """
    return zlib.crc32(tensor_bytes(t))
