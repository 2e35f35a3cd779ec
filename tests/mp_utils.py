"""Run a function once per rank in freshly spawned processes, with a deadline and per-rank tracebacks.

``fn`` must be a module-level function (``spawn`` pickles it by reference) with the signature
``fn(rank, world_size, port, *args)``; its return value must pickle.

Ranks start together: each spawned process imports torch and the test module (from 3 to 30 s on a loaded 2-core
machine), says it is ready and waits; ``fn`` runs on every rank once all are ready. Start-up is therefore outside
every deadline a rank sets (``timeout_s`` of a group) and outside ``run_ranks``'s own ``timeout``.

Also the one home of the start-up limit and of the margin that deadline asserts allow (:func:`deadline_budget`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_JOIN_S = 5.0

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


def free_port() -> int:
    """A port the OS considers free right now (another process could still take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results: Any, go: Any
) -> None:
    # Unpickling ``fn`` imported its module (torch included) before this line: start-up is over.
    results.put(("ready", rank, None))
    if not go.wait(2 * STARTUP_LIMIT_S):
        os._exit(3)  # the parent gave up on a peer's start-up (and will kill this process anyway)
    try:
        outcome = fn(rank, world_size, port, *args)
        pickle.dumps(outcome)  # fail here, with a traceback, rather than silently in the queue's feeder thread
    except BaseException as e:  # noqa: BLE001 - everything a rank raises goes back to the parent
        try:
            exc: BaseException | None = pickle.loads(pickle.dumps(e))
        except Exception:  # noqa: BLE001 - an unpicklable exception still reports its text
            exc = None
        outcome = RankFailure(rank, type(e).__name__, str(e), traceback.format_exc(), exc)
    results.put(("done", rank, outcome))
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is delivered; skip interpreter teardown, which takes seconds with torch loaded.
    os._exit(0)


def _start_together(procs: list[Any], results: Any, go: Any) -> dict[int, RankFailure]:
    """Wait until every rank has started up, then let all run. If one dies or hangs starting, nothing runs and
    every rank gets a failure saying why."""
    ready: set[int] = set()
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while len(ready) < len(procs) and time.monotonic() < deadline:
        try:
            _, rank, _ = results.get(timeout=0.1)
            ready.add(rank)
            continue
        except queue.Empty:
            pass
        if any(not p.is_alive() for r, p in enumerate(procs) if r not in ready):
            break
    if len(ready) == len(procs):
        go.set()
        return {}
    failed = {}
    for r, p in enumerate(procs):
        if r in ready:
            failed[r] = RankFailure(r, "Stopped", "started up, but a peer did not; killed before it ran")
        elif not p.is_alive():
            failed[r] = RankFailure(r, "Died", f"exited with code {p.exitcode} during start-up")
        elif time.monotonic() >= deadline:
            failed[r] = RankFailure(r, "Timeout", f"did not start up within {STARTUP_LIMIT_S:g}s; killed")
        else:
            failed[r] = RankFailure(r, "Stopped", "killed during start-up, after a peer died")
    return failed


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    return_exceptions: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, port, *args)`` for every rank in its own spawned process.

    Returns the per-rank results in rank order. A rank that raised, died or missed ``timeout`` (killed
    then) yields a :class:`RankFailure`; unless ``return_exceptions`` is set, any failure raises an
    AssertionError carrying every failed rank's traceback instead. ``timeout`` counts from the moment every
    rank has started up and ``fn`` starts everywhere; start-up has its own limit, :data:`STARTUP_LIMIT_S`.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    results = ctx.Queue()
    go = ctx.Event()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, args, results, go), name=f"rank{r}", daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, Any] = {}
    killed: set[int] = set()
    try:
        outcomes.update(_start_together(procs, results, go))
        deadline = time.monotonic() + timeout
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                _, rank, outcome = results.get(timeout=0.1)
                outcomes[rank] = outcome
                continue
            except queue.Empty:
                pass
            if all(not p.is_alive() for r, p in enumerate(procs) if r not in outcomes):
                # Every silent rank is dead; collect anything still in the pipe, then stop waiting.
                try:
                    while True:
                        _, rank, outcome = results.get(timeout=0.5)
                        outcomes[rank] = outcome
                except queue.Empty:
                    break
    finally:
        for rank, p in enumerate(procs):
            if p.is_alive():
                killed.add(rank)
                p.kill()
        for p in procs:
            p.join(_JOIN_S)
        results.close()
    for rank, p in enumerate(procs):
        if rank in outcomes:
            continue
        if rank in killed:
            outcomes[rank] = RankFailure(rank, "Timeout", f"did not finish within {timeout:g}s; killed")
        else:
            outcomes[rank] = RankFailure(rank, "Died", f"exited with code {p.exitcode} without a result")
    ordered = [outcomes[r] for r in range(world_size)]
    failures = [o for o in ordered if isinstance(o, RankFailure)]
    if failures and not return_exceptions:
        details = "\n".join(f"--- {f} ---\n{f.traceback}" for f in failures)
        raise AssertionError(f"{len(failures)} of {world_size} ranks failed:\n{details}")
    return ordered


def _play_scenarios(
    rank: int, world_size: int, port: int, scenarios: dict, ports: dict[str, int], barrier: Any, timeout: float
) -> dict:
    from refit_app.errors import RefitError

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
    barrier = mp.get_context("spawn").Barrier(world_size)
    return run_ranks(_play_scenarios, world_size, scenarios, ports, barrier, timeout, timeout=timeout)
