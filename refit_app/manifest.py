"""What the producer tells every consumer before any tensor moves: the tensors and the wire settings."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field

import torch

from refit_app.checksum import default_algorithm
from refit_app.errors import HandshakeError

MANIFEST_VERSION = 3
"""2: companion ``files`` (a model's config.json) travel with the tensors. 3: ``checksum_algorithm`` names the
per-tensor checksum; binary companion files (a ``tokenizer.model``) travel base64-encoded."""
MAX_LISTED_CHANGES = 5


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_str(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise HandshakeError(f"unknown dtype {name!r} in the producer's manifest")
    return dtype


def dtype_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorMeta:
    """One tensor as it travels: its name, shape, dtype and the shard file it belongs to when saved."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard: str | None = None
    """Source file name (``model-00001-of-00002.safetensors``) so a saving consumer keeps the layout."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": dtype_to_str(self.dtype), "shard": self.shard}

    @classmethod
    def from_json(cls, d: dict) -> TensorMeta:
        return cls(d["name"], tuple(int(x) for x in d["shape"]), dtype_from_str(d["dtype"]), d.get("shard"))


@dataclass
class Manifest:
    """Everything a consumer needs to receive, unpack, verify and save a refit."""

    tensors: list[TensorMeta]
    buffer_size_bytes: int
    use_legacy_packing: bool
    checksums: bool = False
    """Whether the producer sends per-tensor checksums after the data (for ``sink=verify``)."""
    checksum_algorithm: str = field(default_factory=default_algorithm)
    """How those checksums are computed (:mod:`refit_app.checksum`); a verifying consumer must compute the same."""
    metadata: dict[str, str] = field(default_factory=dict)
    """Checkpoint-level metadata (safetensors ``__metadata__``) carried to a saving consumer."""
    source: str = ""
    """Human-readable description of where the weights came from."""
    files: dict[str, str | bytes] = field(default_factory=dict)
    """Small files that belong with the weights (a model's ``config.json``, its tokenizer), by file name: text as
    ``str``, anything else as ``bytes``."""

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_bytes(self) -> bytes:
        doc = {
            "version": MANIFEST_VERSION,
            "tensors": [t.to_json() for t in self.tensors],
            "buffer_size_bytes": self.buffer_size_bytes,
            "use_legacy_packing": self.use_legacy_packing,
            "checksums": self.checksums,
            "checksum_algorithm": self.checksum_algorithm,
            "metadata": self.metadata,
            "source": self.source,
            # JSON carries text only: binary files go base64-encoded, under their own key.
            "files": {name: data for name, data in self.files.items() if isinstance(data, str)},
            "binary_files": {
                name: base64.b64encode(data).decode("ascii")
                for name, data in self.files.items()
                if isinstance(data, bytes)
            },
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            doc = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HandshakeError(f"the producer's manifest is not valid JSON ({e}); is the peer a refit_app producer?") from e
        if doc.get("version") != MANIFEST_VERSION:
            raise HandshakeError(
                f"manifest version {doc.get('version')!r} from the producer, this consumer speaks {MANIFEST_VERSION}; "
                "run the same refit_app version on every rank"
            )
        return cls(
            tensors=[TensorMeta.from_json(t) for t in doc["tensors"]],
            buffer_size_bytes=int(doc["buffer_size_bytes"]),
            use_legacy_packing=bool(doc["use_legacy_packing"]),
            checksums=bool(doc["checksums"]),
            checksum_algorithm=str(doc["checksum_algorithm"]),
            metadata=dict(doc.get("metadata", {})),
            source=str(doc.get("source", "")),
            files={
                **{str(k): str(v) for k, v in doc.get("files", {}).items()},
                **{str(k): base64.b64decode(v) for k, v in doc.get("binary_files", {}).items()},
            },
        )


def tensor_list_changes(old: list[TensorMeta], new: list[TensorMeta]) -> list[str]:
    """How ``new`` differs from ``old`` (names, order, shapes, dtypes), as short phrases; empty when equal."""
    if old == new:
        return []
    before = {m.name: m for m in old}
    after = {m.name: m for m in new}
    changes = []
    added = [n for n in after if n not in before]
    removed = [n for n in before if n not in after]
    reshaped = [
        f"{n} {list(before[n].shape)} {dtype_to_str(before[n].dtype)} -> {list(m.shape)} {dtype_to_str(m.dtype)}"
        for n, m in after.items()
        if n in before and (before[n].shape, before[n].dtype) != (m.shape, m.dtype)
    ]
    for label, items in (("added", added), ("removed", removed), ("changed", reshaped)):
        if items:
            shown = ", ".join(items[:MAX_LISTED_CHANGES])
            more = f" and {len(items) - MAX_LISTED_CHANGES} more" if len(items) > MAX_LISTED_CHANGES else ""
            changes.append(f"{len(items)} {label} ({shown}{more})")
    if not changes:
        changes.append("the same tensors in another order")
    return changes
