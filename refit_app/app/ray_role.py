"""``role=ray``: the producer and every consumer as Ray actors, one placement-group bundle per rank.

Each actor runs :func:`refit_app.app.roles.run_producer` or :func:`~refit_app.app.roles.run_consumer`, exactly as a
rank of ``role=local`` does (same sources, sinks, rounds, settings and metrics), over the same
:func:`refit_app.transport.groups.connect` group: this run's own token, the producer's address and a free port
taken on its actor's node (:func:`refit_app.integrations.ray.member.node_address`). What happens, with a deadline
on every wait::

    join the cluster (ray.address), or start a local one          ray.start_timeout_s
    reserve one bundle per rank (ray.strategy, CPUs, GPUs)        ray.start_timeout_s
    start every rank's actor (imports torch) and ask the producer's node address
    run every rank at once; after the first failure the others get RAY_EXIT_GRACE_S
    kill the actors, remove the placement group, stop the local cluster (always: success, failure, Ctrl-C)

Ray is imported here only, inside :func:`run_ray`, so that every other role runs without it.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from refit_app.app.config import RaySpec, RunSettings
from refit_app.app.local import (
    NO_ROUND,
    check_source_early,
    combine_outcomes,
    num_producers,
    rank_label,
    rank_logging,
    rank_settings,
    with_run_secret,
)
from refit_app.app.rank_harness import DeferredSignals, RankOutcome, outcome_of
from refit_app.common.errors import ConfigError, RefitError, one_line
from refit_app.integrations.ray.defaults import RAY_EXTRA

RAY_DEDUP_LOGS_ENV = "RAY_DEDUP_LOGS"
RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"
"""Ray starts its worker processes, the ranks' actors among them, at niceness 15 by default: on a host whose cores
are busy with anything else they then get a few percent of a core, and a refit crawls. A local cluster this run
starts keeps them at the run's own priority (0); a user's own setting wins. A joined cluster has its own setting
(``RAY_worker_niceness=0 ray start ...``, docs/ray.md)."""
"""Set to ``0`` unless the user set it: Ray would fold the ranks' lines that look alike."""

logger = logging.getLogger(__name__)

RAY_EXIT_GRACE_S = 10.0
"""How long the other ranks may take, after one failed, to end with their own errors before they are killed (as
role=local's grace, plus the time Ray takes to report an actor's end)."""
PROBE_S = 5.0
"""How long ``ray.address`` may take to accept a connection: Ray itself would retry an address where nothing
listens for minutes."""


def run_ray(s: RunSettings) -> dict[str, Any]:
    """Run the producer and every consumer as actors on a Ray cluster; the producer's figures at the top level."""
    assert s.ray is not None
    ray = _import_ray()
    check_source_early(s)
    s = with_run_secret(s)
    signals = DeferredSignals()  # Ctrl-C and SIGTERM end the run at the next check, after the clean-up below
    cluster = _Cluster(ray, s.ray, s.group.world_size, num_producers(s))
    try:
        cluster.start(signals)
        outcomes = cluster.run(s, signals)
    finally:
        cluster.stop()
        signals.restore()
    signals.check()  # a signal that came during the clean-up
    restarts = (
        {rank: {"restarts": n} for rank, n in enumerate(cluster.restarts) if rank >= cluster.producers}
        if s.refit.elastic
        else None
    )
    return combine_outcomes(outcomes, s, "ray", restarts)


def _import_ray() -> Any:
    # Ray folds the ranks' lines that look alike ("[repeated 2x across cluster]"), hiding the consumers' own;
    # read when Ray is imported. A user's own setting wins.
    os.environ.setdefault(RAY_DEDUP_LOGS_ENV, "0")
    try:
        return importlib.import_module("ray")
    except ImportError as e:
        raise ConfigError(f"role=ray needs the ray extra: {RAY_EXTRA} ({one_line(e)})") from e


