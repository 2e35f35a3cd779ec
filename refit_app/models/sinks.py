"""Where a consumer's received weights go: verified against the producer's checksums, saved, or dropped."""

from __future__ import annotations

import logging
import os
import shutil
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from refit_app.checkpoint.writer import CheckpointWriter
from refit_app.common.errors import SinkError
from refit_app.common.sizes import format_size
from refit_app.models.plugins import instantiate
from refit_app.packed_tensor import tensor_bytes
from refit_app.protocol.manifest import Manifest

logger = logging.getLogger(__name__)

MIRROR = "mirror"
"""``delta_storage``: the session keeps a copy of the model that delta rounds patch, and ``consume`` gets views of
it (every tensor, every round)."""
TARGETS = "targets"
"""``delta_storage``: the sink's own tensors, from ``targets()`` (called once the manifest is in), are written into
every round, dense or delta, and ``consume`` gets those tensors."""
DELTAS = "deltas"
"""``delta_storage``: ``consume`` gets ``(name, TensorDelta)`` items for the changed tensors of a delta round."""
MIRRORED_DELTAS = "mirrored_deltas"
"""``delta_storage``: both: the session keeps a copy of the model that delta rounds patch; ``consume`` gets views
of it in a dense round, and ``(name, TensorDelta)`` items for the changed tensors of a delta round, each carrying
the copy (``TensorDelta.mirror``). For an engine that applies some changes itself and reloads other tensors whole,
with their unchanged neighbours (``sink=vllm``)."""


