"""Byte sizes as users type them (``256MiB``, ``1.5GiB``, ``64MB``) and as logs show them: buffer and model sizes
in binary units (``256 MiB``), payloads and throughput in decimal ones (``1.07 GB``). Every size shown anywhere goes
through this module."""

from __future__ import annotations

import re
from decimal import Decimal

from refit_app.common.errors import ConfigError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
_HINT = "use an integer number of bytes or a size like 256MiB, 1GiB, 64MB"
MAX_SIZE = 2**63 - 1
"""The largest byte count a size may be: torch, numpy and the C kernel count bytes in signed 64-bit integers, so a
larger one would fail deep inside a rank (OverflowError) instead of here, naming the key."""


def parse_size(text: str | int, key: str = "size") -> int:
    """Bytes in ``text``; binary units (KiB..TiB) are powers of 1024, decimal ones (KB..TB) powers of 1000.

    ``key`` is the config key the value came from, so the error tells the user which setting to fix.
    """
    # bool is an int subclass; ``True`` bytes is a typo, not a size.
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ConfigError(f"{key}: {text} is not a size (it must be more than 0 bytes); {_HINT}")
        return _bounded(text, str(text), key)
    if not isinstance(text, str):
        raise ConfigError(f"{key}: {text!r} is not a size; {_HINT}")
    match = _SIZE_RE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{key}: {text!r} is not a size; {_HINT}")
    number = match.group(1)
    if unit in ("", "B") and "." in number:
        # A fractional byte count is almost certainly a missing unit.
        raise ConfigError(f"{key}: {text!r} is not a whole number of bytes; {_HINT}")
    value = int(Decimal(number) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"{key}: {text!r} is not a size (it must be more than 0 bytes); {_HINT}")
    return _bounded(value, repr(text), key)


def _bounded(value: int, shown: str, key: str) -> int:
    if value > MAX_SIZE:
        raise ConfigError(f"{key}: {shown} is more bytes than any size can be (at most {MAX_SIZE}, 8 EiB); {_HINT}")
    return value


def format_size(n: int) -> str:
    """``268435456`` -> ``"256 MiB"``, ``1610612736`` -> ``"1.5 GiB"``; at most two decimals."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= factor:
            return f"{n / factor:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} B"


def format_decimal(nbytes: float) -> str:
    """Decimal units, as throughput and payloads are quoted: ``1.07 GB``, ``537 MB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"
    return f"{nbytes:.0f} B"


def gb_per_s(nbytes: int, seconds: float) -> float | None:
    """Throughput as the metrics report it (decimal GB); None when no time was measured."""
    if seconds <= 0:
        return None
    return nbytes / 1e9 / seconds
