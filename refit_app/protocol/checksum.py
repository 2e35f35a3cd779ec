"""Per-tensor checksums over the exact bytes that travel, so a consumer can prove it got what was sent.

Non-cryptographic hashes: they catch the corruption refit can cause (a reused buffer, a flipped or shifted byte)
at memory speed, and each releases the GIL, so hashing overlaps communication. The algorithm travels in the
manifest (``Manifest.checksum_algorithm``): both sides hash the same way, and a consumer that cannot compute the
producer's refuses at the handshake, naming it. Measured on this project's 2-core machine, on 256 MiB:

=========  ===============================  ==========
name       package                          speed
=========  ===============================  ==========
xxh3_64    ``xxhash`` (a dependency)        13 GB/s
crc32c     ``crc32c`` (hardware CRC32C)     7 GB/s
crc32      ``zlib`` (standard library)      2.6 GB/s
=========  ===============================  ==========

The producer picks the first one installed, in that order; zlib's CRC32 is the fallback that always exists.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from refit_app.common.errors import HandshakeError

ChecksumFunction = Callable[[memoryview], int]
"""Bytes -> an unsigned integer of at most 64 bits."""

_ALGORITHMS: dict[str, tuple[str, str, str]] = {
    # name: (module, function, what to pip install)
    "xxh3_64": ("xxhash", "xxh3_64_intdigest", "xxhash"),
    "crc32c": ("crc32c", "crc32c", "crc32c"),
    "crc32": ("zlib", "crc32", ""),
}
"""Every algorithm refit_app can compute, fastest first: the producer's order of preference."""

ALGORITHM_NAMES = tuple(_ALGORITHMS)
FALLBACK_ALGORITHM = "crc32"


@functools.cache
def _load(name: str) -> ChecksumFunction | None:
    module_name, function, _ = _ALGORITHMS[name]
    try:
        return getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError):
        return None


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


class Incremental:
    """One checksum fed piece by piece (``update``), equal to ``checksum_function(name)`` of all pieces joined:
    a delta round hashes each tensor block by block while the block is in cache."""

    def __init__(self, name: str) -> None:
        checksum_function(name)  # refuses, naming it, where this host cannot compute it
        self._xxh = None
        if name == "xxh3_64":
            import xxhash

            self._xxh = xxhash.xxh3_64()
        else:
            self._function = _load(name)
            self._value = 0

    def update(self, data: object) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._value = self._function(data, self._value)

    def value(self) -> int:
        return self._xxh.intdigest() if self._xxh is not None else self._value


def available_algorithms() -> list[str]:
    """The algorithms this host can compute, fastest first."""
    return [name for name in ALGORITHM_NAMES if _load(name) is not None]


def default_algorithm() -> str:
    """The fastest algorithm installed here; zlib's CRC32 when neither xxhash nor crc32c is."""
    return available_algorithms()[0]
