"""The run's control records in the producer's store, and :class:`RunStore`, the one way ranks read and write them.

Anything that reaches the producer's port can list, read and overwrite the store (:mod:`refit_app.transport.auth`).
So every record a rank writes is sealed (signed with the run's key as one ``kind`` of record) under a key only a key
holder can name, and every record it reads is parsed defensively and opened against that key: one that does not
check is ignored and logged once, as if it were absent. :class:`RunStore` owns that rule, so that no call site can
forget a step of it (a forgotten hide once let a stranger break the consumers' leave count). Without a token keys
are public and records unsigned, but still parsed defensively.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from refit_app.transport.auth import RunAuth

logger = logging.getLogger(__name__)

MAX_RECORD_BYTES = 1 << 20
"""A control record longer than this is not one of ours; it is refused before it is parsed."""
_MIN_WAIT_S = 0.1
"""The least a store wait is given, however little of its deadline is left (a wait of 0 would wait forever)."""


class RecordError(ValueError):
    """A control record that is malformed or whose signature does not check; its text says which."""


def load_record(raw: bytes | str) -> dict[str, Any]:
    """A JSON object read defensively: too long, not JSON, too deep or not an object is a RecordError."""
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"is {len(raw)} bytes long (at most {MAX_RECORD_BYTES})")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise RecordError(f"is not JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise RecordError("is not a JSON object")
    return doc


def need(doc: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``doc[name]``, checked to be of ``kind`` (bools are not ints), or :class:`RecordError`."""
    value = doc.get(name)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise RecordError(f"lacks a valid {name!r}")
    return value


def seal(auth: RunAuth, kind: str, doc: dict[str, Any]) -> str:
    """``doc`` as a store value, signed with ``auth``'s key as a ``kind`` record (plain JSON without a token)."""
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    if not auth.signed:
        return body
    return json.dumps({"body": body, "mac": auth.mac(kind, body.encode()).hex()}, separators=(",", ":"))


def unseal(auth: RunAuth, kind: str, raw: bytes | str) -> dict[str, Any]:
    """The record ``seal(auth, kind, ...)`` made, or :class:`RecordError` saying why ``raw`` is not one."""
    doc = load_record(raw)
    if not auth.signed:
        return doc
    body, mac = doc.get("body"), doc.get("mac")
    if not isinstance(body, str) or not isinstance(mac, str):
        raise RecordError("is not signed")
    try:
        good = hmac.compare_digest(bytes.fromhex(mac), auth.mac(kind, body.encode()))
    except ValueError:
        good = False
    if not good:
        raise RecordError("has a signature that does not check (another group.token, or forged)")
    return load_record(body)


def distrust(auth: RunAuth, what: str, where: str, reason: Exception | str) -> None:
    """Log, once per ``what`` and rank, that a record was ignored; the run goes on as if it were absent."""
    if what in auth.ignored:
        return
    auth.ignored.add(what)
    logger.warning(
        "rank %d: ignored %s at %s: it %s; only this run's ranks are believed", auth.rank, what, where, reason
    )


