"""Who may join a refit group: the run's key, the signatures made with it, and which records were not believed.

Anything that reaches the producer's port can talk to its store: list every key, read it, overwrite it. So nothing
read from the store is trusted for what it says about itself. With ``group.token`` every rank derives one key per
run (from the token, the run id and the producer's fresh nonce) and signs each control record with it (HMAC-SHA256);
a record whose signature does not check is ignored and logged once, never believed and never a crash. The token
itself never travels: the producer publishes a random nonce, a consumer proves it holds the token by signing its
check-in over that nonce, and the producer proves the same to the consumer by signing its greeting.

Without a token records are still parsed defensively (a malformed one is ignored and logged, never a crash), but
anyone who reaches the port can join, abort or feed the run: hence the loopback-only default. How a record is
parsed, sealed and opened, and the store every rank reads them through: :mod:`refit_app.transport.records`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
import socket
from dataclasses import dataclass, field

from refit_app.common.errors import ConfigError

logger = logging.getLogger(__name__)

TOKEN_ENV = "REFIT_APP_TOKEN"
"""The environment variable ``group.token`` defaults to (read by the config, nowhere else)."""
TOKEN_DEFAULT = "${oc.env:" + TOKEN_ENV + ",null}"
"""``group.token``'s default in the schema, and what a saved config says instead of the secret."""
MAC_BYTES = 32
_TAG_HEX = 16
"""Hex digits of the signature that names a phase report's key (64 bits: unguessable for one run's lifetime)."""


def new_secret() -> str:
    """A fresh random token or nonce (128 bits, hex)."""
    return secrets.token_hex(16)


def new_run_id() -> str:
    return secrets.token_hex(4)


@dataclass
class RunAuth:
    """One run's identity and key: the run id, the producer's nonce and (with a token) the signing key.

    Built by the producer from its settings and a fresh nonce, and by a consumer from the producer's greeting and
    its own token; two ranks agree on ``key`` only if they hold the same token, run id and nonce.
    """

    run_id: str
    nonce: str
    key: bytes | None
    """None: no token; records are parsed defensively but not signed."""
    rank: int = 0
    ignored: set[str] = field(default_factory=set, repr=False)
    """What this rank has logged as ignored, each once (:func:`refit_app.transport.records.distrust`)."""

    @classmethod
    def derive(cls, token: str | None, run_id: str, nonce: str, rank: int) -> RunAuth:
        key = None
        if token is not None:
            key = hmac.new(
                token.encode(), b"\0".join((b"refit-app/1/key", run_id.encode(), nonce.encode())), hashlib.sha256
            ).digest()
        return cls(run_id, nonce, key, rank)

    @property
    def signed(self) -> bool:
        return self.key is not None

    @property
    def namespace(self) -> str:
        """The store prefix of everything after the check-in (control records, the backend's own keys): one per
        producer start, so a consumer of an earlier run on the same port never reads this run's keys."""
        return f"refit/run/{self.run_id}/{self.nonce}"

    def mac(self, kind: str, data: bytes) -> bytes:
        """The signature of ``data`` as a ``kind`` record (b"" without a token)."""
        if self.key is None:
            return b""
        h = hmac.new(self.key, kind.encode() + b"\0", hashlib.sha256)
        h.update(data)  # no copy of a large manifest
        return h.digest()

    def check_mac(self, kind: str, data: bytes, mac: bytes) -> bool:
        return self.key is None or hmac.compare_digest(self.mac(kind, data), mac)

    def tag(self, *parts: object) -> str:
        """A suffix for a key whose presence is the message (a phase report): only a key holder can name it."""
        if self.key is None:
            return ""
        return "/" + self.mac("tag", "\0".join(map(str, parts)).encode()).hex()[:_TAG_HEX]

    def hide(self, key: str) -> str:
        """``key`` made one that only a key holder can name (``key`` itself without a token): every key a rank writes,
        adds to or waits for after the greeting. Anyone can list the store and read the run's prefix from the
        greeting, so a public name could be pre-set: a rank claimed, a counter made a non-number (an ``add`` on it
        closes the caller's store connection), an outcome or an error put where the ranks look."""
        return key + self.tag(key)


def is_loopback(host: str) -> bool | None:
    """Whether every address ``host`` names is a loopback one; None if it cannot be resolved (reported later)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


_warned_open = False


def check_exposure(host: str, port: int | None, rank: int, token: str | None, allow_unauthenticated: bool) -> None:
    """Refuse an unauthenticated group on a non-loopback address unless the user opted in; warn once otherwise."""
    global _warned_open
    if token is not None:
        return
    loopback = is_loopback(host)
    if loopback is False and not allow_unauthenticated:
        raise ConfigError(
            f"group.host={host} is not a loopback address and group.token is not set: anyone who reaches port "
            f"{port} could join the refit and receive the model, or abort it; set the same group.token (or "
            f"{TOKEN_ENV}) on every rank, or group.allow_unauthenticated=true on a network you trust"
        )
    if _warned_open:
        return
    _warned_open = True
    if loopback is False:
        logger.warning(
            "rank %d: group.allow_unauthenticated=true: any host that reaches %s:%s can join the refit or abort it",
            rank,
            host,
            port,
        )
    else:
        logger.warning(
            "rank %d: group.token is not set: any process on this host can join the refit at %s:%s or "
            "abort it; set %s on every rank to prevent that",
            rank,
            host,
            port,
            TOKEN_ENV,
        )
