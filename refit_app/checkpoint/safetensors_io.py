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
once every tensor is on disk, so an interrupted run never leaves a file that looks like a complete checkpoint;
a checkpoint directory is published as a whole (see :class:`CheckpointWriter`).

Every header is checked by :func:`read_header` before the library sees it: the file must be a regular file (a FIFO
would block the open forever), its header a JSON object within the format's limits, with no duplicate key, no
number longer than an int64, no nesting deeper than a real header has, and no shape torch could not describe. A
hostile or damaged file is refused with one line, not with a crash deep inside the library or torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import gc
import json
import logging
import os
import re
import secrets
import shutil
import stat
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from refit_app.common.errors import SinkError, SourceError, some_of
from refit_app.common.files import create_temp, fsync_dir, write_atomic
from refit_app.common.sizes import format_size
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import host_bytes as tensor_bytes
from refit_app.core.wire import tensor_bytes as tensor_byte_view

logger = logging.getLogger(__name__)

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"
METADATA_KEY = "__metadata__"

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
    return some_of(problems, sep="; ")


def _torch_shape(code: str, shape: Sequence[int]) -> tuple[int, ...]:
    per = _PACKED_PER_ELEMENT.get(code, 1)
    return tuple(shape[:-1]) + (shape[-1] // per,) if per > 1 and shape else tuple(shape)


def _file_shape(code: str, shape: Sequence[int]) -> list[int]:
    per = _PACKED_PER_ELEMENT.get(code, 1)
    return list(shape[:-1]) + [shape[-1] * per] if per > 1 and shape else list(shape)


# ---------------------------------------------------------------------------------------------------------
# Header checks, before the library (or torch) sees a header

MAX_HEADER_BYTES = 100_000_000
"""The reference implementation's limit on the JSON header."""
INT64_MAX = 2**63 - 1
_MAX_NUMBER_CHARS = 20
"""Longer than any int64 (19 digits and a sign): a longer number is refused before Python builds a huge int."""


class HeaderProblem(ValueError):
    """What makes a JSON document unacceptable as a header or an index, in words for the one-line error."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        # json.loads would keep the last silently, and the library may keep another: refuse the ambiguity.
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise HeaderProblem(f"key {key[:80]!r} appears twice in one object")
    return obj


def _bounded_int(text: str) -> int:
    if len(text) > _MAX_NUMBER_CHARS:  # "-" and 19 digits at most; Python would build any int up to 4300 digits
        raise HeaderProblem(f"it holds a number of {len(text)} digits, longer than any int64")
    return int(text)


def _bounded_float(text: str) -> float:
    if len(text) > 40:
        raise HeaderProblem(f"it holds a number of {len(text)} characters")
    return float(text)


def _no_float(text: str) -> int:
    raise HeaderProblem(f"it holds the number {text[:40]}, where a safetensors header has only integers")


def _no_constant(text: str) -> float:
    raise HeaderProblem(f"it holds {text}, which is not JSON")


_LONG_DIGITS = re.compile(rf"[0-9]{{{_MAX_NUMBER_CHARS + 1}}}")


def load_json(text: str, *, floats: bool = True) -> object:
    """``json.loads`` for files that may be hostile: duplicate keys, numbers of thousands of digits, NaN and nesting
    past Python's recursion limit each raise :class:`HeaderProblem` (JSON syntax errors raise ``ValueError``)."""
    # A hook per integer costs a Python call each (millions in a header of 600k tensors): only worth it when a
    # run of digits long enough to be refused appears somewhere (perhaps only in a string).
    long_digits = _LONG_DIGITS.search(text)
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_int=_bounded_int if long_digits else None,
                          parse_float=_bounded_float if floats else _no_float, parse_constant=_no_constant)
    except RecursionError:
        raise HeaderProblem("it nests objects or arrays thousands deep, far deeper than any real file") from None


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while a header's objects are built: a header of 600k tensors makes
    millions of acyclic dicts and lists, and the collections their creation triggers double the parse time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _is_count(value: object) -> bool:
    return type(value) is int and 0 <= value <= INT64_MAX


