"""The rendezvous: the producer's store, and the check-in on it through which every rank joins a refit group.

Over 500 lines on purpose: the producer's and the consumer's halves of the check-in are one protocol (each step of
one answers a step of the other, with the same deadlines and records), and read best side by side.

The producer (rank 0) hosts a ``TCPStore`` on ``group.host``. Before any process group exists, every consumer checks
in on that store: world size, rank and backend are compared there, so a misconfigured rank gets a one-line error and
so does the producer, instead of everyone waiting in a collective that can never complete. The outcome (the backend,
or the first failure) is one key that every rank reads.

Anything that reaches the port can read and write the store, so the check-in is also where a rank proves it belongs
(:mod:`refit_app.transport.auth`)::

    producer                                        consumer
    greeting: run id, fresh nonce, world size  ---> same run id? same token (the greeting's signature checks)?
    (signed with the run's key)                     claim its rank, then a check-in signed over the nonce
    check-in slots: ignore what does not check <--- (written, in the public area, even when the greeting did
                                                     not check, so that the producer can say why rank N did not join)
    outcome: the backend, or the first failure ---> (signed; a forged or malformed one is ignored)

Everything after the check-in lives under the run's own key prefix (:attr:`RunAuth.namespace`), one per producer
start, so a consumer of an earlier run on the same port never reads this run's keys. That prefix is in the public
greeting, so with a token every key a rank writes, adds to or waits for (claims, check-ins, the outcome) also has a
name only a key holder can form: a stranger cannot pre-claim a rank or break a counter. Every record here is read
and written through a :class:`~refit_app.transport.records.RunStore`, which hides keys and seals records.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from typing import Any

import torch.distributed as dist

from refit_app.common.errors import ConfigError, PeerError, RefitError, one_line
from refit_app.transport.auth import TOKEN_ENV, RunAuth, new_run_id, new_secret
from refit_app.transport.backends import capabilities, resolve_backend, shm_ring_problem
from refit_app.transport.control import NoAnswer, Poller, ranks_text, within
from refit_app.transport.records import RecordError, RecordKind, RunStore, envelope, need
from refit_app.transport.spec import BACKENDS, PRODUCER_RANK, GroupSpec

logger = logging.getLogger(__name__)

WAITING_NOTICE_INTERVAL_S = 10.0
"""How often a consumer that cannot reach its producer yet says that it is still waiting, and where: on its
first failed try, then at this interval, so that a consumer started first is neither silent nor noisy."""
STORE_ANSWER_GRACE_S = 1.0
"""Past the deadline, how long a store client may still take to answer: its own timeout is the deadline's rest."""

PROTOCOL = 2
"""The check-in's version: a greeting of another version is another refit_app's (or not a refit_app producer)."""
_MAX_SLOTS_PER_RANK = 8
"""Check-in slots the producer reads per consumer: a client that floods the counter cannot make it read forever."""
_OUTCOME_TRIES = 5
"""How often the producer replaces an outcome that is not its ranks' before it gives up on a flooded store."""

# The one public key: a consumer must find it before it knows the run's prefix or key.
_K_HELLO = "refit/rdzv/hello"
_PUBLIC_AREA = "refit/rdzv"
"""Where a consumer whose greeting did not check leaves its check-in, so that the producer can say why it never
joined; anyone can write here, so what lies here only ever counts as ignored."""
# Keys in the run's namespace, each hidden by its RunStore where the run has a token.
_K_OUTCOME = "rdzv/outcome"
# Keys in a check-in area.
_K_COUNT = "checkins"


def _k_claim(rank: int) -> str:
    return f"rdzv/claim/{rank}"


def _k_slot(n: int) -> str:
    return f"checkin/{n}"


def _checkin_area(public: RunStore, trusted: bool) -> RunStore:
    """Where a consumer's check-in goes: under a name only the run's ranks can form if it verified the greeting
    (the public area itself without a token), in the public area if it did not."""
    return public.area(_PUBLIC_AREA, hidden=trusted)


_ERROR_TYPES: dict[str, type[RefitError]] = {"ConfigError": ConfigError, "PeerError": PeerError}


