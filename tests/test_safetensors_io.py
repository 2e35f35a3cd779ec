"""The safetensors reader (the ``safetensors`` package behind refit_app's one-line errors) and the streaming writer:
every dtype, files identical to the reference writer's, real and sharded checkpoints, companion files."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from tensor_utils import raw_bytes

from refit_app.checkpoint.dtypes import DTYPE_CODES
from refit_app.checkpoint.layout import INDEX_FILE_NAME, SINGLE_FILE_NAME
from refit_app.checkpoint.reader import Checkpoint, SafetensorsFile
from refit_app.checkpoint.writer import CheckpointWriter, SafetensorsWriter, save_tensors
from refit_app.common.errors import SinkError, SourceError
from refit_app.core.meta import TensorMeta


def write_raw(path: Path, header: object, data: bytes = b"", header_bytes: bytes | None = None) -> Path:
    encoded = header_bytes if header_bytes is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


def sample_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype``: NaN payloads and odd bit patterns included, to test bit-exactness."""
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw % 2).to(torch.bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


def leftover_temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp"))


def assert_one_line_source_error(excinfo: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def assert_reference_loads_identical(path: Path, expected: dict[str, torch.Tensor]) -> None:
    """``path`` loads with the safetensors package itself, tensor for tensor identical to ``expected``."""
    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        for name, want in expected.items():
            got = f.get_tensor(name)
            assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), name
            assert raw_bytes(got) == raw_bytes(want), name
            assert got.numel() == 0 or got.data_ptr() % got.element_size() == 0, f"{name} is misaligned in {path}"


# ------------------------------------------------------------------------------------------ validation


def test_truncated_data_names_sizes(tmp_path):
    path = save_tensors(tmp_path / "model.safetensors", {"w": torch.zeros(1000, dtype=torch.float32)})
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    with open(path, "r+b") as f:
        f.truncate(8 + header_len + 1000)
    with pytest.raises(SourceError) as excinfo:
        SafetensorsFile(path)
    assert_one_line_source_error(excinfo, str(path), "is truncated: header says 4000 data bytes, file has 1000")


def test_trailing_bytes_named(tmp_path):
    path = save_tensors(tmp_path / "model.safetensors", {"w": torch.zeros(4, dtype=torch.float32)})
    with open(path, "ab") as f:
        f.write(b"junk")
    with pytest.raises(SourceError) as excinfo:
        SafetensorsFile(path)
    assert_one_line_source_error(excinfo, str(path), "4 bytes after its last tensor")


def test_truncated_inside_header(tmp_path):
    path = save_tensors(tmp_path / "m.safetensors", {"w": torch.zeros(10)})
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(SourceError) as excinfo:
        SafetensorsFile(path)
    assert_one_line_source_error(excinfo, str(path), "is truncated", "file has 12")


def test_shorter_than_length_field(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"abc")
    with pytest.raises(SourceError) as excinfo:
        SafetensorsFile(path)
    assert_one_line_source_error(excinfo, str(path), "not a safetensors file", "3 bytes")


def test_absurd_header_length(tmp_path):
    path = tmp_path / "text.safetensors"
    path.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(SourceError) as excinfo:
        SafetensorsFile(path)
    assert_one_line_source_error(excinfo, str(path), "not a safetensors file")


def test_corrupt_json(tmp_path):
    path = write_raw(tmp_path / "m.safetensors", None, header_bytes=b'{"w": {"dtype": "F32", ')
    with pytest.raises(SourceError) as excinfo:
        SafetensorsFile(path)
    assert_one_line_source_error(excinfo, str(path), "corrupt header", "invalid JSON")


def test_header_not_an_object(tmp_path):
    path = write_raw(tmp_path / "m.safetensors", [1, 2, 3])
    with pytest.raises(SourceError) as excinfo:
        SafetensorsFile(path)
    assert_one_line_source_error(excinfo, str(path), "corrupt header", "sequence")


def test_unknown_dtype_named(tmp_path):
    header = {
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "b": {"dtype": "F33", "shape": [1], "data_offsets": [4, 8]},
    }
    path = write_raw(tmp_path / "m.safetensors", header, bytes(8))
    with pytest.raises(SourceError) as excinfo:
        SafetensorsFile(path)
    assert_one_line_source_error(excinfo, str(path), "corrupt header", "F33")


def test_dtype_torch_cannot_hold_is_named(tmp_path):
    # F6_E2M3 is valid safetensors (4 six-bit values in 3 bytes), but torch has no dtype for it.
    header = {
        "a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]},
        "b": {"dtype": "F6_E3M2", "shape": [4], "data_offsets": [3, 6]},
    }
    path = write_raw(tmp_path / "m.safetensors", header, bytes(6))
    with pytest.raises(SourceError) as excinfo:
        SafetensorsFile(path)
    assert_one_line_source_error(
        excinfo, str(path), "'a' has dtype F6_E2M3, which torch", "'b' has dtype F6_E3M2", "cannot hold"
    )


def test_overlapping_ranges(tmp_path):
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    path = write_raw(tmp_path / "m.safetensors", header, bytes(12))
    with pytest.raises(SourceError) as excinfo:
        SafetensorsFile(path)
    assert_one_line_source_error(excinfo, str(path), "invalid header", "invalid offset")


def test_shape_disagrees_with_byte_range(tmp_path):
    header = {"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 8]}}
    path = write_raw(tmp_path / "m.safetensors", header, bytes(8))
    with pytest.raises(SourceError) as excinfo:
        SafetensorsFile(path)
    assert_one_line_source_error(excinfo, str(path), "invalid header", "shape")


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        ({"__metadata__": {"format": 1}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, "integer"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "-1"),
        ({"a": {"dtype": "F32"}}, "missing field"),
        ({"a": 7}, "integer `7`"),
    ],
)
def test_malformed_entries_and_metadata(tmp_path, header, fragment):
    path = write_raw(tmp_path / "m.safetensors", header, bytes(4))
    with pytest.raises(SourceError) as excinfo:
        SafetensorsFile(path)
    assert_one_line_source_error(excinfo, str(path), "corrupt header", fragment)


def test_unreadable_file_named(tmp_path):
    path = tmp_path / "gone.safetensors"
    with pytest.raises(SourceError) as excinfo:
        SafetensorsFile(path)
    assert_one_line_source_error(excinfo, str(path))


def test_missing_path(tmp_path):
    with pytest.raises(SourceError) as excinfo:
        Checkpoint(tmp_path / "nope")
    assert_one_line_source_error(excinfo, str(tmp_path / "nope"), "does not exist")


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SourceError) as excinfo:
        Checkpoint(tmp_path)
    assert_one_line_source_error(excinfo, str(tmp_path), "no safetensors checkpoint")


