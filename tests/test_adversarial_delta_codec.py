"""The delta codec against corrupt and forged records (issue 31), with the C kernel and with numpy.

A stream comes only from an authenticated producer, but a buggy or corrupted one must fail with one line naming the
tensor, never crash or write at the wrong place. Checked here: round trips of random positions against a pure-Python
oracle (:mod:`delta_fuzz`); forged records (counts, escapes, encodings, lengths, escaped gaps near 2^63 and 2^64)
refused with ValueError or applied exactly as the oracle says; forged headers through the consumer's receive path;
the finding's cases with the section before a PROT_NONE page, each in a subprocess (an out-of-bounds read is a
SIGSEGV there, a failed test here); and the kernel built with AddressSanitizer and UBSan over all of it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conditions import needs_asan
from delta_fuzz import (
    ITEMSIZES,
    LIMIT,
    POSITION_ENCODINGS,
    REGRESSIONS,
    U64,
    WIDTH,
    check_kernel_gaps,
    check_record,
    interesting,
    oracle_decode,
    oracle_encode,
    oracle_header_ok,
)
from fakes import ReplayGroup
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from refit_app.common.errors import HandshakeError
from refit_app.core.delta import codec
from refit_app.core.delta.stream import HEADER_WORDS
from refit_app.core.meta import TensorMeta
from refit_app.protocol.delta.receive import ConsumerDelta
from refit_app.protocol.delta.types import DeltaStats

HERE = Path(__file__).resolve().parent
PATHS = ["kernel", "numpy"]


def fuzz(examples: int) -> settings:
    """No per-example deadline (a busy 2-core machine); ``examples`` keeps each test to a few seconds."""
    return settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def codec_path(path: str) -> Iterator[None]:
    """The codec with the C kernel, or as numpy alone (as where the kernel was not built)."""
    kernel = codec.kernel
    if path == "kernel" and kernel is None:
        pytest.skip("the C kernel was not built here")
    codec.kernel = kernel if path == "kernel" else None
    try:
        yield
    finally:
        codec.kernel = kernel


@st.composite
def changed_positions(draw: st.DrawFn) -> tuple[int, list[int]]:
    """A tensor size and sorted unique positions in it: dense and sparse, gaps that escape 8 and 16 bits."""
    numel = draw(st.integers(1, 600) | st.sampled_from([65_536, 65_537, 200_000]))
    positions = draw(st.sets(st.integers(0, numel - 1), max_size=min(numel, 48)))
    if draw(st.booleans()):  # a run at the end (a gap of 0 after a long one)
        positions |= set(range(max(0, numel - 3), numel))
    return numel, sorted(positions)


@pytest.mark.parametrize("path", PATHS)
@fuzz(100)
@given(case=changed_positions(), itemsize=st.sampled_from(ITEMSIZES), seed=st.integers(0, 2**32 - 1))
def test_positions_round_trip_through_every_encoding(path, case, itemsize, seed):
    numel, positions = case
    with codec_path(path):
        for encoding in POSITION_ENCODINGS:
            section, escapes = oracle_encode(encoding, positions, numel)
            assert check_record(encoding, section, len(positions), escapes, numel, itemsize, seed=seed)
        # The encoder writes the oracle's bytes for the encoding it picks.
        encoded = codec.encode(np.array(positions, dtype=np.int64), numel, itemsize)
        if encoded.encoding != codec.DENSE:
            want, escapes = oracle_encode(encoded.encoding, positions, numel)
            assert (bytes(encoded.positions), encoded.escapes, encoded.count) == (want, escapes, len(positions))


@st.composite
def forged_records(draw: st.DrawFn) -> tuple[int, bytes, int, int, int, int, int]:
    """A valid record changed in any of its fields: (encoding, section, count, escapes, numel, itemsize, values
    bytes)."""
    numel, positions = draw(changed_positions())
    itemsize = draw(st.sampled_from(ITEMSIZES))
    encoding = draw(st.sampled_from(POSITION_ENCODINGS))
    section, escapes = oracle_encode(encoding, positions, numel)
    section, count = bytearray(section), len(positions)
    limit = LIMIT.get(encoding, 0xFF)
    edges = st.sampled_from(interesting(numel, limit))
    if draw(st.booleans()):
        count = draw(edges | st.integers(0, numel))
    if draw(st.booleans()):
        escapes = draw(edges | st.integers(0, 4))
    if escapes > 0 and encoding in LIMIT and draw(st.booleans()):  # an escaped gap's value: 2^64 - 10, 2^63, numel
        at = codec.padded(len(positions) * WIDTH[encoding]) + 8 * draw(st.integers(0, min(escapes, 64) - 1))
        if at + 8 <= len(section):
            section[at : at + 8] = (draw(edges | st.integers(0, U64 - 1)) % U64).to_bytes(8, "little")
    if section and draw(st.booleans()):  # a gap or mask byte
        section[draw(st.integers(0, len(section) - 1))] = draw(
            st.sampled_from([0, 1, 0xFE, 0xFF]) | st.integers(0, 255)
        )
    cut = draw(st.integers(-9, 9) | st.just(0))
    section = section[:cut] if cut < 0 else section + bytes(cut)
    encoding = draw(st.just(encoding) | st.integers(0, 5))
    fits = 0 <= count <= numel  # values are never sized by a forged count
    values = count * itemsize if fits else 0
    values = draw(st.just(values) | st.integers(0, 64))
    return encoding, bytes(section), count, escapes, numel, itemsize, values


@pytest.mark.parametrize("path", PATHS)
@fuzz(500)
@given(record=forged_records(), seed=st.integers(0, 2**32 - 1))
def test_a_forged_record_is_refused_or_applied_exactly(path, record, seed):
    with codec_path(path):
        event("applied" if check_record(*record, seed=seed) else "refused")  # --hypothesis-show-statistics
        encoding, section, count, escapes, numel, itemsize, values = record
        check_kernel_gaps(encoding, np.frombuffer(section, np.uint8), count, escapes, numel, itemsize, values)


# -------------------------------------------------------------------------------------------------------------
# The consumer's receive path: a forged header is one line naming the tensor, before anything is sized by it.

_DTYPES = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.int64, 16: torch.complex128}
NAME = "model.layers.3.mlp.up_proj.weight"


def _record(
    index: int, encoding: int, flags: int, count: int, escapes: int, section: bytes, values: bytes, pos_nbytes=None
) -> bytes:
    header = codec.RECORD.pack(
        index, encoding, flags, 0, count, escapes, len(section) if pos_nbytes is None else pos_nbytes, len(values)
    )
    return header + section + bytes(codec.padded(len(section)) - len(section)) + values + bytes(-len(values) % 8)


def receive(stream: bytes, numel: int, itemsize: int, *, hand_out: bool = False) -> torch.Tensor:
    """``stream`` (records, without the end record) received by a consumer into a tensor of zeros; returns it."""
    stream += codec.RECORD.pack(codec.END, 0, 0, 0, 0, 0, 0, 0)
    meta = TensorMeta(NAME, (numel,), _DTYPES[itemsize])
    tensor = torch.zeros(numel, dtype=meta.dtype)
    consumer = ConsumerDelta(mirror=False)
    targets = consumer.targets_for([meta], {NAME: tensor})
    chunks = [torch.tensor([len(stream), 1], dtype=torch.int64), torch.frombuffer(bytearray(stream), dtype=torch.uint8)]
    assert chunks[0].numel() == HEADER_WORDS
    received = consumer.receive_delta(
        [meta],
        ReplayGroup(chunks),
        0,
        DeltaStats(),
        device=torch.device("cpu"),
        targets=targets,
        chunk_bytes=len(stream),
        hand_out=hand_out,
    )
    for _ in received:
        pass
    return tensor


def test_a_stream_chunk_header_over_the_agreed_chunk_is_refused_before_any_allocation():
    """The stream's chunk size follows from the manifest on both sides; a header that says 2**62 bytes must not
    size this rank's memory (before: ``buffers.get(0, n)`` allocated whatever the header said)."""
    meta = TensorMeta(NAME, (8,), torch.uint8)
    consumer = ConsumerDelta(mirror=False)
    targets = consumer.targets_for([meta], {NAME: torch.zeros(8, dtype=torch.uint8)})
    group = ReplayGroup([torch.tensor([1 << 62, 1], dtype=torch.int64)])
    received = consumer.receive_delta(
        [meta], group, 0, DeltaStats(), device=torch.device("cpu"), targets=targets, chunk_bytes=2 << 20
    )
    with pytest.raises(ValueError, match=r"says 4611686018427387904 bytes \(at most 2097152\)"):
        next(received)


