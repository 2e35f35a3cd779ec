"""Errors a user can cause or fix. Each one is reported as a single line, without a traceback."""


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