def run_store(store: dist.Store, auth: RunAuth) -> dist.PrefixStore:
    """The store every key after the check-in goes to: this run's prefix of the producer's store."""
    return dist.PrefixStore(auth.namespace, store)


def _outcome_error(doc: dict[str, Any]) -> RefitError:
    return _ERROR_TYPES.get(doc["kind"], PeerError)(doc["message"])


def _check_outcome(doc: dict[str, Any]) -> None:
    if need(doc, "ok", bool):
        if need(doc, "backend", str) not in BACKENDS:
            raise RecordError("names an unknown backend")
    else:
        need(doc, "kind", str), need(doc, "message", str)


_OUTCOME = RecordKind("outcome", "a rendezvous outcome", _check_outcome)
_HELLO = RecordKind("hello", "the producer's greeting")
_CHECKIN = RecordKind("checkin", "a check-in")
"""A check-in as its consumer writes it; the producer checks its fields against the run (:func:`producer_checkin`)."""


def _settle(run: RunStore, doc: dict[str, Any]) -> dict[str, Any] | None:
    """Make ``doc`` the outcome unless one of this run's ranks set one first; returns that earlier outcome,
    or None if ``doc`` stands. A value that is not this run's is overwritten."""
    try:
        return run.settle(_K_OUTCOME, _OUTCOME, doc, tries=_OUTCOME_TRIES)
    except RecordError:
        raise PeerError(
            f"the rendezvous at {run.where} keeps being overwritten by a client that is not one of this run's ranks; "
            "set group.token, or keep the port off untrusted networks"
        ) from None


def fail_rendezvous(run: RunStore, exc: RefitError) -> RefitError:
    """Make ``exc`` the rendezvous outcome so every rank stops with it; return what to raise here.

    If the rendezvous already failed, that earlier failure is the root cause and wins. If it already
    succeeded without this rank (a late duplicate, say), the others are not disturbed.
    """
    earlier = _settle(run, {"ok": False, "kind": type(exc).__name__, "message": str(exc)})
    if earlier is None or earlier["ok"]:
        return exc
    return _outcome_error(earlier)


def _listen(spec: GroupSpec) -> int:
    """A socket listening on ``group.host`` only (torch's TCPStore on its own listens on every interface)."""
    try:
        infos = socket.getaddrinfo(spec.host, spec.port, type=socket.SOCK_STREAM)
        # One address only; IPv4 first, as consumers connecting to a name like localhost try every address anyway.
        family, kind, proto, _, address = min(infos, key=lambda info: info[0] != socket.AF_INET)
    except socket.gaierror as e:
        raise ConfigError(
            f"group.host={spec.host!r} cannot be resolved ({e.strerror}); give this host's name or IP address, "
            "or 0.0.0.0 to listen on every interface"
        ) from e
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT from the last run is free
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"group.port={spec.port} is already in use on this host; choose a free group.port "
                "(and give consumers the same one) or stop the process holding it"
            ) from e
        if e.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(
                f"group.host={spec.host} is not an address of this host, so the producer cannot listen on it; "
                "give one of its addresses, or 0.0.0.0 to listen on every interface"
            ) from e
        raise ConfigError(f"cannot listen on {spec.address}: {one_line(e)}") from e
    return sock.detach()