def _tensor_problem(name: str, spec: object) -> str | None:
    """Why one header entry cannot describe a tensor torch can hold; offsets against the data are the library's."""
    if not isinstance(spec, dict):
        return f"entry {name[:80]!r} is {_json_kind(spec)}, not an object"
    missing = [field for field in ("dtype", "shape", "data_offsets") if field not in spec]
    if missing:
        return f"tensor {name[:80]!r} is missing field(s) {', '.join(missing)}"
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str):
        return f"tensor {name[:80]!r} has dtype {_json_kind(dtype)}, not a string"
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        return f"tensor {name[:80]!r} has shape {str(shape)[:80]}, not a list of sizes from 0 to int64's maximum"
    # Torch describes even a zero-element tensor with strides, the products of the later sizes taken as at least
    # 1: [0, 2**40, 2**40] holds nothing but overflows int64 (and C++ frames from torch would say so).
    extent = 1
    for d in shape:
        extent *= max(d, 1)
        if extent > INT64_MAX:  # at once: a hostile list of a million sizes never builds a huge int
            return (f"tensor {name[:80]!r} has shape {str(shape)[:80]}, whose sizes multiply past int64 (zero "
                    "elements or not)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        return f"tensor {name[:80]!r} has data_offsets that are not [begin, end] int64 offsets"
    return None


def _json_kind(value: object) -> str:
    """A JSON value in words, as the library's errors put it (``integer `7```)."""
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "sequence", dict: "map"}
    kind = kinds.get(type(value), "null")
    return f"{kind} `{value}`" if isinstance(value, (int, float)) else kind


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return "not a regular file"


def regular_file_problem(path: Path) -> str | None:
    """Why ``path`` is not a regular file, from ``stat`` alone: opening a FIFO would block forever."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    if stat.S_ISREG(mode):
        return None
    return f"{path} is {_file_kind(mode)}, not a regular file; give a .safetensors file or a model directory"


def _read_exactly(fd: int, n: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = os.read(fd, min(n, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_header(path: Path) -> dict[str, object]:
    """The header of the safetensors file at ``path``, checked as the module docstring says; raises one
    :class:`SourceError` line naming the file, the problem and what to do."""
    problem = regular_file_problem(path)
    if problem:
        raise SourceError(problem)
    try:
        # O_NONBLOCK: should a FIFO take the file's place after the stat, the open returns instead of blocking.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SourceError(f"{path} is {_file_kind(st.st_mode)}, not a regular file; give a .safetensors file")
        if st.st_size < 8:
            raise SourceError(
                f"{path} is not a safetensors file: it has {st.st_size} bytes, fewer than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", _read_exactly(fd, 8))
        if header_len > INT64_MAX:
            raise SourceError(f"{path} is not a safetensors file: its first 8 bytes give a negative header length")
        if header_len > MAX_HEADER_BYTES:
            raise SourceError(
                f"{path} is not a safetensors file: its first 8 bytes give a header of {header_len} bytes, above the "
                f"format's limit of {MAX_HEADER_BYTES}")
        if header_len > st.st_size - 8:
            raise SourceError(
                f"{path} is truncated: header length is {header_len} bytes, file has {st.st_size - 8} after "
                "the length field; re-download or re-save it")
        raw = _read_exactly(fd, header_len)
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    try:
        with _no_gc():
            header = load_json(raw.decode("utf-8"), floats=False)
    except HeaderProblem as e:
        raise SourceError(f"{path} has a corrupt header: {e}; it was not written by a safetensors writer, "
                          "re-download or re-save it") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise SourceError(f"{path} has a corrupt header: invalid JSON in header: {e}; re-download or "
                          "re-save it") from None
    if not isinstance(header, dict):
        kind = "sequence" if isinstance(header, list) else "single value"
        raise SourceError(f"{path} has a corrupt header: it is a JSON {kind}, not an object; re-download or "
                          "re-save it")
    with _no_gc():
        problems = _header_problems(header)
    if problems:
        raise SourceError(f"{path} has a corrupt header: {_summarize(problems)}; re-download or re-save it")
    return header


def _header_problems(header: dict[str, object]) -> list[str]:
    problems = []
    metadata = header.get(METADATA_KEY, {})
    if not isinstance(metadata, dict):
        problems.append(f"{METADATA_KEY} is {_json_kind(metadata)}, not an object of strings")
    else:
        problems += [f"{METADATA_KEY} value {k[:80]!r} is {_json_kind(v)}, not a string"
                     for k, v in metadata.items() if not isinstance(v, str)]
    for name, spec in header.items():
        if name != METADATA_KEY:
            problem = _tensor_problem(name, spec)
            if problem:
                problems.append(problem)
    return problems


def _size_problem(path: Path, header: dict[str, object]) -> str:
    """Why a file whose header parses is not the size its tensors need (the library says only "not covered")."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    tensors = [spec for name, spec in header.items() if name != METADATA_KEY]
    needed = max((spec["data_offsets"][1] for spec in tensors), default=0)
    present = path.stat().st_size - 8 - header_len
    if needed > present:
        return f"is truncated: header says {needed} data bytes, file has {present}; re-download or re-save it"
    return f"has {present - needed} bytes after its last tensor, which the format forbids; was it appended to?"