def assert_refused_naming_the_tensor(excinfo: pytest.ExceptionInfo) -> None:
    message = str(excinfo.value)
    assert repr(NAME) in message and "\n" not in message, message


@pytest.mark.parametrize(
    "encoding, flags, count, escapes, pos_nbytes, values",
    [
        (codec.GAPS16, 0, 1 << 62, 0, 16, 0),  # issue 31's count
        (codec.GAPS8, 0, 4, 1 << 61, 8, 4),  # issue 31's escapes
        (codec.GAPS8, 0, 1, 0, 1 << 62, 1),  # positions bytes that numpy was asked to allocate
        (codec.GAPS8, codec.ZSTD, 4, 1 << 61, 8, 4),  # a decompressor allowed 2^64 bytes of output
        (codec.BITMASK, 0, 1, 0, 1 << 40, 1),
        (codec.GAPS8, 0, 1, 0, 1, 1 << 62),  # values
        (7, 0, 1, 0, 1, 1),  # an unknown encoding
        (codec.GAPS8, 0x80, 1, 0, 1, 1),  # an unknown flag
        (codec.DENSE, 0, 3, 0, 0, 3),  # a dense record of fewer elements than the tensor
    ],
    ids=[
        "count",
        "escapes",
        "positions-bytes",
        "zstd-escapes",
        "bitmask-bytes",
        "values",
        "encoding",
        "flags",
        "dense",
    ],
)
def test_a_forged_header_is_refused_naming_the_tensor(encoding, flags, count, escapes, pos_nbytes, values):
    # Gaps of 5 (valid): each record is wrong in its header only.
    stream = _record(0, encoding, flags, count, escapes, bytes([5] * 8), bytes(8), pos_nbytes=pos_nbytes)
    stream = stream[:32] + values.to_bytes(8, "little") + stream[40:]  # the header's values bytes, as forged
    with pytest.raises(HandshakeError) as excinfo:
        receive(stream, 100, 1)
    assert_refused_naming_the_tensor(excinfo)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("hand_out", [False, True], ids=["applied", "handed-out"])
