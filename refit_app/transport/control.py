"""The control channel: phase reports and the first error, over the producer's store, for every backend.

Collectives only say *that* a peer went away; this channel carries *why*, so every rank can fail with the reason
from the rank that failed first. A consumer reaches the store through a :class:`DeadlineStore`, so that a stopped
producer cannot freeze it, and every phase gather has the group's deadline. Anyone who reaches the store can write
to it: the first error is a signed record (:class:`~refit_app.transport.records.RunStore`) and a phase report a
key only a rank can name (:mod:`refit_app.transport.auth`); what does not check is ignored and logged once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from refit_app.common.errors import PeerError, RefitError, one_line, some_of
from refit_app.transport.auth import RunAuth
from refit_app.transport.records import RecordError, RecordKind, RunStore, need
from refit_app.transport.spec import PRODUCER_RANK

logger = logging.getLogger(__name__)

EXPLAIN_WAIT_S = 1.0
"""How long a rank whose collective broke waits for the failing rank to publish the root cause."""
RELAYED_EXPLAIN_WAIT_S = 5 * EXPLAIN_WAIT_S
"""The same wait for a rank that hears of a failure second hand (a chain's producer when a rank further down dies):
the rank next to the dead one waits ``EXPLAIN_WAIT_S`` itself before it publishes what it lost, and both may have
given up on the same stalled moment; the rest is for a loaded machine (3 s was short under two busy loops and the
suite's two workers: the producer named the relaying rank, not the dead one)."""
_SHORT_STORE_TIMEOUT_S = 2.0
"""Store timeout for best-effort calls made while failing; a stalled producer must not stall them."""
_STORE_CALL_MIN_S = 1.0
"""Least time a consumer's store call gets before the store counts as lost, however little of a deadline is left:
a live producer answers in milliseconds, a loaded one may not answer in the last 0.1 s of a gather."""
_REPLACE_TRIES = 5
"""How often a rank replaces an error record that is not its peers' before it gives up on a flooded store."""
_POLL_START_S = 0.005
_POLL_MAX_S = 0.1
_GATHER_POLL_START_S = 0.0005
"""A gather ends every round: the other ranks are typically a millisecond or two behind, and the first sleep of
5 ms cost each round of a refit loop that much (5.5 ms of a 90 ms round, measured)."""

_K_LEFT = "refit/left"
_K_ERROR = "refit/ctl/error"


def _k_report(phase: str, seq: int, rank: int) -> str:
    return f"refit/ctl/{phase}/{seq}/{rank}"


def _check_error(doc: dict[str, Any]) -> None:
    need(doc, "rank", int), need(doc, "message", str), need(doc, "phase", (str, type(None)))


_ERROR = RecordKind("error", "an error report", _check_error)


class Poller:
    """Backoff sleeps for polling: quick answers for fast peers, little load for slow ones. Sleeps double from
    ``start_s`` up to ``max_s``, so a wait overshoots what it waits for by at most the time already waited (or
    ``max_s``)."""

    def __init__(self, start_s: float = _POLL_START_S, max_s: float = _POLL_MAX_S) -> None:
        self._delay = start_s
        self._max = max_s

    def sleep(self, deadline: float) -> None:
        time.sleep(max(0.0, min(self._delay, deadline - time.monotonic())))
        self._delay = min(self._delay * 2, self._max)


class DeadlineStore:
    """A consumer's client of the producer's store in which every call ends by the store's timeout.

    torch's TCPStore client waits for a reply without a deadline: while the producer is stopped (SIGSTOP, a
    debugger, a frozen host) its server accepts requests but never answers, and check, get, set, add and
    compare_set block forever, whatever ``set_timeout`` says. Each call runs on a daemon thread instead; one
    that outlives the timeout marks the store lost (its thread stays blocked until the process exits) and every
    later call fails at once, as the ``DistStoreError`` any other store failure raises.
    """

    def __init__(self, store: dist.Store, timeout_s: float) -> None:
        self._store = store
        self._timeout_s = timeout_s
        self._lost: str | None = None

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
        self._store.set_timeout(timeout)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def _call(self, name: str, *args: Any) -> Any:
        if self._lost is not None:
            raise dist.DistStoreError(self._lost)
        limit = max(self._timeout_s, _STORE_CALL_MIN_S)
        try:
            return within(lambda: getattr(self._store, name)(*args), limit, f"refit-store-{name}")
        except NoAnswer:
            self._lost = f"the producer's store did not answer within {limit:g}s"
            raise dist.DistStoreError(self._lost) from None


class NoAnswer(Exception):
    """:func:`within`'s call did not return in time (its thread is left blocked until the process exits)."""


def within(call: Callable[[], Any], limit_s: float, name: str) -> Any:
    """``call()``'s value, or its exception, where it returns within ``limit_s``; else :class:`NoAnswer`. For
    torch's store client, which waits for a reply without a deadline but lets go of the GIL meanwhile: the call runs
    on a daemon thread, left behind where it outlives the limit."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as e:  # handed to the caller's thread
            outcome.append((False, e))

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(limit_s)
    if not outcome:
        raise NoAnswer(name)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def ranks_text(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 1, 2``, or for a large group ``ranks 1, 2, 3, 4, 5 and 99994 more``: one readable line."""
    return ("rank " if len(ranks) == 1 else "ranks ") + some_of([str(r) for r in ranks])


class Control:
    """Backend-agnostic control channel over the producer's store: phase reports and the first error.

    Collectives only say *that* a peer went away; this channel carries *why*, so every rank can fail with
    the reason from the rank that failed first.
    """

    def __init__(
        self,
        store: dist.Store | DeadlineStore,
        rank: int,
        world_size: int,
        timeout_s: float,
        address: str,
        auth: RunAuth | None = None,
        members: list[int] | None = None,
    ) -> None:
        self._store = store
        self.auth = auth if auth is not None else RunAuth.derive(None, "", "", rank)
        """Signs what this rank publishes and checks what it reads (:mod:`refit_app.transport.auth`); unsigned without a
        token."""
        self.rank = rank
        self.world_size = world_size
        self.members = list(range(world_size)) if members is None else list(members)
        """The ranks whose reports a gather waits for: every rank of the group, or a generation's members in an
        elastic session (:mod:`refit_app.transport.elastic`), whose ranks keep their numbers as members come and go."""
        self.timeout_s = timeout_s
        self._address = address
        self._records = RunStore(store, self.auth, address)
        """The same store for the first error and the leave count: keys only a rank can name, records signed."""
        self._reported: dict[str, int] = {}
        self.failed = False
        """Set once this rank published, reported or observed an error; ``RefitGroup.close`` then lingers."""
        self._explained = False

    def _k_report(self, phase: str, seq: int, rank: int) -> str:
        # A report is a key whose presence is the message; with a token only a rank can name it, so a client that
        # lists the store can neither forge a report nor complete a gather early.
        return _k_report(phase, seq, rank) + self.auth.tag(phase, seq, rank)

    @contextmanager
    def _short_timeout(self) -> Iterator[None]:
        self._store.set_timeout(timedelta(seconds=_SHORT_STORE_TIMEOUT_S))
        try:
            yield
        finally:
            self._store.set_timeout(timedelta(seconds=self.timeout_s))

    def publish_error(self, rank: int, message: str, *, phase: str | None = None) -> None:
        """Record ``message`` as the refit's failure unless another rank's failure was recorded first.

        ``phase`` ties the failure to a phase gather, which then raises its own error type for it.
        """
        self.failed = True
        try:
            with self._short_timeout():
                # A value that is not this run's ranks' (a malformed or forged one) must not hide the real reason.
                self._records.settle(
                    _K_ERROR, _ERROR, {"rank": rank, "message": message, "phase": phase}, tries=_REPLACE_TRIES
                )
        except RecordError:
            pass  # a flooded store: peers will see the broken collective instead of the reason
        except dist.DistError as e:
            # The producer's store is gone; peers will see the broken collective instead of the reason.
            logger.warning("rank %d: could not publish its error to %s: %s", self.rank, self._address, one_line(e))

    def _read_error(self) -> tuple[str, str | None] | None:
        """The first published failure as ``("rank N failed: ...", phase)``, or None."""
        doc = self._records.find_record(_K_ERROR, _ERROR)
        if doc is None:
            return None
        self.failed = True
        return f"rank {doc['rank']} failed: {doc['message']}", doc["phase"]

    def failed_rank(self) -> int | None:
        """The rank whose failure was published first, or None; does not wait."""
        doc = self._records.find_record(_K_ERROR, _ERROR)
        return None if doc is None else doc["rank"]

    def error(self) -> str | None:
        """The first published failure as ``"rank N failed: ..."``, or None; does not wait."""
        found = self._read_error()
        return None if found is None else found[0]

    def _raise_if_failed(self, phase: str, error_type: type[RefitError]) -> None:
        found = self._read_error()
        if found is not None:
            # A failure from another phase (a sink error while we still wait for the handshake) stops us
            # just the same, but it is not, say, a handshake disagreement.
            raise (error_type if found[1] == phase else PeerError)(found[0])

    def report(self, phase: str, error: str | None = None) -> None:
        """Tell every rank this one reached ``phase`` (``error=None``) or failed in it (and why).

        Reporting a failure never raises: the caller is about to raise the failure itself, and a lost
        store must not replace it.
        """
        if error is not None:
            self.publish_error(self.rank, error, phase=phase)
        seq = self._reported.get(phase, 0)
        self._reported[phase] = seq + 1
        try:
            self._store.set(self._k_report(phase, seq, self.rank), json.dumps({"error": error}))
        except dist.DistError as e:
            if error is None:
                raise PeerError(
                    f"lost the control connection to the producer at {self._address} while reporting {phase} "
                    f"({one_line(e)}); rank {PRODUCER_RANK} may have died"
                ) from e
            logger.debug("rank %d: could not report its failure in %s: %s", self.rank, phase, one_line(e))

    def gather(self, phase: str, *, timeout_s: float | None = None, error_type: type[RefitError] = PeerError) -> None:
        """Wait until every rank reported its latest ``phase``; raise if any rank failed or missed the deadline.

        Returns as soon as all reports are in. Raises at the first published error, without waiting for
        the remaining ranks, so a failure anywhere stops everyone promptly: ``error_type`` when a rank
        reported that error for this ``phase``, :class:`PeerError` otherwise.
        """
        seq = self._reported.get(phase, 0) - 1
        if seq < 0:
            raise ValueError(f"gather({phase!r}) before report({phase!r}) on rank {self.rank}")
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        keys = [self._k_report(phase, seq, r) for r in self.members]
        poller = Poller(_GATHER_POLL_START_S)
        try:
            while True:
                # A blocked store call must not outlive the deadline (a SIGSTOPped producer holds the store).
                self._store.set_timeout(timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
                self._raise_if_failed(phase, error_type)
                if self._store.check(keys):
                    # report() publishes before it reports, so a failure in this phase is visible by now
                    # even if it landed after the check above.
                    self._raise_if_failed(phase, error_type)
                    return
                if time.monotonic() >= deadline:
                    missing = [r for r, k in zip(self.members, keys) if not self._store.check([k])]
                    self.failed = True
                    raise PeerError(
                        f"{ranks_text(missing)} did not report {phase} within {limit:g}s; it may have died or stalled"
                    )
                poller.sleep(deadline)
        except dist.DistError as e:
            self.failed = True
            raise PeerError(
                f"lost the control connection to the producer at {self._address} while waiting for {phase} "
                f"({one_line(e)}); rank {PRODUCER_RANK} may have died"
            ) from e
        finally:
            self._store.set_timeout(timedelta(seconds=self.timeout_s))

    def explain(self, exc: BaseException, *, wait_s: float = EXPLAIN_WAIT_S) -> str:
        """One line for a failed collective, preferring the root cause a failing rank published.

        The rank whose sink or source failed publishes its reason just before its sockets close; the others
        see only "connection reset", so wait up to ``wait_s`` for that reason before falling back to the symptom.
        """
        self.failed = True
        text = one_line(exc)
        # Only the first broken collective waits: the others in flight (one per buffer) broke for the same
        # reason, and a wait for each would push this rank's exit further past the deadline.
        deadline = time.monotonic() + (0.0 if self._explained else wait_s)
        self._explained = True
        poller = Poller()
        try:
            with self._short_timeout():
                while True:
                    published = self.error()
                    if published is not None:
                        return published
                    if time.monotonic() >= deadline:
                        break
                    poller.sleep(deadline)
        except dist.DistError:
            if self.rank != PRODUCER_RANK:
                return (
                    f"lost the producer (rank {PRODUCER_RANK}) at {self._address}; it may have died or stalled ({text})"
                )
        lower = text.lower()
        # With two ranks the peer is known; with more, a broadcast does not say which of them stopped.
        if len(self.members) == 2:
            other = next(r for r in self.members if r != self.rank)
            peer, who, link = f"rank {other}", "it", ", or the network to it failed"
        else:
            peer, who, link = "a peer", "a rank", ""
        if "timed out" in lower or "timeout" in lower:
            return f"no progress from {peer} within {self.timeout_s:g}s; {who} may have stalled or died{link} ({text})"
        if any(s in lower for s in ("connection reset", "connection closed", "broken pipe", "connection refused")):
            return f"lost the connection to {peer}; {who} may have died ({text})"
        return text

    def leave(self) -> None:
        """A consumer is done with the store, so the producer may close it without breaking a late read."""
        try:
            with self._short_timeout():
                self._records.add(_K_LEFT, 1)
        except dist.DistError as e:
            logger.debug("rank %d: producer store already gone at leave: %s", self.rank, one_line(e))

    def wait_for_consumers_to_leave(self, seconds: float) -> None:
        """Wait up to ``seconds`` for every consumer's :meth:`leave`. Never raises: every rank has agreed on how the
        refit ended by now, and nothing a stranger writes to the store may turn that into a failure here."""
        deadline = time.monotonic() + seconds
        poller = Poller()
        try:
            while self._records.add(_K_LEFT, 0) < self.world_size - 1 and time.monotonic() < deadline:
                poller.sleep(deadline)
        except dist.DistError as e:
            # Without a token the count's key is public: a non-number written there closes this connection. The
            # consumers may still be reading the store (the last phase's reports): closing it now would fail them
            # after an end they agreed on, so they get the whole wait instead of the count.
            logger.warning(
                "rank %d: could not count the consumers that left (%s): a client that is not one of this run's "
                "ranks may have written to the store at %s; waiting %.0fs for them instead",
                self.rank,
                one_line(e),
                self._address,
                max(0.0, deadline - time.monotonic()),
            )
            time.sleep(max(0.0, deadline - time.monotonic()))

    def release(self) -> None:
        """Drop this rank's store connection; on the producer, with the group gone, this stops the store server
        and frees the port."""
        self._store = None
        self._records = None