def test_index_names_missing_shard(tmp_path):
    save_tensors(tmp_path / "model-00001-of-00002.safetensors", {"a": torch.zeros(2)})
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / INDEX_FILE_NAME).write_text(json.dumps(index))
    with pytest.raises(SourceError) as excinfo:
        Checkpoint(tmp_path)
    assert_one_line_source_error(excinfo, INDEX_FILE_NAME, "missing shard", "model-00002-of-00002.safetensors")


def test_index_disagrees_with_shards(tmp_path):
    save_tensors(tmp_path / "s1.safetensors", {"a": torch.zeros(2), "b": torch.zeros(1)})
    save_tensors(tmp_path / "s2.safetensors", {"b": torch.zeros(1)})
    index = {"weight_map": {"a": "s2.safetensors", "b": "s1.safetensors"}}
    (tmp_path / INDEX_FILE_NAME).write_text(json.dumps(index))
    with pytest.raises(SourceError) as excinfo:
        Checkpoint(tmp_path)
    assert_one_line_source_error(
        excinfo, "'b' is in both s1.safetensors and s2.safetensors", "index puts 'a' in s2.safetensors but it is in s1"
    )


def test_a_single_file_beside_an_index_is_refused_naming_both(tmp_path):
    """Which of the two is the checkpoint is not the reader's guess to make: one may be stale."""
    save_tensors(tmp_path / SINGLE_FILE_NAME, {"a": torch.zeros(2)})
    save_tensors(tmp_path / "s1.safetensors", {"a": torch.ones(2)})
    (tmp_path / INDEX_FILE_NAME).write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    with pytest.raises(SourceError) as excinfo:
        Checkpoint(tmp_path)
    assert_one_line_source_error(excinfo, str(tmp_path), f"both {SINGLE_FILE_NAME} and {INDEX_FILE_NAME}")