def start_store(spec: GroupSpec) -> dist.TCPStore:
    fd = _listen(spec)
    try:
        return dist.TCPStore(
            spec.host,
            spec.port,
            world_size=None,
            is_master=True,
            timeout=timedelta(seconds=spec.timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except dist.DistError as e:
        os.close(fd)
        raise ConfigError(f"cannot listen on group.port={spec.port}: {one_line(e)}") from e


@dataclass(frozen=True)
class Route:
    """How a consumer reaches the producer: the addresses that gloo's connections must use on both ends.

    Gloo binds to the address its host name resolves to unless told otherwise; in containers, VMs and network
    namespaces that is often 127.0.0.1, and a mesh across hosts cannot form. The store connection already found a
    working route, so both sides take their gloo addresses from it.
    """

    local: str
    """This consumer's address on the route."""
    producer: str
    """The producer's address as this consumer reached it."""


def join_store(spec: GroupSpec, deadline: float) -> tuple[dist.TCPStore, Route]:
    # Probe with a plain socket first: a TCPStore client retrying a closed port floods stderr with C++
    # stack traces, and a consumer routinely starts before its producer.
    unreachable = PeerError(
        f"could not reach the producer at {spec.address} within {spec.timeout_s:g}s; start the producer "
        "(group.rank=0) or check group.host and group.port"
    )
    poller = Poller()
    next_notice = time.monotonic()
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((spec.host, spec.port), timeout=max(0.05, min(remaining, 2.0))) as probe:
                # The route to the producer: this rank's address on it, and the producer's as seen from here.
                route = Route(local=probe.getsockname()[0], producer=probe.getpeername()[0])
                break
        except socket.gaierror as e:
            raise ConfigError(
                f"group.host={spec.host!r} cannot be resolved ({e.strerror}); give the producer's host name "
                "or IP address"
            ) from e
        except OSError:
            now = time.monotonic()
            if now >= deadline:
                raise unreachable from None
            if now >= next_notice:
                logger.info(
                    "rank %d: waiting for the producer at %s (%.0fs left of group.timeout_s=%g)",
                    spec.rank,
                    spec.address,
                    deadline - now,
                    spec.timeout_s,
                )
                next_notice = now + WAITING_NOTICE_INTERVAL_S
            poller.sleep(deadline)
    store = _store_client(spec, deadline, unreachable)
    store.set_timeout(timedelta(seconds=spec.timeout_s))
    return store, route


def _store_client(spec: GroupSpec, deadline: float, unreachable: PeerError) -> dist.TCPStore:
    """A client of the producer's store, within ``deadline``. torch's client waits for the store's answer to its
    handshake without a deadline: at a port another program listens on (a port taken between choosing it and the
    producer's start, say) it would wait forever, so it connects :func:`~refit_app.transport.control.within` the
    deadline."""

    def connect() -> dist.TCPStore:
        timeout = timedelta(seconds=max(deadline - time.monotonic(), 0.1))
        return dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)

    try:
        return within(connect, max(deadline - time.monotonic(), 0.0) + STORE_ANSWER_GRACE_S, "refit-store-client")
    except NoAnswer:
        raise PeerError(
            f"the listener at {spec.address} did not answer as a refit producer's store within "
            f"group.timeout_s={spec.timeout_s:g}s: is group.port another program's? (or the producer is stuck)"
        ) from None
    except dist.DistError as e:
        raise unreachable from e


def announce(store: dist.Store, spec: GroupSpec, *, elastic: bool = False) -> RunAuth:
    """Producer: publish this run's greeting (run id, a fresh nonce, the world size, and whether its session goes
    on without a lost consumer); returns the run's key."""
    auth = RunAuth.derive(spec.token, spec.run_id or new_run_id(), new_secret(), PRODUCER_RANK)
    hello = {"protocol": PROTOCOL, "run_id": auth.run_id, "nonce": auth.nonce, "world_size": spec.world_size}
    if elastic:
        hello["elastic"] = True
    RunStore(store, auth, spec.address, hide_keys=False).put(_K_HELLO, _HELLO, hello)
    return auth


def _check_checkin(doc: dict[str, Any], run_id: str, world_size: int) -> None:
    rank = need(doc, "rank", int)
    if not 0 < rank < world_size:
        raise RecordError(f"claims rank {rank}, not one of 1..{world_size - 1}")
    if need(doc, "run_id", str) != run_id:
        raise RecordError("is for another run")
    caps = need(doc, "caps", dict)
    if need(caps, "backend", str) not in BACKENDS:
        raise RecordError("names an unknown backend")
    need(caps, "cuda", bool), need(caps, "vllm", bool)
    if not all(isinstance(v, (str, bool, int, type(None))) for v in caps.values()):
        raise RecordError("has capabilities that are not plain values")
    need(doc, "producer_address", str)
    if not isinstance(doc.get("refused", ""), str):
        raise RecordError("has a refusal that is not text")


class _Slots:
    """One check-in area as the producer reads it: the slots its counter has counted, each read once it is written.

    The counter is read, never added to: a non-number a stranger wrote there must not close the producer's store
    connection (an ``add`` on it does)."""

    def __init__(self, area: RunStore, limit: int) -> None:
        self._area = area
        self._limit = limit
        self._counted = 0
        self._unread: list[int] = []

    def new_records(self) -> list[bytes]:
        total = min(self._area.count(_K_COUNT), self._limit)
        self._unread += range(self._counted + 1, total + 1)
        self._counted = max(self._counted, total)
        records = []
        for n in list(self._unread):
            if self._area.check([_k_slot(n)]):  # else: the consumer counted its slot and is about to write it
                self._unread.remove(n)
                records.append(self._area.get(_k_slot(n)))
        return records


def _claimed_twice(rank: int, world_size: int, auth: RunAuth) -> ConfigError:
    # With a token only this run's ranks can claim a rank or sign a check-in; without one, anyone can.
    who = "" if auth.signed else " (or by one and a client that is not: without group.token anyone can claim a rank)"
    return ConfigError(
        f"group.rank={rank} is claimed by two consumers{who}; give each consumer its own group.rank in "
        f"1..{world_size - 1}"
    )


def _why_not_joined(pending: list[int], refused: int, spec: GroupSpec) -> PeerError:
    why = ""
    if refused:
        why = (
            f"; {refused} check-in(s) were ignored: a consumer with another group.token, or a client "
            "that is not a refit_app consumer"
        )
    return PeerError(
        f"{ranks_text(pending)} did not join the producer at {spec.address} within {spec.timeout_s:g}s; start every "
        f"consumer with this group.host/group.port and group.world_size={spec.world_size}{why}"
    )


def _refused_greeting(rank: int, why: str, public: RunStore) -> PeerError:
    """What the producer says when one of its consumers refused the greeting: its own was replaced if it no longer
    checks with the run's key (a client wrote the public key), else the consumer's settings differ."""
    try:
        public.open(_HELLO, public.get(_K_HELLO))
        replaced = ""
    except (RecordError, dist.DistError):
        replaced = (
            "; this producer's greeting was overwritten by a client that is not one of this run's ranks: keep "
            "group.port off untrusted networks and start the refit again"
        )
    return PeerError(f"consumer rank {rank} refused the greeting it read at {public.where} ({why}){replaced}")


def producer_checkin(public: RunStore, run: RunStore, spec: GroupSpec, deadline: float) -> tuple[str, str]:
    """Wait for every consumer's check-in; returns the backend and this producer's address as the consumers reached
    it (where its gloo connections must listen). ``public``: the producer's store (keys as given: the greeting, the
    check-in areas); ``run``: the run's prefix of it (hidden keys: the outcome)."""
    auth = run.auth
    infos = {PRODUCER_RANK: capabilities(spec)}
    records: dict[int, dict[str, Any]] = {}
    pending = list(range(1, spec.world_size))
    limit = _MAX_SLOTS_PER_RANK * spec.world_size
    trusted = [True] if auth.signed else []  # without a token the trusted area is the public one
    slots = [_Slots(_checkin_area(public, t), limit) for t in [False, *trusted]]
    checkin = replace(_CHECKIN, check=partial(_check_checkin, run_id=auth.run_id, world_size=spec.world_size))
    refused = 0
    logger.info(
        "rank 0: waiting up to %gs for %d consumer(s) at port %d, run %s (group.host of the consumers: this host's "
        "address; group.run_id=%s makes sure they join this run)",
        spec.timeout_s,
        len(pending),
        spec.port,
        auth.run_id,
        auth.run_id,
    )
    ring_problem = shm_ring_problem(spec) if spec.backend in ("auto", "shm") else None
    poller = Poller()
    while pending:
        _raise_if_settled(run)
        for raw in [raw for area in slots for raw in area.new_records()]:
            doc = public.believe(raw, checkin)
            if doc is None:
                refused += 1
                continue
            rank = doc["rank"]
            if doc.get("refused"):
                # Signed with this run's key: one of this run's consumers, which read a greeting it could not
                # believe and has exited. Waiting for it would end in "did not join" at the deadline.
                raise fail_rendezvous(run, _refused_greeting(rank, doc["refused"], public))
            if rank in records:
                if records[rank] != doc:  # the same record again is a replay, and harmless
                    raise fail_rendezvous(run, _claimed_twice(rank, spec.world_size, auth))
                continue
            records[rank] = doc
            infos[rank] = {**doc["caps"], "producer_address": doc["producer_address"]}
            pending.remove(rank)
            logger.info("rank 0: rank %d checked in", rank)  # a consumer, or a sharded refit's producer
            try:
                resolve_backend(infos, ring_problem)
            except ConfigError as e:
                raise fail_rendezvous(run, e) from None
        if not pending:
            break
        if time.monotonic() >= deadline:
            raise fail_rendezvous(run, _why_not_joined(pending, refused, spec))
        poller.sleep(deadline)
    try:
        backend = resolve_backend(infos, ring_problem)
    except ConfigError as e:
        raise fail_rendezvous(run, e) from None
    if ring_problem is not None and backend != "shm" and resolve_backend(infos) == "shm":
        logger.warning("rank 0: group.backend=auto takes gloo rather than shm: the ring's %s", ring_problem)
    earlier = _settle(run, {"ok": True, "backend": backend})
    if earlier is not None:
        raise _outcome_error(earlier) if not earlier["ok"] else PeerError("the rendezvous succeeded twice")
    # Where consumers reached this producer; with several routes, the first consumer's (gloo listens on one).
    return backend, str(infos[PRODUCER_RANK + 1].get("producer_address") or spec.host)


def _raise_if_settled(run: RunStore) -> None:
    """Raise the failure a consumer made the rendezvous outcome (a world size that differs, say)."""
    doc = run.find_record(_K_OUTCOME, _OUTCOME)
    if doc is not None and not doc["ok"]:
        raise _outcome_error(doc)


def _await_record(
    store: RunStore, name: str, kind: RecordKind, deadline: float, late: RefitError, spec: GroupSpec
) -> tuple[bytes, dict[str, Any]]:
    """The first record at ``name`` that is believed, and its raw value; ``late`` where none is by ``deadline``
    (a record that does not check is ignored: the rightful one may still replace it)."""
    poller = Poller()
    while True:
        try:
            store.wait([name], deadline)
        except dist.DistError as e:
            if time.monotonic() >= deadline or "timeout" in str(e).lower():
                raise late from e
            raise PeerError(
                f"lost the producer at {spec.address} during the rendezvous ({one_line(e)}); it may have died"
            ) from e
        raw = store.get(name)
        doc = store.believe(raw, kind)
        if doc is not None:
            return raw, doc
        if time.monotonic() >= deadline:
            raise late
        poller.sleep(deadline)


def _check_greeting(outer: dict[str, Any]) -> None:
    doc, _ = envelope(outer)
    if need(doc, "protocol", int) != PROTOCOL:
        raise RecordError(f"is of protocol {doc['protocol']}, this consumer speaks {PROTOCOL}")
    need(doc, "run_id", str), need(doc, "nonce", str), need(doc, "world_size", int)


_GREETING = RecordKind("hello", "the producer's greeting", _check_greeting)
"""The greeting as a consumer reads it first: against no key, as it does not know the run's key yet."""


def await_producer(
    store: dist.Store, spec: GroupSpec, deadline: float, *, elastic: bool = False
) -> tuple[RunAuth, int]:
    """Consumer: read the producer's greeting and check that it is this run's; returns the run's key and the
    producer's world size. Refuses another run's producer, and one that does not hold this rank's token, in one
    line (after leaving a check-in there, so that the producer can say why this rank did not join)."""
    late = PeerError(
        f"the process at {spec.address} did not start a refit rendezvous within {spec.timeout_s:g}s; "
        "is group.port the refit producer's?"
    )
    # The greeting is read before the run's key is known: against no key (its signature is checked below).
    unchecked = RunStore(store, RunAuth("", "", None, spec.rank), spec.address, hide_keys=False)
    raw, outer = _await_record(unchecked, _K_HELLO, _GREETING, deadline, late, spec)
    hello, signed = envelope(outer)
    run_id = hello["run_id"]
    if spec.run_id is not None and run_id != spec.run_id:
        raise ConfigError(
            f"the producer at {spec.address} belongs to run {run_id!r}, this consumer to run {spec.run_id!r}; "
            "refusing another run's producer: give this consumer its own run's group.host/group.port"
        )
    auth = RunAuth.derive(spec.token, run_id, hello["nonce"], spec.rank)
    public = RunStore(store, auth, spec.address, hide_keys=False)
    problem = _greeting_problem(public, raw, signed)
    if problem is not None:
        # Left where the producer looks, so that it can say why this rank never joined.
        _leave_untrusted_checkin(public, spec, problem)
        raise ConfigError(f"{problem}; set the same group.token (or {TOKEN_ENV}) on every rank")
    if hello.get("elastic", False) is not elastic:
        # Either way the two would wait for each other in different places until a deadline: say why now.
        theirs, mine = ("continue", "fail") if not elastic else ("fail", "continue")
        raise ConfigError(
            f"refit.on_consumer_loss differs: the producer at {spec.address} has {theirs}, this consumer {mine}; "
            "set the same refit.on_consumer_loss on every rank"
        )
    return auth, hello["world_size"]


def _greeting_problem(public: RunStore, raw: bytes, signed: bool) -> str | None:
    """Why this consumer cannot believe the greeting, or None. Anyone can write the greeting's key, so a greeting
    that does not check may be a stranger's as well as another producer's: the text names both."""
    where = public.where
    if signed and not public.auth.signed:
        return f"the producer at {where} requires group.token, and this consumer has none"
    if public.auth.signed and not signed:
        return (
            f"the greeting at {where} is not signed: the producer there runs without group.token, or a client that "
            "is not the producer wrote it"
        )
    if signed:
        try:
            public.open(_HELLO, raw)
        except RecordError:
            return (
                f"the greeting at {where} does not check with this consumer's group.token: the producer there holds "
                "another group.token, or a client that is not the producer wrote it"
            )
    return None


def _write_checkin(public: RunStore, spec: GroupSpec, route: Route, *, refused: str = "") -> None:
    """``refused``: why this consumer could not believe the greeting; its check-in then goes to the public area,
    and where it is signed with the run's key after all (a stranger copied the real greeting unsigned), the
    producer reads the reason instead of counting the rank as joined."""
    area = _checkin_area(public, trusted=not refused)
    n = area.add(_K_COUNT, 1)
    record = {
        "rank": spec.rank,
        "run_id": public.auth.run_id,
        "caps": capabilities(spec),
        "producer_address": route.producer,
    }
    if refused:
        record["refused"] = refused
    area.put(_k_slot(n), _CHECKIN, record)


def _leave_untrusted_checkin(public: RunStore, spec: GroupSpec, why: str) -> None:
    """Best effort: the public area's counter is anyone's to break, and the caller is about to raise its reason."""
    try:
        _write_checkin(public, spec, Route("", ""), refused=why)
    except dist.DistError as e:
        logger.debug("rank %d: could not leave a check-in at %s: %s", spec.rank, spec.address, one_line(e))


def consumer_checkin(
    public: RunStore, run: RunStore, spec: GroupSpec, producer_size: int, deadline: float, route: Route
) -> tuple[str, str]:
    """Check in with the producer; returns the backend and this consumer's address on its route to the producer.
    ``public`` and ``run``: as for :func:`producer_checkin`."""
    if producer_size != spec.world_size:
        raise fail_rendezvous(
            run,
            ConfigError(
                f"group.world_size differs: the producer has {producer_size}, consumer rank {spec.rank} has "
                f"{spec.world_size}; set the same group.world_size on every rank"
            ),
        )
    if run.add(_k_claim(spec.rank), 1) > 1:
        raise fail_rendezvous(run, _claimed_twice(spec.rank, producer_size, run.auth))
    _write_checkin(public, spec, route)
    late = PeerError(
        f"the producer at {spec.address} did not complete the rendezvous within {spec.timeout_s:g}s; "
        "another consumer may be missing"
    )
    _, outcome = _await_record(run, _K_OUTCOME, _OUTCOME, deadline, late, spec)
    if not outcome["ok"]:
        raise _outcome_error(outcome)
    return str(outcome["backend"]), route.local
