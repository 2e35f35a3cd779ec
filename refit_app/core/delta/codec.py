"""Delta encoding: the elements of a tensor whose bytes changed since the last round, found, encoded and applied.

A trainer's RL step leaves most bf16 elements as they were (Adam's update is below half a rounding step), so a
round can send only positions and new values. Everything here compares and copies **raw bytes**, never values:
``-0.0`` vs ``0.0``, NaN payloads, fp8, integers and bools are all exact, and an element counts as changed when
any of its bytes did.

Wire format of one record (little-endian, every section padded to a multiple of 8 bytes)::

    header   RECORD: u32 tensor index, u8 encoding, u8 flags, u16 0, u64 count, u64 escapes,
                     u64 positions bytes (as sent), u64 values bytes
    positions        (not for DENSE) the changed elements' flat indices, encoded as ``encoding`` says,
                     zstd-compressed where ``flags & ZSTD``
    values           DENSE: the whole tensor's bytes; else ``count`` elements' bytes, in position order

Encodings of the positions (``count`` changed elements of ``numel``):

- ``DENSE``: no positions; the values are the tensor (a tensor that changed too much, or a round's first).
- ``BITMASK``: ``ceil(numel / 8)`` bytes, bit ``i % 8`` of byte ``i // 8`` set where element ``i`` changed.
- ``GAPS8`` / ``GAPS16``: per change, the number of unchanged elements since the previous one as u8 / u16;
  a gap that does not fit is written as the type's maximum and its value follows, in order, as one of the
  ``escapes`` u64 words after the gaps.

Each tensor takes the smallest of these (:func:`encode`); the positions are zstd-compressed where that saves at
least :data:`ZSTD_MIN_SAVING` of them. A round's records follow each other in a byte stream
(:mod:`refit_app.core.delta.stream`), in increasing tensor index, unchanged tensors left out, ended by a record whose
index is :data:`END`.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    from refit_app.core.delta import _delta_kernel as kernel
except ImportError:  # built where a C compiler was at install time; numpy does the same where not
    kernel = None

DENSE = 0
BITMASK = 1
GAPS8 = 2
GAPS16 = 3
ENCODING_NAMES = {DENSE: "dense", BITMASK: "bitmask", GAPS8: "gaps8", GAPS16: "gaps16"}
ZSTD = 0x01
"""Record flag: the positions section is zstd-compressed."""
END = 0xFFFF_FFFF
"""The index of the record that ends a round's stream."""

RECORD = struct.Struct("<IBBHQQQQ")
"""A record's header: index, encoding, flags, reserved, count, escapes, positions bytes, values bytes."""
ALIGN = 8

BLOCK_BYTES = 1 << 20
"""Bytes compared per step: the two blocks and the mask stay in cache while their changes are gathered and the
snapshot updated, so each byte is read from memory once."""
ZSTD_MIN_BYTES = 4096
"""Positions shorter than this are sent as they are: compressing them saves less than a broadcast's overhead."""
ZSTD_MIN_SAVING = 0.2
"""zstd is used where it shrinks the positions by at least this share. Positions of scattered changes are close to
incompressible (geometric gaps carry about as many bits as GAPS8 spends), so zstd pays only where the changes
cluster: whole rows or blocks of a matrix."""
ZSTD_LEVEL = 1

