"""A model's bytes kept whole on each side, so that the next round can send only what changed.

An image is one host buffer holding every tensor's bytes back to back, in manifest order: exactly the dense wire
format, so a chunk of the plan is a slice of it. A producer that sends deltas keeps the image of what it sent
last (its snapshot); a consumer that applies deltas into no tensors of its own keeps the image of what it
received (its mirror). A dense round then makes no more copies than without one: the producer packs each
tensor into its image slice and broadcasts the slice (the copy it would make into a rotating buffer anyway), and
the consumer receives each chunk in place; but the image is not in cache, so such a round costs more than one
through rotating buffers (``delta="auto"`` sends those where deltas do not pay). Only ``num_buffers`` broadcasts
are in flight at a time, as with rotating buffers.

The cost is one host copy of the model on each side that keeps one (the producer's even when its tensors live on a
GPU: the comparison runs on the host).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from refit_app.core.chunks import Chunk
from refit_app.core.group import BroadcastGroup, Work
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import is_dense_host, memmove, tensor_bytes

_PAGE = 4096


class Image:
    """Every tensor of one manifest, back to back in one host buffer, with each tensor's byte range."""

    def __init__(self, metas: Sequence[TensorMeta]) -> None:
        self.metas = list(metas)
        sizes = [m.nbytes for m in self.metas]
        self.offsets = [0, *itertools.accumulate(sizes)]
        self.nbytes = self.offsets[-1]
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        self.bytes = self.buffer.numpy()
        """The same memory as a numpy array (the delta comparison's view)."""
        # Touch every page now, while the manifest is agreed, so that the first round pays no page faults: its time
        # is then one that later rounds can be compared with (``delta="auto"``).
        self.bytes[::_PAGE] = 0
        self.round = 0
        """The round whose bytes the image holds; 0: none (new, or a round failed half-way)."""

    def tensor_bytes(self, index: int) -> np.ndarray:
        """Tensor ``index``'s bytes, as a writable view."""
        return self.bytes[self.offsets[index] : self.offsets[index + 1]]

    def view(self, index: int) -> torch.Tensor:
        """Tensor ``index`` with its shape and dtype: a view of the image where its offset is aligned for its dtype,
        else a copy (a byte-sized tensor before it can leave the next one unaligned)."""
        meta = self.metas[index]
        start, stop = self.offsets[index], self.offsets[index + 1]
        if stop == start:
            return torch.empty(meta.shape, dtype=meta.dtype)
        raw = self.buffer[start:stop]
        if start % meta.dtype.itemsize:
            raw = raw.clone()
        return raw.view(meta.dtype).view(meta.shape)

    def chunk(self, chunk: Chunk) -> torch.Tensor:
        """The bytes of one chunk of the plan."""
        return self.buffer[self.offsets[chunk.first] : self.offsets[chunk.stop]]


def write_tensor(image: Image, index: int, t: torch.Tensor) -> None:
    """Copy ``t``'s bytes into its image slice (from any device)."""
    start, stop = image.offsets[index], image.offsets[index + 1]
    if stop == start:
        return
    if t.device.type == "cpu" and is_dense_host(t):
        memmove(image.buffer.data_ptr() + start, t.data_ptr(), stop - start)
    else:
        image.buffer[start:stop].copy_(tensor_bytes(t).cpu())


def send_image(
    image: Image,
    tensors: Iterable[torch.Tensor],
    chunks: Iterable[Chunk],
    group: BroadcastGroup,
    src: int,
    *,
    num_buffers: int,
    device: torch.device,
    on_tensor: Callable[[int, torch.Tensor], None] | None = None,
    on_chunk_sent: Callable[[Chunk], None] | None = None,
) -> None:
    """A dense round from an image: each tensor is packed into its slice (``on_tensor(index, t)`` first, with the
    slice still holding the last round's bytes), and each chunk of the plan broadcast from the image once packed,
    at most ``num_buffers`` at a time. ``on_chunk_sent(chunk)`` runs once a chunk's broadcast has started. Returns
    when every broadcast has finished; the tensors must come in manifest order."""
    it = iter(tensors)
    flight = _Flight(num_buffers)
    try:
        for chunk in chunks:
            for index in range(chunk.first, chunk.stop):
                t = next(it)
                if on_tensor is not None:
                    on_tensor(index, t)
                write_tensor(image, index, t)
            if chunk.broadcast:
                data = image.chunk(chunk)
                if device.type != "cpu":
                    data = data.to(device)
                flight.add(_start(group, data, src), data)
            if on_chunk_sent is not None:
                on_chunk_sent(chunk)
    except BaseException:
        flight.abort()
        raise
    flight.drain()


def receive_image(
    image: Image,
    chunks: Iterable[Chunk],
    group: BroadcastGroup,
    src: int,
    *,
    num_buffers: int,
    device: torch.device,
) -> Iterator[Chunk]:
    """A dense round into an image: every chunk is received in place (a host image on a host group), up to
    ``num_buffers`` at a time; yields each chunk once it has arrived, in order."""
    flight = _Flight(num_buffers)
    staged: deque[tuple[Chunk, torch.Tensor | None]] = deque()

    def landed() -> Chunk:
        chunk, data = staged.popleft()
        if data is not None and data.device.type != "cpu":
            image.chunk(chunk).copy_(data.cpu())
        return chunk

    try:
        for chunk in chunks:
            data = None
            if chunk.broadcast:
                data = image.chunk(chunk)
                if device.type != "cpu":
                    data = torch.empty(data.numel(), dtype=torch.uint8, device=device)
                if flight.full():
                    flight.pop()
                    yield landed()
                flight.add(_start(group, data, src), data)
            staged.append((chunk, data))
            if data is None and len(flight) == 0:
                yield landed()
        while len(flight):
            flight.pop()
            yield landed()
        while staged:
            yield landed()
    except BaseException:
        flight.abort()
        raise


class _Flight:
    """Broadcasts in flight, oldest first, at most ``limit``; each keeps its tensor alive until it has finished."""

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._works: deque[tuple[Work, torch.Tensor]] = deque()

    def __len__(self) -> int:
        return len(self._works)

    def full(self) -> bool:
        return len(self._works) >= self._limit

    def add(self, work: Work, data: torch.Tensor) -> None:
        if self.full():
            self.pop()
        self._works.append((work, data))

    def pop(self) -> None:
        work, _ = self._works.popleft()
        work.wait()

    def drain(self) -> None:
        error: BaseException | None = None
        while self._works:
            try:
                self.pop()
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error

    def abort(self) -> None:
        try:
            self.drain()
        except BaseException:
            pass


def _start(group: BroadcastGroup, data: torch.Tensor, src: int) -> Work:
    start = getattr(group, "broadcast_async", None)
    if start is not None:
        return start(data, src)
    group.broadcast(data, src)
    return _Done()


class _Done:
    def wait(self) -> None:
        return None