class _Cluster:
    """This run's part of a Ray cluster: the connection (and the local cluster, if it started one), the placement
    group and the actors; :meth:`stop` removes all of it and is safe at any point."""

    def __init__(self, ray: Any, spec: RaySpec, world_size: int, producers: int = 1) -> None:
        self.ray = ray
        self.spec = spec
        self.world_size = world_size
        self.producers = producers
        self.labels = [rank_label(r, producers) for r in range(world_size)]
        """Each rank's name in lines: ``producer``, ``producer 1`` (a sharded refit's), ``consumer 3``."""
        self.local = spec.address is None
        self.placement: Any = None
        self.actors: list[Any] = []
        self.gpus_per_rank = 0.0
        self.producer_address: tuple[str, int] = ("", 0)
        self.restarts = [0] * world_size
        """How often each rank's actor was restarted by Ray and run again (refit.on_consumer_loss=continue)."""

    # -- start-up -------------------------------------------------------------------------------------------------

    def start(self, signals: DeferredSignals) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        self._connect()
        signals.check()
        self.gpus_per_rank = self._gpus_per_rank()
        bundle = {"CPU": self.spec.cpus_per_rank, **({"GPU": self.gpus_per_rank} if self.gpus_per_rank else {})}
        self._reserve(bundle, deadline, signals)
        self._start_actors(deadline, signals)

    def _connect(self) -> None:
        ray, spec = self.ray, self.spec
        if self.local:
            # Logical CPUs: enough for every rank's bundle even on a machine with fewer cores (the ranks mostly wait
            # on the network); address="local" never joins a cluster this machine happens to run already.
            cpus = max(os.cpu_count() or 1, math.ceil(self.world_size * spec.cpus_per_rank))
            options: dict[str, Any] = {"address": "local", "num_cpus": cpus}
            os.environ.setdefault(RAY_WORKER_NICENESS_ENV, "0")  # read by the raylet that ray.init starts
            logger.info("starting a local Ray cluster (%d CPUs)", cpus)
        else:
            _probe(spec.address)
            options = {"address": spec.address}
            logger.info("joining the Ray cluster at %s", spec.address)
        try:
            with _sigterm_kept(), _sigterm_blocked_in_children(self.local):
                ray.init(include_dashboard=False, logging_level=logging.WARNING, **options)
        except (ConnectionError, ValueError, RuntimeError) as e:
            where = "start a local Ray cluster" if self.local else f"join the Ray cluster at ray.address={spec.address}"
            raise RefitError(f"could not {where}: {one_line(e)}") from e

    def _gpus_per_rank(self) -> float:
        if self.spec.gpus_per_rank is not None:
            return float(self.spec.gpus_per_rank)
        gpus = self.ray.cluster_resources().get("GPU", 0)
        return 1.0 if gpus >= self.world_size else 0.0

    def _reserve(self, bundle: dict[str, float], deadline: float, signals: DeferredSignals) -> None:
        from ray.util.placement_group import placement_group

        self.placement = placement_group([dict(bundle)] * self.world_size, strategy=self.spec.strategy)
        ready = self.placement.ready()
        shortfall = self._shortfall(bundle)
        if shortfall and self.local:  # a cluster of our own never grows: waiting cannot help
            raise RefitError(f"cannot place {self._bundles(bundle)}: {shortfall}")
        while not self.ray.wait([ready], timeout=0.2)[0]:
            signals.check()
            if time.monotonic() >= deadline:
                why = f": {shortfall}" if shortfall else " (the cluster is busy?)"
                raise RefitError(
                    f"could not place {self._bundles(bundle)} within ray.start_timeout_s="
                    f"{self.spec.start_timeout_s:g}s{why}"
                )

    def _bundles(self, bundle: dict[str, float]) -> str:
        return f"{self.world_size} bundles of {bundle} with ray.strategy={self.spec.strategy}"

    def _shortfall(self, bundle: dict[str, float]) -> str:
        """What the cluster lacks, as it stands now, for the bundles; empty where it has enough."""
        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        have = self.ray.cluster_resources()
        lacking = [
            f"{need * self.world_size:g} {key} (the cluster has {have.get(key, 0):g})"
            for key, need in bundle.items()
            if need * self.world_size > have.get(key, 0)
        ]
        if self.spec.strategy == "STRICT_SPREAD" and len(nodes) < self.world_size:
            lacking.append(f"STRICT_SPREAD needs a node per rank, {self.world_size}, and the cluster has {len(nodes)}")
        return "; ".join(lacking)

    def _start_actors(self, deadline: float, signals: DeferredSignals) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from refit_app.integrations.ray.calls import raise_on_failure, wait_calls

        remote = self.ray.remote(RankActor)
        for rank in range(self.world_size):
            self.actors.append(
                remote.options(
                    num_cpus=self.spec.cpus_per_rank,
                    num_gpus=self.gpus_per_rank,
                    # A consumer restarted by Ray rejoins an elastic run; the run cannot go on without a producer
                    # (a sharded refit's producers hold shards that exist nowhere else).
                    max_restarts=0 if rank < self.producers else self.spec.max_restarts,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement, placement_group_bundle_index=rank
                    ),
                ).remote()
            )
        # Every actor imports the ranks' code (torch) before any rank runs: the rendezvous deadline
        # (group.timeout_s) never includes a peer's start-up.
        calls = [actor.start.remote() for actor in self.actors]
        labels = self.labels
        left = max(deadline - time.monotonic(), 0.0)
        self.producer_address = raise_on_failure(
            wait_calls(calls, labels, left, check=signals.check), "starting the ranks' actors"
        )[0]

    # -- the run ----------------------------------------------------------------------------------------------------

    def run(self, s: RunSettings, signals: DeferredSignals) -> list[RankOutcome]:
        from refit_app.integrations.ray.calls import wait_calls

        host, port = self.producer_address
        s = replace(s, group=replace(s.group, host=host, port=port))
        logger.info("ray: %d ranks, the producer at %s", self.world_size, s.group.address)
        log_files = [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
        labels = self.labels

        def launch(rank: int, attempt: int) -> Any:
            return self.actors[rank].run.remote(rank, s, log_files, os.getcwd(), attempt)

        if s.refit.elastic:
            outcomes = self._run_elastic(s, launch, labels, signals)
        else:
            # No deadline of its own for a whole run (rounds of any size): each step inside has group.timeout_s, an
            # actor that dies is reported by Ray, and after the first failure the others get RAY_EXIT_GRACE_S.
            calls = [launch(rank, 0) for rank in range(self.world_size)]
            outcomes = wait_calls(calls, labels, math.inf, grace_s=RAY_EXIT_GRACE_S, check=signals.check)
        return [
            o.value if o.ok else RankOutcome(rank, False, error=o.error, exc_type=o.exc_type, failed_at=o.failed_at)
            for rank, o in enumerate(outcomes)
        ]

    def _run_elastic(
        self, s: RunSettings, launch: Callable[[int, int], Any], labels: list[str], signals: DeferredSignals
    ) -> list[Any]:
        """Every rank's run under refit.on_consumer_loss=continue: a consumer whose actor died is run again once
        Ray has restarted it (up to ray.max_restarts times) and rejoins at a round boundary. Once the producer's run
        has ended, the others get the time to hear it and end."""
        from refit_app.integrations.ray.calls import DIED, POLL_S, TIMEOUT, CallOutcome, ended_call
        from refit_app.integrations.ray.restarts import ActorRestarts

        ray = self.ray
        back = ActorRestarts(labels, self.spec.max_restarts)
        self.restarts = back.counts  # metrics.json's consumers[].restarts
        outcomes: list[CallOutcome | None] = [None] * self.world_size
        pending: dict[Any, int] = {launch(rank, 0): rank for rank in range(self.world_size)}
        # A consumer hears of the end within its answer wait (answer_wait_s: 2 x group.timeout_s).
        grace_s = RAY_EXIT_GRACE_S + 2 * s.group.timeout_s
        producer_ended: float | None = None
        while pending or back.ranks:
            signals.check()
            if producer_ended is not None and time.monotonic() >= producer_ended + grace_s:
                break
            ray.wait([*pending, *back.refs], num_returns=1, timeout=POLL_S)
            # A restarted actor answered (or Ray gave up on it): run its rank again.
            for rank, outcome in back.answered():
                if not outcome.ok:
                    outcomes[rank] = outcome
                elif producer_ended is not None:
                    outcomes[rank] = CallOutcome(labels[rank], False, error=NO_ROUND, exc_type="NoRound")
                else:
                    pending[launch(rank, back.counts[rank])] = rank
            for ref in ray.wait(list(pending), num_returns=len(pending), timeout=0)[0]:
                rank = pending.pop(ref)
                outcome = ended_call(ref, labels[rank])
                died = not outcome.ok and outcome.exc_type == DIED
                consumer = rank >= self.producers
                if consumer and died and producer_ended is None and back.ask_back(rank, self.actors[rank].start):
                    logger.warning(
                        "%s: its actor died (%s); Ray restarts it (%d of ray.max_restarts=%d), and it rejoins the run",
                        labels[rank],
                        outcome.error,
                        back.counts[rank],
                        self.spec.max_restarts,
                    )
                    continue
                outcomes[rank] = outcome
                if rank == 0:
                    producer_ended = time.monotonic()
        for rank in [*pending.values(), *back.forget()]:
            outcomes[rank] = CallOutcome(
                labels[rank],
                False,
                error=f"{labels[rank]} did not end within {grace_s:g}s of the producer's end",
                exc_type=TIMEOUT,
            )
        return outcomes

    # -- clean-up ---------------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Kill the actors, remove the placement group and leave (a local cluster: stop) the cluster; each step is
        tried whatever the others did."""
        ray = self.ray
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:
                logger.warning("ray: could not kill an actor: %s", one_line(e))
        self.actors = []
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement)
            except Exception as e:
                logger.warning("ray: could not remove the placement group: %s", one_line(e))
            self.placement = None
        if ray.is_initialized():
            ray.shutdown()  # a local cluster stops with it; a joined cluster is only left
            if self.local:
                logger.info("stopped the local Ray cluster")


class RankActor:
    """One rank of ``role=ray`` (made a Ray actor by :func:`run_ray`)."""

    def start(self) -> tuple[str, int]:
        """Import the ranks' code (torch) and give this node's address and a free port there."""
        importlib.import_module("refit_app.app.roles")
        from refit_app.integrations.ray.member import node_address

        return node_address()

    def run(self, rank: int, s: RunSettings, log_files: list[str], cwd: str, attempt: int = 0) -> RankOutcome:
        """This rank's part of the run, as a rank of role=local runs it; its outcome, failures included. ``attempt``:
        how often Ray restarted this actor before (a restarted consumer rejoins, and its fault hook is spent)."""
        from refit_app.app.roles import run_consumer, run_producer

        if attempt:
            s = replace(s, refit=replace(s.refit, die_in_round=None))

        if os.path.isdir(cwd):
            os.chdir(cwd)  # relative paths (sink.path) as the user typed them, where the node shares the directory
        # The driver's log files, where this node has them (the same host, a shared file system).
        rank_logging(rank, [f for f in log_files if os.path.isfile(f)], producers=num_producers(s))
        # Ray gives each actor its GPUs (CUDA_VISIBLE_DEVICES): the current device is the actor's own.
        ranked = rank_settings(s, rank, local_rank=None)
        if s.sharded is not None:  # one of a sharded refit's producers or consumers
            from refit_app.app.sharded_run import run_sharded

            return outcome_of(lambda r: run_sharded(ranked), rank)
        # No live progress line: Ray relays an actor's output line by line, with a prefix.
        return outcome_of(lambda r: (run_producer if r == 0 else run_consumer)(ranked, show_progress=False), rank)


def _probe(address: str) -> None:
    """Fail in seconds, with one line, where nothing listens at ``ray.address`` (host:port)."""
    if address == "auto" or "://" in address:
        return  # RAY_ADDRESS or this host's cluster; a Ray Client address: Ray's own checks say enough
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"ray.address={address} is invalid: must be host:port of the cluster's head, or auto")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S):
            pass
    except OSError as e:
        raise RefitError(
            f"ray.address={address}: nothing answers there ({one_line(e)}); start the cluster (ray start --head) "
            "or leave ray.address unset for a local one"
        ) from e


@contextmanager
def _sigterm_blocked_in_children(local: bool) -> Iterator[None]:
    """Start a local cluster's processes (GCS, raylet, their helpers, the workers the raylet starts) with SIGTERM
    blocked, as Ray itself starts them with SIGINT blocked. They share the driver's process group (and cgroup), so
    a SIGTERM to all of it (``timeout``, ``kill -- -PGID``, a scheduler ending the job) would stop the GCS under the
    driver, whose clean-up then waits 60 s for it and is ended by Ray without its one line. The driver stops them
    itself (:meth:`_Cluster.stop`; Ray's shutdown then kills each after a second's grace). A signal mask is
    inherited across fork and exec; the driver's own SIGTERM, pending meanwhile, arrives once it is unblocked."""
    if not local:
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextmanager
def _sigterm_kept() -> Iterator[None]:
    """``ray.init`` replaces the SIGTERM handler with its own ``sys.exit``; put back the one this run relies on
    (the application's: SIGTERM ends a run as Ctrl-C does, after the clean-up)."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