_GAP_LIMIT = {GAPS8: 0xFF, GAPS16: 0xFFFF}
_GAP_DTYPE = {GAPS8: np.dtype("<u1"), GAPS16: np.dtype("<u2")}
_UINT = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def padded(n: int) -> int:
    """``n`` rounded up to the record alignment."""
    return -(-n // ALIGN) * ALIGN


# -------------------------------------------------------------------------------------------------------------
# Finding the changes.


@dataclass
class Changes:
    """What changed in one tensor: element indices (ascending) and the new bytes of those elements."""

    positions: np.ndarray
    """int64 flat element indices."""
    values: np.ndarray
    """uint8, ``len(positions) * itemsize`` bytes."""

    @property
    def count(self) -> int:
        return int(self.positions.size)


DENSE_ABOVE = 0.05
"""A tensor goes whole once more than this share of its elements changed (measured as the comparison goes). Its
changes would still take fewer bytes (a bf16 tensor's 5% take 7.5% of it as gaps and values, and a bitmask stays
smaller up to ~90%), but finding, encoding and applying that many changes costs more CPU than copying it: measured
with ``python -m refit_app.bench --delta-shares`` on a 1 GB model, a round at 3% changed took 2.5x a dense round's time
and at 10% 7x, all of it the producer's comparison and encoding (docs/results.md). Tensors smaller than the first
block (64 KiB) are compared whole and take the smallest encoding."""
_FIRST_BLOCK_BYTES = 64 * 1024
"""The first block compared is this small, so that a tensor that changed throughout is found to be dense after a
64 KiB look rather than after a whole comparison; a share measured on less would be noise."""


@dataclass
class Whole:
    """What :func:`diff` returns for a tensor that changed too much to send as changes: it goes whole."""

    estimated: int
    """Changed elements, estimated from the share found before giving up (for the round's figures)."""

    count = property(lambda self: self.estimated)


def diff(
    new: np.ndarray,
    old: np.ndarray,
    itemsize: int,
    *,
    update: bool = True,
    hasher: Any = None,
    dense_above: float = DENSE_ABOVE,
) -> Changes | Whole:
    """The elements whose bytes differ between ``new`` and ``old`` (uint8 arrays of one tensor's bytes), and their
    new bytes; with ``update``, ``old`` is made equal to ``new`` (only the changed words are written); where more
    than ``dense_above`` of the elements changed (measured as it goes): :class:`Whole`, the tensor is then sent
    whole, and ``old`` is made equal to ``new`` by a copy.

    ``hasher`` (an object with ``update(buffer)``) is fed ``new`` block by block while the block is in cache, so a
    round's checksums cost no second read of the tensor. Compares 8-byte words first (most words are unchanged),
    then finds the changed elements inside the changed words.
    """
    n = new.size
    if old.size != n:
        raise ValueError(f"a tensor of {n} bytes cannot be compared with a snapshot of {old.size}")
    if n % itemsize:
        raise ValueError(f"{n} bytes are not a whole number of {itemsize}-byte elements")
    words = n // 8 * 8
    # A block is a whole number of words and of elements (itemsize divides 16 for every dtype torch has).
    step = BLOCK_BYTES - BLOCK_BYTES % max(16, itemsize)
    finder: _KernelFinder | _NumpyFinder
    if kernel is not None and itemsize in (1, 2, 4, 8, 16):
        finder = _KernelFinder(n, itemsize, step, update)
    else:
        finder = _NumpyFinder(itemsize, step, update)
    first = min(_FIRST_BLOCK_BYTES, step)
    for start in itertools.chain((0,), range(first, words, step)) if words else ():
        if start and finder.count > dense_above * (start // itemsize):
            if update:
                np.copyto(old[start:], new[start:])
            if hasher is not None:
                hasher.update(new[start:])
            return Whole(round(finder.count * (n // itemsize) / (start // itemsize)))
        stop = min(start + (first if start == 0 else step), words)
        finder.compare(new[start:stop], old[start:stop], start)
        if hasher is not None:
            hasher.update(new[start:stop])
    positions, values = finder.found()
    if words < n:  # the last < 8 bytes: whole elements of 1, 2 or 4 bytes
        if hasher is not None:
            hasher.update(new[words:])
        _compare_tail(new, old, words, itemsize, update, positions, values)
    if not positions:
        return Changes(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.uint8))
    if len(positions) == 1:
        return Changes(positions[0].astype(np.int64, copy=False), values[0])
    return Changes(np.concatenate(positions).astype(np.int64, copy=False), np.concatenate(values))


class _KernelFinder:
    """:func:`diff`'s blocks compared by the C kernel, which writes the changes straight into arrays that grow by
    doubling: no copy per block, one trim at the end."""

    def __init__(self, n: int, itemsize: int, step: int, update: bool) -> None:
        self.itemsize, self.update = itemsize, update
        self.positions = np.empty(min(n // itemsize, 4 * (step // itemsize)), dtype=np.int64)
        self.values = np.empty(self.positions.size * itemsize, dtype=np.uint8)
        self.count = 0
        """Changed elements found so far."""

    def compare(self, nb: np.ndarray, ob: np.ndarray, start: int) -> None:
        """The block of ``new`` and ``old`` from byte ``start``; with ``update``, the kernel patches ``ob``."""
        itemsize = self.itemsize
        room = nb.size // itemsize
        if self.count + room > self.positions.size:
            size = max(2 * self.positions.size, self.count + room)
            self.positions = np.resize(self.positions, size)  # np.resize copies into a new array of that size
            self.values = np.resize(self.values, size * itemsize)
        self.count += kernel.diff(
            nb,
            ob,
            itemsize,
            self.positions[self.count :],
            self.values[self.count * itemsize :],
            start // itemsize,
            self.update,
        )

    def found(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The changes' positions and values, as lists of parts."""
        if not self.count:
            return [], []
        return [self.positions[: self.count]], [self.values[: self.count * self.itemsize]]


class _NumpyFinder:
    """:func:`diff`'s blocks compared with numpy: 8-byte words first (most words are unchanged), then the changed
    elements inside the changed words."""

    def __init__(self, itemsize: int, step: int, update: bool) -> None:
        self.itemsize, self.update = itemsize, update
        self.mask = np.empty(step // 8, dtype=bool)
        self.positions: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.count = 0
        """Changed elements found so far."""

    def compare(self, nb: np.ndarray, ob: np.ndarray, start: int) -> None:
        """The block of ``new`` and ``old`` from byte ``start``; with ``update``, its changed words written into
        ``ob``."""
        nw, ow = nb.view(np.uint64), ob.view(np.uint64)
        m = self.mask[: nw.size]
        np.not_equal(nw, ow, out=m)
        changed = np.flatnonzero(m)
        if changed.size == 0:
            return
        local = _changed_elements(nw, ow, changed, self.itemsize)
        self.count += local.size
        self.positions.append(local + start // self.itemsize)
        self.values.append(_gather(nb, local, self.itemsize))
        if self.update:
            ow[changed] = nw[changed]

    def found(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The changes' positions and values, as lists of parts (one per block with changes)."""
        return self.positions, self.values


def _compare_tail(
    new: np.ndarray,
    old: np.ndarray,
    words: int,
    itemsize: int,
    update: bool,
    positions: list[np.ndarray],
    values: list[np.ndarray],
) -> None:
    """:func:`diff` of the bytes after the last whole word (fewer than 8: elements of 1, 2 or 4 bytes), its
    changes appended to ``positions`` and ``values``."""
    dt = _UINT[itemsize]
    nt, ot = new[words:].view(dt), old[words:].view(dt)
    local = np.flatnonzero(nt != ot)
    if local.size:
        positions.append(local + words // itemsize)
        values.append(nt[local].view(np.uint8))
        if update:
            ot[local] = nt[local]


def _changed_elements(nw: np.ndarray, ow: np.ndarray, changed: np.ndarray, itemsize: int) -> np.ndarray:
    """Block-local indices of the changed elements inside the changed words ``changed``."""
    if itemsize >= 8:
        # One element per word (8) or one per two words (16): every changed word names its element.
        elements = changed * 8 // itemsize
        if itemsize > 8 and elements.size > 1:
            elements = elements[np.concatenate(([True], elements[1:] != elements[:-1]))]
        return elements
    lanes = 8 // itemsize
    # One 1-D nonzero over the changed words' lanes (a 2-D nonzero is several times slower).
    flat = np.flatnonzero((nw[changed] ^ ow[changed]).view(_UINT[itemsize]))
    return changed[flat // lanes] * lanes + flat % lanes


def _gather(block: np.ndarray, elements: np.ndarray, itemsize: int) -> np.ndarray:
    """The bytes of ``elements`` of ``block``, in order."""
    if itemsize in _UINT:
        return block.view(_UINT[itemsize])[elements].view(np.uint8)
    return block.reshape(-1, itemsize)[elements].reshape(-1)


# -------------------------------------------------------------------------------------------------------------
# Encoding and decoding the positions.


@dataclass
class Encoded:
    """One record, ready to write: its header fields and its positions section (values are the caller's)."""

    encoding: int
    flags: int
    count: int
    escapes: int
    positions: bytes | np.ndarray
    """The positions section as sent (compressed where ``flags & ZSTD``; bytes or a uint8 array), unpadded; empty
    for DENSE."""

    def header(self, index: int, values_nbytes: int) -> bytes:
        return RECORD.pack(
            index, self.encoding, self.flags, 0, self.count, self.escapes, len(self.positions), values_nbytes
        )

    def nbytes(self, values_nbytes: int) -> int:
        """The record's size in the stream."""
        return RECORD.size + padded(len(self.positions)) + padded(values_nbytes)


def dense_size(numel: int, itemsize: int) -> int:
    return RECORD.size + padded(numel * itemsize)


def encode(positions: np.ndarray, numel: int, itemsize: int, *, compressor: Any = None) -> Encoded:
    """The smallest record for ``positions`` (ascending element indices) of a tensor of ``numel`` elements: a
    positions encoding, or DENSE where sending the whole tensor is no larger. ``compressor``: a zstd compressor
    (``zstandard.ZstdCompressor``) to try on the positions; None: never compress."""
    count = int(positions.size)
    dense = dense_size(numel, itemsize)
    if count == numel or count * itemsize >= numel * itemsize:
        return Encoded(DENSE, 0, numel, 0, b"")
    gaps = np.diff(positions, prepend=-1) - 1 if count else np.empty(0, dtype=np.int64)
    options = [(padded((numel + 7) // 8), BITMASK, 0)]
    for encoding, limit in _GAP_LIMIT.items():
        escapes = int(np.count_nonzero(gaps >= limit))
        options.append((padded(count * _GAP_DTYPE[encoding].itemsize) + 8 * escapes, encoding, escapes))
    size, encoding, escapes = min(options)
    if RECORD.size + size + padded(count * itemsize) >= dense:
        return Encoded(DENSE, 0, numel, 0, b"")
    raw = _positions_section(encoding, positions, gaps, numel, escapes)
    flags = 0
    if compressor is not None and len(raw) >= ZSTD_MIN_BYTES and _compresses(compressor, raw):
        packed = compressor.compress(raw)
        if len(packed) <= (1 - ZSTD_MIN_SAVING) * len(raw):
            raw, flags = packed, ZSTD
    return Encoded(encoding, flags, count, escapes, raw)


_ZSTD_SAMPLE = 64 * 1024


def _compresses(compressor: Any, raw: np.ndarray) -> bool:
    """Whether the first 64 KiB of ``raw`` shrink enough to try all of it: scattered changes' gaps do not, and
    compressing megabytes of them for nothing would cost more than the bytes it might save."""
    if len(raw) <= 2 * _ZSTD_SAMPLE:
        return True
    sample = raw[:_ZSTD_SAMPLE]
    return len(compressor.compress(sample)) <= (1 - ZSTD_MIN_SAVING) * len(sample)


def _positions_section(encoding: int, positions: np.ndarray, gaps: np.ndarray, numel: int, escapes: int) -> np.ndarray:
    """The raw positions section as uint8."""
    if encoding == BITMASK:
        mask = np.zeros(numel, dtype=bool)
        mask[positions] = True
        return np.packbits(mask, bitorder="little")
    limit, dtype = _GAP_LIMIT[encoding], _GAP_DTYPE[encoding]
    small = np.minimum(gaps, limit).astype(dtype).view(np.uint8)
    if not escapes:
        return small
    pad = np.zeros(padded(small.size) - small.size, dtype=np.uint8)
    return np.concatenate([small, pad, gaps[gaps >= limit].astype("<u8").view(np.uint8)])


def raw_positions_nbytes(encoding: int, count: int, escapes: int, numel: int) -> int:
    """The size of a positions section before compression, from its header: what a decompressor may produce."""
    if encoding == BITMASK:
        return (numel + 7) // 8
    width = _GAP_DTYPE[encoding].itemsize
    return (padded(count * width) + 8 * escapes) if escapes else count * width


def check_header(
    encoding: int,
    flags: int,
    count: int,
    escapes: int,
    positions_nbytes: int,
    values_nbytes: int,
    numel: int,
    itemsize: int,
) -> None:
    """ValueError, saying which field is wrong, where a record's header cannot describe changes of a tensor of
    ``numel`` elements of ``itemsize`` bytes. The receiver calls this before it reads or allocates anything by the
    header's sizes: a corrupt header (a count of 2^62) is refused instead of asking numpy for 2^62 bytes."""
    if encoding not in ENCODING_NAMES:
        raise ValueError(f"unknown encoding {encoding} (known: {sorted(ENCODING_NAMES)})")
    if flags & ~ZSTD or (flags and encoding == DENSE):
        raise ValueError(f"flags {flags:#x} are not valid for encoding {ENCODING_NAMES[encoding]}")
    if encoding == DENSE:
        if count != numel or escapes or positions_nbytes:
            raise ValueError(
                f"a dense record has {count} changes, {escapes} escapes and {positions_nbytes} positions bytes; "
                f"it must have {numel}, 0 and 0"
            )
        want_values = numel * itemsize
    else:
        _check_counts(encoding, count, escapes, numel)
        raw = raw_positions_nbytes(encoding, count, escapes, numel)
        # zstd is kept only where it saves ZSTD_MIN_SAVING, so compressed positions are never longer than raw ones.
        if not (0 < positions_nbytes <= raw if flags & ZSTD else positions_nbytes == raw):
            raise ValueError(
                f"{positions_nbytes} positions bytes for {count} changes and {escapes} escapes as "
                f"{ENCODING_NAMES[encoding]}{' (zstd)' if flags & ZSTD else ''}: "
                f"{'at most ' if flags & ZSTD else ''}{raw} expected"
            )
        want_values = count * itemsize
    if values_nbytes != want_values:
        raise ValueError(f"{values_nbytes} value bytes for {count} of {numel} elements: {want_values} expected")


def _check_counts(encoding: int, count: int, escapes: int, numel: int) -> None:
    """ValueError unless ``encoding`` encodes positions and ``count``, ``escapes`` can describe changes of ``numel``
    elements. Checked before any size is computed from them: a forged count must not make a slice or an allocation
    that large."""
    if encoding not in (BITMASK, *_GAP_LIMIT):
        raise ValueError(f"encoding {encoding} does not encode positions (bitmask, gaps8 or gaps16 do)")
    if not 0 <= count <= numel or not 0 <= escapes <= (count if encoding in _GAP_LIMIT else 0):
        raise ValueError(
            f"a record of {count} changes and {escapes} escapes does not fit a tensor of {numel} elements "
            "(at most one change per element, one escape per change, none in a bitmask)"
        )


_NO_OVERFLOW_NUMEL = 3_037_000_499
"""Below this many elements (the square root of 2^63), ``count <= numel`` gaps each below ``numel`` sum to less than
2^63: their int64 running sum cannot wrap, so positions strictly increase without a check of their order."""


def decode_positions(encoding: int, section: np.ndarray, count: int, escapes: int, numel: int) -> np.ndarray:
    """The ascending int64 element indices a positions section encodes; ValueError where it is inconsistent (so a
    corrupt record is refused, never applied at wrong places)."""
    _check_counts(encoding, count, escapes, numel)
    if encoding == BITMASK:
        nbytes = (numel + 7) // 8
        if section.size < nbytes:
            raise ValueError(f"a bitmask of {section.size} bytes is too short for {numel} elements")
        positions = np.flatnonzero(np.unpackbits(section[:nbytes], bitorder="little")[:numel])
    else:
        limit, dtype = _GAP_LIMIT[encoding], _GAP_DTYPE[encoding]
        width = dtype.itemsize
        at = padded(count * width) if escapes else count * width
        if section.size < at + 8 * escapes:
            raise ValueError(
                f"a positions section of {section.size} bytes is too short for {count} changes and {escapes} escapes"
            )
        gaps = section[: count * width].view(dtype).astype(np.int64)
        escaped = np.flatnonzero(gaps == limit)
        if escaped.size != escapes:
            raise ValueError(f"{escaped.size} escaped gaps where the record says {escapes}")
        if escapes:
            words = section[at : at + 8 * escapes].view("<u8")
            # An escaped gap is a u64: one of 2^63 or more would turn negative as an int64 and move the position
            # back (2^64 - 10 by ten), and numpy would write there, or wrap a negative index, without a word.
            if int(words.max()) >= numel:
                raise ValueError(f"an escaped gap of {int(words.max())} in a tensor of {numel} elements")
            gaps[escaped] = words.astype(np.int64)
        positions = np.cumsum(gaps + 1) - 1
        if numel > _NO_OVERFLOW_NUMEL and count > 1 and not np.all(positions[1:] > positions[:-1]):
            raise ValueError(f"the positions of a record of {count} changes overflow")
    if positions.size != count or (count and (positions[0] < 0 or positions[-1] >= numel)):
        raise ValueError(f"the positions of a record of {count} changes do not fit a tensor of {numel} elements")
    return positions


def apply_record(
    target: np.ndarray, encoding: int, section: np.ndarray, count: int, escapes: int, values: np.ndarray, itemsize: int
) -> None:
    """Write a record's ``values`` at the positions its ``section`` encodes, into ``target`` (a tensor's uint8
    bytes, writable); ValueError where the section is inconsistent, before anything is written. Gaps go through the
    kernel's one pass where it was built (decoding to int64 positions first cost the consumer two thirds as much as
    applying them)."""
    numel = target.size // itemsize
    _check_counts(encoding, count, escapes, numel)
    if values.size != count * itemsize:
        raise ValueError(f"{values.size} value bytes for {count} changes of {itemsize}-byte elements")
    if encoding in _GAP_LIMIT and kernel is not None and target.flags.c_contiguous and target.flags.writeable:
        kernel.apply_gaps(target, section, _GAP_DTYPE[encoding].itemsize, count, escapes, values, itemsize)
        return
    apply(target, decode_positions(encoding, section, count, escapes, numel), values, itemsize)


def apply(target: np.ndarray, positions: np.ndarray, values: np.ndarray, itemsize: int) -> None:
    """Write ``values`` (uint8, ``itemsize`` bytes per position) at ``positions`` of ``target`` (a tensor's uint8
    bytes, writable); ValueError, before anything is written, where a position lies outside ``target`` (numpy
    would wrap a negative one to the end) or the values do not match the positions."""
    if kernel is not None and target.flags.c_contiguous and target.flags.writeable:
        kernel.scatter(target, np.ascontiguousarray(positions, dtype=np.int64), np.ascontiguousarray(values), itemsize)
        return
    numel = target.size // itemsize
    if values.size != positions.size * itemsize:
        raise ValueError(f"{values.size} value bytes for {positions.size} positions of {itemsize}-byte elements")
    if positions.size and (positions.min() < 0 or positions.max() >= numel):
        raise ValueError(f"a position lies outside the target of {numel} elements")
    if itemsize in _UINT:
        target.view(_UINT[itemsize])[positions] = values.view(_UINT[itemsize])
    else:
        target.reshape(-1, itemsize)[positions] = values.reshape(-1, itemsize)
