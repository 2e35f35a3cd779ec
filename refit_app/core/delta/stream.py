"""A byte stream over a group: bytes written in order reach every consumer in chunks, through rotating buffers.

A delta round's size is known only once its last tensor is compared, so its chunks cannot follow a plan made
from the manifest the way a dense round's do. Instead each chunk travels as two broadcasts: a header of two
int64 (the chunk's length, and 1 if it is the stream's last) and then the bytes. The producer fills one of
``num_buffers`` buffers while the ones before it are on the wire, exactly as the packed broadcast does, so
comparing the next tensors overlaps sending the last ones' changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from refit_app.core.group import BroadcastGroup, Work

logger = logging.getLogger(__name__)

HEADER_WORDS = 2
HEADER_BYTES = 8 * HEADER_WORDS
"""What each chunk costs on the wire besides its bytes."""


class _Out:
    """One send buffer and the broadcasts still reading it (the header's and the bytes')."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.works: list[Work] = []
        self.keep: list[torch.Tensor] = []

    def wait(self) -> None:
        works, self.works = self.works, []
        try:
            for work in works:
                work.wait()
        finally:
            self.keep = []


class Buffers:
    """Host byte buffers an end of a stream keeps from one round to the next: fresh memory is faulted in page by
    page, which on a VM costs more than a small round's whole transfer (see :class:`~refit_app.core.buffers.
    HostBufferPool`); a stream's buffers are its own, never shared with a caller, so they need no checks."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        while len(self._buffers) <= index:
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._buffers[index].numel() < nbytes:
            self._buffers[index] = torch.empty(0, dtype=torch.uint8)  # the old one goes first
            self._buffers[index] = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffers[index]

    def clear(self) -> None:
        self._buffers = []


class ChunkStream:
    """The producer's end: :meth:`write` bytes in order, :meth:`close` to send the rest and end the stream.

    ``on_chunk(nbytes)`` is called as each chunk is handed to the group. :attr:`wire_bytes` counts every byte
    broadcast, headers included. ``buffers``: where its ``num_buffers`` send buffers come from (kept by the caller
    across rounds).
    """

    def __init__(
        self,
        group: BroadcastGroup,
        src: int,
        *,
        chunk_bytes: int,
        num_buffers: int,
        device: torch.device,
        buffers: Buffers,
        on_chunk: Callable[[int], None] | None = None,
    ) -> None:
        if chunk_bytes < 1 or num_buffers < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} and num_buffers={num_buffers} must be >= 1")
        self._group = group
        self._src = src
        self._chunk = chunk_bytes
        self._device = device
        self._on_chunk = on_chunk
        self._outs = [_Out(buffers.get(i, chunk_bytes)[:chunk_bytes]) for i in range(num_buffers)]
        self._current = 0
        self._fill = 0
        self._view = self._outs[0].buffer.numpy()
        self.wire_bytes = 0
        self.chunks = 0
        self._closed = False

    def write(self, data: Any) -> None:
        """Append ``data`` (bytes, a memoryview or a numpy array, read as bytes) to the stream."""
        src = data if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1 else _bytes_of(data)
        done, n = 0, src.size
        while done < n:
            take = min(n - done, self._chunk - self._fill)
            self._view[self._fill : self._fill + take] = src[done : done + take]
            self._fill += take
            done += take
            if self._fill == self._chunk:
                self._send(last=False)

    def pad(self, nbytes: int) -> None:
        """Append ``nbytes`` zero bytes."""
        if nbytes:
            self.write(np.zeros(nbytes, dtype=np.uint8))

    def close(self) -> None:
        """Send what is left as the last chunk and wait until every chunk has left this rank."""
        if self._closed:
            return
        self._closed = True
        self._send(last=True)
        self._drain()

    def abort(self) -> None:
        """Wait for what is in flight, ignoring its errors (the caller's exception is the one that matters)."""
        self._closed = True
        for out in self._outs:
            try:
                out.wait()
            except BaseException:
                logger.debug("a chunk in flight failed while unwinding", exc_info=True)

    def _send(self, *, last: bool) -> None:
        out, n = self._outs[self._current], self._fill
        header = torch.tensor([n, int(last)], dtype=torch.int64)
        data = out.buffer[:n]
        if self._device.type != "cpu":
            header, data = header.to(self._device), data.to(self._device)
        out.keep = [header, data]
        out.works = [_broadcast_async(self._group, header, self._src)]
        if n:
            out.works.append(_broadcast_async(self._group, data, self._src))
        self.wire_bytes += HEADER_BYTES + n
        self.chunks += 1
        if self._on_chunk is not None:
            self._on_chunk(n)
        self._current = (self._current + 1) % len(self._outs)
        nxt = self._outs[self._current]
        nxt.wait()  # its buffer is refilled next
        self._view = nxt.buffer.numpy()
        self._fill = 0

    def _drain(self) -> None:
        error: BaseException | None = None
        for out in self._outs:
            try:
                out.wait()
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error


def receive_stream(
    group: BroadcastGroup,
    src: int,
    *,
    device: torch.device,
    buffers: Buffers,
    max_chunk: int,
    on_chunk: Callable[[int], None] | None = None,
) -> Iterator[np.ndarray]:
    """The consumer's end: each chunk's bytes (a uint8 array, valid until the next one is asked for), in order,
    until the producer's last. ``on_chunk(nbytes)`` runs for every chunk header, the empty last one included.
    ``max_chunk``: the producer's ``chunk_bytes``, which both sides know from the manifest; a header that says more
    is refused before anything is allocated for it (a corrupt or buggy peer must not size this rank's memory).
    Every receive has the group's own deadline."""
    while True:
        header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=device)
        group.broadcast(header, src)
        n, last = (int(x) for x in header.cpu().tolist())
        if n < 0 or n > max_chunk or last not in (0, 1):
            raise ValueError(
                f"a stream chunk header says {n} bytes (at most {max_chunk}), last={last}: the peer is not in step"
            )
        if on_chunk is not None:
            on_chunk(n)
        if n:
            data = buffers.get(0, n)[:n] if device.type == "cpu" else torch.empty(n, dtype=torch.uint8, device=device)
            group.broadcast(data, src)
            yield data.cpu().numpy()
        if last:
            return


def _bytes_of(data: Any) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def _broadcast_async(group: BroadcastGroup, tensor: torch.Tensor, src: int) -> Any:
    start = getattr(group, "broadcast_async", None)
    if start is not None:
        return start(tensor, src)
    group.broadcast(tensor, src)
    return _Done()


class _Done:
    def wait(self) -> None:
        return None
