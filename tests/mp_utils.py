"""Run a function once per rank in its own process, with a deadline and per-rank tracebacks, through the project's
one harness (:mod:`refit_app.app.rank_harness`, which ``role=local`` and the benchmark use too).

``fn`` must be a module-level function (it is pickled by reference) with the signature
``fn(rank, world_size, port, *args)``; its return value must pickle.

Ranks start together: each process imports the test module (from 3 to 30 s on a loaded 2-core machine), says it
is ready and waits; ``fn`` runs on every rank once all are ready. Start-up is therefore outside every deadline a
rank sets (``timeout_s`` of a group) and outside ``run_ranks``'s own ``timeout``.

Also the one home of the start-up limit, of the margin that deadline asserts allow (:func:`deadline_budget`) and
of the group settings every rank of a test connects with (:func:`gloo_spec`).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from refit_app.app import rank_harness
from refit_app.app.rank_harness import free_port
from refit_app.transport.spec import GroupSpec

__all__ = [
    "DEADLINE_MARGIN",
    "EXIT_SLACK_S",
    "STARTUP_LIMIT_S",
    "RankFailure",
    "deadline_budget",
    "free_port",
    "gloo_spec",
    "init_gloo",
    "play_scenarios",
    "run_ranks",
]

STARTUP_LIMIT_S = 180.0
"""Hard limit on one process's start-up (interpreter, torch, Hydra, the code under test). Observed: 3 s idle, up to
40 s on a 2-core machine with two CPU hogs and a dozen processes starting at once. Only a hang gets near it; it is
never part of a deadline under test."""

DEADLINE_MARGIN = 2.5
"""How many deadlines (``group.timeout_s``) a rank may take to give up after the event a deadline is about (a peer
killed or stopped, the rendezvous entered). Why 2.5: a rank notices a dead or stalled peer within one deadline;
reporting why over the producer's store may take one more (each store call has the same deadline); the last half
absorbs a loaded machine's scheduling delays. The assert still fails a rank that ignores its deadline (gloo's own
default is 30 minutes) or waits it several times over: with group.timeout_s=6, anything past 25 s."""

EXIT_SLACK_S = 10.0
"""Seconds on top of the deadlines, for what no deadline covers after a rank gives up: the producer's 2 s linger for
consumers to read its reason, writing metrics.json, and interpreter teardown with torch loaded (2-3 s measured
under load)."""


def deadline_budget(timeout_s: float) -> float:
    """The most a deadline assert allows from the event to the exit, for ranks with ``group.timeout_s=timeout_s``."""
    return DEADLINE_MARGIN * timeout_s + EXIT_SLACK_S


def gloo_spec(rank: int, world_size: int, port: int, *, timeout_s: float, **fields: Any) -> GroupSpec:
    """Rank ``rank``'s settings for a gloo group of ``world_size`` on ``port`` of this host, with ``group.timeout_s``
    ``timeout_s``; ``fields``: any other GroupSpec field (``backend``, ``token``, ``topology``, ...)."""
    fields.setdefault("backend", "gloo")
    return GroupSpec(port=port, world_size=world_size, rank=rank, timeout_s=timeout_s, **fields)


def init_gloo(rank: int, world_size: int, port: int, *, timeout_s: float) -> None:
    """Join torch's default process group on ``port`` of this host over gloo, every wait bounded by ``timeout_s``: the
    plain process group the sharded refits' tests run over (the rest connect through :func:`gloo_spec`)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def wait_all_past_init(rank: int, world_size: int, *, waiter: int, timeout_s: float) -> None:
    """Hold rank ``waiter`` until every rank has returned from :func:`init_gloo`; the others only say so and go on.

    torch's ``init_process_group`` has no barrier: a rank that a test kills early could otherwise die while a peer is
    still connecting its gloo pairs (or, for rank 0, while a peer still waits on the store it hosts), and that peer
    would fail in torch's setup instead of in the code under test. A set needs no answer, so the ranks that only say
    so hold no open wait on the store when the waiter dies."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.set(f"past_init/{rank}", "1")
    if rank == waiter:
        store.wait([f"past_init/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))


@dataclass
class RankFailure:
    """What a rank left behind instead of a result: its exception (if it raised) or how it ended."""

    rank: int
    exc_type: str
    """Class name of the exception, ``"Died"`` for a process that exited without a result, ``"Timeout"``."""
    message: str
    traceback: str = ""
    exc: BaseException | None = None
    """The exception itself when it survived pickling."""

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.exc_type}: {self.message}"


def _call(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple) -> Any:
    return fn(rank, world_size, port, *args)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    return_exceptions: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, port, *args)`` for every rank in its own process, through the project's one
    harness (:func:`refit_app.app.rank_harness.run_ranks`), the ranks started together.

    Returns the per-rank results in rank order. A rank that raised, died or missed ``timeout`` (killed
    then) yields a :class:`RankFailure`; unless ``return_exceptions`` is set, any failure raises an
    AssertionError carrying every failed rank's traceback instead. ``timeout`` counts from the moment every
    rank has started up and ``fn`` starts everywhere; start-up has its own limit, :data:`STARTUP_LIMIT_S`.
    """
    outcomes = rank_harness.run_ranks(
        _call, world_size, (fn, world_size, free_port(), args), timeout_s=timeout, startup_s=STARTUP_LIMIT_S
    )
    ordered = [
        o.value
        if o.ok
        else RankFailure(o.rank, o.exc_type, str(o.exc) if o.exc is not None else o.error, o.traceback, o.exc)
        for o in outcomes
    ]
    failures = [o for o in ordered if isinstance(o, RankFailure)]
    if failures and not return_exceptions:
        details = "\n".join(f"--- {f} ---\n{f.traceback}" for f in failures)
        raise AssertionError(f"{len(failures)} of {world_size} ranks failed:\n{details}")
    return ordered


def _play_scenarios(
    rank: int, world_size: int, port: int, scenarios: dict, ports: dict[str, int], barrier: Any, timeout: float
) -> dict:
    from refit_app.common.errors import RefitError

    outcomes: dict[str, Any] = {}
    for name, scenario in scenarios.items():
        # Every scenario starts on all ranks at once: the previous one may end seconds apart on different ranks
        # (a rank that gives up early, the producer's linger), and that skew must not eat the next one's deadline.
        barrier.wait(timeout)
        try:
            outcomes[name] = scenario(rank, ports[name])
        except RefitError as e:
            outcomes[name] = e
    return outcomes


def play_scenarios(scenarios: dict[str, Callable[[int, int], Any]], world_size: int, timeout: float = 120.0) -> list:
    """Run every ``scenario(rank, port)`` in turn on each rank of one spawned group of processes, each scenario on
    its own port and started on every rank at once, paying the processes' start-up once. Returns per rank
    ``{name: result or RefitError raised}``."""
    ports = {name: free_port() for name in scenarios}
    barrier = mp.get_context(rank_harness.START_METHOD).Barrier(world_size)
    return run_ranks(_play_scenarios, world_size, scenarios, ports, barrier, timeout, timeout=timeout)
