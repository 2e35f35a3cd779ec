"""Reading and writing the safetensors format without the ``safetensors`` package.

The format: an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``, offsets relative to
the end of the header), then the tensor bytes. Reading validates the whole header before touching data so
a truncated or corrupt checkpoint fails at start-up with one line, not half-way through a refit. Tensors
are then served lazily from an mmap so a checkpoint larger than memory streams through.

Writing goes to hidden temporary files that are renamed into place only once every tensor is on disk,
so an interrupted run never leaves a file that looks like a complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from refit_app.checksum import host_bytes as tensor_bytes
from refit_app.errors import SinkError, SourceError
from refit_app.files import create_temp, fsync_dir, write_atomic
from refit_app.manifest import TensorMeta, dtype_itemsize
from refit_app.sizes import format_size

logger = logging.getLogger(__name__)

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"
METADATA_KEY = "__metadata__"
MAX_HEADER_BYTES = 100_000_000
"""The reference implementation's limit; a larger "header" means the file is not safetensors at all."""
MAX_LISTED_PROBLEMS = 5

DTYPE_CODES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
# Unsigned wide integers arrived in torch 2.3; older builds simply cannot read or write them.
for _code, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if isinstance(getattr(torch, _attr, None), torch.dtype):
        DTYPE_CODES[_code] = getattr(torch, _attr)
DTYPE_TO_CODE: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPE_CODES.items()}