class Sink(Protocol):
    """A consumer's destination for the weights, round after round (``sink=``, or your own class by ``_target_``).

    Optional attributes the application reads: ``verifies`` (True: check every round bit for bit against the
    producer's checksums), ``probe_tokens`` (> 0: after every round, compare the sink's model with the producer's
    through ``check(probe, probe_tokens) -> dict``) and ``delta_storage`` (:data:`MIRROR`, :data:`TARGETS`,
    :data:`DELTAS` or :data:`MIRRORED_DELTAS`: how the sink takes delta rounds; without it the consumer asks for
    dense rounds only).
    """

    def begin(self, manifest: Manifest) -> None:
        """A fresh manifest (the first round, or the tensor list changed), before any of its tensors move: whatever
        can fail early fails here, and every rank stops with it."""
        ...

    def consume(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """Take received tensors. They are views into receive buffers: copy or load what you keep."""
        ...

    def finish(self, checksums: list[int] | None) -> dict:
        """The round's data has arrived (with the producer's per-tensor checksums where it sent them). Returns figures
        for the round's metrics; raising fails the round on every rank."""
        ...

    def close(self) -> dict:
        """The session is over: publish what the last round left (a checkpoint). Returns figures for the metrics."""
        ...

    def abort(self) -> None:
        """Undo partial work (temporary files); safe to call at any time and more than once."""
        ...


class _KeepsNothing:
    """The body of the sinks that keep nothing (:class:`VerifySink`, :class:`DiscardSink`): every call is a no-op
    and no round leaves figures for the metrics."""

    def begin(self, manifest: Manifest) -> None:
        """Nothing can fail early: there is nowhere to write (the session refuses a manifest that a verifying
        sink cannot check itself)."""

    def consume(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """Drop the batch; the views die with the call (a verifying session has checksummed it already)."""

    def finish(self, checksums: list[int] | None) -> dict:
        return {}

    def close(self) -> dict:
        return {}

    def abort(self) -> None:
        """Nothing to undo."""


class VerifySink(_KeepsNothing):
    """Keeps nothing and asks the session to check every round bit for bit against the producer's checksums (with
    delta rounds, on the session's copy of the model)."""

    verifies = True
    delta_storage = MIRROR


class SaveSink:
    """Saves the received weights as a Hugging Face checkpoint directory at ``path``, with the companion files
    the producer sent (a model directory's config.json and tokenizer files), so ``from_pretrained`` opens it.

    Written into a hidden directory beside ``path`` that replaces it as a whole only when every tensor is on
    disk (see :class:`~refit_app.checkpoint.writer.CheckpointWriter`): a killed or failed run leaves the existing
    checkpoint there intact, and the user's other files in ``path`` are carried into the new one.
    """

    delta_storage = MIRROR
    """With delta rounds the session's copy holds the whole model, and every round writes all of it."""

    def __init__(self, path: str):
        self.path = Path(path)
        self._writer: CheckpointWriter | None = None

    def begin(self, manifest: Manifest) -> None:
        self.abort()  # a fresh manifest mid-session: the previous layout's temporary files go
        writer = CheckpointWriter(self.path, manifest.tensors, manifest.metadata, manifest.files)
        if self.path.exists() and not self.path.is_dir():
            raise SinkError(f"sink.path {self.path} is a file; give a directory to save the checkpoint in")
        # Creates the directory and the temporary files: an unwritable path fails now, before any transfer.
        writer.open()
        self._writer = writer
        free = shutil.disk_usage(writer.staging or self.path).free
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
        """The round is in the temporary files; the next round overwrites it there, :meth:`close` publishes it."""
        if self._writer is None:
            raise RuntimeError("SaveSink.finish() before begin()")
        self._writer.end_round()
        return {}

    def prepare(self) -> None:
        """Make the last round durable in the staging directory without publishing it (what can fail, fails here);
        :meth:`close` is then one swap. For savers that publish together (a sharded run's consumers)."""
        if self._writer is None:
            raise RuntimeError("SaveSink.prepare() before begin()")
        self._writer.seal()

    def close(self) -> dict:
        if self._writer is None:
            return {}
        files = self._writer.commit()
        self._writer = None
        return {"saved_to": str(self.path), "saved_files": [p.name for p in files]}

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


class DiscardSink(_KeepsNothing):
    """Keeps nothing: measures the transfer alone (a delta round's changes too)."""

    delta_storage = DELTAS


class _FaultySink:
    """A sink around ``inner`` that passes every call on; the fault hooks below change one of them."""

    def __init__(self, inner: Sink) -> None:
        self._inner = inner

    def begin(self, manifest: Manifest) -> None:
        self._inner.begin(manifest)

    def consume(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        self._inner.consume(batch)

    def finish(self, checksums: list[int] | None) -> dict:
        return self._inner.finish(checksums)

    def close(self) -> dict:
        return self._inner.close()

    def abort(self) -> None:
        self._inner.abort()

    def __getattr__(self, name: str) -> Any:
        # verifies, probe_tokens, check: whatever the wrapped sink offers.
        return getattr(self._inner, name)


class CorruptingSink(_FaultySink):
    """Test-only fault hook (``refit.debug.corrupt_chunk``): flips one received byte of chunk ``chunk`` before
    ``inner`` sees it, to prove that verification catches corruption."""

    def __init__(self, inner: Sink, chunk: int) -> None:
        super().__init__(inner)
        self._chunk = chunk
        self._seen = 0

    def begin(self, manifest: Manifest) -> None:
        self._seen = 0
        self._inner.begin(manifest)

    def consume(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        if self._seen == self._chunk:
            i = next((i for i, (_, t) in enumerate(batch) if t.numel()), None)
            if i is not None:
                name, t = batch[i]
                logger.warning("refit.debug.corrupt_chunk=%d: flipping one byte of %s", self._chunk, name)
                # A flipped copy in its place: what was received may be read-only (group.backend=shm hands out
                # views of the producer's memory), and the checks after this sink see the same list.
                t = t.clone()
                tensor_bytes(t)[0] ^= 0x01
                batch[i] = (name, t)
        self._seen += 1
        self._inner.consume(batch)


class DyingSink(_FaultySink):
    """Test-only fault hook (``refit.debug.die_in_round``): SIGKILLs this process at its first batch of round
    ``round_`` (counting the rounds ``inner`` finished), mid-transfer, as a crash would end it."""

    def __init__(self, inner: Sink, round_: int) -> None:
        super().__init__(inner)
        self._round = round_
        self._finished = 0

    def consume(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        if self._finished + 1 == self._round:
            logger.warning("refit.debug.die_in_round=%d: this consumer kills itself now", self._round)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        self._inner.consume(batch)

    def finish(self, checksums: list[int] | None) -> dict:
        self._finished += 1
        return self._inner.finish(checksums)


def make_sink(
    target: str, params: Mapping[str, Any], *, corrupt_chunk: int | None = None, die_in_round: int | None = None
) -> Sink:
    """The sink that ``target`` (a ``module.Class`` path, as a config's ``_target_``) names, built with
    ``params``; the config has checked the built-in sinks' parameters already. ``corrupt_chunk``,
    ``die_in_round``: the test-only fault hooks (``refit.debug.*``)."""
    sink = instantiate(target, params)
    if corrupt_chunk is not None:
        sink = CorruptingSink(sink, corrupt_chunk)
    return sink if die_in_round is None else DyingSink(sink, die_in_round)