def _explain(path: Path, error: Exception, header: dict[str, object] | None = None) -> SourceError:
    """The library's error as one line naming the file and what is wrong with it (``header``: as
    :func:`read_header` returned it, for the size a truncated file should have)."""
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
    if "not fully covered" in text and header is not None:
        try:
            return SourceError(f"{path} {_size_problem(path, header)}")
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
            pass
    if text.startswith("invalid JSON in header"):
        return SourceError(f"{path} has a corrupt header: {text}; re-download or re-save it")
    if text.startswith(("invalid offset", "invalid shape")):
        return SourceError(f"{path} has an invalid header: {text}")
    return SourceError(f"{path} is not a readable safetensors file: {text}")


@contextlib.contextmanager
def _opened(path: Path, header: dict[str, object] | None = None) -> Iterator:
    """``safe_open(path)``; any error it (or a read through it) raises becomes one SourceError line."""
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise _explain(path, e, header) from e


class SafetensorsFile:
    """One safetensors file, its header read and checked on construction; tensors are read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        problems: list[str] = []
        self.metas: list[TensorMeta] = []
        """Every tensor, in the file's data order (the order :meth:`iter_tensors` yields them)."""
        header = read_header(self.path)
        # The library checks what read_header leaves to it (dtype codes, offsets against shapes and the data);
        # dtypes and shapes then come from the parsed header, not from one library call per tensor.
        with _opened(self.path, header) as f:
            order = f.offset_keys()
        self.metadata: dict[str, str] = dict(header.get(METADATA_KEY) or {})  # type: ignore[arg-type]
        with _no_gc():
            self._read_metas(header, order, problems)
        if problems:
            raise SourceError(f"{self.path} cannot be read: {_summarize(problems)}")

    def _read_metas(self, header: dict[str, object], order: Sequence[str], problems: list[str]) -> None:
        for name in order:
            spec = header[name]
            code, shape = spec["dtype"], spec["shape"]  # type: ignore[index]
            dtype = DTYPE_CODES.get(code)
            if dtype is None:
                problems.append(f"tensor {name!r} has dtype {code}, which torch {torch.__version__} cannot hold")
                continue
            self.metas.append(TensorMeta(name, _torch_shape(code, shape), dtype))

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.metas)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors in data order, each backed by the file's pages (copy-on-write, so writable; the mapping lives
        as long as a tensor from it does)."""
        problem = regular_file_problem(self.path)  # replaced since the header was read: never open a FIFO
        if problem:
            raise SourceError(problem)
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
        problem = regular_file_problem(path)
        if problem:
            raise SourceError(problem)
        return [path], None
    try:
        names = os.listdir(path)
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from e
    odd = sorted(n for n in names
                 if (n.endswith(".safetensors") or n == INDEX_FILE_NAME) and regular_file_problem(path / n))
    if odd:
        # Skipping them would load another file than the user meant; opening a FIFO would block forever.
        raise SourceError(f"{path} holds checkpoint file(s) that are not regular files (a FIFO, a device, a "
                          f"directory or a broken link): {_summarize(odd)}; remove them or point at a file")
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
    names = some_of([p.name for p in candidates])
    raise SourceError(
        f"{path} holds {len(candidates)} .safetensors files ({names}) but no {INDEX_FILE_NAME} saying how they "
        "form one checkpoint; point at one file or add the index"
    )


def _read_index(index_path: Path) -> tuple[list[Path], dict[str, str]]:
    try:
        index = load_json(index_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SourceError(f"cannot read {index_path}: {e.strerror or e}") from e
    except HeaderProblem as e:
        raise SourceError(f"{index_path} is not a valid index: {e}") from None
    except (UnicodeDecodeError, ValueError) as e:
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
    odd = [s for s in shard_names if (index_path.parent / s).exists() and not (index_path.parent / s).is_file()]
    if odd:
        raise SourceError(f"{index_path} names shard(s) that are not regular files (a FIFO or a device would block "
                          f"the read): {_summarize(odd)}")
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


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_STAGING_INFIX = ".refit-save-"
_STAGING_TRIES = 5
_OUR_TEMP_FILE = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")
"""Names :func:`~refit_app.common.files.create_temp` gives: a killed save's temporary files, never carried forward."""


