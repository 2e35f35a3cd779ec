"""Where a consumer's received weights go: verified against the producer's checksums, saved, or dropped."""

from __future__ import annotations

import logging
import shutil
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from refit_app.checksum import tensor_checksum
from refit_app.errors import HandshakeError, SinkError, VerificationError
from refit_app.manifest import Manifest, TensorMeta
from refit_app.packed_tensor import (
    _flat_bytes as tensor_bytes,  # TODO(lead): public name
)
from refit_app.plugins import instantiate
from refit_app.safetensors_io import CheckpointWriter
from refit_app.sizes import format_size

logger = logging.getLogger(__name__)

MAX_NAMED_TENSORS = 5


class Sink(Protocol):
    def begin(self, manifest: Manifest) -> None:
        """Called after the handshake, before any tensor moves: everything that can fail early fails here."""
        ...

    def consume(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """Take received tensors. They are views into a receive buffer, valid only during this call."""
        ...

    def finish(self, checksums: list[int] | None) -> dict:
        """Complete the refit given the producer's per-tensor checksums (manifest order), if it sent them.

        Returns figures for the metrics; raises VerificationError or SinkError when the refit did not
        fully happen.
        """
        ...

    def abort(self) -> None:
        """Undo partial work (temporary files); safe to call at any time and more than once."""
        ...


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:MAX_NAMED_TENSORS])
    extra = len(names) - MAX_NAMED_TENSORS
    return shown + (f" and {extra} more" if extra > 0 else "")


class _Arrivals:
    """Which manifest tensors arrived, how often, and whether each matched its declared shape and dtype."""

    def __init__(self, tensors: list[TensorMeta]):
        self.index = {m.name: i for i, m in enumerate(tensors)}
        self.tensors = tensors
        self.counts: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.mismatched: list[str] = []

    def record(self, name: str, t: torch.Tensor) -> int | None:
        """The tensor's manifest position, or None when it is not in the manifest."""
        i = self.index.get(name)
        if i is None:
            self.unexpected.append(name)
            return None
        self.counts[name] += 1
        meta = self.tensors[i]
        if tuple(t.shape) != meta.shape or t.dtype != meta.dtype:
            self.mismatched.append(f"{name} ({t.dtype} {list(t.shape)}, expected {meta.dtype} {list(meta.shape)})")
        return i

    def problems(self) -> list[str]:
        problems = []
        missing = [m.name for m in self.tensors if self.counts[m.name] == 0]
        repeated = [n for n, c in self.counts.items() if c > 1]
        if missing:
            problems.append(f"{len(missing)} tensor(s) never arrived: {_names(missing)}")
        if repeated:
            problems.append(f"{len(repeated)} tensor(s) arrived more than once: {_names(repeated)}")
        if self.unexpected:
            problems.append(f"{len(self.unexpected)} tensor(s) not in the manifest: {_names(self.unexpected)}")
        if self.mismatched:
            problems.append(
                f"{len(self.mismatched)} tensor(s) with the wrong shape or dtype: {_names(self.mismatched)}"
            )
        return problems