def test_a_tensor_that_the_index_does_not_list_is_refused(tmp_path):
    save_tensors(tmp_path / "s1.safetensors", {"a": torch.zeros(2), "stray": torch.zeros(1)})
    save_tensors(tmp_path / "s2.safetensors", {"b": torch.zeros(1)})
    (tmp_path / INDEX_FILE_NAME).write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    with pytest.raises(SourceError) as excinfo:
        Checkpoint(tmp_path)
    assert_one_line_source_error(excinfo, "'stray' is in s1.safetensors, but the index does not list it")


def test_several_files_without_index(tmp_path):
    save_tensors(tmp_path / "a.safetensors", {"a": torch.zeros(1)})
    save_tensors(tmp_path / "b.safetensors", {"b": torch.zeros(1)})
    with pytest.raises(SourceError) as excinfo:
        Checkpoint(tmp_path)
    assert_one_line_source_error(excinfo, "2 .safetensors files", INDEX_FILE_NAME)


# ------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype_bit_exact(tmp_path, code):
    dtype = DTYPE_CODES[code]
    tensors = {
        # A one-byte tensor first would push every later tensor off its alignment in a file laid out in order.
        "odd": torch.ones(1, dtype=torch.uint8),
        "empty": sample_tensor(dtype, (0, 4), seed=2),
        "matrix": sample_tensor(dtype, (7, 6), seed=3),
        "transposed": sample_tensor(dtype, (4, 6), seed=4).t(),
    }
    if dtype != torch.float4_e2m1fn_x2:  # two packed values: no 0-dim form in safetensors (refused below)
        tensors["scalar"] = sample_tensor(dtype, (), seed=1)
    path = save_tensors(tmp_path / "m.safetensors", tensors, {"format": "pt", "note": code})
    f = SafetensorsFile(path)
    assert f.metadata == {"format": "pt", "note": code}
    read = dict(f.iter_tensors())
    assert sorted(read) == sorted(tensors)
    for name, want in tensors.items():
        got = read[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert raw_bytes(got) == raw_bytes(want), name
        assert got.numel() == 0 or got.data_ptr() % got.element_size() == 0, f"{name} is misaligned"
    assert_reference_loads_identical(path, tensors)


def test_file_is_byte_identical_to_the_reference_writers(tmp_path):
    """Same layout (widest dtype first, then by name), same header, same padding: a file refit_app writes is the
    file ``safetensors.torch.save_file`` writes. (One metadata key: the reference writer orders several by hash.)"""
    tensors = {code: sample_tensor(dtype, (3, 2), seed=i) for i, (code, dtype) in enumerate(DTYPE_CODES.items())}
    tensors |= {"b.scalar": torch.tensor(2.5), "a.empty": torch.empty(0, 3, dtype=torch.bfloat16), "ü": torch.ones(2)}
    for metadata in (None, {"format": "pt"}):
        ours = save_tensors(tmp_path / "ours.safetensors", tensors, metadata)
        reference = tmp_path / "reference.safetensors"
        safetensors.torch.save_file(tensors, reference, metadata=metadata)
        assert ours.read_bytes() == reference.read_bytes()


def test_reads_files_the_reference_writer_wrote(tmp_path):
    # Including the dtypes the hand-written reader refused: F8_E8M0 and the FNUZ float8 types.
    tensors = {code: sample_tensor(dtype, (5, 4), seed=i) for i, (code, dtype) in enumerate(DTYPE_CODES.items())}
    assert {"F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"} <= set(tensors)
    path = tmp_path / "reference.safetensors"
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    f = SafetensorsFile(path)
    assert f.metadata == {"format": "pt"}
    assert {m.name: (m.dtype, m.shape) for m in f.metas} == {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    for name, t in f.iter_tensors():
        assert raw_bytes(t) == raw_bytes(tensors[name]), name


def test_unaligned_file_from_another_writer_reads_aligned(tmp_path):
    header = {
        "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]},
    }
    data = b"\x07" + torch.tensor([1.5, -2.0]).numpy().tobytes()
    path = write_raw(tmp_path / "m.safetensors", header, data)
    read = dict(SafetensorsFile(path).iter_tensors())
    assert read["b"].tolist() == [1.5, -2.0]
    assert read["b"].data_ptr() % 4 == 0


def test_read_tensors_are_copy_on_write(tmp_path):
    path = save_tensors(tmp_path / "m.safetensors", {"w": torch.arange(4, dtype=torch.float32)})
    before = path.read_bytes()
    ((_, t),) = SafetensorsFile(path).iter_tensors()
    t.fill_(7.0)
    assert path.read_bytes() == before


def test_minilm_matches_the_reference_reader(minilm_dir):
    path = minilm_dir / "model.safetensors"
    ours = list(Checkpoint(path).iter_tensors())
    with safe_open(path, framework="pt") as f:
        assert [name for name, _ in ours] == f.offset_keys()
        assert len(ours) >= 100
        for name, t in ours:
            assert raw_bytes(t) == raw_bytes(f.get_tensor(name)), name


def sharded_metas() -> list[TensorMeta]:
    metas = []
    for i in range(3):
        shard = f"model-0000{i + 1}-of-00003.safetensors"
        metas += [
            TensorMeta(f"layers.{i}.w", (8, 4), torch.bfloat16, shard),
            TensorMeta(f"layers.{i}.scale", (), torch.float32, shard),
            TensorMeta(f"layers.{i}.ids", (5,), torch.int64, shard),
        ]
    return metas


def test_sharded_write_then_read_in_order(tmp_path):
    metas = sharded_metas()
    data = {m.name: sample_tensor(m.dtype, m.shape, seed=i) for i, m in enumerate(metas)}
    writer = CheckpointWriter(tmp_path, metas, {"format": "pt"})
    writer.open()
    for m in reversed(metas):  # any arrival order lands at the precomputed offsets
        writer.write(m.name, data[m.name])
    files = writer.commit()
    assert sorted(p.name for p in files) == sorted({m.shard for m in metas} | {INDEX_FILE_NAME})
    assert leftover_temp_files(tmp_path) == []

    index = json.loads((tmp_path / INDEX_FILE_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(m.nbytes for m in metas)
    assert index["weight_map"] == {m.name: m.shard for m in metas}

    ckpt = Checkpoint(tmp_path)
    # Each shard in the reference writer's layout (widest dtype first, then by name); shards in index order.
    assert sorted(ckpt.metas(), key=lambda m: m.name) == sorted(metas, key=lambda m: m.name)
    assert [m.shard for m in ckpt.metas()] == [m.shard for m in metas]
    assert ckpt.metadata() == {"format": "pt"}
    read = list(ckpt.iter_tensors())
    assert [n for n, _ in read] == [m.name for m in ckpt.metas()]
    for name, t in read:
        assert raw_bytes(t) == raw_bytes(data[name]), name
    for shard in {m.shard for m in metas}:
        assert_reference_loads_identical(tmp_path / shard, {m.name: data[m.name] for m in metas if m.shard == shard})


def test_writer_abort_removes_temp_files(tmp_path):
    metas = sharded_metas()
    writer = CheckpointWriter(tmp_path / "ckpt", metas)
    writer.open()
    assert writer.staging is not None and writer.staging.parent == tmp_path
    assert len(leftover_temp_files(writer.staging)) == 3
    writer.write(metas[0].name, torch.zeros(metas[0].shape, dtype=metas[0].dtype))
    writer.abort()
    writer.abort()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"] and list((tmp_path / "ckpt").iterdir()) == []


def test_writer_refuses_incomplete_or_wrong_tensors(tmp_path):
    metas = [TensorMeta("a", (2,), torch.float32), TensorMeta("b", (3,), torch.float16)]
    writer = SafetensorsWriter(tmp_path / SINGLE_FILE_NAME, metas)
    writer.open()
    with pytest.raises(SinkError, match=r"got torch.float32 \[3\], manifest says torch.float16 \[3\]"):
        writer.write("b", torch.zeros(3))
    with pytest.raises(SinkError, match="not in the manifest"):
        writer.write("c", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(SinkError, match="arrived twice"):
        writer.write("a", torch.zeros(2))
    with pytest.raises(SinkError, match=r"1 tensor\(s\) never arrived: b"):
        writer.seal()
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_a_packed_scalar(tmp_path):
    with pytest.raises(SinkError, match=r"'s' is a 0-dim torch\.float4_e2m1fn_x2"):
        SafetensorsWriter(tmp_path / "x.safetensors", [TensorMeta("s", (), torch.float4_e2m1fn_x2)])


def test_writer_rejects_duplicate_names(tmp_path):
    with pytest.raises(SinkError, match="'a' appears twice"):
        SafetensorsWriter(tmp_path / "x.safetensors", [TensorMeta("a", (1,), torch.float32)] * 2)


def test_shard_names_cannot_escape_directory(tmp_path):
    metas = [
        TensorMeta("a", (1,), torch.float32, "../evil.safetensors"),
        TensorMeta("b", (1,), torch.float32, "ok.safetensors"),
    ]
    with pytest.raises(SinkError, match=r"refusing shard file names \.\./evil\.safetensors"):
        CheckpointWriter(tmp_path, metas)


def test_new_checkpoint_replaces_old_only_on_commit(tmp_path):
    old = sharded_metas()
    old_writer = CheckpointWriter(tmp_path, old)
    old_writer.open()
    for m in old:
        old_writer.write(m.name, torch.zeros(m.shape, dtype=m.dtype))
    old_writer.commit()
    old_files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    new = [TensorMeta("w", (3,), torch.float32)]
    failed = CheckpointWriter(tmp_path, new)
    failed.open()
    failed.abort()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == old_files

    writer = CheckpointWriter(tmp_path, new)
    writer.open()
    writer.write("w", torch.ones(3))
    writer.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE_NAME]
    assert [n for n, _ in Checkpoint(tmp_path).iter_tensors()] == ["w"]


def test_saved_files_get_ordinary_permissions(tmp_path):
    previous = os.umask(0o022)
    try:
        path = save_tensors(tmp_path / "m.safetensors", {"w": torch.ones(1)})
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_save_removes_only_shards_that_the_old_index_named(tmp_path):
    # An old sharded checkpoint whose index also names config.json (hand-edited, or hostile).
    old = [
        TensorMeta("a", (2,), torch.float32, "model-00001-of-00002.safetensors"),
        TensorMeta("b", (2,), torch.float32, "model-00002-of-00002.safetensors"),
    ]
    writer = CheckpointWriter(tmp_path, old, {"format": "pt"})
    writer.open()
    for m in old:
        writer.write(m.name, torch.ones(m.shape))
    writer.commit()
    index = json.loads((tmp_path / INDEX_FILE_NAME).read_text())
    index["weight_map"]["c"] = "config.json"
    (tmp_path / INDEX_FILE_NAME).write_text(json.dumps(index))
    (tmp_path / "config.json").write_text("{}")

    new = [TensorMeta("a", (2,), torch.float32, SINGLE_FILE_NAME)]
    writer = CheckpointWriter(tmp_path, new, {"format": "pt"})
    writer.open()
    writer.write("a", torch.zeros(2))
    writer.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", SINGLE_FILE_NAME]
