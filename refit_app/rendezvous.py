"""The rendezvous: the producer's store, and the check-in on it through which every rank joins a refit group.

The producer (rank 0) hosts a ``TCPStore``. Before any process group exists, every consumer checks in on that
store: world size, rank and backend are compared there, so a misconfigured rank gets a one-line error and so does
the producer, instead of everyone waiting in a collective that can never complete. The outcome (the backend, or
the first failure) is one key that every rank reads.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from refit_app.backends import capabilities, resolve_backend
from refit_app.control import Poller, ranks_text
from refit_app.errors import ConfigError, PeerError, RefitError, one_line
from refit_app.settings import PRODUCER_RANK, GroupSpec

logger = logging.getLogger(__name__)

WAITING_NOTICE_INTERVAL_S = 10.0
"""How often a consumer that cannot reach its producer yet says that it is still waiting, and where: on its
first failed try, then at this interval, so that a consumer started first is neither silent nor noisy."""

_K_PRODUCER = "refit/rdzv/producer"
_K_OUTCOME = "refit/rdzv/outcome"


def _k_claim(rank: int) -> str:
    return f"refit/rdzv/claim/{rank}"


def _k_checkin(rank: int) -> str:
    return f"refit/rdzv/rank/{rank}"


_ERROR_TYPES: dict[str, type[RefitError]] = {"ConfigError": ConfigError, "PeerError": PeerError}


def outcome_error(doc: dict[str, Any]) -> RefitError:
    return _ERROR_TYPES.get(doc["kind"], PeerError)(doc["message"])


def fail_rendezvous(store: dist.Store, exc: RefitError) -> RefitError:
    """Make ``exc`` the rendezvous outcome so every rank stops with it; return what to raise here.

    If the rendezvous already failed, that earlier failure is the root cause and wins. If it already
    succeeded without this rank (a late duplicate, say), the others are not disturbed.
    """
    payload = json.dumps({"ok": False, "kind": type(exc).__name__, "message": str(exc)})
    current = store.compare_set(_K_OUTCOME, "", payload).decode()
    doc = json.loads(current)
    if current == payload or doc["ok"]:
        return exc
    return outcome_error(doc)


def start_store(spec: GroupSpec) -> dist.TCPStore:
    try:
        return dist.TCPStore(
            spec.host,
            spec.port,
            world_size=None,
            is_master=True,
            timeout=timedelta(seconds=spec.timeout_s),
            wait_for_workers=False,
        )
    except dist.DistError as e:
        if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
            raise ConfigError(
                f"group.port={spec.port} is already in use on this host; choose a free group.port "
                "(and give consumers the same one) or stop the process holding it"
            ) from e
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
                logger.info("rank %d: waiting for the producer at %s (%.0fs left of group.timeout_s=%g)",
                            spec.rank, spec.address, deadline - now, spec.timeout_s)
                next_notice = now + WAITING_NOTICE_INTERVAL_S
            poller.sleep(deadline)
    try:
        store = dist.TCPStore(
            spec.host,
            spec.port,
            is_master=False,
            timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.1)),
        )
    except dist.DistError as e:
        raise unreachable from e
    store.set_timeout(timedelta(seconds=spec.timeout_s))
    return store, route


def producer_checkin(store: dist.Store, spec: GroupSpec, deadline: float) -> tuple[str, str]:
    """Wait for every consumer's check-in; returns the backend and this producer's address as the consumers reached
    it (where its gloo connections must listen)."""
    store.set(_K_PRODUCER, json.dumps({"world_size": spec.world_size, "backend": spec.backend}))
    infos = {PRODUCER_RANK: capabilities(spec.backend)}
    pending = list(range(1, spec.world_size))
    logger.info(
        "rank 0: waiting up to %gs for %d consumer(s) at port %d (group.host of the consumers: this host's address)",
        spec.timeout_s, len(pending), spec.port,
    )
    poller = Poller()
    while pending:
        if store.check([_K_OUTCOME]):
            raise outcome_error(json.loads(store.get(_K_OUTCOME)))
        for rank in list(pending):
            if store.check([_k_checkin(rank)]):
                infos[rank] = json.loads(store.get(_k_checkin(rank)))
                pending.remove(rank)
                logger.info("rank 0: consumer rank %d checked in", rank)
                try:
                    resolve_backend(infos)
                except ConfigError as e:
                    raise fail_rendezvous(store, e) from None
        if not pending:
            break
        if time.monotonic() >= deadline:
            raise fail_rendezvous(
                store,
                PeerError(
                    f"{ranks_text(pending)} did not join the producer at {spec.address} within "
                    f"{spec.timeout_s:g}s; start every consumer with this group.host/group.port and "
                    f"group.world_size={spec.world_size}"
                ),
            )
        poller.sleep(deadline)
    try:
        backend = resolve_backend(infos)
    except ConfigError as e:
        raise fail_rendezvous(store, e) from None
    ready = json.dumps({"ok": True, "backend": backend})
    current = store.compare_set(_K_OUTCOME, "", ready).decode()
    if current != ready:
        raise outcome_error(json.loads(current))
    # Where consumers reached this producer; with several routes, the first consumer's (gloo listens on one).
    return backend, str(infos[PRODUCER_RANK + 1].get("producer_address") or spec.host)


def _wait_key(store: dist.Store, key: str, deadline: float, late: RefitError, spec: GroupSpec) -> None:
    try:
        store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
    except dist.DistError as e:
        if time.monotonic() >= deadline or "timeout" in str(e).lower():
            raise late from e
        raise PeerError(
            f"lost the producer at {spec.address} during the rendezvous ({one_line(e)}); it may have died"
        ) from e


def consumer_checkin(store: dist.Store, spec: GroupSpec, deadline: float, route: Route) -> tuple[str, str]:
    """Check in with the producer; returns the backend and this consumer's address on its route to the producer."""
    _wait_key(
        store,
        _K_PRODUCER,
        deadline,
        PeerError(
            f"the process at {spec.address} did not start a refit rendezvous within {spec.timeout_s:g}s; "
            "is group.port the refit producer's?"
        ),
        spec,
    )
    producer = json.loads(store.get(_K_PRODUCER))
    producer_size = int(producer["world_size"])
    if producer_size != spec.world_size:
        raise fail_rendezvous(
            store,
            ConfigError(
                f"group.world_size differs: the producer has {producer_size}, consumer rank {spec.rank} has "
                f"{spec.world_size}; set the same group.world_size on every rank"
            ),
        )
    if store.add(_k_claim(spec.rank), 1) > 1:
        raise fail_rendezvous(
            store,
            ConfigError(
                f"group.rank={spec.rank} is claimed by two consumers; give each consumer its own group.rank "
                f"in 1..{producer_size - 1}"
            ),
        )
    store.set(_k_checkin(spec.rank), json.dumps({**capabilities(spec.backend), "producer_address": route.producer}))
    _wait_key(
        store,
        _K_OUTCOME,
        deadline,
        PeerError(
            f"the producer at {spec.address} did not complete the rendezvous within {spec.timeout_s:g}s; "
            "another consumer may be missing"
        ),
        spec,
    )
    outcome = json.loads(store.get(_K_OUTCOME))
    if not outcome["ok"]:
        raise outcome_error(outcome)
    return str(outcome["backend"]), route.local
