"""In-process stand-ins for a broadcast group, for tests about ordering and bytes (no communication)."""

from __future__ import annotations

import torch


class RecordingGroup:
    """A producer-side group that records a copy of every broadcast, in order."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.sent: list[torch.Tensor] = []
        self.data_ptrs: list[int] = []
        self.events: list[tuple[str, int]] = []

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        assert tensor.dtype == torch.uint8 and tensor.dim() == 1
        self.sent.append(tensor.clone())
        self.data_ptrs.append(tensor.data_ptr())
        self.events.append(("broadcast", tensor.numel()))

    @property
    def sizes(self) -> list[int]:
        return [t.numel() for t in self.sent]


class ReplayGroup:
    """A consumer-side group that fills each receive buffer with the next recorded chunk."""

    def __init__(self, chunks: list[torch.Tensor], device: str = "cpu") -> None:
        self.device = torch.device(device)
        self._chunks = list(chunks)
        self.received = 0

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        chunk = self._chunks[self.received]
        assert tensor.numel() == chunk.numel(), f"receive of {tensor.numel()} bytes, chunk has {chunk.numel()}"
        tensor.copy_(chunk)
        self.received += 1


class _DoneWork:
    def __init__(self, log: list[tuple[str, int]], index: int) -> None:
        self._log = log
        self._index = index

    def wait(self) -> None:
        self._log.append(("wait", self._index))


class AsyncRecordingGroup(RecordingGroup):
    """Like RecordingGroup, with ``broadcast_async``, logging when each broadcast is started and waited for."""

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> _DoneWork:
        self.broadcast(tensor, src)
        return _DoneWork(self.events, len(self.sent) - 1)