def _summarize(problems: Sequence[str]) -> str:
    shown = "; ".join(problems[:MAX_LISTED_PROBLEMS])
    extra = len(problems) - MAX_LISTED_PROBLEMS
    return shown + (f"; and {extra} more" if extra > 0 else "")


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as the header describes it; ``start``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def _entry_problems(name: str, spec: object) -> tuple[list[str], tuple[torch.dtype, tuple[int, ...], int, int] | None]:
    """Every problem with one header entry, and the parsed entry when there are none."""
    if not isinstance(spec, dict):
        return [f"tensor {name!r} is {type(spec).__name__}, not an object"], None
    problems = []
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in spec]
    if missing:
        return [f"tensor {name!r} lacks {', '.join(missing)}"], None
    dtype = DTYPE_CODES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        problems.append(f"tensor {name!r} has unknown dtype {spec['dtype']!r} (known: {' '.join(DTYPE_CODES)})")
    shape = spec["shape"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        problems.append(f"tensor {name!r} has shape {shape!r}, not a list of non-negative integers")
    offsets = spec["data_offsets"]
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        problems.append(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
    if problems:
        return problems, None
    assert dtype is not None
    expected = math.prod(shape) * dtype_itemsize(dtype)
    if offsets[1] - offsets[0] != expected:
        problems.append(
            f"tensor {name!r} is {spec['dtype']}{shape} = {expected} bytes but data_offsets {offsets} span "
            f"{offsets[1] - offsets[0]}"
        )
        return problems, None
    return [], (dtype, tuple(shape), offsets[0], offsets[1])


def read_header(path: str | os.PathLike) -> tuple[list[HeaderEntry], dict[str, str]]:
    """The validated header of one safetensors file: entries in data-offset order, and its metadata.

    Reads only the header; raises SourceError with one line naming the file and every problem found.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SourceError(
                    f"{path} is not a safetensors file: it has {size} bytes, fewer than the 8-byte header length"
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise SourceError(
                    f"{path} is not a safetensors file: its first 8 bytes give a header length of {header_len} bytes, "
                    f"above the format's {MAX_HEADER_BYTES}"
                )
            if header_len > size - 8:
                raise SourceError(
                    f"{path} is truncated: header length is {header_len} bytes, file has {size - 8} after the length "
                    "field; re-download or re-save the checkpoint"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{path} has a corrupt header: not valid JSON ({e}); re-download or re-save it") from e
    if not isinstance(header, dict):
        raise SourceError(f"{path} has a corrupt header: a JSON {type(header).__name__}, not an object")

    metadata = header.pop(METADATA_KEY, {})
    problems: list[str] = []
    if not (isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        problems.append(f"{METADATA_KEY} is not an object of strings")
        metadata = {}

    data_start = 8 + header_len
    entries: list[HeaderEntry] = []
    for name, spec in header.items():
        entry_problems, parsed = _entry_problems(name, spec)
        problems.extend(entry_problems)
        if parsed is not None:
            dtype, shape, begin, end = parsed
            entries.append(HeaderEntry(name, dtype, shape, data_start + begin, data_start + end))

    # Sorting by (start, end) puts a zero-length range at the start of a non-empty one, which is fine:
    # only ranges that share at least one byte overlap.
    entries.sort(key=lambda e: (e.start, e.end))
    for prev, cur in zip(entries, entries[1:]):
        if cur.start < prev.end:
            problems.append(
                f"tensors {prev.name!r} [{prev.start - data_start}, {prev.end - data_start}) and "
                f"{cur.name!r} [{cur.start - data_start}, {cur.end - data_start}) overlap"
            )
    if problems:
        raise SourceError(f"{path} has an invalid header: {_summarize(problems)}")

    data_needed = max((e.end for e in entries), default=data_start) - data_start
    if data_needed > size - data_start:
        raise SourceError(
            f"{path} is truncated: header says {data_needed} data bytes, file has {size - data_start}; "
            "re-download or re-save the checkpoint"
        )
    return entries, metadata


class SafetensorsFile:
    """One validated safetensors file whose tensors are read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.entries, self.metadata = read_header(self.path)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors in data-offset order, each backed by the file's pages (copy-on-write, so writable).

        The mmap is never closed explicitly: tensors returned by ``torch.frombuffer`` hold a reference to
        it, and closing it under them would leave dangling pointers. It is unmapped once the last such
        tensor is gone.
        """
        if not self.entries:
            return
        try:
            with open(self.path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise SourceError(f"cannot map {self.path}: {e.strerror or e}") from e
        if len(mapped) < max(e.end for e in self.entries):
            raise SourceError(f"{self.path} shrank to {len(mapped)} bytes while being read; was it overwritten?")
        for entry in self.entries:
            yield entry.name, _tensor_at(mapped, entry)


def _tensor_at(mapped: mmap.mmap, entry: HeaderEntry) -> torch.Tensor:
    numel = math.prod(entry.shape)
    if numel == 0:
        # frombuffer refuses empty ranges; an empty tensor has no bytes to share anyway.
        return torch.empty(entry.shape, dtype=entry.dtype)
    itemsize = dtype_itemsize(entry.dtype)
    if entry.start % itemsize == 0:
        return torch.frombuffer(mapped, dtype=entry.dtype, count=numel, offset=entry.start).view(entry.shape)
    # A misaligned typed view would make vectorised kernels fault or slow down; a fresh allocation is aligned.
    raw = torch.frombuffer(mapped, dtype=torch.uint8, count=entry.end - entry.start, offset=entry.start)
    return raw.clone().view(entry.dtype).view(entry.shape)


def _checkpoint_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The files of the checkpoint at ``path`` and, when sharded, its weight map (tensor name -> shard)."""
    if not path.exists():
        raise SourceError(f"checkpoint path {path} does not exist; expected a .safetensors file or a model directory")
    if not path.is_dir():
        return [path], None
    if (path / SINGLE_FILE_NAME).is_file():
        # Transformers prefers the single file over an index, so a directory holding both loads the same here.
        return [path / SINGLE_FILE_NAME], None
    index_path = path / INDEX_FILE_NAME
    if index_path.is_file():
        return _read_index(index_path)
    candidates = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if len(candidates) == 1:
        return candidates, None
    if not candidates:
        raise SourceError(
            f"{path} holds no safetensors checkpoint: no {SINGLE_FILE_NAME}, no {INDEX_FILE_NAME} "
            "and no *.safetensors file"
        )
    names = ", ".join(p.name for p in candidates[:MAX_LISTED_PROBLEMS])
    raise SourceError(
        f"{path} holds {len(candidates)} .safetensors files ({names}) but no {INDEX_FILE_NAME} saying how they "
        "form one checkpoint; point at one file or add the index"
    )


def _read_index(index_path: Path) -> tuple[list[Path], dict[str, str]]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SourceError(f"cannot read {index_path}: {e.strerror or e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{index_path} is not valid JSON ({e})") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not (
        isinstance(weight_map, dict)
        and weight_map
        and all(isinstance(v, str) for v in weight_map.values())
    ):
        raise SourceError(f"{index_path} has no \"weight_map\" object of tensor name -> shard file")
    shard_names = sorted(set(weight_map.values()))
    bad = [s for s in shard_names if Path(s).name != s]
    if bad:
        raise SourceError(f"{index_path} names shards outside its directory: {_summarize(bad)}")
    missing = [s for s in shard_names if not (index_path.parent / s).is_file()]
    if missing:
        raise SourceError(f"{index_path} names {len(missing)} missing shard file(s): {_summarize(missing)}")
    return [index_path.parent / s for s in shard_names], weight_map


class Checkpoint:
    """A safetensors checkpoint: one file, or a Hugging Face model directory (single or sharded).

    Every header is read and validated on construction, so all metadata is known before any data moves.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        paths, weight_map = _checkpoint_files(self.path)
        self.files = [SafetensorsFile(p) for p in paths]
        self.sharded = weight_map is not None
        self._check_consistent(weight_map)

    def _check_consistent(self, weight_map: dict[str, str] | None) -> None:
        problems = []
        owner: dict[str, str] = {}
        for f in self.files:
            for e in f.entries:
                if e.name in owner:
                    problems.append(f"tensor {e.name!r} is in both {owner[e.name]} and {f.path.name}")
                owner[e.name] = f.path.name
        if weight_map is not None:
            for name, shard in weight_map.items():
                if owner.get(name) != shard:
                    where = f"is in {owner[name]}" if name in owner else "is in no shard"
                    problems.append(f"index puts {name!r} in {shard} but it {where}")
        if problems:
            raise SourceError(f"{self.path} is inconsistent: {_summarize(problems)}")

    @property
    def total_bytes(self) -> int:
        return sum(e.end - e.start for f in self.files for e in f.entries)

    def metas(self) -> list[TensorMeta]:
        """Every tensor in reading order; ``shard`` keeps the file layout for a consumer that saves."""
        return [
            TensorMeta(e.name, e.shape, e.dtype, f.path.name if self.sharded else SINGLE_FILE_NAME)
            for f in self.files
            for e in f.entries
        ]

    def metadata(self) -> dict[str, str]:
        """``__metadata__`` of all files merged; Hugging Face shards normally all carry the same."""
        merged: dict[str, str] = {}
        for f in self.files:
            for k, v in f.metadata.items():
                merged.setdefault(k, v)
        return merged

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for f in self.files:
            yield from f.iter_tensors()


# ---------------------------------------------------------------------------------------------------------
# Writing


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
        offset = 0
        problems = []
        for meta in metas:
            code = DTYPE_TO_CODE.get(meta.dtype)
            if code is None:
                problems.append(f"{meta.name!r} has dtype {meta.dtype}, which safetensors cannot store")
                continue
            if meta.name in self._slots:
                problems.append(f"{meta.name!r} appears twice")
                continue
            if meta.name == METADATA_KEY:
                problems.append(f"{meta.name!r} is reserved for metadata")
                continue
            end = offset + meta.nbytes
            header[meta.name] = {"dtype": code, "shape": list(meta.shape), "data_offsets": [offset, end]}
            self._slots[meta.name] = (meta, offset)
            offset = end
        if problems:
            raise SinkError(f"cannot write {self.path}: {_summarize(problems)}")
        encoded = json.dumps(header, separators=(",", ":")).encode()
        # Pad with spaces (as the reference writer does) so the data starts 8-byte aligned and mmap'd
        # tensors need no copy.
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
            raise SinkError(f"cannot finish {self.path}: {len(missing)} tensor(s) never arrived: {_summarize(missing)}")
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
        raise SinkError(f"refusing shard file names {_summarize(bad)}: not plain *.safetensors names")
    groups: dict[str, list[TensorMeta]] = {}
    current = named[0]
    for m in metas:
        current = m.shard if m.shard is not None else current
        groups.setdefault(current, []).append(m)
    return list(groups.items())


class CheckpointWriter:
    """Writes a Hugging Face checkpoint directory: ``model.safetensors``, or shards plus the index.

    No file appears under a final name until every shard is complete and flushed; the index, which is
    what makes a sharded directory look loadable, is renamed into place last. Files of a previous
    checkpoint that the new one does not overwrite are removed only after that, so a failed run leaves
    the old checkpoint intact.
    """

    def __init__(
        self, directory: str | os.PathLike, metas: Sequence[TensorMeta], metadata: Mapping[str, str] | None = None
    ):
        self.directory = Path(directory)
        self._layout = shard_layout(metas)
        self._writers = {
            name: SafetensorsWriter(self.directory / name, group, metadata) for name, group in self._layout
        }
        self._shard_of = {m.name: name for name, group in self._layout for m in group}
        self.sharded = len(self._layout) > 1
        self.total_bytes = sum(m.nbytes for m in metas)

    @property
    def file_names(self) -> list[str]:
        return list(self._writers) + ([INDEX_FILE_NAME] if self.sharded else [])

    def open(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SinkError(f"cannot create directory {self.directory}: {e.strerror or e}") from e
        if not self.directory.is_dir():
            raise SinkError(f"{self.directory} exists and is not a directory")
        try:
            for w in self._writers.values():
                w.open()
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shard = self._shard_of.get(name)
        if shard is None:
            raise SinkError(f"cannot write {name!r} to {self.directory}: it is not in the manifest")
        self._writers[shard].write(name, tensor)

    def end_round(self) -> None:
        """Raise unless every tensor of the checkpoint was written since the last round ended."""
        for w in self._writers.values():
            w.end_round()

    def commit(self) -> list[Path]:
        """Seal every file, rename them into place, write the index last; returns the final paths."""
        previous = self._previous_files()
        try:
            for w in self._writers.values():
                w.seal()
            for w in self._writers.values():
                w.publish()
            if self.sharded:
                index = {
                    "metadata": {"total_size": self.total_bytes},
                    "weight_map": dict(sorted(self._shard_of.items())),
                }
                write_atomic(self.directory / INDEX_FILE_NAME, json.dumps(index, indent=2).encode() + b"\n", durable=True)
        except OSError as e:
            self.abort()
            raise SinkError(f"cannot write {self.directory / INDEX_FILE_NAME}: {e.strerror or e}") from e
        except BaseException:
            self.abort()
            raise
        final = [self.directory / n for n in self.file_names]
        for stale in sorted(previous - set(final)):
            logger.info("removing %s, left from the checkpoint this one replaces", stale)
            stale.unlink(missing_ok=True)
        fsync_dir(self.directory)
        logger.info("saved %s in %d file(s) to %s", format_size(self.total_bytes), len(final), self.directory)
        return final

    def _previous_files(self) -> set[Path]:
        """Files of an existing checkpoint in the directory, which a loader could confuse with ours."""
        found = {p for p in (self.directory / SINGLE_FILE_NAME, self.directory / INDEX_FILE_NAME) if p.is_file()}
        index_path = self.directory / INDEX_FILE_NAME
        if index_path.is_file():
            try:
                doc = json.loads(index_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                logger.warning("cannot read the existing %s (%s); its shards stay in place", index_path, e)
                doc = None
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if isinstance(weight_map, dict):
                found |= {self.directory / s for s in weight_map.values() if isinstance(s, str) and Path(s).name == s}
        return {p for p in found if p.is_file()}

    def abort(self) -> None:
        for w in self._writers.values():
            w.abort()


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
