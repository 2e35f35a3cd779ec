"""Writing safetensors checkpoints with a streaming writer of our own.

Writing is our own because the library's writers (``save_file``, ``save``) need every tensor in memory at once;
a refit receives tensors one chunk at a time, and a checkpoint may be larger than memory. The writer lays the
file out as the reference writer does (tensors sorted by dtype, widest first, then by name; the header padded
to 8 bytes), so every tensor starts aligned for its dtype and a file loads with ``safetensors`` and
``transformers`` exactly as one they wrote. It writes to hidden temporary files that are renamed into place only
once every tensor is on disk, so an interrupted run never leaves a file that looks like a complete checkpoint;
a checkpoint directory is published as a whole (see :class:`CheckpointWriter` and :mod:`~refit_app.checkpoint.publish`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from refit_app.checkpoint.dtypes import DTYPE_TO_CODE, PACKED_PER_ELEMENT, WRITE_RANK, file_shape
from refit_app.checkpoint.header import METADATA_KEY, load_json, summarize
from refit_app.checkpoint.layout import INDEX_FILE_NAME, SINGLE_FILE_NAME
from refit_app.checkpoint.publish import carry_over, claim_staging, remove_leftovers, switch_dirs
from refit_app.common.errors import SinkError
from refit_app.common.files import create_temp, fsync_dir, write_atomic
from refit_app.common.sizes import format_size
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import host_bytes as tensor_bytes

logger = logging.getLogger(__name__)


def companion_name_problems(names: Iterable[str]) -> list[str]:
    """Why each of ``names`` cannot be written beside a checkpoint. The names come from the producer over the
    network: never let one escape the directory, hide, or replace a weight file."""
    problems = []
    for name in names:
        if Path(name).name != name or name.startswith(".") or name in ("", ".."):
            problems.append(f"{name!r} is not a plain file name")
        elif name.endswith(".safetensors") or name == INDEX_FILE_NAME:
            problems.append(f"{name!r} would replace a weight file")
    return problems


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written


class SafetensorsWriter:
    """Writes one safetensors file whose tensors (shapes and dtypes known up front) arrive in any order.

    The header goes first and every tensor lands at its precomputed offset, so nothing is buffered. The
    bytes live in a hidden ``.<name>.*.tmp`` file next to the target until ``publish``.
    """

    def __init__(self, path: str | os.PathLike, metas: Sequence[TensorMeta], metadata: Mapping[str, str] | None = None):
        self.path = Path(path)
        self._slots: dict[str, tuple[TensorMeta, int]] = {}
        header: dict[str, object] = {}
        if metadata:
            header[METADATA_KEY] = dict(metadata)
        problems = []
        coded: list[tuple[str, TensorMeta]] = []
        seen: set[str] = set()
        for meta in metas:
            code = DTYPE_TO_CODE.get(meta.dtype)
            if code is None:
                problems.append(f"{meta.name!r} has dtype {meta.dtype}, which safetensors cannot store")
            elif meta.name in seen:
                problems.append(f"{meta.name!r} appears twice")
            elif meta.name == METADATA_KEY:
                problems.append(f"{meta.name!r} is reserved for metadata")
            elif code in PACKED_PER_ELEMENT and not meta.shape:
                problems.append(
                    f"{meta.name!r} is a 0-dim {meta.dtype}, which safetensors cannot describe (its shape "
                    "counts packed values)"
                )
            else:
                coded.append((code, meta))
            seen.add(meta.name)
        if problems:
            raise SinkError(f"cannot write {self.path}: {summarize(problems)}")
        # The reference writer's layout: widest dtype first, then by name. Every size is a multiple of its
        # itemsize and the widths are powers of two, so each tensor starts aligned for its dtype (after a header
        # padded to 8 bytes): readers map it without a copy, and the bytes match a file save_file writes.
        coded.sort(key=lambda item: (-WRITE_RANK[item[0]], item[1].name))
        offset = 0
        for code, meta in coded:
            end = offset + meta.nbytes
            header[meta.name] = {"dtype": code, "shape": file_shape(code, meta.shape), "data_offsets": [offset, end]}
            self._slots[meta.name] = (meta, offset)
            offset = end
        encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        # Padded with spaces, as the reference writer does, so the data starts 8-byte aligned.
        encoded += b" " * (-len(encoded) % 8)
        self._header = struct.pack("<Q", len(encoded)) + encoded
        self.total_bytes = len(self._header) + offset
        self._written: set[str] = set()
        self._round_complete = False
        self._tmp: Path | None = None
        self._fd: int | None = None

    def open(self) -> None:
        """Create the temporary file; the first point where a missing or read-only directory shows up."""
        try:
            fd, tmp = create_temp(self.path)
        except OSError as e:
            raise SinkError(f"cannot create a file in {self.path.parent}: {e.strerror or e}") from e
        self._fd, self._tmp = fd, tmp
        try:
            os.ftruncate(fd, self.total_bytes)
            _pwrite_all(fd, memoryview(self._header), 0)
        except OSError as e:
            self.abort()
            raise SinkError(f"cannot write {tmp}: {e.strerror or e}") from e

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._fd is None:
            raise RuntimeError("SafetensorsWriter.write() before open()")
        slot = self._slots.get(name)
        if slot is None:
            raise SinkError(f"cannot write {name!r} to {self.path}: it is not in the manifest")
        meta, offset = slot
        if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
            raise SinkError(
                f"cannot write {name!r} to {self.path}: got {tensor.dtype} {list(tensor.shape)}, "
                f"manifest says {meta.dtype} {list(meta.shape)}"
            )
        if self._round_complete:
            # The next round overwrites the previous one in place.
            self._written.clear()
            self._round_complete = False
        if name in self._written:
            raise SinkError(f"cannot write {name!r} to {self.path}: it arrived twice")
        try:
            _pwrite_all(self._fd, tensor_bytes(tensor), len(self._header) + offset)
        except OSError as e:
            raise SinkError(f"cannot write {self._tmp}: {e.strerror or e}") from e
        self._written.add(name)

    def end_round(self) -> None:
        """Raise unless every tensor was written since the last round ended; the next write starts a new round."""
        missing = [n for n in self._slots if n not in self._written]
        if missing:
            raise SinkError(f"cannot finish {self.path}: {len(missing)} tensor(s) never arrived: {summarize(missing)}")
        self._round_complete = True

    def seal(self) -> None:
        """Check completeness and flush to disk; after this only ``publish`` or ``abort`` remain."""
        self.end_round()
        if self._fd is None:
            raise RuntimeError("SafetensorsWriter.seal() before open()")
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise SinkError(f"cannot flush {self._tmp}: {e.strerror or e}") from e
        os.close(self._fd)
        self._fd = None

    def publish(self) -> None:
        """Rename the sealed file to its final name, replacing any file there."""
        if self._tmp is None or self._fd is not None:
            raise RuntimeError("SafetensorsWriter.publish() before seal()")
        try:
            os.replace(self._tmp, self.path)
        except OSError as e:
            raise SinkError(f"cannot rename {self._tmp} to {self.path}: {e.strerror or e}") from e
        self._tmp = None

    def abort(self) -> None:
        """Remove the temporary file; safe to call at any point and more than once."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None


