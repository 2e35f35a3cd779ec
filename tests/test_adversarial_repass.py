"""Adversarial re-pass over the issue 31 fixes: cases the first pass left open.

- A zstd positions section whose frame header declares a content size far above what the record's header allows:
   the decompressor allocated (and, for a real bomb, wrote) that many bytes before the size was checked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refit_app.common.errors import HandshakeError
from refit_app.core import delta as codec
from refit_app.core.meta import TensorMeta
from refit_app.protocol.delta import DeltaStats
from refit_app.protocol.delta_receive import _RecordReader


def _rle_frame(size: int) -> bytes:
    """A zstd frame of ``size`` zero bytes made of RLE blocks (4 bytes per 128 KiB), declaring its content size."""
    block = 128 * 1024
    out = bytearray(b"\x28\xb5\x2f\xfd")  # magic
    out += bytes([0b1110_0000])  # 8-byte content size, single segment, no checksum, no dictionary
    out += size.to_bytes(8, "little")
    left = size
    while left:
        n = min(block, left)
        left -= n
        out += ((n << 3) | (1 << 1) | (1 if not left else 0)).to_bytes(3, "little") + b"\x00"  # RLE block
    return bytes(out)


def test_a_zstd_bomb_in_a_positions_section_is_refused_before_it_is_decompressed():
    """A 1 MiB int8 tensor allows a 128 KiB compressed bitmask; 8 KiB of RLE blocks decompress to 256 MiB. The
    record must fail in one line naming the tensor, having allocated nothing near that size."""
    import tracemalloc

    numel = 1 << 20
    meta = TensorMeta("victim", (numel,), torch.int8)
    frame = _rle_frame(256 << 20)
    assert len(frame) <= (numel + 7) // 8
    header = codec.RECORD.pack(0, codec.BITMASK, codec.ZSTD, 0, 1, 0, len(frame), 1)
    stream = header + frame + b"\0" * (codec.padded(len(frame)) - len(frame)) + b"\x01" + b"\0" * 7
    target = np.zeros(numel, dtype=np.uint8)
    from refit_app.protocol.delta_receive import Target

    reader = _RecordReader([meta], [Target(array=target)], DeltaStats(), hand_out=False, mirror=None)
    tracemalloc.start()
    try:
        with pytest.raises(HandshakeError) as e:
            reader.feed(np.frombuffer(stream, dtype=np.uint8))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "'victim'" in str(e.value) and "\n" not in str(e.value)
    assert peak < 16 << 20, f"decompressing a forged positions section took {peak >> 20} MiB"
    assert not target.any()
