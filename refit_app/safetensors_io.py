"""Safetensors checkpoints: read with the ``safetensors`` package, written by a streaming writer of our own.

Reading goes through ``safetensors.safe_open``, the reference implementation: lazy and memory-mapped (a
checkpoint larger than memory streams through), every dtype it knows, and its header validation. Each of its
errors is turned into one line naming the file and what is wrong (truncated, corrupt header, a dtype torch
cannot hold), raised when the checkpoint is opened, before any data moves, not half-way through a refit.

Writing is our own because the library's writers (``save_file``, ``save``) need every tensor in memory at once;
a refit receives tensors one chunk at a time, and a checkpoint may be larger than memory. The writer lays the
file out as the reference writer does (tensors sorted by dtype, widest first, then by name; the header padded
to 8 bytes), so every tensor starts aligned for its dtype and a file loads with ``safetensors`` and
``transformers`` exactly as one they wrote. It writes to hidden temporary files that are renamed into place only
once every tensor is on disk, so an interrupted run never leaves a file that looks like a complete checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from refit_app.checksum import host_bytes as tensor_bytes
from refit_app.core.wire import tensor_bytes as tensor_byte_view
from refit_app.errors import SinkError, SourceError
from refit_app.files import create_temp, fsync_dir, write_atomic
from refit_app.manifest import TensorMeta
from refit_app.sizes import format_size

logger = logging.getLogger(__name__)

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"
METADATA_KEY = "__metadata__"
MAX_LISTED_PROBLEMS = 5

COMPANION_FILE_NAMES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "preprocessor_config.json",
)
"""Files of a model directory that travel with its weights, so a saved copy opens with ``from_pretrained``."""
MAX_COMPANION_FILE_BYTES = 32 * 1024**2
"""Larger than any tokenizer.json of a common model (Gemma's, the largest, is about 33 MB: it is left out)."""
MAX_COMPANION_BYTES = 64 * 1024**2
"""All companion files together: they travel in the manifest, which both sides hold in memory."""

# Every dtype code of the format, in the reference implementation's order (its writer puts the last first), with
# the torch dtype that holds it where this torch has one. F6_* have none in torch; F4 is held two per byte.
_DTYPE_ORDER = (
    ("BOOL", "bool"),
    ("F4", "float4_e2m1fn_x2"),
    ("F6_E2M3", None),
    ("F6_E3M2", None),
    ("U8", "uint8"),
    ("I8", "int8"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E8M0", "float8_e8m0fnu"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("I16", "int16"),
    ("U16", "uint16"),
    ("F16", "float16"),
    ("BF16", "bfloat16"),
    ("I32", "int32"),
    ("U32", "uint32"),
    ("F32", "float32"),
    ("C64", "complex64"),
    ("F64", "float64"),
    ("I64", "int64"),
    ("U64", "uint64"),
)
DTYPE_CODES: dict[str, torch.dtype] = {
    code: getattr(torch, attr)
    for code, attr in _DTYPE_ORDER
    if attr is not None and isinstance(getattr(torch, attr, None), torch.dtype)
}
"""Safetensors dtype code -> the torch dtype holding it, for every code this torch can hold."""
DTYPE_TO_CODE: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPE_CODES.items()}
_WRITE_RANK = {code: i for i, (code, _) in enumerate(_DTYPE_ORDER)}
_PACKED_PER_ELEMENT = {"F4": 2}
"""Codes whose torch dtype packs several values in one element: the file's shape counts values, the last
dimension of torch's shape counts elements."""


def _summarize(problems: Sequence[str]) -> str:
    shown = "; ".join(problems[:MAX_LISTED_PROBLEMS])
    extra = len(problems) - MAX_LISTED_PROBLEMS
    return shown + (f"; and {extra} more" if extra > 0 else "")


def _torch_shape(code: str, shape: Sequence[int]) -> tuple[int, ...]:
    per = _PACKED_PER_ELEMENT.get(code, 1)
    return tuple(shape[:-1]) + (shape[-1] // per,) if per > 1 and shape else tuple(shape)


def _file_shape(code: str, shape: Sequence[int]) -> list[int]:
    per = _PACKED_PER_ELEMENT.get(code, 1)
    return list(shape[:-1]) + [shape[-1] * per] if per > 1 and shape else list(shape)


def _size_problem(path: Path) -> str:
    """Why a file whose header parses is not the size its tensors need (the library says only "not covered")."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop(METADATA_KEY, None)
    needed = max((spec["data_offsets"][1] for spec in header.values()), default=0)
    present = path.stat().st_size - 8 - header_len
    if needed > present:
        return f"is truncated: header says {needed} data bytes, file has {present}; re-download or re-save it"
    return f"has {present - needed} bytes after its last tensor, which the format forbids; was it appended to?"


def _explain(path: Path, error: Exception) -> SourceError:
    """The library's error as one line naming the file and what is wrong with it."""
    if isinstance(error, OSError):
        return SourceError(f"cannot read {path}: {error.strerror or error}")
    text = " ".join(str(error).split()).removeprefix("Error while deserializing header: ")
    if text.startswith("header too small"):
        size = path.stat().st_size
        return SourceError(f"{path} is not a safetensors file: it has {size} bytes, fewer than the 8-byte header length")
    if text.startswith("header too large"):
        return SourceError(
            f"{path} is not a safetensors file: its first 8 bytes give a header length above the format's limit"
        )
    if text.startswith("invalid header length"):
        (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
        return SourceError(
            f"{path} is truncated: header length is {header_len} bytes, file has {path.stat().st_size - 8} after "
            "the length field; re-download or re-save it"
        )
    if "not fully covered" in text:
        try:
            return SourceError(f"{path} {_size_problem(path)}")
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
            pass
    if text.startswith("invalid JSON in header"):
        return SourceError(f"{path} has a corrupt header: {text}; re-download or re-save it")
    if text.startswith(("invalid offset", "invalid shape")):
        return SourceError(f"{path} has an invalid header: {text}")
    return SourceError(f"{path} is not a readable safetensors file: {text}")


@contextlib.contextmanager
def _opened(path: Path) -> Iterator:
    """``safe_open(path)``; any error it (or a read through it) raises becomes one SourceError line."""
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise _explain(path, e) from e


class SafetensorsFile:
    """One safetensors file, its header read and checked on construction; tensors are read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        problems = []
        self.metas: list[TensorMeta] = []
        """Every tensor, in the file's data order (the order :meth:`iter_tensors` yields them)."""
        with _opened(self.path) as f:
            self.metadata: dict[str, str] = dict(f.metadata() or {})
            for name in f.offset_keys():
                view = f.get_slice(name)
                code = view.get_dtype()
                dtype = DTYPE_CODES.get(code)
                if dtype is None:
                    problems.append(f"tensor {name!r} has dtype {code}, which torch {torch.__version__} cannot hold")
                    continue
                self.metas.append(TensorMeta(name, _torch_shape(code, view.get_shape()), dtype))
        if problems:
            raise SourceError(f"{self.path} cannot be read: {_summarize(problems)}")

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.metas)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors in data order, each backed by the file's pages (copy-on-write, so writable; the mapping lives
        as long as a tensor from it does)."""
        with _opened(self.path) as f:
            for meta in self.metas:
                yield meta.name, _aligned(f.get_tensor(meta.name))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or an aligned copy when it starts mid-element, as in a file another writer left unaligned: a
    misaligned typed view makes vectorised kernels fault or slow down; a fresh allocation is aligned."""
    if t.numel() == 0 or t.data_ptr() % t.element_size() == 0:
        return t
    return tensor_byte_view(t).clone().view(t.dtype).view(t.shape)


def read_companion_files(directory: str | os.PathLike) -> dict[str, str | bytes]:
    """The :data:`COMPANION_FILE_NAMES` present in a model directory: text as ``str``, binary files (a
    sentencepiece ``tokenizer.model``) as ``bytes``. A file over the size caps is left out with a warning."""
    directory = Path(directory)
    files: dict[str, str | bytes] = {}
    total = 0
    for name in COMPANION_FILE_NAMES:
        path = directory / name
        if not path.is_file():
            continue
        size = path.stat().st_size
        if size > MAX_COMPANION_FILE_BYTES or total + size > MAX_COMPANION_BYTES:
            cap = "per file" if size > MAX_COMPANION_FILE_BYTES else "for all companion files"
            limit = MAX_COMPANION_FILE_BYTES if size > MAX_COMPANION_FILE_BYTES else MAX_COMPANION_BYTES
            logger.warning("not sending %s (%s): over the %s limit %s; copy it beside the saved checkpoint yourself",
                           path, format_size(size), format_size(limit), cap)
            continue
        try:
            data = path.read_bytes()
        except OSError as e:
            raise SourceError(f"cannot read {path}: {e.strerror or e}") from e
        try:
            files[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            files[name] = data
        total += size
    return files


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
            for m in f.metas:
                if m.name in owner:
                    problems.append(f"tensor {m.name!r} is in both {owner[m.name]} and {f.path.name}")
                owner[m.name] = f.path.name
        if weight_map is not None:
            for name, shard in weight_map.items():
                if owner.get(name) != shard:
                    where = f"is in {owner[name]}" if name in owner else "is in no shard"
                    problems.append(f"index puts {name!r} in {shard} but it {where}")
        if problems:
            raise SourceError(f"{self.path} is inconsistent: {_summarize(problems)}")

    @property
    def total_bytes(self) -> int:
        return sum(f.total_bytes for f in self.files)

    def metas(self) -> list[TensorMeta]:
        """Every tensor in reading order; ``shard`` keeps the file layout for a consumer that saves."""
        return [
            TensorMeta(m.name, m.shape, m.dtype, f.path.name if self.sharded else SINGLE_FILE_NAME)
            for f in self.files
            for m in f.metas
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
            elif code in _PACKED_PER_ELEMENT and not meta.shape:
                problems.append(f"{meta.name!r} is a 0-dim {meta.dtype}, which safetensors cannot describe (its shape "
                                "counts packed values)")
            else:
                coded.append((code, meta))
            seen.add(meta.name)
        if problems:
            raise SinkError(f"cannot write {self.path}: {_summarize(problems)}")
        # The reference writer's layout: widest dtype first, then by name. Every size is a multiple of its
        # itemsize and the widths are powers of two, so each tensor starts aligned for its dtype (after a header
        # padded to 8 bytes): readers map it without a copy, and the bytes match a file save_file writes.
        coded.sort(key=lambda item: (-_WRITE_RANK[item[0]], item[1].name))
        offset = 0
        for code, meta in coded:
            end = offset + meta.nbytes
            header[meta.name] = {"dtype": code, "shape": _file_shape(code, meta.shape), "data_offsets": [offset, end]}
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
    """Writes a Hugging Face checkpoint directory: ``model.safetensors``, or shards plus the index, and the
    companion ``files`` (config.json, tokenizer files) beside them.

    No file appears under a final name until every shard is complete and flushed; the companion files follow,
    and the index, which is what makes a sharded directory look loadable, is renamed into place last. Files of
    a previous checkpoint that the new one does not overwrite are removed only after that, so a failed run
    leaves the old checkpoint intact.
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
            raise SinkError(f"refusing companion files for {self.directory}: {_summarize(problems)}")
        self._files = {
            name: data.encode() if isinstance(data, str) else bytes(data) for name, data in (files or {}).items()
        }
        self._file_temps: dict[str, Path] = {}
        self._layout = shard_layout(metas)
        self._writers = {
            name: SafetensorsWriter(self.directory / name, group, metadata) for name, group in self._layout
        }
        self._shard_of = {m.name: name for name, group in self._layout for m in group}
        self.sharded = len(self._layout) > 1
        self.total_bytes = sum(m.nbytes for m in metas)

    @property
    def file_names(self) -> list[str]:
        return list(self._writers) + list(self._files) + ([INDEX_FILE_NAME] if self.sharded else [])

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
            for name, data in self._files.items():
                self._file_temps[name] = self._write_temp(name, data)
        except BaseException:
            self.abort()
            raise

    def _write_temp(self, name: str, data: bytes) -> Path:
        """A companion file, complete and flushed under a hidden name, for :meth:`commit` to rename."""
        final = self.directory / name
        try:
            fd, tmp = create_temp(final)
        except OSError as e:
            raise SinkError(f"cannot create a file in {self.directory}: {e.strerror or e}") from e
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise SinkError(f"cannot write {tmp}: {e.strerror or e}") from e
        return tmp

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
            for name in list(self._file_temps):
                os.replace(self._file_temps[name], self.directory / name)
                del self._file_temps[name]
            if self.sharded:
                index = {
                    "metadata": {"total_size": self.total_bytes},
                    "weight_map": dict(sorted(self._shard_of.items())),
                }
                write_atomic(self.directory / INDEX_FILE_NAME, json.dumps(index, indent=2).encode() + b"\n", durable=True)
        except OSError as e:
            self.abort()
            raise SinkError(f"cannot publish the checkpoint in {self.directory}: {e.strerror or e}") from e
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
                # Only shards: an index that names config.json or a tokenizer file (hand-edited, or hostile) must
                # not make a save delete them.
                found |= {
                    self.directory / s
                    for s in weight_map.values()
                    if isinstance(s, str) and Path(s).name == s and s.endswith(".safetensors")
                }
        return {p for p in found if p.is_file()}

    def abort(self) -> None:
        for w in self._writers.values():
            w.abort()
        for tmp in self._file_temps.values():
            tmp.unlink(missing_ok=True)
        self._file_temps.clear()


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
