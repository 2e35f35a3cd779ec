"""Tensors the tests send, and the checks of what arrived: every value is compared through bytes computed here,
independently of the code under test (refit_app's own ``host_bytes`` could be wrong the same way on both sides)."""

from __future__ import annotations

import hashlib

import torch

IDENTITY = lambda item: item[1]  # noqa: E731
"""The producer's ``post_iter_func`` that sends each tensor as it is."""

ALIGN = 16
"""Where :func:`deliver` places each tensor in its buffer: a multiple of every dtype's item size, so that every
slice can be viewed as its dtype."""


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in row-major order (a strided view, a lazy conjugate, a GPU tensor alike)."""
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach().cpu())
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes()


def digest(tensors) -> list[tuple[str, tuple[int, ...], str, str]]:
    """``(name, shape, dtype, sha256 of the bytes)`` of each named tensor: what a rank returns instead of tensors,
    which would share memory with a process that is exiting."""
    return [(n, tuple(t.shape), str(t.dtype), hashlib.sha256(raw_bytes(t)).hexdigest()) for n, t in tensors]


def assert_exact(sent, received) -> None:
    """The same names in the same order, each with the same shape, dtype and bytes."""
    assert [n for n, _ in received] == [n for n, _ in sent]
    for (name, a), (_, b) in zip(sent, received):
        assert b.shape == a.shape and b.dtype == a.dtype, name
        assert raw_bytes(b) == raw_bytes(a), name


def awkward_tensors() -> list[tuple[str, torch.Tensor]]:
    """Every weight dtype plus the layouts that break naive packing."""
    g = torch.Generator().manual_seed(0)
    f = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return [
        ("kv_amax", torch.tensor(3.25, dtype=torch.bfloat16)),  # 0-dim, 2 bytes: later fp32 slices are unaligned
        ("w_fp32", f(7, 5)),
        ("w_bf16", f(9, 3).to(torch.bfloat16)),
        ("w_fp16", f(11).to(torch.float16)),
        ("w_fp64", f(3, 3).double()),
        ("w_int8", torch.randint(-128, 127, (13,), dtype=torch.int8, generator=g)),
        ("w_uint8", torch.randint(0, 255, (5,), dtype=torch.uint8, generator=g)),
        ("w_int32", torch.randint(-(2**31), 2**31 - 1, (6,), dtype=torch.int32, generator=g)),
        ("w_int64", torch.randint(-(2**62), 2**62, (4,), dtype=torch.int64, generator=g)),
        ("w_bool", torch.randint(0, 2, (9,), generator=g).bool()),
        ("w_e4m3", f(17).to(torch.float8_e4m3fn)),
        ("w_e5m2", f(19).to(torch.float8_e5m2)),
        ("w_c64", torch.randn(5, dtype=torch.complex64, generator=g)),
        ("scalar_fp32", torch.tensor(-1.5)),
        ("empty", torch.empty(0, 8)),
        ("transposed", f(6, 4).T),
        ("strided", f(20)[::3]),
        ("size1_view", torch.arange(6, dtype=torch.int64).view(3, 2)[:1, 1]),  # contiguous, last stride 2
        ("big", f(300)),  # 1200 bytes: larger than the targets used below
        ("tail_empty", torch.empty(0, dtype=torch.bfloat16)),
    ]


def metas(tensors):
    """The consumer's list for ``tensors``: ``(name, (shape, dtype))`` each."""
    return [(name, (list(t.shape), t.dtype)) for name, t in tensors]


def deliver(sink, items: list[tuple[str, torch.Tensor]], per_batch: int = 3, corrupt: str | None = None) -> None:
    """Hand ``items`` to ``sink.consume`` the way the core does: in batches of views into one receive buffer,
    overwritten (0xFF: NaN in every float dtype) after each batch. A sink that keeps a view past ``consume``
    instead of copying what it needs would read the scribble. ``corrupt``: the tensor whose first byte arrives
    flipped, as after a bad transfer."""
    batches = [items[start : start + per_batch] for start in range(0, len(items), per_batch)]
    need = max((sum(-(-len(raw_bytes(t)) // ALIGN) * ALIGN for _, t in batch) for batch in batches), default=0)
    buffer = torch.empty(need, dtype=torch.uint8)
    for batch in batches:
        views, offset = [], 0
        for name, t in batch:
            raw = raw_bytes(t)
            slot = buffer[offset : offset + len(raw)]
            if raw:
                slot.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            if name == corrupt:
                slot[0] ^= 0x01
            views.append((name, slot.view(t.dtype).reshape(t.shape)))
            offset += -(-len(raw) // ALIGN) * ALIGN
        sink.consume(views)
        buffer.fill_(0xFF)


def tensor_checksum(t: torch.Tensor, algorithm: str | None = None) -> int:
    """What a verifying consumer computes for ``t``: ``algorithm`` (default: the fastest installed) over the bytes
    that travel (refit_app's own ``host_bytes``, so strided, conjugated and device tensors go through its path)."""
    from refit_app.core.wire import host_bytes
    from refit_app.protocol.checksum import checksum_function, default_algorithm

    return checksum_function(algorithm or default_algorithm())(host_bytes(t))
