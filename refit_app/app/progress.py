"""Progress of one transfer: a live line on a terminal, a periodic log line elsewhere, nothing for short ones."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from refit_app.common.sizes import format_decimal, gb_per_s

logger = logging.getLogger(__name__)

# A terminal redraw costs a write syscall; five a second reads as live without slowing a per-chunk loop.
_REDRAW_INTERVAL_S = 0.2
_CLEAR_TO_EOL = "\x1b[K"


def _duration(seconds: float) -> str:
    if seconds < 100:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


class Progress:
    """Reports bytes and chunks done of a known total, the rate and the time left.

    ``update`` runs once per chunk inside the transfer loop, so it only adds and reads the clock until a
    report is due. Transfers shorter than ``min_seconds`` report nothing, so fast refits keep quiet logs.
    """

    def __init__(
        self,
        total_bytes: int,
        total_chunks: int,
        label: str,
        *,
        stream: TextIO | None = None,
        min_seconds: float = 2.0,
        log_every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_bytes = total_bytes
        self.total_chunks = total_chunks
        self.label = label
        self.done_bytes = 0
        self.done_chunks = 0
        self._stream = stream if stream is not None else sys.stderr
        self._min_seconds = min_seconds
        self._log_every_s = log_every_s
        self._clock = clock
        self._start = clock()
        try:
            self._tty = self._stream.isatty()
        except (AttributeError, ValueError):  # a closed or minimal stream is not a terminal
            self._tty = False
        self._interval = _REDRAW_INTERVAL_S if self._tty else log_every_s
        self._last_report = self._start
        self._drawn = False
        self._closed = False

    def update(self, nbytes: int, nchunks: int = 1) -> None:
        self.done_bytes += nbytes
        self.done_chunks += nchunks
        now = self._clock()
        if now - self._last_report < self._interval or now - self._start < self._min_seconds:
            return
        self._last_report = now
        self._report(now)

    def _text(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        rate = self.done_bytes / elapsed
        text = (
            f"{self.label}: {format_decimal(self.done_bytes)} / {format_decimal(self.total_bytes)}, "
            f"{self.done_chunks}/{self.total_chunks} chunks, {gb_per_s(self.done_bytes, elapsed):.2f} GB/s"
        )
        remaining = self.total_bytes - self.done_bytes
        if remaining > 0 and rate > 0:
            text += f", ETA {_duration(remaining / rate)}"
        return text

    def _report(self, now: float) -> None:
        if self._tty:
            self._stream.write(f"\r{self._text(now)}{_CLEAR_TO_EOL}")
            self._stream.flush()
            self._drawn = True
        else:
            logger.info("%s", self._text(now))

    def close(self) -> None:
        """Leave the terminal line at its final figures, so the next log line does not overwrite it."""
        if self._closed:
            return
        self._closed = True
        if self._drawn:
            self._stream.write(f"\r{self._text(self._clock())}{_CLEAR_TO_EOL}\n")
            self._stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