class VerifySink:
    """Checks every received tensor bit for bit against the producer's CRC32s, keeping nothing.

    Each tensor is checksummed as it arrives (the views die after ``consume``), so verification needs
    no second pass and no copy of the model.
    """

    def __init__(self) -> None:
        self._arrivals: _Arrivals | None = None
        self._received: list[int | None] = []

    def begin(self, manifest: Manifest) -> None:
        if not manifest.checksums:
            raise HandshakeError(
                "sink=verify needs per-tensor checksums but the producer's manifest says it sends none; "
                "run a producer of the same refit_app version"
            )
        self._arrivals = _Arrivals(manifest.tensors)
        self._received = [None] * len(manifest.tensors)

    def consume(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        if self._arrivals is None:
            raise RuntimeError("VerifySink.consume() before begin()")
        for name, t in batch:
            i = self._arrivals.record(name, t)
            if i is not None:
                self._received[i] = tensor_checksum(t)

    def finish(self, checksums: list[int] | None) -> dict:
        if self._arrivals is None:
            raise RuntimeError("VerifySink.finish() before begin()")
        tensors = self._arrivals.tensors
        if checksums is None:
            raise VerificationError("cannot verify: the producer sent no checksums")
        if len(checksums) != len(tensors):
            raise VerificationError(
                f"cannot verify: the producer sent {len(checksums)} checksums for a manifest of {len(tensors)} tensors"
            )
        problems = self._arrivals.problems()
        differ = [
            m.name for m, got, want in zip(tensors, self._received, checksums) if got is not None and got != want
        ]
        if differ:
            problems.insert(
                0, f"{len(differ)} of {len(tensors)} tensor(s) differ from what the producer sent: {_names(differ)}"
            )
        if problems:
            raise VerificationError("verification failed: " + "; ".join(problems))
        logger.info("verified %d tensors bit for bit", len(tensors))
        return {"verified": True, "verified_tensors": len(tensors)}

    def abort(self) -> None:
        """Nothing to undo: verification keeps no state outside memory."""


class SaveSink:
    """Saves the received weights as a Hugging Face checkpoint directory at ``path``.

    Written through hidden temporary files renamed into place only when every tensor is on disk, so a
    killed or failed run leaves no file under a final name and an existing checkpoint there intact.
    """

    def __init__(self, path: str):
        self.path = Path(path)
        self._writer: CheckpointWriter | None = None

    def begin(self, manifest: Manifest) -> None:
        writer = CheckpointWriter(self.path, manifest.tensors, manifest.metadata)
        if self.path.exists() and not self.path.is_dir():
            raise SinkError(f"sink.path {self.path} is a file; give a directory to save the checkpoint in")
        # Creates the directory and the temporary files: an unwritable path fails now, before any transfer.
        writer.open()
        self._writer = writer
        free = shutil.disk_usage(self.path).free
        if free < writer.total_bytes:
            self.abort()
            raise SinkError(
                f"sink.path {self.path} has {format_size(free)} free, the checkpoint needs "
                f"{format_size(writer.total_bytes)}; free space or choose another sink.path"
            )

    def consume(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        if self._writer is None:
            raise RuntimeError("SaveSink.consume() before begin()")
        for name, t in batch:
            self._writer.write(name, t)

    def finish(self, checksums: list[int] | None) -> dict:
        if self._writer is None:
            raise RuntimeError("SaveSink.finish() before begin()")
        files = self._writer.commit()
        self._writer = None
        return {"verified": None, "saved_to": str(self.path), "saved_files": [p.name for p in files]}

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


class DiscardSink:
    """Keeps nothing: measures the transfer alone."""

    def begin(self, manifest: Manifest) -> None:
        """Nothing can fail early: there is nowhere to write."""

    def consume(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """Drop the batch; the views die with the call."""

    def finish(self, checksums: list[int] | None) -> dict:
        return {"verified": None}

    def abort(self) -> None:
        """Nothing to undo."""


class CorruptingSink:
    """Test-only fault hook (``refit.debug.corrupt_chunk``): flips one received byte of chunk ``chunk`` before
    ``inner`` sees it, to prove that verification catches corruption."""

    def __init__(self, inner: Sink, chunk: int) -> None:
        self._inner = inner
        self._chunk = chunk
        self._seen = 0

    def begin(self, manifest: Manifest) -> None:
        self._seen = 0
        self._inner.begin(manifest)

    def consume(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        if self._seen == self._chunk:
            name, t = next(((n, t) for n, t in batch if t.numel()), (None, None))
            if t is not None:
                logger.warning("refit.debug.corrupt_chunk=%d: flipping one byte of %s", self._chunk, name)
                tensor_bytes(t)[0] ^= 0x01
        self._seen += 1
        self._inner.consume(batch)

    def finish(self, checksums: list[int] | None) -> dict:
        return self._inner.finish(checksums)

    def abort(self) -> None:
        self._inner.abort()


def make_sink(target: str, params: Mapping[str, Any], *, corrupt_chunk: int | None = None) -> Sink:
    """The sink that ``target`` (a ``module.Class`` path, as a config's ``_target_``) names, built with
    ``params``; the config has checked the built-in sinks' parameters already."""
    sink = instantiate(target, params)
    return sink if corrupt_chunk is None else CorruptingSink(sink, corrupt_chunk)