def envelope(outer: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A sealed record's fields and whether it is signed, checked against no key (the greeting, read before a
    consumer knows the run's key); or RecordError."""
    signed = set(outer) == {"body", "mac"}
    return (load_record(need(outer, "body", str)) if signed else outer), signed


@dataclass(frozen=True)
class RecordKind:
    """One kind of control record: what its signature is made as, what a log line calls one that is ignored, and
    the check of its fields (raising :class:`RecordError` for a record that is not what its reader expects)."""

    name: str
    what: str
    check: Callable[[dict[str, Any]], object] | None = None


class RunStore:
    """The producer's store as a rank reads and writes control records there: keys hidden, records sealed and
    opened with the run's key, and a record that does not check ignored (logged once) instead of believed.

    ``store`` may be any store (a prefix of the producer's, a consumer's
    :class:`~refit_app.transport.control.DeadlineStore`): every call goes to it unchanged, so its deadlines hold.
    ``where`` (the producer's address) is what an ignored record's log line names. With ``hide_keys=False`` keys are
    used as given: the public greeting and check-in area, which a consumer reads or writes before it can name
    anything else.
    """

    def __init__(self, store: Any, auth: RunAuth, where: str, *, hide_keys: bool = True) -> None:
        self._store = store
        self.auth = auth
        self.where = where
        self._hide_keys = hide_keys
        self._keys: dict[str, str] = {}

    def key(self, name: str) -> str:
        """The store key of ``name``: one only a key holder can form (:meth:`RunAuth.hide`), ``name`` itself
        without a token or with ``hide_keys=False``."""
        if not self._hide_keys:
            return name
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = self.auth.hide(name)  # an HMAC: a gather asks for the same keys at every poll
        return key

    def area(self, name: str, *, hidden: bool) -> RunStore:
        """The records under ``name/``: a name only a key holder can form where ``hidden``, else ``name`` itself
        (a public area, where anyone may write and what lies there only ever counts as ignored)."""
        prefix = self.auth.hide(name) if hidden else name
        return RunStore(dist.PrefixStore(prefix, self._store), self.auth, self.where, hide_keys=False)

    def prefix_store(self, name: str) -> dist.PrefixStore:
        """A plain store under ``name``'s key, for what keeps its own records there (a generation's group)."""
        return dist.PrefixStore(self.key(name), self._store)

    def put(self, name: str, kind: RecordKind, doc: dict[str, Any]) -> None:
        """Write ``doc`` at ``name``, sealed as a ``kind`` record."""
        self._store.set(self.key(name), seal(self.auth, kind.name, doc))

    def open(self, kind: RecordKind, raw: bytes | str) -> dict[str, Any]:
        """``raw`` opened as a ``kind`` record and checked, or :class:`RecordError`: for a reader that refuses
        what does not check rather than ignore it."""
        doc = unseal(self.auth, kind.name, raw)
        if kind.check is not None:
            kind.check(doc)
        return doc

    def believe(self, raw: bytes | str, kind: RecordKind) -> dict[str, Any] | None:
        """``raw`` opened as a ``kind`` record and checked; None for one that is malformed or not this run's,
        logged once."""
        try:
            return self.open(kind, raw)
        except RecordError as e:
            distrust(self.auth, kind.what, self.where, e)
            return None

    def get_record(self, name: str, kind: RecordKind) -> dict[str, Any] | None:
        """The record at ``name`` (which must exist), as :meth:`believe` reads it."""
        return self.believe(self._store.get(self.key(name)), kind)

    def find_record(self, name: str, kind: RecordKind) -> dict[str, Any] | None:
        """The record at ``name``, as :meth:`believe` reads it, or None where there is none yet; does not wait."""
        if not self._store.check([self.key(name)]):
            return None
        return self.get_record(name, kind)

    def settle(self, name: str, kind: RecordKind, doc: dict[str, Any], *, tries: int) -> dict[str, Any] | None:
        """Make ``doc`` the record at ``name`` unless one of this run's ranks put one there first: returns that
        earlier record, or None where ``doc`` stands. A value that is not this run's is replaced, ``tries`` times
        at most; :class:`RecordError` where it keeps coming back (a client floods the store)."""
        key, payload = self.key(name), seal(self.auth, kind.name, doc)
        current = self._store.compare_set(key, "", payload)
        for _ in range(tries):
            if current == payload.encode():
                return None
            earlier = self.believe(current, kind)
            if earlier is not None:
                return earlier
            current = self._store.compare_set(key, current, payload)
        raise RecordError("keeps being overwritten")

    def get(self, name: str) -> bytes:
        return self._store.get(self.key(name))

    def check(self, names: list[str]) -> bool:
        return self._store.check([self.key(n) for n in names])

    def add(self, name: str, amount: int) -> int:
        return self._store.add(self.key(name), amount)

    def count(self, name: str) -> int:
        """The counter at ``name`` (0 where it is unset or not a number: a stranger may have written there). Read,
        never added to: an ``add`` on a non-number closes the caller's store connection."""
        if not self.check([name]):
            return 0
        try:
            return max(int(self.get(name)), 0)
        except ValueError:
            return 0

    def wait(self, names: list[str], deadline: float) -> None:
        """Wait for ``names`` until ``deadline`` (``time.monotonic()``); the store's DistError where it passes."""
        timeout = timedelta(seconds=max(deadline - time.monotonic(), _MIN_WAIT_S))
        self._store.wait([self.key(n) for n in names], timeout)
