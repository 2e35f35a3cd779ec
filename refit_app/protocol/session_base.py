"""What both ends of a session share: the group, the manifest in force and its chunk plan, and the small
exchanges at its start and before each round (:mod:`refit_app.protocol.session` describes the whole protocol)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch

from refit_app.core.chunks import Chunk
from refit_app.packed_tensor import (
    PackedPlan,
)
from refit_app.protocol.manifest import Manifest
from refit_app.protocol.rounds import (
    plan_manifest,
)
from refit_app.transport.groups import RefitGroup
from refit_app.transport.spec import PRODUCER_RANK

Batch = list[tuple[str, Any]]


class Session:
    def __init__(self, group: RefitGroup) -> None:
        self.group = group
        self.device = group.group.device
        self.rounds = 0
        """Rounds completed so far."""
        self.manifest: Manifest | None = None
        """The manifest in force (the last one sent or accepted)."""
        self.closed = False
        self._plan = PackedPlan()
        """The chunk plan of the manifest in force: the first round records it, later rounds follow it (one fused
        copy per chunk on the producer, precomputed views on the consumer)."""
        self._chunks: list[Chunk] = []
        """The manifest's chunks (planned once per manifest, not per round)."""
        self._delta_on = False
        """Whether the producer may send delta rounds (it says so when the session starts)."""

    @property
    def num_chunks(self) -> int:
        """Chunks of the manifest in force."""
        return len(self._chunks)

    @property
    def _broadcasts(self) -> int:
        return sum(c.broadcast for c in self._chunks)

    def _new_plan(self) -> None:
        """A fresh manifest is in force: plan it anew."""
        self._plan.release()
        self._plan = PackedPlan()
        assert self.manifest is not None
        self._chunks = plan_manifest(self.manifest)

    def _broadcast_header(self, header: torch.Tensor) -> None:
        self.group.group.broadcast(header, PRODUCER_RANK)

    def _exchange_needs(self, delta: bool, verify: bool, probe_tokens: int) -> tuple[bool, bool, int]:
        """The producer says whether it may send deltas; then each consumer in turn tells every rank whether it
        verifies and how long a probe it wants. Returns (deltas on, any consumer verifies, the longest probe asked
        for). Tiny broadcasts over the data group, so it works with every backend."""
        mode = torch.tensor([int(delta)], dtype=torch.int64, device=self.device)
        self.group.group.broadcast(mode, PRODUCER_RANK)
        any_verify, longest_probe = False, 0
        for rank in range(1, self.group.world_size):
            mine = self.group.rank == rank
            need = torch.tensor(
                [int(verify and mine), probe_tokens if mine else 0], dtype=torch.int64, device=self.device
            )
            self.group.group.broadcast(need, rank)
            any_verify |= bool(need[0].item())
            longest_probe = max(longest_probe, int(need[1].item()))
        return bool(mode.item()), any_verify, longest_probe

    def _exchange_held(self, mine: int) -> list[int]:
        """With deltas on, before each round: every consumer's held round, in rank order."""
        held = []
        for rank in range(1, self.group.world_size):
            value = torch.tensor([mine if self.group.rank == rank else 0], dtype=torch.int64, device=self.device)
            self.group.group.broadcast(value, rank)
            held.append(int(value.item()))
        return held

    def _extra(self, data: bytes | None, length: int) -> bytes:
        """Broadcast ``data`` (producer) or receive ``length`` bytes of it (consumer)."""
        if length == 0:
            return b""
        if data is not None:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            payload = torch.empty(length, dtype=torch.uint8, device=self.device)
        self.group.group.broadcast(payload, PRODUCER_RANK)
        return data if data is not None else payload.cpu().numpy().tobytes()

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError
