"""Per-tensor checksums over the exact bytes that travel, so a consumer can prove it got what was sent.

Non-cryptographic hashes: they catch the corruption refit can cause (a reused buffer, a flipped or shifted byte)
at memory speed, and each releases the GIL, so hashing overlaps communication. The algorithm travels in the
manifest (``Manifest.checksum_algorithm``): both sides hash the same way, and a consumer that cannot compute the
producer's refuses at the handshake, naming it. Measured on this project's 2-core machine, on 256 MiB:

=============  ===============================  =================================
name           package                          speed
=============  ===============================  =================================
xxh3_64_16mib  ``xxhash`` (a dependency)        13 GB/s a thread, on both threads
xxh3_64        ``xxhash``                       13 GB/s
crc32c         ``crc32c`` (hardware CRC32C)     7 GB/s
crc32          ``zlib`` (standard library)      2.6 GB/s
=============  ===============================  =================================

The producer picks the first one installed, in that order; zlib's CRC32 is the fallback that always exists.

``xxh3_64_16mib`` is xxh3_64 where a tensor has at most 16 MiB; a larger one's checksum is the xxh3_64 of its
16 MiB pieces' xxh3_64 digests (each 8 bytes, little-endian, in order; the last piece may be shorter). Pieces can
be hashed apart: a large tensor's pieces are hashed on two threads (1 GiB: 0.045 s against 0.072 s here), and a delta
round's comparison hashes each half of a tensor on the thread that compares it, while it is in that core's cache.
"""

from __future__ import annotations

import functools
import importlib
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from refit_app.common.errors import HandshakeError

ChecksumFunction = Callable[[memoryview], int]
"""Bytes -> an unsigned integer of at most 64 bits."""

PIECE_BYTES = 16 << 20
"""The piece of ``xxh3_64_16mib`` (its name says it: changing it is another algorithm)."""
PIECED = "xxh3_64_16mib"

_ALGORITHMS: dict[str, tuple[str, str, str]] = {
    # name: (module, function, what to pip install)
    PIECED: ("xxhash", "xxh3_64_intdigest", "xxhash"),
    "xxh3_64": ("xxhash", "xxh3_64_intdigest", "xxhash"),
    "crc32c": ("crc32c", "crc32c", "crc32c"),
    "crc32": ("zlib", "crc32", ""),
}
"""Every algorithm refit_app can compute, fastest first: the producer's order of preference."""

ALGORITHM_NAMES = tuple(_ALGORITHMS)
FALLBACK_ALGORITHM = "crc32"

_HELPER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-hash")
_PARALLEL_MIN_PIECES = 4
"""A tensor of at least this many pieces is hashed on two threads (a thread's start costs more than a piece)."""
_PARALLEL_MIN_BYTES = 4 << 20
"""Buffers of at least this many bytes in all are hashed on two threads by :func:`checksum_all`."""


@functools.cache
def _load(name: str) -> ChecksumFunction | None:
    module_name, function, _ = _ALGORITHMS[name]
    try:
        base = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError):
        return None
    return functools.partial(_pieced, base) if name == PIECED else base


def _piece_digests(xxh3: ChecksumFunction, data: Any, start: int, stop: int) -> bytes:
    view = memoryview(data).cast("B")
    return b"".join(
        struct.pack("<Q", xxh3(view[at : min(at + PIECE_BYTES, stop)])) for at in range(start, stop, PIECE_BYTES)
    )


def _pieced(xxh3: ChecksumFunction, data: Any) -> int:
    n = memoryview(data).nbytes
    if n <= PIECE_BYTES:
        return xxh3(data)
    pieces = -(-n // PIECE_BYTES)
    if pieces < _PARALLEL_MIN_PIECES:
        return xxh3(_piece_digests(xxh3, data, 0, n))
    half = pieces // 2 * PIECE_BYTES
    second = _HELPER.submit(_piece_digests, xxh3, data, half, n)
    first = _piece_digests(xxh3, data, 0, half)
    return xxh3(first + second.result())


def checksum_function(name: str) -> ChecksumFunction:
    """The function computing ``name``; HandshakeError naming it and its package when this host cannot."""
    if name not in _ALGORITHMS:
        raise HandshakeError(
            f"checksum algorithm {name!r} is unknown to this refit_app (it knows {', '.join(ALGORITHM_NAMES)}); "
            "run the same refit_app version on every rank"
        )
    function = _load(name)
    if function is None:
        raise HandshakeError(
            f"the producer checksums with {name}, which this host cannot compute: pip install {_ALGORITHMS[name][2]}"
        )
    return function


def checksum_all(name: str, buffers: Sequence[Any]) -> list[int]:
    """``checksum_function(name)`` of each host buffer, on two threads: the buffers (a large one as its 16 MiB
    pieces, for ``xxh3_64_16mib``) are split into two runs of about equal bytes, the second hashed on the helper
    thread. A model of many tensors under 64 MiB, which :func:`checksum_function` hashes on one thread each, takes
    about half the time this way."""
    function = checksum_function(name)
    views = [memoryview(b).cast("B") for b in buffers]
    pieced = name == PIECED
    unit_function = _load("xxh3_64") if pieced else function
    assert unit_function is not None  # xxh3_64_16mib and xxh3_64 come from the same package
    # Units of work: (buffer, start, stop); a pieced buffer over one piece is one unit per piece.
    units = []
    for i, view in enumerate(views):
        n = view.nbytes
        if pieced and n > PIECE_BYTES:
            units += [(i, at, min(at + PIECE_BYTES, n)) for at in range(0, n, PIECE_BYTES)]
        else:
            units.append((i, 0, n))
    total = sum(stop - start for _, start, stop in units)

    def digests(part: list[tuple[int, int, int]]) -> list[int]:
        return [unit_function(views[i][start:stop]) for i, start, stop in part]

    cut = len(units)
    if total >= _PARALLEL_MIN_BYTES:
        done, cut = 0, 0
        while cut < len(units) and done < total // 2:
            done += units[cut][2] - units[cut][1]
            cut += 1
    second = _HELPER.submit(digests, units[cut:]) if cut < len(units) else None
    values = digests(units[:cut]) + (second.result() if second is not None else [])
    if not pieced:
        return values
    out: list[list[int]] = [[] for _ in views]
    for (i, _, _), value in zip(units, values):
        out[i].append(value)
    return [
        parts[0] if views[i].nbytes <= PIECE_BYTES else unit_function(b"".join(struct.pack("<Q", d) for d in parts))
        for i, parts in enumerate(out)
    ]


def split_point(name: str, nbytes: int) -> int | None:
    """Where a tensor of ``nbytes`` can be hashed in two parts apart (:meth:`Incremental.join`), near its middle:
    a piece boundary of ``xxh3_64_16mib``; None for the other algorithms, or a tensor of one piece."""
    pieces = -(-nbytes // PIECE_BYTES)
    if name != PIECED or pieces < 2:
        return None
    return pieces // 2 * PIECE_BYTES


class Incremental:
    """One checksum fed in order (``update``), equal to ``checksum_function(name)`` of all the bytes joined: a delta
    round hashes each tensor block by block while the block is in cache.

    ``total``: the tensor's size in bytes (``xxh3_64_16mib`` hashes a tensor of one piece plainly, a larger one by
    pieces).
    ``start``: where in the tensor the bytes fed begin, for the second part of :func:`split_point`, whose hasher
    the first part's then takes with :meth:`join`.
    """

    def __init__(self, name: str, total: int, *, start: int = 0) -> None:
        checksum_function(name)  # refuses, naming it, where this host cannot compute it
        self._xxh = self._pieces = None
        self._offset = start
        if name in ("xxh3_64", PIECED):
            import xxhash

            self._xxh = xxhash.xxh3_64()
            if name == PIECED and total > PIECE_BYTES:
                self._pieces = []
        else:
            self._function = _load(name)
            self._value = 0

    def update(self, data: object) -> None:
        if self._pieces is not None:
            view = memoryview(data).cast("B")
            while view.nbytes:
                room = PIECE_BYTES - self._offset % PIECE_BYTES
                self._xxh.update(view[:room])
                self._offset += min(room, view.nbytes)
                if self._offset % PIECE_BYTES == 0:
                    self._end_piece()
                view = view[room:]
        elif self._xxh is not None:
            self._xxh.update(data)
        else:
            self._value = self._function(data, self._value)

    def _end_piece(self) -> None:
        self._pieces.append(struct.pack("<Q", self._xxh.intdigest()))
        self._xxh.reset()

    def join(self, rest: Incremental) -> None:
        """Take the digests of the tensor's second part, hashed apart from ``split_point`` on."""
        assert self._pieces is not None and rest._pieces is not None and self._offset % PIECE_BYTES == 0
        rest._finish()
        self._pieces += rest._pieces
        rest._pieces = []

    def _finish(self) -> None:
        if self._offset % PIECE_BYTES:
            self._end_piece()
            self._offset += PIECE_BYTES - self._offset % PIECE_BYTES

    def value(self) -> int:
        if self._pieces is not None:
            self._finish()
            import xxhash

            return xxhash.xxh3_64_intdigest(b"".join(self._pieces))
        return self._xxh.intdigest() if self._xxh is not None else self._value


def available_algorithms() -> list[str]:
    """The algorithms this host can compute, fastest first."""
    return [name for name in ALGORITHM_NAMES if _load(name) is not None]


def default_algorithm() -> str:
    """The fastest algorithm installed here; zlib's CRC32 when neither xxhash nor crc32c is."""
    return available_algorithms()[0]