def shard_layout(metas: Sequence[TensorMeta]) -> list[tuple[str, list[TensorMeta]]]:
    """Files to write and their tensors: one ``model.safetensors`` unless the metas name several shards.

    A tensor without a shard in an otherwise sharded manifest joins the shard of the tensor before it
    (or the first shard), keeping neighbours together as the source had them.
    """
    named = [m.shard for m in metas if m.shard is not None]
    if len(set(named)) <= 1:
        return [(SINGLE_FILE_NAME, list(metas))]
    bad = sorted({s for s in named if Path(s).name != s or not s.endswith(".safetensors") or s.startswith(".")})
    if bad:
        # Shard names come from the producer over the network; never let one escape the target directory.
        raise SinkError(f"refusing shard file names {summarize(bad)}: not plain *.safetensors names")
    groups: dict[str, list[TensorMeta]] = {}
    current = named[0]
    for m in metas:
        current = m.shard if m.shard is not None else current
        groups.setdefault(current, []).append(m)
    return list(groups.items())


class CheckpointWriter:
    """Writes a Hugging Face checkpoint directory: ``model.safetensors``, or shards plus the index, and the
    companion ``files`` (config.json, tokenizer files) beside them, published all at once.

    Everything is written into a new hidden directory beside the target (``.<name>.refit-save-<random>``, locked
    while this writer lives). :meth:`commit` completes and flushes it, hard-links in the files of the old directory
    that this checkpoint does not replace (the user's own files; not the old weights, index or shards), then
    exchanges the two directories with one ``renameat2(RENAME_EXCHANGE)`` and removes the old one. So a reader, or
    a crash at any moment, sees the old checkpoint or the new one, never a mix; and the target stays a real
    directory (a versioned directory behind a switched symlink would also be atomic, but would turn the user's
    directory into a link and leave the versions to manage). Where the exchange is unavailable (not Linux, or a
    file system without it) two renames replace the directory, and a crash between them leaves none at the target.
    Staging directories of killed saves are removed by the next save into the same place.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        metas: Sequence[TensorMeta],
        metadata: Mapping[str, str] | None = None,
        files: Mapping[str, str | bytes] | None = None,
    ):
        self.directory = Path(directory)
        problems = companion_name_problems(files or {})
        if problems:
            raise SinkError(f"refusing companion files for {self.directory}: {summarize(problems)}")
        self._files = {
            name: data.encode() if isinstance(data, str) else bytes(data) for name, data in (files or {}).items()
        }
        self._layout = shard_layout(metas)
        self._writers = {
            name: SafetensorsWriter(self.directory / name, group, metadata) for name, group in self._layout
        }
        self._shard_of = {m.name: name for name, group in self._layout for m in group}
        self.sharded = len(self._layout) > 1
        self.total_bytes = sum(m.nbytes for m in metas)
        self.staging: Path | None = None
        """The hidden directory being written, between :meth:`open` and :meth:`commit` or :meth:`abort`."""
        self._lock: int | None = None
        self._sealed = False

    @property
    def file_names(self) -> list[str]:
        return list(self._writers) + list(self._files) + ([INDEX_FILE_NAME] if self.sharded else [])

    @property
    def _target(self) -> Path:
        # A symlinked sink.path stays a link: the directory it points to is the one replaced.
        return Path(os.path.realpath(self.directory))

    def open(self) -> None:
        target = self._target
        try:
            # Created now, empty, so that an unusable path fails before any transfer.
            target.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SinkError(f"cannot create directory {self.directory}: {e.strerror or e}") from e
        if not target.is_dir():
            raise SinkError(f"{self.directory} exists and is not a directory")
        if os.path.ismount(target):
            raise SinkError(
                f"{self.directory} is a mount point, which a save cannot replace as a whole; save into "
                f"a directory inside it (for example {self.directory / 'model'})"
            )
        remove_leftovers(target)
        self.staging, self._lock = claim_staging(target)
        self._sealed = False
        staging = self.staging
        try:
            for name, w in self._writers.items():
                w.path = staging / name
                w.open()
            for name, data in self._files.items():
                self._write_file(staging / name, data)
        except BaseException:
            self.abort()
            raise

    @staticmethod
    def _write_file(path: Path, data: bytes) -> None:
        try:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise SinkError(f"cannot write {path}: {e.strerror or e}") from e

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shard = self._shard_of.get(name)
        if shard is None:
            raise SinkError(f"cannot write {name!r} to {self.directory}: it is not in the manifest")
        self._writers[shard].write(name, tensor)

    def end_round(self) -> None:
        """Raise unless every tensor of the checkpoint was written since the last round ended."""
        for w in self._writers.values():
            w.end_round()

    @contextlib.contextmanager
    def _publishing(self) -> Iterator[None]:
        """Abort on any failure; an OS error becomes a one-line SinkError naming the directory."""
        try:
            yield
        except OSError as e:
            self.abort()
            raise SinkError(f"cannot publish the checkpoint in {self.directory}: {e.strerror or e}") from e
        except BaseException:
            self.abort()
            raise

    def seal(self) -> None:
        """Seal every file and complete the staging directory, durable on disk, without publishing it: all that can
        fail (a full disk, an I/O error) fails here, so that :meth:`commit` after it is one swap. Several writers
        that publish together (a sharded run's consumers) seal, agree, then commit."""
        staging, target = self.staging, self._target
        if staging is None:
            raise RuntimeError("CheckpointWriter.seal() before open()")
        if self._sealed:
            return
        with self._publishing():
            for w in self._writers.values():
                w.seal()
            for w in self._writers.values():
                w.publish()
            if self.sharded:
                index = {
                    "metadata": {"total_size": self.total_bytes},
                    "weight_map": dict(sorted(self._shard_of.items())),
                }
                write_atomic(staging / INDEX_FILE_NAME, json.dumps(index, indent=2).encode() + b"\n", durable=True)
            if target.is_dir():
                stale = {p.name for p in self._previous_files(target)}
                carry_over(target, staging, stale | set(self.file_names))
                os.chmod(staging, stat.S_IMODE(target.stat().st_mode))
            fsync_dir(staging)
        self._sealed = True

    def commit(self) -> list[Path]:
        """Seal (unless :meth:`seal` did), swap the staging directory in for the old one; returns the final paths."""
        self.seal()
        staging, target = self.staging, self._target
        assert staging is not None
        with self._publishing():
            switch_dirs(staging, target)
        with contextlib.suppress(OSError):
            fsync_dir(target.parent)  # the switch survives a power loss
        # The staging name now holds the previous checkpoint, if there was one.
        shutil.rmtree(staging, ignore_errors=True)
        self._release()
        final = [self.directory / n for n in self.file_names]
        logger.info("saved %s in %d file(s) to %s", format_size(self.total_bytes), len(final), self.directory)
        return final

    @staticmethod
    def _previous_files(directory: Path) -> set[Path]:
        """Weight files of the checkpoint in ``directory``, which a loader could confuse with ours: not carried
        into the new one."""
        found = {p for p in (directory / SINGLE_FILE_NAME, directory / INDEX_FILE_NAME) if p.is_file()}
        index_path = directory / INDEX_FILE_NAME
        if index_path.is_file():
            try:
                doc = load_json(index_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                logger.warning("cannot read the existing %s (%s); its shards stay in place", index_path, e)
                doc = None
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if isinstance(weight_map, dict):
                # Only shards: an index that names config.json or a tokenizer file (hand-edited, or hostile) must
                # not make a save drop them.
                found |= {
                    directory / s
                    for s in weight_map.values()
                    if isinstance(s, str) and Path(s).name == s and s.endswith(".safetensors")
                }
        return {p for p in found if p.is_file()}

    def _release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        self.staging = None

    def abort(self) -> None:
        """Remove the staging directory; the target is untouched. Safe to call at any point and more than once."""
        for w in self._writers.values():
            w.abort()
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
        self._release()


def save_tensors(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write in-memory tensors to one safetensors file atomically (tests and small tools)."""
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    writer = SafetensorsWriter(path, [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in items], metadata)
    writer.open()
    try:
        for name, t in items:
            writer.write(name, t)
        writer.seal()
        writer.publish()
    except BaseException:
        writer.abort()
        raise
    return writer.path