def test_an_escaped_gap_that_steps_back_is_refused_naming_the_tensor(hand_out, path):
    section = bytes([5, 0xFF, 20]) + bytes(5) + (U64 - 10).to_bytes(8, "little")
    with codec_path(path), pytest.raises(HandshakeError) as excinfo:
        receive(_record(0, codec.GAPS8, 0, 3, 1, section, bytes([1, 2, 3])), 100, 1, hand_out=hand_out)
    assert_refused_naming_the_tensor(excinfo)


@fuzz(200)
@given(
    record=forged_records(),
    flags=st.just(0) | st.sampled_from([0x02, 0x80]),
    pos_delta=st.just(0) | st.sampled_from([-8, -1, 1, 8, 1 << 62]),
    hand_out=st.booleans(),
)
def test_a_forged_record_is_received_exactly_or_refused_naming_the_tensor(record, flags, pos_delta, hand_out):
    encoding, section, count, escapes, numel, itemsize, values_nbytes = record
    count, escapes = count % U64, escapes % U64  # as a u64 header holds them (-1 is 2^64 - 1)
    pos_nbytes = max(0, len(section) + pos_delta)
    header_ok = oracle_header_ok(encoding, flags, count, escapes, pos_nbytes, values_nbytes, numel, itemsize)
    if pos_nbytes <= len(section) + 64:  # else the header says more bytes than the stream has: refused before
        section = (section + bytes(64))[:pos_nbytes]
    values = np.random.default_rng(count % 1000).integers(0, 256, values_nbytes, dtype=np.uint8).tobytes()
    stream = _record(0, encoding, flags, count, escapes, section, values, pos_nbytes=pos_nbytes)
    positions = oracle_decode(encoding, section, count, escapes, numel) if encoding != codec.DENSE else None
    if not header_ok or (encoding != codec.DENSE and positions is None):
        with pytest.raises(HandshakeError) as excinfo:
            receive(stream, numel, itemsize, hand_out=hand_out)
        assert_refused_naming_the_tensor(excinfo)
        return
    got = receive(stream, numel, itemsize, hand_out=hand_out).view(-1).view(torch.uint8).numpy()
    want = np.zeros(numel * itemsize, dtype=np.uint8)
    if positions is None:
        want[:] = np.frombuffer(values, np.uint8)
    for k, p in enumerate(positions or []):
        want[p * itemsize : (p + 1) * itemsize] = np.frombuffer(values, np.uint8)[k * itemsize : (k + 1) * itemsize]
    assert np.array_equal(got, want)


