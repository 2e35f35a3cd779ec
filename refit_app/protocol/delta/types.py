"""What both sides of a delta round share (:mod:`refit_app.protocol.delta` describes the whole scheme): the round's
figures (:class:`DeltaStats`), the stream's chunk size (:func:`delta_chunk_bytes`), one tensor's changes as a consumer
that applies them itself gets them (:class:`TensorDelta`), and changes written into a tensor
(:func:`apply_positions`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from refit_app.core.wire import tensor_bytes


@dataclass
class DeltaStats:
    """What a round's delta work measured (both sides fill what they see)."""

    wire_bytes: int = 0
    changed_elements: int = 0
    total_elements: int = 0
    changed_tensors: int = 0
    encodings: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    """Producer: comparing and encoding. Consumer: decoding and applying."""

    @property
    def changed_fraction(self) -> float | None:
        return self.changed_elements / self.total_elements if self.total_elements else None


DELTA_CHUNK_BYTES = 2 << 20
"""A delta round's stream goes out in chunks of at most this (or the buffer size, if smaller): a 1% round of a 1 GB
model is ~18 MB, which in 16 MiB chunks would reach the consumer only once the producer had compared nearly every
tensor; in 2 MiB chunks the consumer applies and hashes while the producer is still comparing."""


def delta_chunk_bytes(buffer_size_bytes: int) -> int:
    """The stream chunk of a delta round, the same on both sides: the consumer refuses a chunk header over it."""
    return min(buffer_size_bytes, DELTA_CHUNK_BYTES)


@dataclass
class TensorDelta:
    """One tensor's changes in a delta round, for a consumer that applies them itself (an engine's loader).

    ``positions`` (int64, flat element indices, strictly increasing) is None where the tensor came whole
    (``values`` is then the tensor, flat); else ``values`` holds the new elements at those positions, in order.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    positions: torch.Tensor | None
    values: torch.Tensor
    mirror: Mapping[str, torch.Tensor] | None = None
    """Where the session keeps a copy of the model (``mirror=True``): every tensor of it by name, as the round
    leaves it (this change already applied; the round's later changes once its data is in). For an engine that
    takes some changes in place and must reload others whole, with their unchanged neighbours. Read it, never
    write it: a write makes this consumer ask for a dense round."""

    def apply_to(self, t: torch.Tensor) -> None:
        """Write the changes into ``t`` (this tensor's previous round, on any device), bit for bit."""
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise ValueError(
                f"{self.name}: changes for {list(self.shape)} {self.dtype} cannot apply to {list(t.shape)} {t.dtype}"
            )
        if self.positions is None:
            tensor_bytes(t).copy_(tensor_bytes(self.values.to(t.device)))
            return
        apply_positions(t, self.positions.to(t.device), self.values.to(t.device))


def apply_positions(t: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """``t.flatten()[positions] = values`` on the raw bits (integer views: NaN payloads and -0.0 stay exact)."""
    if not t.is_contiguous():
        raise ValueError("changes apply to contiguous tensors only")
    itemsize = t.element_size()
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(itemsize)
    if int_type is not None:
        flat = t.view(-1).view(int_type) if t.dtype != int_type else t.view(-1)
        flat[positions] = values.reshape(-1).view(int_type)
    else:
        rows = t.view(-1).view(torch.uint8).view(-1, itemsize)
        rows[positions] = values.reshape(-1).view(torch.uint8).view(-1, itemsize)
