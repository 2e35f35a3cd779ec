"""Checking a safetensors header before anything trusts it: every header is checked by :func:`read_header` before
the ``safetensors`` library sees it. The file must be a regular file (a FIFO would block the open forever), its header
a JSON object within the format's limits, with no duplicate key, no number longer than an int64, no nesting deeper
than a real header has, and no shape torch could not describe. A hostile or damaged file is refused with one line,
not with a crash deep inside the library or torch. :func:`load_json` is the same guarded parse for an index file.

Torch-free: what is checked here is JSON and ``stat``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import stat
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

from refit_app.common.errors import SourceError, some_of

METADATA_KEY = "__metadata__"
"""The header's one entry that is not a tensor: string metadata (``{"format": "pt"}``)."""


def summarize(problems: Sequence[str]) -> str:
    """Problems in one line, as every error about a checkpoint lists them (the reader's and the writer's too)."""
    return some_of(problems, sep="; ")


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
        return json.loads(
            text,
            object_pairs_hook=_unique_keys,
            parse_int=_bounded_int if long_digits else None,
            parse_float=_bounded_float if floats else _no_float,
            parse_constant=_no_constant,
        )
    except RecursionError:
        raise HeaderProblem("it nests objects or arrays thousands deep, far deeper than any real file") from None


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
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
            return (
                f"tensor {name[:80]!r} has shape {str(shape)[:80]}, whose sizes multiply past int64 (zero "
                "elements or not)"
            )
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        return f"tensor {name[:80]!r} has data_offsets that are not [begin, end] int64 offsets"
    return None


def _json_kind(value: object) -> str:
    """A JSON value in words, as the library's errors put it (``integer `7```)."""
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "sequence", dict: "map"}
    kind = kinds.get(type(value), "null")
    return f"{kind} `{value}`" if isinstance(value, (int, float)) else kind


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
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
                f"{path} is not a safetensors file: it has {st.st_size} bytes, fewer than the 8-byte header length"
            )
        (header_len,) = struct.unpack("<Q", _read_exactly(fd, 8))
        if header_len > INT64_MAX:
            raise SourceError(f"{path} is not a safetensors file: its first 8 bytes give a negative header length")
        if header_len > MAX_HEADER_BYTES:
            raise SourceError(
                f"{path} is not a safetensors file: its first 8 bytes give a header of {header_len} bytes, above the "
                f"format's limit of {MAX_HEADER_BYTES}"
            )
        if header_len > st.st_size - 8:
            raise SourceError(
                f"{path} is truncated: header length is {header_len} bytes, file has {st.st_size - 8} after "
                "the length field; re-download or re-save it"
            )
        raw = _read_exactly(fd, header_len)
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    try:
        with no_gc():
            header = load_json(raw.decode("utf-8"), floats=False)
    except HeaderProblem as e:
        raise SourceError(
            f"{path} has a corrupt header: {e}; it was not written by a safetensors writer, re-download or re-save it"
        ) from None
    except (UnicodeDecodeError, ValueError) as e:
        raise SourceError(
            f"{path} has a corrupt header: invalid JSON in header: {e}; re-download or re-save it"
        ) from None
    if not isinstance(header, dict):
        kind = "sequence" if isinstance(header, list) else "single value"
        raise SourceError(f"{path} has a corrupt header: it is a JSON {kind}, not an object; re-download or re-save it")
    with no_gc():
        problems = _header_problems(header)
    if problems:
        raise SourceError(f"{path} has a corrupt header: {summarize(problems)}; re-download or re-save it")
    return header


def _header_problems(header: dict[str, object]) -> list[str]:
    problems = []
    metadata = header.get(METADATA_KEY, {})
    if not isinstance(metadata, dict):
        problems.append(f"{METADATA_KEY} is {_json_kind(metadata)}, not an object of strings")
    else:
        problems += [
            f"{METADATA_KEY} value {k[:80]!r} is {_json_kind(v)}, not a string"
            for k, v in metadata.items()
            if not isinstance(v, str)
        ]
    for name, spec in header.items():
        if name != METADATA_KEY:
            problem = _tensor_problem(name, spec)
            if problem:
                problems.append(problem)
    return problems
