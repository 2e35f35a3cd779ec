"""The delta codec on its own: every dtype's bytes compared exactly (NaN payloads, -0.0, fp8, ints, bool), every
encoding decoded back to the same positions, corrupt records refused, with the C kernel and with numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from refit_app.core.delta import codec
from refit_app.core.wire import tensor_bytes
from refit_app.protocol.delta.types import TensorDelta, apply_positions

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int64,
    torch.bool,
    torch.complex128,
]


SIMD_LEVELS = {"avx512": 2, "avx2": 1, "words": 0}
"""The kernel's comparisons (``set_simd``): each that this CPU runs is tested against the same inputs."""


@pytest.fixture(params=[*SIMD_LEVELS, "numpy"])
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(codec, "kernel", None)
        yield request.param
        return
    if codec.kernel is None:
        pytest.skip("the C kernel was not built here")
    level = SIMD_LEVELS[request.param]
    before = codec.kernel.set_simd(level)
    try:
        if codec.kernel.set_simd(level) != level:
            pytest.skip(f"this CPU does not run the {request.param} comparison")
        yield request.param
    finally:
        codec.kernel.set_simd(before)


def _tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),), generator=g, dtype=torch.uint8)
    t = raw.view(dtype) if dtype != torch.bool else (raw % 2).view(torch.bool)
    return t.clone()


