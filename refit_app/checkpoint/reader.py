"""Reading a safetensors checkpoint: one file, or a Hugging Face model directory (single or sharded), and the
companion files beside it.

Reading goes through ``safetensors.safe_open``, the reference implementation: lazy and memory-mapped (a
checkpoint larger than memory streams through), every dtype it knows, and its header validation, after
:func:`~refit_app.checkpoint.header.read_header` has checked the header itself. Each of its errors is turned into
one line naming the file and what is wrong (truncated, corrupt header, a dtype torch cannot hold), raised when the
checkpoint is opened, before any data moves, not half-way through a refit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from refit_app.checkpoint.dtypes import DTYPE_CODES, torch_shape
from refit_app.checkpoint.header import (
    METADATA_KEY,
    HeaderProblem,
    load_json,
    no_gc,
    read_header,
    regular_file_problem,
    summarize,
)
from refit_app.checkpoint.layout import (
    COMPANION_FILE_NAMES,
    INDEX_FILE_NAME,
    MAX_COMPANION_BYTES,
    MAX_COMPANION_FILE_BYTES,
    SINGLE_FILE_NAME,
)
from refit_app.common.errors import SourceError, some_of
from refit_app.common.sizes import format_size
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import tensor_bytes as tensor_byte_view

logger = logging.getLogger(__name__)


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
        return SourceError(
            f"{path} is not a safetensors file: it has {size} bytes, fewer than the 8-byte header length"
        )
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
        with no_gc():
            self._read_metas(header, order, problems)
        if problems:
            raise SourceError(f"{self.path} cannot be read: {summarize(problems)}")

    def _read_metas(self, header: dict[str, object], order: Sequence[str], problems: list[str]) -> None:
        for name in order:
            spec = header[name]
            code, shape = spec["dtype"], spec["shape"]  # type: ignore[index]
            dtype = DTYPE_CODES.get(code)
            if dtype is None:
                problems.append(f"tensor {name!r} has dtype {code}, which torch {torch.__version__} cannot hold")
                continue
            self.metas.append(TensorMeta(name, torch_shape(code, shape), dtype))

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
            logger.warning(
                "not sending %s (%s): over the %s limit %s; copy it beside the saved checkpoint yourself",
                path,
                format_size(size),
                format_size(limit),
                cap,
            )
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
    odd = sorted(
        n for n in names if (n.endswith(".safetensors") or n == INDEX_FILE_NAME) and regular_file_problem(path / n)
    )
    if odd:
        # Skipping them would load another file than the user meant; opening a FIFO would block forever.
        raise SourceError(
            f"{path} holds checkpoint file(s) that are not regular files (a FIFO, a device, a "
            f"directory or a broken link): {summarize(odd)}; remove them or point at a file"
        )
    single, index_path = path / SINGLE_FILE_NAME, path / INDEX_FILE_NAME
    if single.is_file() and index_path.is_file():
        # Loaders disagree on which wins (transformers takes the single file), and one of them is often a stale
        # leftover of an earlier save: reading either would send weights the user may not mean.
        raise SourceError(
            f"{path} holds both {SINGLE_FILE_NAME} and {INDEX_FILE_NAME}, so it is not clear which is the checkpoint "
            f"(one may be stale); remove the other, or point source.path at {single} for the single file"
        )
    if single.is_file():
        return [single], None
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
    if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
        raise SourceError(f'{index_path} has no "weight_map" object of tensor name -> shard file')
    shard_names = sorted(set(weight_map.values()))
    bad = [s for s in shard_names if Path(s).name != s]
    if bad:
        raise SourceError(f"{index_path} names shards outside its directory: {summarize(bad)}")
    odd = [s for s in shard_names if (index_path.parent / s).exists() and not (index_path.parent / s).is_file()]
    if odd:
        raise SourceError(
            f"{index_path} names shard(s) that are not regular files (a FIFO or a device would block "
            f"the read): {summarize(odd)}"
        )
    missing = [s for s in shard_names if not (index_path.parent / s).is_file()]
    if missing:
        raise SourceError(f"{index_path} names {len(missing)} missing shard file(s): {summarize(missing)}")
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
            # The index is the checkpoint's list of tensors: one it does not list (a leftover) is not sent.
            problems += [
                f"{name!r} is in {shard}, but the index does not list it"
                for name, shard in owner.items()
                if name not in weight_map
            ]
        if problems:
            raise SourceError(f"{self.path} is inconsistent: {summarize(problems)}")

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
