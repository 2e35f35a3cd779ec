"""Hostile or odd files as a source: each is refused at start-up with one line naming the file and the problem,
never a hang, a traceback, C++ frames from torch or the wrong advice.

Headers are checked once, where they are read (``checkpoint.header.read_header``): a number of thousands of digits,
JSON nested 200k deep, a zero-element shape whose other sizes overflow int64, a duplicate key, an impossible
header length. A FIFO (or any non-regular file) is refused from ``stat`` alone, before anything opens it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from refit_app.checkpoint.reader import Checkpoint, SafetensorsFile
from refit_app.common.errors import SourceError


def write_header(path: Path, header: str | bytes, data: bytes = b"") -> Path:
    """A file of ``header`` and ``data``; the hostile headers describe exactly their data (8 bytes at most), so
    nothing but the header's hostility is wrong with them."""
    raw = header.encode() if isinstance(header, str) else header
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and "Exception raised from" not in message and "c10::" not in message, message
    return message


def refused(path: Path) -> str:
    with pytest.raises(SourceError) as excinfo:
        Checkpoint(path)
    message = one_line(excinfo)
    assert str(path) in message, message
    return message


ENTRY = '{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
HOSTILE_HEADERS = {
    "huge shape number": (
        '{"a":{"dtype":"F32","shape":[' + "9" * 5000 + '],"data_offsets":[0,8]}}',
        "number of 5000 digits",
    ),
    "huge offset number": (
        '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,1' + "0" * 3000 + "]}}",
        "number of 3001 digits",
    ),
    "deep nesting": ('{"__metadata__":{"x":' + "[" * 200_000 + "]" * 200_000 + "}}", "nests"),
    "deep nesting, tensor entry": ('{"a":' + '{"b":' * 200_000 + "1" + "}" * 200_001, "nests"),
    "zero elements, overflowing sizes": (
        '{"a":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}}',
        "multiply past int64",
    ),
    "size above int64": (
        '{"a":{"dtype":"F32","shape":[0,9223372036854775808],"data_offsets":[0,0]}}',
        "not a list of sizes",
    ),
    "duplicate tensor": ('{"a":' + ENTRY + ',"a":' + ENTRY + "}", "key 'a' appears twice"),
    "duplicate field": (
        '{"a":{"dtype":"F32","dtype":"I32","shape":[2],"data_offsets":[0,8]}}',
        "key 'dtype' appears twice",
    ),
    "duplicate metadata key": ('{"__metadata__":{"k":"1","k":"2"},"a":' + ENTRY + "}", "key 'k' appears twice"),
    "NaN": ('{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]}}', "NaN"),
    "float size": ('{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', "only integers"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_hostile_headers_are_refused_in_one_line(tmp_path, case):
    header, fragment = HOSTILE_HEADERS[case]
    message = refused(write_header(tmp_path / "m.safetensors", header, b"\0" * 8 if "[0,8]" in header else b""))
    assert fragment in message and "corrupt header" in message and "re-download or re-save" in message, message


@pytest.mark.parametrize(
    ("length", "fragment"),
    [
        (2**64 - 1, "negative header length"),
        (2**63, "negative header length"),
        (2**40, "above the format's limit"),
        (1000, "is truncated"),
    ],
)
def test_impossible_header_lengths(tmp_path, length, fragment):
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", length) + b"{}" + b"\0" * 6)
    assert fragment in refused(path)


def test_a_valid_header_still_loads(tmp_path):
    path = write_header(tmp_path / "m.safetensors", '{"__metadata__":{"format":"pt"},"a":' + ENTRY + "}", b"\0" * 8)
    f = SafetensorsFile(path)
    assert [m.name for m in f.metas] == ["a"] and f.metadata == {"format": "pt"}


def test_a_hostile_index_is_refused(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map":{"a":"s.safetensors"},"metadata":' + "[" * 200_000 + "]" * 200_000 + "}"
    )
    assert "nests" in refused(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map":{"a":"s1.safetensors","a":"s2.safetensors"}}')
    assert "appears twice" in refused(tmp_path)


def test_fifo_in_a_directory_is_refused_without_opening_it(tmp_path):
    os.mkfifo(tmp_path / "model.safetensors")
    assert "FIFO" in refused(tmp_path)
    os.unlink(tmp_path / "model.safetensors")
    os.mkfifo(tmp_path / "s2.safetensors")
    write_header(tmp_path / "s1.safetensors", '{"a":' + ENTRY + "}", b"\0" * 8)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})
    )
    assert "s2.safetensors" in refused(tmp_path)


def test_cli_refuses_a_fifo_source(cli, tmp_path):
    fifo = tmp_path / "m.safetensors"
    os.mkfifo(fifo)
    result = cli("source=safetensors", f"source.path={fifo}", "sink=discard")
    assert result.returncode == 1, result.describe()
    lines = [line for line in result.stderr_lines() if line.startswith("refit_app: error:")]
    assert len(lines) == 1 and "is a FIFO, not a regular file" in lines[0], result.describe()
    assert "Traceback" not in result.stderr, result.describe()


def test_cli_refuses_a_hostile_header(cli, tmp_path):
    header, fragment = HOSTILE_HEADERS["zero elements, overflowing sizes"]
    path = write_header(tmp_path / "m.safetensors", header)
    result = cli("source=safetensors", f"source.path={path}", "sink=discard")
    assert result.returncode == 1, result.describe()
    lines = [line for line in result.stderr_lines() if line.startswith("refit_app: error:")]
    assert len(lines) == 1 and fragment in lines[0] and str(path) in lines[0], result.describe()
    assert "Traceback" not in result.stderr and "c10::" not in result.stderr, result.describe()


def test_cli_refuses_a_directory_with_both_a_single_file_and_an_index(cli, tmp_path):
    """Exit 1 and one line, before anything connects: a stale file beside the checkpoint is never sent."""
    write_header(tmp_path / "model.safetensors", '{"a":' + ENTRY + "}", b"\0" * 8)
    write_header(tmp_path / "s1.safetensors", '{"a":' + ENTRY + "}", b"\0" * 8)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    result = cli("source=safetensors", f"source.path={tmp_path}", "sink=discard")
    assert result.returncode == 1, result.describe()
    assert result.stderr_lines() == [
        f"refit_app: error: {tmp_path} holds both model.safetensors and model.safetensors.index.json, so it is not "
        "clear which is the checkpoint (one may be stale); remove the other, or point source.path at "
        f"{tmp_path / 'model.safetensors'} for the single file"
    ], result.describe()
    assert "Traceback" not in result.stdout, result.describe()
