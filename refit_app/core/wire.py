"""The wire format: how tensors lie in a packed buffer, and how they are copied in and viewed back out.

A chunk is the raw bytes of its tensors one after another (row-major, no padding, no header), exactly as vLLM's
``pack_tensors`` lays them out. Nothing but the data travels; each side knows the tensors' names, shapes and dtypes
(and so every offset) from the metadata it was given. Pure and device-agnostic: everything here works on CPU
tensors and on any device's.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Iterable

import torch

from refit_app.core.chunks import Chunk
from refit_app.core.meta import TensorMeta

memmove = ctypes.memmove
"""libc's memmove; ctypes releases the GIL around it, so gloo's threads and the caller's keep running."""
_memmove = memmove


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes ``t`` takes on the wire."""
    return t.numel() * t.element_size()


def meta_nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    """Bytes a tensor of this shape and dtype takes on the wire."""
    return math.prod(map(int, shape)) * dtype.itemsize


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in row-major order as a 1-D uint8 tensor on its device.

    A view of ``t``'s memory when it can be (writing to it writes to ``t``); a copy only when ``t`` is not
    contiguous, or is a lazily conjugated or negated view, whose stored bytes differ from its values.
    ``view(torch.uint8)`` needs a last stride of 1, which a contiguous tensor can lack when a dimension has size 1
    (``torch.zeros(3, 2)[:1, 1]``); re-striding the dense storage as 1-D avoids that failure.
    """
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def host_bytes(t: torch.Tensor) -> memoryview:
    """:func:`tensor_bytes` on the host, as a buffer the hashes and ``os.pwrite`` accept.

    Copies only when it must: to CPU for device tensors, and where ``tensor_bytes`` copies.
    """
    return memoryview(tensor_bytes(t.cpu()).numpy())


def pack_into(buffer: torch.Tensor, offset: int, t: torch.Tensor) -> int:
    """Copy ``t``'s bytes into ``buffer[offset:]``; returns the offset after it."""
    n = tensor_nbytes(t)
    if n == 0:
        return offset
    if is_plain_host_copy(buffer, t):
        if offset < 0 or offset + n > buffer.numel():
            raise ValueError(f"{n} bytes at offset {offset} do not fit a buffer of {buffer.numel()} bytes")
        # torch's copy_ splits a copy of more than 32K elements across its intra-op threads and waits for all of
        # them. A CPU refit keeps the cores busy with the broadcast's own send and receive threads, so that
        # barrier stalls the packing whenever one of its threads is descheduled: measured on the 2-core machine,
        # 40-90 KB adapter matrices took 54-75 us each that way, 4.4 us with one memcpy on the calling thread
        # (8-9 GB/s for large tensors too), which also needs no view objects and no alignment.
        _memmove(buffer.data_ptr() + offset, t.data_ptr(), n)
        return offset + n
    dst = buffer[offset : offset + n]
    if offset % t.element_size() == 0:
        # Aligned: copy straight from a strided source, no temporary.
        dst.view(t.dtype).view(t.shape).copy_(t)
    else:
        dst.copy_(tensor_bytes(t))
    return offset + n


def pack_all(buffer: torch.Tensor, spans: Iterable[tuple[int, int]], tensors: Iterable[torch.Tensor]) -> None:
    """Copy each tensor into ``buffer`` at its ``(offset, nbytes)`` span: one chunk of a recorded plan, whose spans
    were checked against the buffer's size when the plan was made. On the host, a dense tensor is one memmove by
    address (no view, no size check: the plan's metadata check has vouched for its shape and dtype)."""
    if buffer.device.type != "cpu" or not buffer.is_contiguous() or buffer.dtype != torch.uint8:
        for (offset, _), t in zip(spans, tensors):
            pack_into(buffer, offset, t)
        return
    base = buffer.data_ptr()
    for (offset, n), t in zip(spans, tensors):
        if not n:
            continue
        if is_dense_host(t):
            _memmove(base + offset, t.data_ptr(), n)
        else:
            pack_into(buffer, offset, t)


