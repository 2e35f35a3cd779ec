"""A pure-Python model of delta positions records (the oracle), forged records, and issue 31's out-of-bounds cases,
for tests/test_adversarial_delta_codec.py and the subprocesses it starts: a run with the section before a guard page
(an out-of-bounds read dies by SIGSEGV there, not in pytest) and a run of an AddressSanitizer build of the kernel.

Imports numpy and :mod:`refit_app.core.delta.codec` only. As a script::

    python tests/delta_fuzz.py case NAME kernel|numpy   # one regression case; exit 0 where it was refused cleanly
    python tests/delta_fuzz.py asan DIR RECORDS         # everything, with the kernel built in DIR (ASan)
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable

import numpy as np

from refit_app.core.delta import codec

U64 = 1 << 64
LIMIT = {codec.GAPS8: 0xFF, codec.GAPS16: 0xFFFF}
WIDTH = {codec.GAPS8: 1, codec.GAPS16: 2}
POSITION_ENCODINGS = (codec.BITMASK, codec.GAPS8, codec.GAPS16)
ITEMSIZES = (1, 2, 4, 8, 16)


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


# -------------------------------------------------------------------------------------------------------------
# The oracle: the wire format as the docstring of refit_app.core.delta.codec states it, one element at a time.


def oracle_encode(encoding: int, positions: list[int], numel: int) -> tuple[bytes, int]:
    """The raw positions section of ``positions`` (ascending, unique) as ``encoding``, and its escapes."""
    if encoding == codec.BITMASK:
        mask = bytearray((numel + 7) // 8)
        for p in positions:
            mask[p // 8] |= 1 << (p % 8)
        return bytes(mask), 0
    limit, width = LIMIT[encoding], WIDTH[encoding]
    gaps = [p - prev - 1 for prev, p in zip([-1, *positions], positions)]
    section = b"".join(min(g, limit).to_bytes(width, "little") for g in gaps)
    escaped = [g for g in gaps if g >= limit]
    if escaped:
        section += bytes(_pad8(len(section)) - len(section)) + b"".join(g.to_bytes(8, "little") for g in escaped)
    return section, len(escaped)


def oracle_decode(encoding: int, section: bytes, count: int, escapes: int, numel: int) -> list[int] | None:
    """The positions a record encodes, or None where no valid tensor of ``numel`` elements has them: every count
    within the tensor, every escape used, every position inside it and after the one before."""
    if encoding == codec.BITMASK:
        if not 0 <= count <= numel or escapes != 0 or len(section) < (numel + 7) // 8:
            return None
        mask = section[: (numel + 7) // 8]
        positions = [8 * i + b for i, byte in enumerate(mask) if byte for b in range(8) if byte >> b & 1]
        positions = [p for p in positions if p < numel]
        return positions if len(positions) == count else None
    if encoding not in LIMIT or not 0 <= escapes <= count <= numel:
        return None
    limit, width = LIMIT[encoding], WIDTH[encoding]
    at = _pad8(count * width) if escapes else count * width
    if len(section) < at + 8 * escapes:
        return None
    positions, seen, position = [], 0, -1
    for k in range(count):
        gap = int.from_bytes(section[k * width : (k + 1) * width], "little")
        if gap == limit:
            if seen == escapes:
                return None
            gap = int.from_bytes(section[at + 8 * seen : at + 8 * seen + 8], "little")
            seen += 1
        position += gap + 1
        if position >= numel:
            return None
        positions.append(position)
    return positions if seen == escapes else None


def oracle_header_ok(
    encoding: int,
    flags: int,
    count: int,
    escapes: int,
    positions_nbytes: int,
    values_nbytes: int,
    numel: int,
    itemsize: int,
) -> bool:
    """Whether a record's header can describe a tensor of ``numel`` elements of ``itemsize`` bytes, sizes exact (a
    zstd-compressed positions section is not modelled: ``flags`` must be 0 here)."""
    if flags:
        return False
    if encoding == codec.DENSE:
        return count == numel and escapes == 0 and positions_nbytes == 0 and values_nbytes == numel * itemsize
    if encoding == codec.BITMASK:
        raw = (numel + 7) // 8
    elif encoding in LIMIT:
        raw = _pad8(count * WIDTH[encoding]) + 8 * escapes if escapes else count * WIDTH[encoding]
    else:
        return False
    fits = 0 <= escapes <= (count if encoding in LIMIT else 0) and count <= numel
    return fits and positions_nbytes == raw and values_nbytes == count * itemsize


def check_record(
    encoding: int,
    section: bytes,
    count: int,
    escapes: int,
    numel: int,
    itemsize: int,
    values_nbytes: int | None = None,
    seed: int = 0,
) -> bool:
    """Decode and apply a (possibly forged) record with the codec as it is set up (kernel or numpy) and compare with
    the oracle: a ValueError where the oracle refuses it, with the target untouched; else exactly the oracle's
    positions and bytes. AssertionError on any difference. Returns whether the record was valid."""
    want = oracle_decode(encoding, section, count, escapes, numel)
    sec = np.frombuffer(section, dtype=np.uint8)
    rng = np.random.default_rng(seed)
    if values_nbytes is None:
        values_nbytes = count * itemsize if 0 <= count <= numel else 0
    values = rng.integers(0, 256, values_nbytes, dtype=np.uint8)
    target = rng.integers(0, 256, numel * itemsize, dtype=np.uint8)
    before = target.copy()
    where = f"encoding={encoding} count={count} escapes={escapes} numel={numel} itemsize={itemsize} section={section!r}"
    try:
        got = codec.decode_positions(encoding, sec, count, escapes, numel)
    except ValueError:
        assert want is None, f"decode_positions refused a valid record: {where}"
    else:
        assert want is not None, f"decode_positions accepted a corrupt record as {got.tolist()}: {where}"
        assert got.dtype == np.int64 and got.tolist() == want, f"decoded {got.tolist()}, want {want}: {where}"
    valid = want is not None and values_nbytes == count * itemsize
    try:
        codec.apply_record(target, encoding, sec, count, escapes, values, itemsize)
    except ValueError:
        assert not valid, f"apply_record refused a valid record: {where}"
        assert np.array_equal(target, before), f"apply_record wrote before refusing: {where}"
        return False
    assert valid, f"apply_record applied a corrupt record: {where} values={values_nbytes}"
    for k, p in enumerate(want):
        before[p * itemsize : (p + 1) * itemsize] = values[k * itemsize : (k + 1) * itemsize]
    assert np.array_equal(target, before), f"apply_record wrote other bytes than the oracle: {where}"
    return True


def check_kernel_gaps(
    encoding: int, section: np.ndarray, count: int, escapes: int, numel: int, itemsize: int, values_nbytes: int
) -> bool:
    """The kernel's apply_gaps called directly, without the Python checks in front of it: it must refuse a record
    the oracle refuses by itself (its own bounds, not the caller's, keep it inside the buffers). Returns whether it
    applied the record; skips what it cannot take (no kernel, not gaps, a count beyond Py_ssize_t)."""
    kernel = codec.kernel
    if (
        kernel is None
        or encoding not in LIMIT
        or not -(1 << 63) <= min(count, escapes) <= max(count, escapes) < 1 << 63
    ):
        return False
    valid = (
        oracle_decode(encoding, bytes(section), count, escapes, numel) is not None and values_nbytes == count * itemsize
    )
    target = np.zeros(numel * itemsize, dtype=np.uint8)
    try:
        kernel.apply_gaps(target, section, WIDTH[encoding], count, escapes, np.ones(values_nbytes, np.uint8), itemsize)
    except ValueError:
        assert not valid and not target.any(), f"apply_gaps: encoding={encoding} count={count} escapes={escapes}"
        return False
    assert valid, f"apply_gaps applied a corrupt record: encoding={encoding} count={count} escapes={escapes}"
    return True


def interesting(numel: int, limit: int) -> list[int]:
    """Counts and gap values at the edges: around the tensor's size, the gap type's limit and the integer widths."""
    edges = [-1, 0, 1, 2, numel - 1, numel, numel + 1, limit - 1, limit, limit + 1, 1 << 31, 1 << 32, 1 << 61, 1 << 62]
    return [*edges, (1 << 63) - 1, 1 << 63, U64 - 10, U64 - 1]


# -------------------------------------------------------------------------------------------------------------
# Forged records, from a seeded generator (the ASan run; the hypothesis tests draw their own).


def forge(rng: np.random.Generator) -> tuple[int, bytes, int, int, int, int, int]:
    """A record that starts valid and is then changed in one or two of its fields: (encoding, section, count,
    escapes, numel, itemsize, values bytes)."""
    numel = int(rng.choice([1, 7, 64, 255, 256, 300, 70_000]))
    itemsize = int(rng.choice(ITEMSIZES))
    encoding = int(rng.choice(POSITION_ENCODINGS))
    count = int(rng.integers(0, min(numel, 40) + 1))
    positions = sorted(int(p) for p in rng.choice(numel, size=count, replace=False))
    section, escapes = oracle_encode(encoding, positions, numel)
    section = bytearray(section)
    edges = interesting(numel, LIMIT.get(encoding, 0xFF))
    for _ in range(int(rng.integers(1, 3))):
        what = int(rng.integers(0, 7))
        if what == 0:
            count = int(rng.choice(edges))
        elif what == 1:
            escapes = int(rng.choice(edges))
        elif what == 2 and section:  # a byte of the gaps or the bitmask
            section[int(rng.integers(0, len(section)))] = int(rng.choice([0, 1, 0xFE, 0xFF]))
        elif what == 3 and escapes > 0:  # an escaped gap's value
            k = _pad8(count * WIDTH.get(encoding, 1)) + 8 * int(rng.integers(0, min(escapes, 64)))
            if k + 8 <= len(section):
                section[k : k + 8] = (int(rng.choice(edges)) % U64).to_bytes(8, "little")
        elif what == 4:
            del section[int(rng.integers(0, len(section) + 1)) :]
        elif what == 5:
            encoding = int(rng.integers(0, 6))
        else:
            section += bytes(int(rng.integers(1, 16)))
    fits = 0 <= count <= numel  # else the values are a few bytes: a forged count must not size them
    values = count * itemsize if fits and rng.random() < 0.9 else int(rng.integers(0, 64))
    return encoding, bytes(section), count, escapes, numel, itemsize, values


# -------------------------------------------------------------------------------------------------------------
# Issue 31's cases: each section ends where a PROT_NONE page begins, so a read past it is a SIGSEGV.


def guarded(data: bytes) -> np.ndarray:
    """``data`` as a read-only uint8 array whose last byte is the last before an inaccessible page."""
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page)
    region[page - len(data) : page] = data
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(address + page, page, 0) != 0:  # PROT_NONE
        raise OSError(ctypes.get_errno(), "mprotect")
    _keep.append(region)  # unmapped never: the arrays below point into it
    return np.frombuffer(region, dtype=np.uint8, count=page)[page - len(data) :]


_keep: list[mmap.mmap] = []


def _escapes_2_61() -> tuple:
    """Four escaped gaps and 2^61 escapes: 8 * escapes wraps to 0, and the escape words were read past the end."""
    return codec.GAPS8, guarded(b"\xff" * 4 + bytes(4)), 4, 1 << 61, 1 << 20, 1, 4


def _count_2_62_gaps16() -> tuple:
    """2^62 16-bit gaps: count * width wraps to a negative size, and the gaps were read past the end."""
    return codec.GAPS16, guarded(bytes(16)), 1 << 62, 0, 1 << 20, 4, 0


def _escaped_gap_backwards() -> tuple:
    """Gaps 5, escaped 2^64 - 10, 20: positions 5, -4, 17; numpy wrote the second at numel - 4."""
    section = bytes([5, 0xFF, 20]) + bytes(5) + (U64 - 10).to_bytes(8, "little")
    return codec.GAPS8, guarded(section), 3, 1, 100, 1, 3


REGRESSIONS: dict[str, Callable[[], tuple]] = {
    "escapes-2^61": _escapes_2_61,
    "count-2^62-gaps16": _count_2_62_gaps16,
    "escaped-gap-2^64-10": _escaped_gap_backwards,
}


def run_regression(name: str) -> None:
    """Apply the case as a record and decode it: both must raise ValueError, the target untouched."""
    encoding, section, count, escapes, numel, itemsize, values_nbytes = REGRESSIONS[name]()
    target = np.zeros(numel * itemsize, dtype=np.uint8)
    for call in (
        lambda: codec.apply_record(
            target, encoding, section, count, escapes, np.ones(values_nbytes, np.uint8), itemsize
        ),
        lambda: codec.decode_positions(encoding, section, count, escapes, numel),
    ):
        try:
            call()
        except ValueError:
            continue
        raise AssertionError(f"{name}: accepted; nonzero bytes of the target at {np.flatnonzero(target).tolist()}")
    assert not target.any(), f"{name}: wrote before refusing"
    assert not check_kernel_gaps(encoding, section, count, escapes, numel, itemsize, values_nbytes), name


def round_trips(rng: np.random.Generator) -> None:
    """diff, encode and apply_record on random tensors (every comparison this CPU runs, lengths that are not a
    multiple of a vector): the target ends equal to the new tensor."""
    for level in (0, 1, 2):
        if codec.kernel is not None:
            codec.kernel.set_simd(level)
        for itemsize in ITEMSIZES:
            for numel in (1, 5, 63, 64, 257, 4099, 70_001):
                old = rng.integers(0, 256, numel * itemsize, dtype=np.uint8)
                new = old.copy()
                changed = rng.choice(numel, size=int(rng.integers(0, numel + 1) // 30 + 1), replace=False)
                for p in changed:
                    new[p * itemsize] ^= 1 << int(rng.integers(0, 8))
                snapshot, target = old.copy(), old.copy()
                changes = codec.diff(new, snapshot, itemsize)
                assert np.array_equal(snapshot, new), (level, itemsize, numel)
                encoded = (
                    codec.encode(changes.positions, numel, itemsize) if isinstance(changes, codec.Changes) else None
                )
                if encoded is None or encoded.encoding == codec.DENSE:
                    positions = np.sort(changed).astype(np.int64)
                    codec.apply(target, positions, new.reshape(-1, itemsize)[positions].reshape(-1).copy(), itemsize)
                else:
                    section = np.frombuffer(bytes(encoded.positions), dtype=np.uint8)
                    codec.apply_record(
                        target, encoded.encoding, section, encoded.count, encoded.escapes, changes.values, itemsize
                    )
                assert np.array_equal(target, new), (level, itemsize, numel)


def _main(argv: list[str]) -> int:
    if argv[0] == "case":
        if argv[2] == "numpy":
            codec.kernel = None
        elif codec.kernel is None:
            print("the C kernel was not built here", file=sys.stderr)
            return 2
        run_regression(argv[1])
        return 0
    if argv[0] == "asan":
        sys.path.insert(0, argv[1])
        import _delta_kernel  # the ASan build

        codec.kernel = _delta_kernel
        for name in REGRESSIONS:
            run_regression(name)
        rng = np.random.default_rng(31)
        valid = 0
        for k in range(int(argv[2])):
            encoding, section, count, escapes, numel, itemsize, values_nbytes = forge(rng)
            valid += check_record(encoding, section, count, escapes, numel, itemsize, values_nbytes, seed=k)
            check_kernel_gaps(
                encoding, np.frombuffer(section, np.uint8), count, escapes, numel, itemsize, values_nbytes
            )
        round_trips(rng)
        print(f"asan: {len(REGRESSIONS)} regressions, {argv[2]} forged records ({valid} valid), round trips: ok")
        return 0
    raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
