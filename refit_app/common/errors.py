"""Errors a user can cause or fix. Each one is reported as a single line, without a traceback."""

import re
from collections.abc import Sequence


class RefitError(Exception):
    """A refit failed for a reason the user can act on (bad input, a lost peer, a mismatch)."""


class ConfigError(RefitError):
    """A configuration value is invalid; the message names the key, the value and what is allowed."""


class PeerError(RefitError):
    """Another rank failed, died or missed a deadline."""


class HandshakeError(RefitError):
    """Producer and consumer disagree on settings that must match."""


class VerificationError(RefitError):
    """Received bytes differ from the bytes the producer sent."""


class SourceError(RefitError):
    """The weights to send cannot be read (missing, truncated or corrupt checkpoint)."""


class SinkError(RefitError):
    """The received weights cannot be stored."""


class StagingError(RefitError):
    """A staged round was refused, failed or cannot be applied: the targets hold what they held before."""


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal (Ctrl-C, SIGTERM): it fails like any other run, with this reason."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    def __reduce__(self) -> tuple[type["Interrupted"], tuple[int]]:
        # The default would call Interrupted(message) when unpickled (a result queue, a multiprocessing error).
        return Interrupted, (self.signum,)

    @property
    def exit_status(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + self.signum


MAX_LISTED = 5
"""How many items an error message names before it says how many more there are."""


def some_of(items: Sequence[str], sep: str = ", ", limit: int = MAX_LISTED) -> str:
    """The first ``limit`` items, then how many more: ``a, b and 3 more``; with ``sep="; "``, ``a; b; and 3 more``."""
    shown = sep.join(items[:limit])
    extra = len(items) - limit
    if extra <= 0:
        return shown
    return f"{shown}{' ' if sep == ', ' else sep}and {extra} more"


MAX_ERROR_CHARS = 500
"""Longest error line that metrics, summaries and logs show; the rest is elided."""

_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def one_line(error: BaseException | str, *, with_type: bool = False) -> str:
    """An error as the single line users see: every line of the message joined, c10d's source location and
    advice boilerplate dropped, at most ``MAX_ERROR_CHARS`` long. ``with_type`` prefixes the exception's class
    name, for errors that are not a :class:`RefitError` (whose messages are written to stand alone)."""
    text = str(error)
    text = _SOURCE_LOCATION.sub("", text.strip())
    text = text.split(" This is typically caused")[0]
    text = "; ".join(" ".join(line.split()) for line in text.splitlines() if line.strip())
    if isinstance(error, BaseException):
        if not text:
            return type(error).__name__
        if with_type:
            text = f"{type(error).__name__}: {text}"
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 3] + "..."
    return text
