"""What a consumer knows of a tensor before its bytes arrive: :class:`TensorMeta`, and dtypes by name.

One type on both sides and in every layer: the core plans chunks and lays out views from it, the manifest sends
it as JSON, sources state their tensors with it and a saving sink keeps each tensor's shard.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from refit_app.common.errors import HandshakeError


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_str(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; :class:`HandshakeError` for a name torch does not know."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise HandshakeError(f"unknown dtype {name!r} in the producer's manifest")
    return dtype


def dtype_itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return dtype.itemsize


class TensorMeta(NamedTuple):
    """One tensor as it travels: its name, shape and dtype, and the shard file it belongs to when saved.

    A tuple, so that the per-tensor paths of the core build and compare millions of them cheaply.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard: str | None = None
    """Source file name (``model-00001-of-00002.safetensors``), so that a saving consumer keeps the layout."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes on the wire."""
        return math.prod(self.shape) * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": dtype_to_str(self.dtype), "shard": self.shard}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorMeta:
        return cls(d["name"], tuple(int(x) for x in d["shape"]), dtype_from_str(d["dtype"]), d.get("shard"))