# -------------------------------------------------------------------------------------------------------------
# Issue 31's cases in a subprocess, the section ending at a PROT_NONE page; the kernel under AddressSanitizer.


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(REGRESSIONS))
def test_issue_31_case_is_refused_without_reading_past_the_section(case, path):
    if path == "kernel" and codec.kernel is None:
        pytest.skip("the C kernel was not built here")
    run = subprocess.run(
        [sys.executable, str(HERE / "delta_fuzz.py"), "case", case, path],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    died = f" (killed by signal {-run.returncode})" if run.returncode < 0 else ""
    assert run.returncode == 0, f"{case} on {path}: exit {run.returncode}{died}\n{run.stdout}{run.stderr}"


def _asan_build(tmp_path: Path) -> Path:
    """_delta_kernel.c as a Python extension built with AddressSanitizer and UBSan (UB aborts, not warns)."""
    out = tmp_path / f"_delta_kernel{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer",
            "-O1",
            "-Wall",
            "-Werror",
            f"-I{sysconfig.get_paths()['include']}",
            str(HERE.parent / "refit_app" / "core" / "delta" / "_delta_kernel.c"),
            "-o",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out


@needs_asan
def test_the_kernel_under_address_sanitizer(tmp_path):
    """Issue 31's cases, 400 forged records (through the codec and into apply_gaps directly) and diff/encode/apply
    round trips on every comparison this CPU runs, with the kernel built with ASan and UBSan: no report, exit 0."""
    started = time.perf_counter()
    try:
        _asan_build(tmp_path)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"the ASan build of _delta_kernel.c failed:\n{e.stderr}")
    libasan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True)
    env = {**os.environ, "LD_PRELOAD": libasan.stdout.strip(), "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0"}
    run = subprocess.run(
        [sys.executable, str(HERE / "delta_fuzz.py"), "asan", str(tmp_path), "400"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    report = run.stdout + run.stderr
    clean = "AddressSanitizer" not in report and "runtime error" not in report
    assert run.returncode == 0 and clean, f"exit {run.returncode}:\n{report[-6000:]}"
    assert "round trips: ok" in run.stdout, report
    assert time.perf_counter() - started < 120
