"""What the producer tells every consumer before any tensor moves: the tensors and the wire settings."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field

from refit_app.common.errors import HandshakeError, some_of
from refit_app.core.meta import TensorMeta, dtype_to_str
from refit_app.protocol.checksum import default_algorithm

MANIFEST_VERSION = 3
"""2: companion ``files`` (a model's config.json) travel with the tensors. 3: ``checksum_algorithm`` names the
per-tensor checksum; binary companion files (a ``tokenizer.model``) travel base64-encoded; ``rounds`` (optional:
a version 3 manifest without it is an open-ended session's)."""


@dataclass
class Manifest:
    """Everything a consumer needs to receive, unpack, verify and save a refit."""

    tensors: list[TensorMeta]
    buffer_size_bytes: int
    use_legacy_packing: bool
    checksums: bool = False
    """Whether the producer sends per-tensor checksums after the data (for ``sink=verify``)."""
    checksum_algorithm: str = field(default_factory=default_algorithm)
    """How those checksums are computed (:mod:`refit_app.protocol.checksum`); a verifying consumer must compute the
    same."""
    metadata: dict[str, str] = field(default_factory=dict)
    """Checkpoint-level metadata (safetensors ``__metadata__``) carried to a saving consumer."""
    source: str = ""
    """Human-readable description of where the weights came from."""
    rounds: int | None = None
    """How many rounds the producer's session sends; None: open-ended (a library loop that closes when it is done)."""
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
            "rounds": self.rounds,
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
            raise HandshakeError(
                f"the producer's manifest is not valid JSON ({e}); is the peer a refit_app producer?"
            ) from e
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
            rounds=None if doc.get("rounds") is None else int(doc["rounds"]),
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
            changes.append(f"{len(items)} {label} ({some_of(items)})")
    if not changes:
        changes.append("the same tensors in another order")
    return changes
