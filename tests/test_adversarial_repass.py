"""Adversarial re-pass over the issue 31 fixes: cases the first pass left open.

1. A write into the consumer's tensors from its own ``post_unpack_func`` during a delta-capable round (an engine
   that post-processes weights in place as they land), without checksums on the wire: the base the consumer
   claimed for the next round was hashed after that write, so the next delta was applied onto bytes that were
   never the producer's round.
2. A zstd positions section whose frame header declares a content size far above what the record's header allows:
   the decompressor allocated (and, for a real bomb, wrote) that many bytes before the size was checked.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from mp_utils import gloo_spec, play_scenarios

from refit_app.common.errors import HandshakeError
from refit_app.core.delta import codec
from refit_app.core.meta import TensorMeta
from refit_app.protocol.delta.receive import _RecordReader
from refit_app.protocol.delta.types import DeltaStats
from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.groups import connect

TIMEOUT_S = 30.0
BUFFER = 4096
ROUNDS = 4


def _model(k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    model = {"w": torch.randn(64, 48, generator=g).to(torch.bfloat16), "b": torch.randn(97, generator=g)}
    for r in range(2, k + 1):
        gr = torch.Generator().manual_seed(r)
        for t in model.values():
            rows = t.view(-1).view(torch.uint8).view(t.numel(), t.element_size())
            rows[torch.randperm(t.numel(), generator=gr)[: max(1, t.numel() // 100)], 0] ^= 0x10
    return model


def _bytes(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}


def _write_in_callback(rank: int, port: int, *, how: str, mirror: bool):
    with connect(gloo_spec(rank, 2, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            with ProducerSession(rg, buffer_size_bytes=BUFFER, delta="on") as session:
                return [session.send(list(_model(k).items())).base_round for k in range(1, ROUNDS + 1)]
        session = ConsumerSession(rg, mirror=mirror)
        targets = None if mirror else {n: torch.zeros_like(t) for n, t in _model(1).items()}
        out = []
        while True:
            seen: dict[str, torch.Tensor] = {}
            k = session.rounds + 1

            def callback(batch, k=k, seen=seen):
                seen.update(batch)
                for name, t in batch:
                    if k == 2 and name == "w":  # an engine post-processing a weight in place as it lands
                        if how == "data_copy":
                            t.data.copy_(torch.full_like(t, 0.5))
                        else:
                            t.add_(1.0)

            r = session.receive(callback, targets=targets)
            if r is None:
                return out
            out.append((r.round, r.base_round, _bytes(dict(seen) if mirror else targets)))


SCENARIOS = {
    "targets_data_copy": functools.partial(_write_in_callback, how="data_copy", mirror=False),
    "targets_add_": functools.partial(_write_in_callback, how="add_", mirror=False),
    "mirror_data_copy": functools.partial(_write_in_callback, how="data_copy", mirror=True),
}


def test_a_write_from_the_consumers_own_callback_is_not_claimed_as_the_next_base():
    producer, consumer = play_scenarios(SCENARIOS, 2, timeout=180)
    problems = []
    for name in SCENARIOS:
        sent, got = producer[name], consumer[name]
        if isinstance(sent, Exception) or isinstance(got, Exception):
            problems.append(f"{name}: producer {sent!r}, consumer {got!r}")
            continue
        if sent[2] != 0:
            problems.append(f"{name}: round 3 sent as changes to round {sent[2]}, onto bytes written in round 2")
        for k, base, held in got:
            if k != 2 and held != _bytes(_model(k)):  # round 2's own bytes are the callback's doing
                problems.append(f"{name}: round {k} (base {base}) left other bytes than the producer's")
    assert not problems, "\n".join(problems)


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
    from refit_app.protocol.delta.receive import Target

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


@pytest.mark.parametrize("seed", ["99999999999999999999999", str(2**63)])
def test_a_seed_past_64_bits_is_refused_naming_the_key_before_any_rank_starts(cli, seed):
    result = cli(f"source.seed={seed}")
    assert result.returncode == 1, result.describe()
    lines = result.stderr_lines()
    assert len(lines) == 1 and lines[0].startswith(f"refit_app: error: source.seed={seed} is invalid"), (
        result.describe()
    )
    assert not (cli.cwd / "outputs").exists() or not any((cli.cwd / "outputs").rglob("metrics.json"))
