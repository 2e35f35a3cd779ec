"""Run a function once per rank in freshly spawned processes, with a deadline and per-rank tracebacks.

``fn`` must be a module-level function (``spawn`` pickles it by reference) with the signature
``fn(rank, world_size, port, *args)``; its return value must pickle.
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


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results: Any) -> None:
    try:
        outcome = fn(rank, world_size, port, *args)
        pickle.dumps(outcome)  # fail here, with a traceback, rather than silently in the queue's feeder thread
    except BaseException as e:  # noqa: BLE001 - everything a rank raises goes back to the parent
        try:
            exc: BaseException | None = pickle.loads(pickle.dumps(e))
        except Exception:  # noqa: BLE001 - an unpicklable exception still reports its text
            exc = None
        outcome = RankFailure(rank, type(e).__name__, str(e), traceback.format_exc(), exc)
    results.put((rank, outcome))
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is delivered; skip interpreter teardown, which takes seconds with torch loaded.
    os._exit(0)


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
    AssertionError carrying every failed rank's traceback instead.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, args, results), name=f"rank{r}", daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, Any] = {}
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, outcome = results.get(timeout=0.1)
                outcomes[rank] = outcome
                continue
            except queue.Empty:
                pass
            if all(not p.is_alive() for r, p in enumerate(procs) if r not in outcomes):
                # Every silent rank is dead; collect anything still in the pipe, then stop waiting.
                try:
                    while True:
                        rank, outcome = results.get(timeout=0.5)
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


def _play_scenarios(rank: int, world_size: int, port: int, scenarios: dict, ports: dict[str, int]) -> dict:
    from refit_app.errors import RefitError

    outcomes: dict[str, Any] = {}
    for name, scenario in scenarios.items():
        try:
            outcomes[name] = scenario(rank, ports[name])
        except RefitError as e:
            outcomes[name] = e
    return outcomes


def play_scenarios(scenarios: dict[str, Callable[[int, int], Any]], world_size: int, timeout: float = 120.0) -> list:
    """Run every ``scenario(rank, port)`` in turn on each rank of one spawned group of processes, each scenario on
    its own port, paying the processes' start-up once. Returns per rank ``{name: result or RefitError raised}``."""
    ports = {name: free_port() for name in scenarios}
    return run_ranks(_play_scenarios, world_size, scenarios, ports, timeout=timeout)