def is_dense_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s values are its bytes as they lie in host memory, in order: on the host, dense, contiguous,
    with no lazy conjugation or negation (those bits change the values without changing the stored bytes). Such a
    tensor can be copied by address with one memmove of ``t.nbytes``."""
    return t.is_cpu and t.layout is torch.strided and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def is_plain_host_copy(buffer: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be copied into the byte ``buffer`` as they lie in memory, by address: both on the
    host, both dense, ``t`` with no lazy conjugation or negation (those bits change the values without changing
    the stored bytes)."""
    return (
        buffer.device.type == "cpu"
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and buffer.is_contiguous()
        and buffer.dtype == torch.uint8
        and not t.is_conj()
        and not t.is_neg()
    )


def unpack_from(buffer: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor stored at ``buffer[offset:]``: a view when aligned for ``dtype``, otherwise an aligned copy.

    A slice that starts mid-element (a bf16 scalar before fp32 weights leaves every later offset odd) cannot be
    viewed as the wider dtype, so it is cloned into fresh, aligned storage; that copy is independent of the buffer.
    """
    n = meta_nbytes(shape, dtype)
    data = buffer[offset : offset + n]
    itemsize = dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=buffer.device)
    if offset % itemsize:
        data = data.clone()
    return data.view(dtype).view(shape)


def pack_tensors(tensors: Iterable[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """Pack tensors into one new byte buffer (the layout of a chunk). For tests and tools, not the hot path."""
    tensors = list(tensors)
    out = torch.empty(sum(tensor_nbytes(t) for t in tensors), dtype=torch.uint8, device=device)
    offset = 0
    for t in tensors:
        offset = pack_into(out, offset, t)
    return out


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    # Cached: a model has few distinct shapes (an adapter's 25,000 matrices have a handful), and this runs once per
    # tensor in every one-shot consumer call.
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


class ChunkLayout:
    """Where one chunk's tensors lie in its buffer, computed once: aligned ones become ``as_strided`` views.

    ``specs`` holds ``(shape, strides, dtype, byte offset, nbytes)`` per tensor; ``aligned`` the positions that can
    be typed views (aligned and non-empty), ``unaligned`` the rest, which are handled one by one; ``spans`` each
    tensor's ``(byte offset, nbytes)``.
    """

    __slots__ = ("aligned", "chunk", "names", "spans", "specs", "unaligned")

    def __init__(self, chunk: Chunk, metas: list[TensorMeta], sizes: list[int] | None = None) -> None:
        """``sizes``: each tensor's byte size, when the caller has computed them already (the planner needs them)."""
        self.chunk = chunk
        self.names = [m.name for m in metas]
        self.specs = []
        offset = 0
        if sizes is None:
            sizes = [meta_nbytes(m.shape, m.dtype) for m in metas]
        for (_, shape, dtype, _), n in zip(metas, sizes):
            self.specs.append((shape, _contiguous_strides(shape), dtype, offset, n))
            offset += n
        self.aligned = [i for i, (_, _, dtype, off, n) in enumerate(self.specs) if n and off % dtype.itemsize == 0]
        aligned = set(self.aligned)
        self.unaligned = [i for i in range(len(self.specs)) if i not in aligned]
        self.spans = [(off, n) for _, _, _, off, n in self.specs]

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor | None]:
        """Every tensor of the chunk as a view of ``buffer`` (None where not aligned or empty)."""
        out: list[torch.Tensor | None] = [None] * len(self.specs)
        typed: dict[torch.dtype, torch.Tensor] = {}
        usable = buffer.numel()
        for i in self.aligned:
            shape, strides, dtype, off, _ = self.specs[i]
            base = typed.get(dtype)
            if base is None:
                # buffer starts aligned (a fresh allocation), so one typed view serves every aligned tensor.
                base = typed[dtype] = buffer[: usable - usable % dtype.itemsize].view(dtype)
            out[i] = base.as_strided(shape, strides, off // dtype.itemsize)
        return out

    def unpack(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The chunk's ``(name, tensor)`` list from its received bytes: views where aligned, copies elsewhere."""
        views = self.views(buffer)
        for i in self.unaligned:
            shape, _, dtype, off, _ = self.specs[i]
            views[i] = unpack_from(buffer, off, shape, dtype)
        return list(zip(self.names, views))
