"""Consumer sinks (verify, save, discard) fed the way the core feeds them: views into a reused receive buffer."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import signal
import sys
import traceback
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conditions import needs_crc32c, needs_xxhash
from tensor_utils import deliver, raw_bytes, tensor_checksum

from refit_app.checkpoint.layout import INDEX_FILE_NAME, SINGLE_FILE_NAME
from refit_app.checkpoint.reader import Checkpoint
from refit_app.checkpoint.writer import CheckpointWriter, save_tensors
from refit_app.common.errors import ConfigError, HandshakeError, SinkError, VerificationError
from refit_app.core.meta import TensorMeta
from refit_app.models.sinks import CorruptingSink, DiscardSink, SaveSink, VerifySink, make_sink
from refit_app.models.sources import SafetensorsSource, SyntheticSource
from refit_app.protocol.checksum import (
    FALLBACK_ALGORITHM,
    available_algorithms,
    checksum_function,
    default_algorithm,
)
from refit_app.protocol.manifest import Manifest
from refit_app.protocol.verify import Verifier


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("w.bf16", torch.randn(33, 7, generator=g).to(torch.bfloat16)),
        ("s.scalar", torch.tensor(0.5)),
        ("e.empty", torch.empty(0, 4, dtype=torch.float16)),
        ("f.fp8", torch.randn(9, generator=g).to(torch.float8_e4m3fn)),
        ("b.bool", torch.rand(5, generator=g) > 0.5),
        ("c.complex", torch.randn(3, generator=g, dtype=torch.complex64)),
        ("i.int64", torch.arange(6).reshape(2, 3)),
        ("t.strided", torch.randn(6, 4, generator=g).t()),
    ]


def manifest_for(metas: list[TensorMeta], metadata: dict[str, str] | None = None) -> Manifest:
    return Manifest(metas, buffer_size_bytes=1 << 20, use_legacy_packing=False, checksums=True, metadata=metadata or {})


def metas_of(items: list[tuple[str, torch.Tensor]], shard: str | None = None) -> list[TensorMeta]:
    return [TensorMeta(n, tuple(t.shape), t.dtype, shard) for n, t in items]


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def published(directory: Path) -> list[str]:
    """Files under final names (the temporary ones are hidden)."""
    return [name for name in files_in(directory) if not name.startswith(".")]


def read_back(directory: Path) -> dict[str, bytes]:
    return {n: raw_bytes(t) for n, t in Checkpoint(directory).iter_tensors()}


# ------------------------------------------------------------------------------------------ checksum


@pytest.mark.parametrize("algorithm", available_algorithms())
def test_checksum_hashes_row_major_bytes(algorithm):
    digest = checksum_function(algorithm)
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert tensor_checksum(t, algorithm) == digest(t.numpy().tobytes())
    assert tensor_checksum(t.t(), algorithm) == digest(t.t().contiguous().numpy().tobytes())
    assert tensor_checksum(t.t(), algorithm) != tensor_checksum(t, algorithm)
    assert tensor_checksum(torch.tensor(2.0), algorithm) == digest(torch.tensor([2.0]).numpy().tobytes())
    assert tensor_checksum(torch.empty(0, 3), algorithm) == digest(b"")
    assert 0 <= tensor_checksum(t, algorithm) < 2**64


def test_crc32_is_zlibs():
    data = b"refit_app"
    assert checksum_function("crc32")(data) == zlib.crc32(data)


@needs_xxhash
def test_xxh3_64_is_the_xxhash_packages():
    import xxhash

    data = b"refit_app"
    assert "xxh3_64" in available_algorithms()
    assert checksum_function("xxh3_64")(data) == xxhash.xxh3_64(data).intdigest()


@needs_xxhash
def test_xxh3_64_16mib_hashes_a_large_tensor_by_its_pieces():
    """Its definition, computed here independently: xxh3_64 up to one piece; above, the xxh3_64 of the pieces'
    little-endian digests (the last piece shorter). Also on two threads (5 pieces and more)."""
    import xxhash

    from refit_app.protocol.checksum import PIECE_BYTES, PIECED

    rng = np.random.default_rng(0)
    for nbytes in (0, 17, PIECE_BYTES, PIECE_BYTES + 1, 2 * PIECE_BYTES, 5 * PIECE_BYTES - 3):
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        if nbytes <= PIECE_BYTES:
            want = xxhash.xxh3_64_intdigest(data)
        else:
            pieces = [data[at : at + PIECE_BYTES] for at in range(0, nbytes, PIECE_BYTES)]
            want = xxhash.xxh3_64_intdigest(b"".join(xxhash.xxh3_64_digest(p)[::-1] for p in pieces))
        assert checksum_function(PIECED)(data) == want, nbytes


@pytest.mark.parametrize("algorithm", available_algorithms())
def test_an_incremental_checksum_fed_in_any_blocks_or_in_two_parts_is_the_whole_ones(algorithm):
    from refit_app.protocol.checksum import PIECE_BYTES, Incremental, split_point

    rng = np.random.default_rng(1)
    for nbytes in (100, PIECE_BYTES + 5, 3 * PIECE_BYTES + 1000):
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        whole = checksum_function(algorithm)(data)
        h = Incremental(algorithm, nbytes)
        at = 0
        for size in itertools.cycle((1, 4097, 1 << 20, 7 << 20)):
            h.update(data[at : at + size])
            at += size
            if at >= nbytes:
                break
        assert h.value() == whole, (algorithm, nbytes)
        split = split_point(algorithm, nbytes)
        if split is None:
            continue
        first, second = Incremental(algorithm, nbytes), Incremental(algorithm, nbytes, start=split)
        second.update(data[split:])  # the helper's part may finish first
        first.update(data[:split])
        first.join(second)
        assert first.value() == whole, (algorithm, nbytes)


@needs_crc32c
def test_crc32c_is_the_published_one():
    assert "crc32c" in available_algorithms()
    assert checksum_function("crc32c")(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_default_checksum_is_the_fastest_installed_and_zlib_is_the_fallback(monkeypatch):
    assert default_algorithm() == available_algorithms()[0]
    assert available_algorithms()[-1] == FALLBACK_ALGORITHM
    from refit_app.protocol import checksum

    checksum._load.cache_clear()
    monkeypatch.setitem(sys.modules, "xxhash", None)  # as if not installed: import raises ImportError
    monkeypatch.setitem(sys.modules, "crc32c", None)
    try:
        assert default_algorithm() == FALLBACK_ALGORITHM
        with pytest.raises(
            HandshakeError, match="checksums with xxh3_64, which this host cannot compute: pip install xxhash"
        ):
            checksum_function("xxh3_64")
    finally:
        checksum._load.cache_clear()
    with pytest.raises(HandshakeError, match="'md5' is unknown"):
        checksum_function("md5")


def test_checksum_sees_values_not_lazy_views():
    c = torch.randn(4, dtype=torch.complex64)
    assert tensor_checksum(c.conj()) == tensor_checksum(c.conj().resolve_conj().clone())
    assert tensor_checksum(c.conj()) != tensor_checksum(c)
    b = torch.tensor([1.0, 2.0]).to(torch.bfloat16)
    assert tensor_checksum(b) == tensor_checksum(b.view(torch.int16))


# ------------------------------------------------------------------------------------------ verify


def test_verify_accepts_exact_bytes():
    items = mixed_tensors()
    sink = Verifier(metas_of(items), default_algorithm())
    deliver(sink, items)
    assert sink.verdict([tensor_checksum(t) for _, t in items]) == {"verified": True, "verified_tensors": len(items)}


def test_verify_names_the_tensor_with_a_flipped_byte():
    items = mixed_tensors()
    sink = Verifier(metas_of(items), default_algorithm())
    deliver(sink, items, corrupt="c.complex")
    with pytest.raises(VerificationError) as excinfo:
        sink.verdict([tensor_checksum(t) for _, t in items])
    message = str(excinfo.value)
    assert f"1 of {len(items)} tensor(s) differ" in message and "'c.complex'" in message
    assert "w.bf16" not in message


def test_verify_lists_first_few_and_counts_the_rest():
    source = SyntheticSource("lora", 1 << 20, 0, torch.bfloat16)
    items = list(source.tensors())
    sink = Verifier(source.manifest_tensors(), default_algorithm())
    deliver(sink, items, per_batch=16)
    with pytest.raises(VerificationError) as excinfo:
        sink.verdict([tensor_checksum(t) ^ 1 for _, t in items])
    message = str(excinfo.value)
    assert "\n" not in message
    assert f"{len(items)} of {len(items)} tensor(s) differ" in message
    assert f"and {len(items) - 5} more" in message
    assert repr(items[0][0]) in message


def test_verify_reports_missing_repeated_unknown_and_misshapen():
    items = mixed_tensors()
    sink = Verifier(metas_of(items), default_algorithm())
    sent = [("w.bf16", items[0][1]), ("w.bf16", items[0][1]), ("ghost", torch.zeros(1)), ("s.scalar", torch.zeros(2))]
    deliver(sink, sent)
    with pytest.raises(VerificationError) as excinfo:
        sink.verdict([tensor_checksum(t) for _, t in items])
    message = str(excinfo.value)
    assert "6 tensor(s) never arrived: 'e.empty'" in message
    assert "arrived more than once: 'w.bf16'" in message
    assert "not in the manifest: 'ghost'" in message
    assert "wrong shape or dtype: 's.scalar (torch.float32 [2], expected torch.float32 [])'" in message


def test_verify_needs_checksums_and_starts_each_round_afresh():
    items = mixed_tensors()
    sink = Verifier(metas_of(items), default_algorithm())
    deliver(sink, items)
    with pytest.raises(VerificationError, match="sent 2 checksums for a manifest of 8 tensors"):
        sink.verdict([0, 0])
    with pytest.raises(VerificationError, match="sent no checksums"):
        sink.verdict(None)
    deliver(sink, items)  # the next round is judged on its own arrivals
    assert sink.verdict([tensor_checksum(t) for _, t in items])["verified"] is True


def test_verify_sink_asks_the_session_to_verify_and_keeps_nothing():
    sink = VerifySink()
    assert sink.verifies is True
    sink.begin(manifest_for(metas_of(mixed_tensors())))
    deliver(sink, mixed_tensors())
    assert sink.finish(None) == {} and sink.close() == {}


# ------------------------------------------------------------------------------------------ save


def test_save_single_file_round_trip(tmp_path):
    items = mixed_tensors()
    sink = SaveSink(str(tmp_path / "out"))
    sink.begin(manifest_for(metas_of(items), {"format": "pt", "origin": "test"}))
    deliver(sink, items)
    assert sink.finish(None) == {}
    assert published(tmp_path / "out") == []  # a round is published only when the session ends
    figures = sink.close()
    assert figures == {"saved_to": str(tmp_path / "out"), "saved_files": [SINGLE_FILE_NAME]}
    assert files_in(tmp_path / "out") == [SINGLE_FILE_NAME]
    assert Checkpoint(tmp_path / "out").metadata() == {"format": "pt", "origin": "test"}
    assert read_back(tmp_path / "out") == {n: raw_bytes(t) for n, t in items}


def test_save_minilm_is_bit_identical(tmp_path, minilm_dir):
    source = SafetensorsSource(str(minilm_dir))
    sink = SaveSink(str(tmp_path))
    sink.begin(manifest_for(source.manifest_tensors(), source.metadata()))
    for name, t in source.tensors():
        sink.consume([(name, t)])
    sink.finish(None)
    sink.close()
    assert files_in(tmp_path) == [SINGLE_FILE_NAME]
    saved = read_back(tmp_path)
    original = {n: raw_bytes(t) for n, t in source.tensors()}
    assert list(saved) == list(original) and saved == original
    assert Checkpoint(tmp_path).metadata() == {"format": "pt"}


def write_sharded(directory: Path, items: list[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    metas = [
        TensorMeta(n, tuple(t.shape), t.dtype, f"model-0000{1 + i * 3 // len(items)}-of-00003.safetensors")
        for i, (n, t) in enumerate(items)
    ]
    writer = CheckpointWriter(directory, metas, {"format": "pt"})
    writer.open()
    for n, t in items:
        writer.write(n, t)
    writer.commit()
    return metas


def test_save_sharded_round_trip_matches_source_files(tmp_path):
    items = mixed_tensors()
    write_sharded(tmp_path / "src", items)
    source = SafetensorsSource(str(tmp_path / "src"))
    sink = SaveSink(str(tmp_path / "dst"))
    sink.begin(manifest_for(source.manifest_tensors(), source.metadata()))
    deliver(sink, list(source.tensors()), per_batch=2)
    sink.finish(None)
    figures = sink.close()
    expected_files = files_in(tmp_path / "src")
    assert sorted(figures["saved_files"]) == expected_files == files_in(tmp_path / "dst")
    assert INDEX_FILE_NAME in expected_files and len(expected_files) == 4
    index = json.loads((tmp_path / "dst" / INDEX_FILE_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in items)
    for name in expected_files:  # same manifest and metadata, so the very same bytes
        assert (tmp_path / "dst" / name).read_bytes() == (tmp_path / "src" / name).read_bytes(), name


def test_abort_leaves_old_checkpoint_and_no_new_files(tmp_path):
    old = save_tensors(tmp_path / SINGLE_FILE_NAME, {"old": torch.ones(3)})
    old_bytes = old.read_bytes()
    items = mixed_tensors()
    sink = SaveSink(str(tmp_path))
    sink.begin(manifest_for(metas_of(items)))
    deliver(sink, items[:4])
    sink.abort()
    sink.abort()
    assert files_in(tmp_path) == [SINGLE_FILE_NAME]
    assert old.read_bytes() == old_bytes


def test_incomplete_transfer_fails_and_publishes_nothing(tmp_path):
    items = mixed_tensors()
    sink = SaveSink(str(tmp_path / "out"))
    sink.begin(manifest_for(metas_of(items, shard=None)))
    deliver(sink, items[:-1])
    with pytest.raises(SinkError, match=r"1 tensor\(s\) never arrived: t\.strided"):
        sink.finish(None)
    sink.abort()
    assert files_in(tmp_path / "out") == []


def test_unwritable_path_fails_in_begin(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    manifest = manifest_for(metas_of(mixed_tensors()))
    with pytest.raises(SinkError, match=f"cannot create directory {blocker}/ckpt"):
        SaveSink(str(blocker / "ckpt")).begin(manifest)
    with pytest.raises(SinkError, match=f"sink.path {blocker} is a file"):
        SaveSink(str(blocker)).begin(manifest)


def _save_then_die(directory: str, errors) -> None:
    try:
        items = mixed_tensors()
        metas = [TensorMeta(n, tuple(t.shape), t.dtype, f"s{i % 2}.safetensors") for i, (n, t) in enumerate(items)]
        sink = SaveSink(directory)
        sink.begin(manifest_for(metas))
        deliver(sink, items[:-1])
    except BaseException:
        errors.put(traceback.format_exc())
        raise
    os.kill(os.getpid(), signal.SIGKILL)


def test_killed_save_leaves_no_final_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    old = save_tensors(ckpt / SINGLE_FILE_NAME, {"old": torch.ones(3)})
    old_bytes = old.read_bytes()
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    proc = ctx.Process(target=_save_then_die, args=(str(ckpt), errors))
    proc.start()
    proc.join(timeout=120)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=10)
        pytest.fail("the saving child did not finish within 120 s")
    assert errors.empty(), errors.get()
    assert proc.exitcode == -signal.SIGKILL
    assert files_in(ckpt) == [SINGLE_FILE_NAME] and old.read_bytes() == old_bytes
    # The killed run's hidden staging directory, with its two shard temporaries, is all it left.
    (staging,) = [p for p in tmp_path.iterdir() if p.name != "ckpt"]
    assert staging.name.startswith(".ckpt.refit-save-") and len(files_in(staging)) == 2
    sink = SaveSink(str(ckpt))
    sink.begin(manifest_for([TensorMeta("w", (1,), torch.float32)]))  # the next save clears it away
    sink.abort()
    assert not staging.exists() and files_in(tmp_path) == ["ckpt"]


# ------------------------------------------------------------------------------------------ discard, factory


def test_discard_keeps_nothing():
    items = mixed_tensors()
    sink = DiscardSink()
    sink.begin(manifest_for(metas_of(items)))
    deliver(sink, items)
    assert sink.finish(None) == {} and sink.close() == {}
    sink.abort()


def test_make_sink_builds_the_target_and_wraps_the_fault_hook(tmp_path):
    assert isinstance(make_sink("refit_app.models.sinks.VerifySink", {}), VerifySink)
    assert isinstance(make_sink("refit_app.models.sinks.DiscardSink", {}), DiscardSink)
    assert isinstance(make_sink("refit_app.models.sinks.SaveSink", {"path": str(tmp_path)}), SaveSink)
    corrupting = make_sink("refit_app.models.sinks.VerifySink", {}, corrupt_chunk=0)
    assert isinstance(corrupting, CorruptingSink)
    with pytest.raises(ConfigError, match=r"module refit_app\.models\.sinks has no 'KeepSink'"):
        make_sink("refit_app.models.sinks.KeepSink", {})


def test_corrupting_sink_flips_one_byte_of_the_chosen_chunk():
    seen = []

    class Recorder(DiscardSink):
        def consume(self, batch):
            seen.append([t.clone() for _, t in batch])

    sink = CorruptingSink(Recorder(), chunk=1)
    sink.begin(Manifest([], 1, False))
    originals = [
        [("a", torch.zeros(4, dtype=torch.uint8))],
        [("b", torch.zeros(0)), ("c", torch.zeros(4, dtype=torch.uint8))],
    ]
    for batch in originals:
        sink.consume(batch)
    assert seen[0][0].tolist() == [0, 0, 0, 0]
    assert seen[1][1].tolist() == [1, 0, 0, 0]


def test_save_publishes_the_last_round_only(tmp_path):
    items = mixed_tensors()
    later = [(n, torch.zeros_like(t)) for n, t in items]
    sink = SaveSink(str(tmp_path / "out"))
    sink.begin(manifest_for(metas_of(items)))
    for round_items in (items, later):
        deliver(sink, round_items)
        assert sink.finish(None) == {}
        assert published(tmp_path / "out") == []
    sink.close()
    assert read_back(tmp_path / "out") == {n: raw_bytes(t) for n, t in later}