def _change(t: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """A copy of ``t`` with one bit of each listed element flipped (the low bit of the element's first byte)."""
    out = t.clone()
    b = tensor_bytes(out).view(-1, out.element_size())
    for p in positions:
        b[p, 0] ^= 1
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    return tensor_bytes(t).numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("share", [0.0, 1e-4, 0.01, 0.3, 1.0])
def test_diff_finds_exactly_the_changed_elements_and_applies_back(path, dtype, share):
    for numel in (1, 5, 8, 1001, 70_000):
        old = _tensor(dtype, numel, numel)
        k = round(numel * share)
        positions = sorted(np.random.default_rng(numel).choice(numel, size=k, replace=False).tolist())
        new = _change(old, positions)
        snapshot = _np(old).copy()
        changes = codec.diff(_np(new), snapshot, new.element_size())
        assert np.array_equal(snapshot, _np(new))  # the snapshot follows
        if isinstance(changes, codec.Whole):  # declared dense: too much changed
            assert share > codec.DENSE_ABOVE / 2
            continue
        assert changes.positions.tolist() == positions
        target = old.clone()
        codec.apply(_np(target), changes.positions, changes.values, target.element_size())
        assert torch.equal(tensor_bytes(target), tensor_bytes(new))


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.int64], ids=str)
def test_changes_at_every_vector_boundary_are_found(path, dtype):
    """The vector loops compare 32 or 64 bytes at a time, skip four unchanged vectors at once and leave the last
    bytes to the word loop: a change on either side of each of those edges is found, in order."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    for nbytes in (64 * 4 * 3 + 64 + 24, 32 * 9 + 8, 256):
        numel = nbytes // itemsize
        edges = {0, numel - 1}
        for width in (32, 64, 128, 256):
            for edge in range(width, nbytes, width):
                edges |= {edge // itemsize - 1, edge // itemsize}
        positions = sorted(p for p in edges if 0 <= p < numel)
        old = _tensor(dtype, numel, nbytes)
        new = _change(old, positions)
        changes = codec.diff(_np(new), _np(old).copy(), itemsize, dense_above=1.0)
        assert changes.positions.tolist() == positions, nbytes


def test_special_values_are_compared_as_bytes(path):
    old = torch.tensor([0.0, 1.0, float("nan"), float("inf"), 2.0], dtype=torch.float32)
    new = old.clone()
    new[0] = -0.0  # == 0.0 as a value
    nan_bits = tensor_bytes(new)[8:12]
    nan_bits[0] ^= 1  # another NaN payload: still NaN, other bytes
    changes = codec.diff(_np(new), _np(old).copy(), 4)
    assert changes.positions.tolist() == [0, 2]
    assert changes.values.view(np.uint32)[0] == 0x8000_0000


def test_a_tensor_that_changed_throughout_is_declared_dense_early(path):
    old = _tensor(torch.bfloat16, 1 << 20, 1)
    new = _tensor(torch.bfloat16, 1 << 20, 2)
    snapshot = _np(old).copy()
    assert isinstance(codec.diff(_np(new), snapshot, 2), codec.Whole)
    assert np.array_equal(snapshot, _np(new))


def test_hashing_during_the_comparison_covers_every_byte(path):
    from refit_app.protocol.checksum import Incremental, checksum_function

    old = _tensor(torch.float32, 300_001, 3)
    new = _change(old, [5, 200_000])
    h = Incremental("xxh3_64", _np(new).size)
    codec.diff(_np(new), _np(old).copy(), 4, hasher=h)
    assert h.value() == checksum_function("xxh3_64")(memoryview(_np(new)))


@pytest.mark.parametrize("algorithm", ["xxh3_64_16mib", "xxh3_64", "crc32"])
def test_a_large_tensor_compared_on_two_threads_hashes_and_patches_it_whole(algorithm):
    """protocol.delta.send._diff: the second half on the helper thread, hashed there (pieces) or after it (others)."""
    from refit_app.protocol.checksum import Incremental, checksum_function
    from refit_app.protocol.delta.send import PARALLEL_MIN_BYTES, _diff

    if codec.kernel is None:
        pytest.skip("the C kernel was not built here")
    numel = (40 << 20) // 2
    assert numel * 2 >= PARALLEL_MIN_BYTES
    old = _tensor(torch.bfloat16, numel, 9)
    positions = sorted(np.random.default_rng(9).choice(numel, size=numel // 100, replace=False).tolist())
    new = _change(old, positions)
    snapshot = _np(old).copy()
    hasher = Incremental(algorithm, snapshot.size)
    changes = _diff(_np(new), snapshot, 2, hasher, algorithm)
    assert changes.positions.tolist() == positions
    assert np.array_equal(snapshot, _np(new))
    assert hasher.value() == checksum_function(algorithm)(_np(new))


@pytest.mark.parametrize(
    "positions, numel",
    [
        ([], 10),
        ([0], 1),
        ([3], 10),
        ([0, 1, 2], 3),
        ([0, 255, 256, 70_000, 70_001, 10**6], 10**6 + 1),
        (list(range(0, 100_000, 3)), 100_000),
        (list(range(1000, 2000)), 10**7),
    ],
)
def test_every_encoding_round_trips(positions, numel):
    positions = np.array(positions, dtype=np.int64)
    gaps = np.diff(positions, prepend=-1) - 1
    for encoding in (codec.BITMASK, codec.GAPS8, codec.GAPS16):
        escapes = int(np.count_nonzero(gaps >= codec._GAP_LIMIT[encoding])) if encoding != codec.BITMASK else 0
        section = codec._positions_section(encoding, positions, gaps, numel, escapes)
        assert len(section) == codec.raw_positions_nbytes(encoding, positions.size, escapes, numel)
        back = codec.decode_positions(encoding, np.asarray(section, dtype=np.uint8), positions.size, escapes, numel)
        assert back.tolist() == positions.tolist()


def test_encode_picks_the_smallest_and_dense_where_that_is_smaller():
    numel = 1_000_000
    sparse = np.arange(0, numel, 1000, dtype=np.int64)  # gaps of 999: u16
    assert codec.encode(sparse, numel, 2).encoding == codec.GAPS16
    dense_ish = np.arange(0, numel, 2, dtype=np.int64)  # half: a bitmask beats gaps
    assert codec.encode(dense_ish, numel, 2).encoding == codec.BITMASK
    scattered = np.arange(0, numel, 50, dtype=np.int64)  # gaps of 49: u8
    assert codec.encode(scattered, numel, 2).encoding == codec.GAPS8
    assert codec.encode(np.arange(numel, dtype=np.int64), numel, 2).encoding == codec.DENSE
    assert codec.encode(np.arange(numel, dtype=np.int64)[:-1], numel, 1).encoding == codec.DENSE


def test_zstd_only_where_it_pays():
    compressor = zstandard.ZstdCompressor(level=1)
    clustered = np.arange(500_000, 700_000, dtype=np.int64)  # one block of changes: gaps of 0 compress away
    e = codec.encode(clustered, 10_000_000, 2, compressor=compressor)
    assert e.flags & codec.ZSTD and len(e.positions) < 0.2 * clustered.size
    rng = np.random.default_rng(0)
    scattered = np.unique(rng.integers(0, 10_000_000, 100_000))  # geometric gaps: barely compressible
    assert not codec.encode(scattered, 10_000_000, 2, compressor=compressor).flags & codec.ZSTD


@pytest.mark.parametrize(
    "section, count, escapes, numel",
    [
        (np.array([5, 5], dtype=np.uint8), 2, 0, 5),  # positions past the end
        (np.array([255, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0], dtype=np.uint8), 1, 0, 10),  # escape not counted
    ],
)
def test_an_inconsistent_record_is_refused(section, count, escapes, numel):
    with pytest.raises(ValueError):
        codec.decode_positions(codec.GAPS8, section, count, escapes, numel)


@pytest.mark.parametrize("encoding", [codec.BITMASK, codec.GAPS8, codec.GAPS16], ids=codec.ENCODING_NAMES.get)
@pytest.mark.parametrize(
    "positions, numel",
    [([], 10), ([0], 1), ([0, 255, 256, 70_000, 70_001, 10**6], 10**6 + 1), (list(range(0, 100_000, 3)), 100_000)],
)
def test_a_record_applies_straight_from_its_section(path, encoding, positions, numel):
    """apply_record (gaps decoded on the way in the kernel) writes what decoding then applying writes."""
    positions = np.array(positions, dtype=np.int64)
    gaps = np.diff(positions, prepend=-1) - 1
    escapes = int(np.count_nonzero(gaps >= codec._GAP_LIMIT[encoding])) if encoding != codec.BITMASK else 0
    section = np.asarray(codec._positions_section(encoding, positions, gaps, numel, escapes), dtype=np.uint8)
    for itemsize in (1, 2, 4, 8, 16):
        target = np.random.default_rng(itemsize).integers(0, 256, numel * itemsize, dtype=np.uint8)
        values = np.random.default_rng(-itemsize % 7).integers(0, 256, positions.size * itemsize, dtype=np.uint8)
        want = target.copy()
        want.reshape(-1, itemsize)[positions] = values.reshape(-1, itemsize)
        codec.apply_record(target, encoding, section, positions.size, escapes, values, itemsize)
        assert np.array_equal(target, want), itemsize


@pytest.mark.parametrize(
    "section, count, escapes, numel",
    [
        (np.array([3, 5], dtype=np.uint8), 2, 0, 9),  # the second change lies past the end
        (np.array([255, 1], dtype=np.uint8), 2, 0, 300),  # an escape the record does not count
        (np.array([2, 1, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0], dtype=np.uint8), 2, 1, 300),  # one never used
        (np.array([255, 0, 0, 0, 0, 0, 0, 0, 255, 255, 255, 255, 255, 255, 255, 255], dtype=np.uint8), 1, 1, 10),
        (np.array([1], dtype=np.uint8), 2, 0, 10),  # shorter than its count
    ],
    ids=["past-the-end", "escape-uncounted", "escape-unused", "escape-huge", "short"],
)
def test_a_corrupt_record_is_refused_before_anything_is_written(path, section, count, escapes, numel):
    target = np.arange(numel * 2, dtype=np.uint16).astype(np.uint8)
    before = target.copy()
    with pytest.raises(ValueError):
        codec.apply_record(target, codec.GAPS8, section, count, escapes, np.full(count * 2, 0xAB, np.uint8), 2)
    assert np.array_equal(target, before)


def test_scatter_refuses_a_position_outside_the_target():
    if codec.kernel is None:
        pytest.skip("the C kernel was not built here")
    target = np.zeros(8, dtype=np.uint8)
    with pytest.raises(ValueError, match="outside"):
        codec.kernel.scatter(target, np.array([4], dtype=np.int64), np.zeros(2, dtype=np.uint8), 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_delta_applies_on_raw_bits(dtype):
    old = _tensor(dtype, 100, 7)
    new = _change(old, [0, 50, 99])
    changes = codec.diff(_np(new), _np(old).copy(), new.element_size())
    d = TensorDelta(
        "t", tuple(old.shape), dtype, torch.from_numpy(changes.positions), torch.from_numpy(changes.values).view(dtype)
    )
    target = old.clone()
    d.apply_to(target)
    assert torch.equal(tensor_bytes(target), tensor_bytes(new))
    with pytest.raises(ValueError, match="cannot apply"):
        d.apply_to(torch.zeros(3, dtype=dtype))
    t2 = old.clone()
    apply_positions(t2, torch.from_numpy(changes.positions), torch.from_numpy(changes.values).view(dtype))
    assert torch.equal(tensor_bytes(t2), tensor_bytes(new))


def test_auto_goes_plain_after_a_slow_delta_round_and_tries_again_when_changes_thin_out():
    from refit_app.protocol.defaults import AUTO_RETRY_ROUNDS
    from refit_app.protocol.delta.auto import DELTA, KEEP, PLAIN, AutoPolicy

    p = AutoPolicy()
    assert p.choose(False) == KEEP  # the first round fills the snapshot
    p.observe(KEEP, 9.0, cold=True)  # no reference: the session's first transfers
    p.changed, p.share = 0.02, 0.03
    assert p.choose(True) == DELTA
    p.observe(DELTA, 0.6)
    assert p.choose(True) == KEEP  # only a cold round to compare with: time a warm dense round
    p.observe(KEEP, 0.7)
    assert p.choose(True) == DELTA
    p.observe(DELTA, 0.6)  # faster than that, but not clearly: measure a plain round
    assert p.choose(True) == PLAIN
    p.observe(PLAIN, 0.5)  # the delta round was slower than a plain one: plain rounds from here
    assert p.plain
    assert [p.choose(False) for _ in range(AUTO_RETRY_ROUNDS - 1)] == [PLAIN] * (AUTO_RETRY_ROUNDS - 1)
    assert p.choose(False) == KEEP  # tried again after AUTO_RETRY_ROUNDS: fill the snapshot, then a delta round
    p.observe(KEEP, 0.7)
    assert p.choose(True) == DELTA
    p.observe(DELTA, 0.55)  # still slower than the last plain round
    assert p.choose(False) == PLAIN
    p.changed, p.share = 0.009, 0.014  # the changes got clearly sparser: try again now
    assert p.choose(False) == KEEP
    assert p.choose(True) == DELTA
    p.observe(DELTA, 0.45)  # faster than plain: stays on deltas
    assert [p.choose(True) for _ in range(AUTO_RETRY_ROUNDS)] == [DELTA] * AUTO_RETRY_ROUNDS
    for _ in range(AUTO_RETRY_ROUNDS - 1):
        p.observe(DELTA, 0.45)
    assert p.choose(True) == PLAIN  # not clearly faster, and the plain figure is old: measure it again
    assert p.choose(False) == KEEP  # a consumer holds nothing (or the plain round left the snapshot behind)
    p.share = 0.6  # more than half the dense bytes: plain, whatever the times
    assert p.choose(True) == PLAIN
    assert [p.choose(False) for _ in range(2 * AUTO_RETRY_ROUNDS)] == [PLAIN] * (2 * AUTO_RETRY_ROUNDS)


def test_auto_keeps_deltas_that_are_clearly_faster_than_a_dense_round():
    from refit_app.protocol.delta.auto import DELTA, KEEP, AutoPolicy

    p = AutoPolicy()
    p.observe(KEEP, 4.5, cold=True)  # over a link: the dense round is the transfer
    p.changed, p.share = 0.01, 0.015
    assert p.choose(True) == DELTA
    p.observe(DELTA, 0.3)
    assert p.choose(True) == KEEP  # one warm dense round timed, once
    p.observe(KEEP, 4.2)
    assert p.choose(True) == DELTA
    for _ in range(100):
        p.observe(DELTA, 0.3)
        assert p.choose(True) == DELTA


def test_the_sample_estimates_the_changed_share_without_a_snapshot():
    from refit_app.protocol.delta.auto import SAMPLE_BLOCK, SAMPLE_EVERY, Sampler

    rng = np.random.default_rng(0)
    n = 4 * SAMPLE_BLOCK * SAMPLE_EVERY  # four sampled blocks of bf16
    old = rng.integers(0, 1 << 16, n // 2, dtype=np.uint16)
    new = old.copy()
    changed = rng.random(new.size) < 0.03
    new[changed] ^= 1
    s = Sampler()
    s.begin(1)
    s.add(old.view(np.uint8), None, 2)
    assert s.end(1) is None  # nothing to compare with yet
    s.begin(2)
    s.add(new.view(np.uint8), None, 2)
    changed, share = s.end(2)
    assert changed == pytest.approx(0.03, rel=0.2)
    assert share == pytest.approx(0.03 * 1.5, rel=0.2)  # a bf16 value and about a byte of position per change
    more = new.copy()
    more[rng.random(new.size) < 0.1] ^= 1
    s.begin(3)
    s.add(more.view(np.uint8), new.view(np.uint8), 2)  # compared with the last round's bytes where held
    changed, share = s.end(3)
    assert changed == pytest.approx(0.1, rel=0.2)
    assert share == 1.0  # over DENSE_ABOVE changed, the tensor would go whole
    s.begin(5)  # a round was missed: the sample is not the last round's
    s.add(new.view(np.uint8), None, 2)
    assert s.end(5) is None