def _staging_pattern(target: Path) -> re.Pattern[str]:
    return re.compile(rf"^\.{re.escape(target.name)}{re.escape(_STAGING_INFIX)}[0-9a-f]{{12}}$")


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap the directory entries ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where
    this system or file system cannot (no such call, or EINVAL/ENOTSUP from the file system)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28+, musl 1.2.5+
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def switch_dirs(staging: Path, target: Path) -> None:
    """Make ``staging`` the directory at ``target``; the previous one, if any, ends up at ``staging``'s name.

    One atomic step where ``target`` does not exist yet (a rename) or where the system can exchange two
    directories; elsewhere two renames, between which ``target`` is briefly missing (never a mix of old and new).
    """
    if not os.path.lexists(target):
        os.rename(staging, target)
        return
    if exchange_dirs(staging, target):
        return
    logger.warning("this system cannot exchange two directories in one step; replacing %s with two renames",
                   target)
    aside = staging.with_name(f".{target.name}{_STAGING_INFIX}{secrets.token_hex(6)}")
    os.rename(target, aside)
    os.rename(staging, target)
    os.rename(aside, staging)


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link ``src`` at ``dst`` (free, same file system), or copy it where links are refused."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        if not stat.S_ISREG(os.lstat(src).st_mode):
            logger.warning("not carrying %s into the new checkpoint: not a regular file", src)
            return
        shutil.copy2(src, dst)


def carry_over(old: Path, new: Path, skip: set[str]) -> None:
    """Bring every entry of ``old`` that is not in ``skip`` into ``new``: the user's own files (a tokenizer, a
    README, a subdirectory) survive a save that replaces the directory holding them."""
    for entry in os.scandir(old):
        if entry.name in skip or _OUR_TEMP_FILE.match(entry.name):
            continue
        dst = new / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), dst)
        elif entry.is_dir():
            shutil.copytree(entry.path, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry.path, str(dst))


def _locked_dir(path: Path) -> int | None:
    """An open descriptor of the directory ``path`` holding its exclusive lock, or None if a live process holds
    it (a save in progress). The lock dies with its process, so a killed save's directory is free to take."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open directory ``fd`` is still the one at ``path`` (not removed, not replaced)."""
    try:
        here, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def remove_leftovers(target: Path) -> None:
    """Remove what saves into ``target`` that were killed left beside it: directories named as this module names
    its staging directories and locked by no live process."""
    pattern = _staging_pattern(target)
    try:
        names = [n for n in os.listdir(target.parent) if pattern.match(n)]
    except OSError:
        return
    for name in names:
        path = target.parent / name
        fd = _locked_dir(path)
        if fd is None:
            continue
        try:
            logger.info("removing %s, left by an interrupted save", path)
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)


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
            raise SinkError(f"refusing companion files for {self.directory}: {_summarize(problems)}")
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
            raise SinkError(f"{self.directory} is a mount point, which a save cannot replace as a whole; save into "
                            f"a directory inside it (for example {self.directory / 'model'})")
        remove_leftovers(target)
        self.staging, self._lock = self._claim_staging(target)
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
    def _claim_staging(target: Path) -> tuple[Path, int]:
        """A new staging directory beside ``target``, locked by this process.

        Between its creation and its lock another save's :func:`remove_leftovers` may take it for a killed save's
        and remove it: the lock then fails, or holds a directory no longer at that path. Either way, try a new one.
        """
        for _ in range(_STAGING_TRIES):
            staging = target.parent / f".{target.name}{_STAGING_INFIX}{secrets.token_hex(6)}"
            try:
                staging.mkdir()
            except OSError as e:
                raise SinkError(f"cannot create a directory in {target.parent}: {e.strerror or e} (a checkpoint is "
                                "written beside its directory and swapped in whole, so the parent must be "
                                "writable)") from e
            fd = _locked_dir(staging)
            if fd is not None and _is_at(fd, staging):
                return staging, fd
            if fd is not None:
                os.close(fd)
            logger.info("%s was removed by another save before this one locked it; trying another", staging)
        raise SinkError(f"could not keep a staging directory beside {target} in {_STAGING_TRIES} tries: other "
                        "processes removed each one; is another save running into the same place?")

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

    def commit(self) -> list[Path]:
        """Seal every file, complete the staging directory, swap it in for the old one; returns the final paths."""
        staging, target = self.staging, self._target
        if staging is None:
            raise RuntimeError("CheckpointWriter.commit() before open()")
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
                write_atomic(staging / INDEX_FILE_NAME, json.dumps(index, indent=2).encode() + b"\n", durable=True)
            if target.is_dir():
                stale = {p.name for p in self._previous_files(target)}
                carry_over(target, staging, stale | set(self.file_names))
                os.chmod(staging, stat.S_IMODE(target.stat().st_mode))
            fsync_dir(staging)
            switch_dirs(staging, target)
        except OSError as e:
            self.abort()
            raise SinkError(f"cannot publish the checkpoint in {self.directory}: {e.strerror or e}") from e
        except BaseException:
            self.abort()
            raise
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
