"""Start ranks as processes on this machine and supervise them: the one harness that ``role=local``, the
benchmark and the tests use.

Each rank runs ``fn(rank, *args)`` in its own process and sends back its return value or its failure. Ranks are
forked from a fork server (:mod:`multiprocessing.forkserver`) that imported torch and the ranks' modules once: on a
2-core machine, N freshly spawned interpreters each importing torch cost N x 2 s of CPU, serially in effect, for a
refit that may take a tenth of a second. The server is a fresh interpreter that only imports, then forks each
rank: no torch operation runs there, so torch has started no thread pool (numpy's OpenBLAS, loaded with torch,
parks its idle workers across fork with its own atfork handlers), the same fork-after-import that torch's own
DataLoader workers rely on. The launcher itself is never forked: its state (Hydra, logging handlers, queue
threads) is no rank's business. Each rank gets the launcher's current environment and working directory (the
server's were fixed when it started).

Ranks die with the launcher, so an interrupted launcher leaves no orphan that could go on to publish a checkpoint:
a rank's parent is the fork server, not the launcher, so besides ``PR_SET_PDEATHSIG`` (which covers the server)
each rank holds the read end of a lifeline pipe whose only writer is the launcher, and kills itself when it reads
end-of-file. (The server alone would not do: it exits once every holder of its "alive" pipe is gone, and the ranks
hold one too.) The supervisor never waits without a deadline: a rank that dies without a word is
reported as such, and once one rank has failed the others get ``grace_s`` to exit with their own errors before
they are killed.

Each rank's latest step (its last log line, through :class:`ActivityHandler`, or :func:`note_activity`) sits in
shared memory, so a rank that is killed or dies is reported with what it was doing, and :func:`root_cause` can
say "rank 1 gave up waiting while rank 0 was still reading its source" instead of "rank 0 was killed".
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from refit_app.common.errors import Interrupted, RefitError, one_line
from refit_app.transport.spec import DEFAULT_HOST

_JOIN_S = 5.0
"""How long a rank that sent its result gets to exit before it is killed."""
_PR_SET_PDEATHSIG = 1
START_METHOD = "forkserver"
"""How ranks are started; ``spawn`` (a fresh interpreter per rank) is the slow, dependency-free alternative."""
BASE_PRELOAD = ("torch",)
"""Imported once by the fork server, before any rank is forked."""
ACTIVITY_BYTES = 240
"""Room for each rank's latest step in shared memory (UTF-8, cut to fit)."""
_ACTIVITY_SLOT = 1 + 2 * ACTIVITY_BYTES
"""A rank's part of the activity array: which of its two texts is current (one byte), then the two texts. A rank
writes the other text and then flips the byte, so the supervisor never reads a line half overwritten."""
_ACTIVITY_READS = 5

_activity: tuple[Any, int] | None = None
"""In a rank: the shared activity array and this rank's slot."""


def free_port(host: str = DEFAULT_HOST) -> int:
    """A port the OS considers free now (another process could still take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class RankOutcome:
    """How one rank ended: its return value, or its failure."""

    rank: int
    ok: bool
    value: Any = None
    """``fn``'s return value when ``ok``."""
    error: str = ""
    """The failure as one line (a :class:`RefitError`'s own message, else the exception's type and message)."""
    exc_type: str = ""
    """Class name of the exception; ``"Died"`` for a rank that exited without a result, ``"Timeout"`` for one
    killed by the supervisor."""
    traceback: str = ""
    exc: BaseException | None = None
    """The exception itself when it survived pickling."""
    activity: str = ""
    """The rank's latest step as it last reported it (its last log line), for any rank that did not succeed."""
    failed_at: float | None = None
    """When the supervisor learned of the failure (``time.monotonic()``): which rank failed first."""

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.exc_type}: {self.error}" if not self.ok else f"rank {self.rank}: ok"


def note_activity(text: str) -> None:
    """Record what this rank is doing now, for the supervisor to report should it fail or be killed; a no-op
    outside a rank started by :func:`run_ranks`."""
    if _activity is None:
        return
    array, rank = _activity
    data = " ".join(text.split()).encode("utf-8")[: ACTIVITY_BYTES - 1]
    base = rank * _ACTIVITY_SLOT
    spare = 1 - array[base][0]  # the text not shown now
    start = base + 1 + spare * ACTIVITY_BYTES
    array[start : start + ACTIVITY_BYTES] = data.ljust(ACTIVITY_BYTES, b"\0")
    array[base] = bytes((spare,))


class ActivityHandler(logging.Handler):
    """Passes each INFO-or-higher log line of a rank to :func:`note_activity`: its last line is its latest step."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            note_activity(record.getMessage())
        except Exception:
            self.handleError(record)


def _read_activity(array: Any, rank: int) -> str:
    """A rank's current text; read again should the rank have flipped to a newer one meanwhile (it could then be
    writing over the one read)."""
    base = rank * _ACTIVITY_SLOT
    for _ in range(_ACTIVITY_READS):
        current = array[base][0]
        start = base + 1 + current * ACTIVITY_BYTES
        raw = bytes(array[start : start + ACTIVITY_BYTES])
        if array[base][0] == current:
            break
    return raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")


def root_cause(
    outcomes: Sequence[RankOutcome], labels: Sequence[str], secondary: Sequence[str] = (), stopped_hint: str = ""
) -> str:
    """One line for a failed run: the failure that caused the others, with what any rank that had to be stopped
    was doing then.

    The cause is the first failure (in the order the supervisor learned of them) that is neither a rank stopped by
    the supervisor nor one of the ``secondary`` exception types (errors that only report a peer's failure); failing
    that, the first failure. A rank that gave up waiting for a slow peer is the first to fail, so the slow peer's
    step ("reading the tensor list of ...") goes with it: the line names both sides. ``labels``: each rank's name;
    ``stopped_hint``: advice added when a rank had to be stopped.
    """
    failures = sorted(
        (o for o in outcomes if not o.ok), key=lambda o: (o.exc_type == "Timeout", o.failed_at or float("inf"), o.rank)
    )
    if not failures:
        return ""
    root = next((f for f in failures if f.exc_type != "Timeout" and f.exc_type not in secondary), failures[0])
    # A rank's own failure (a bad sink, a disk full) explains itself, and the ranks stopped after it only waited
    # for it; when the first failure merely reports a peer, what the stopped ranks were doing is the clue.
    own_failure = root.exc_type not in ("Timeout", "Died", *secondary)
    stopped = [] if own_failure else [f for f in failures if f.exc_type == "Timeout" and f is not root]
    message = root.error
    if stopped and not message.startswith(f"rank {root.rank}"):
        message = f"{labels[root.rank]} (rank {root.rank}) failed first: {message}"
    for f in stopped:
        doing = f"its last step: {f.activity}" if f.activity else "it had logged nothing yet"
        message += f"; {labels[f.rank]} (rank {f.rank}) was still running ({doing}) and was stopped"
    if root.exc_type in ("Timeout", "Died") and root.activity:
        # No exception to say why: its last step is the best clue (a rank OOM-killed while loading, say).
        message += f" (its last step: {root.activity})"
    if stopped and stopped_hint:
        message += f"; {stopped_hint}"
    return message


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies; a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:
        # The parent died before the request took effect.
        os._exit(1)


def prestart(preload: Sequence[str] = ()) -> None:
    """Start the fork server now, importing torch and ``preload`` in the background while the caller goes on
    (composing a config, checking a checkpoint's headers); :func:`run_ranks` then forks from it at once.

    Only the first start's ``preload`` counts; a module left out is imported by each rank that needs it.
    """
    if START_METHOD != "forkserver":
        return
    ctx = mp.get_context(START_METHOD)
    ctx.set_forkserver_preload([*BASE_PRELOAD, *preload])
    # Asynchronous: the server imports its preload while this process continues; the first fork waits for it.
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _adopt_launcher_state(env: dict[str, str], cwd: str) -> None:
    """The launcher's environment and directory as of this launch: a forked rank would otherwise see the fork
    server's, fixed when it started (a test's monkeypatched variable, an env-var knob set since)."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    if os.getcwd() != cwd:
        os.chdir(cwd)


def _watch_lifeline(lifeline: Any) -> None:
    """SIGKILL this rank once the launcher is gone: the launcher holds the only write end of ``lifeline`` and never
    writes, so a read returns only when it has closed, by exiting or dying."""

    def watch() -> None:
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="launcher-lifeline", daemon=True).start()


def _child(
    fn: Callable[..., Any],
    rank: int,
    args: tuple,
    results: Any,
    lifeline: Any,
    env: dict[str, str],
    cwd: str,
    start: tuple[Any, Any] | None,
    activity: Any,
) -> None:
    global _activity
    _die_with_parent()
    _watch_lifeline(lifeline)
    _activity = (activity, rank)
    try:
        _adopt_launcher_state(env, cwd)
        if start is not None:
            # Unpickling ``fn`` imported its module: start-up is over. Wait for every peer's, then run together.
            ready, go = start
            ready.put(rank)
            go.wait()
    except BaseException as e:
        outcome = _failed(rank, e)
    else:
        outcome = outcome_of(fn, rank, *args)
    results.put(outcome)
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is delivered; skip interpreter teardown, which takes seconds with torch loaded.
    os._exit(0)


def outcome_of(fn: Callable[..., Any], rank: int, *args: Any) -> RankOutcome:
    """Run ``fn(rank, *args)`` as a rank and say how it ended: its value (checked to pickle, so that a value that
    cannot travel fails here, with a traceback), or its failure as one line with its traceback."""
    try:
        value = fn(rank, *args)
        pickle.dumps(value)
    except BaseException as e:
        return _failed(rank, e)
    return RankOutcome(rank, True, value)


def _failed(rank: int, e: BaseException) -> RankOutcome:
    try:
        exc: BaseException | None = pickle.loads(pickle.dumps(e))
    except Exception:
        exc = None
    message = str(e) if isinstance(e, RefitError) else one_line(e, with_type=True)
    return RankOutcome(rank, False, error=message, exc_type=type(e).__name__, traceback=traceback.format_exc(), exc=exc)


class DeferredSignals:
    """SIGINT and SIGTERM while the supervisor runs: noted by the handler and raised as
    :class:`~refit_app.common.errors.Interrupted` at the supervisor loop's next :meth:`check` (within 0.1 s), never from
    inside a queue's, a lock's or a join's code, where an exception raised by a signal can leave a lock taken and the
    clean-up that follows blocked on it. Only in the main thread (the only one Python delivers signals to)."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for s in self._SIGNALS:
                self._previous[s] = signal.signal(s, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum

    def check(self) -> None:
        """Raise Interrupted if a signal has come."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    def restore(self) -> None:
        """Put the previous handlers back (a signal noted and not raised yet stays for :meth:`check`)."""
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float | None = None,
    grace_s: float | None = None,
    name: str = "rank",
    preload: Sequence[str] = (),
    startup_s: float | None = None,
) -> list[RankOutcome]:
    """Run ``fn(rank, *args)`` for ranks ``0..world_size-1``, each in its own process; outcomes in rank order.

    ``fn`` must be a module-level function (it is pickled by reference) and its return value must pickle.
    ``preload``: modules the fork server imports once for every rank (see :func:`prestart`).
    ``timeout_s``: every rank still running then is killed. ``grace_s``: after the first failure, how long the
    others may take to exit with their own errors before they are killed (None: until ``timeout_s``).
    ``startup_s``: start the ranks together: ``fn`` runs nowhere until every rank has started up (imports done),
    and ``timeout_s`` counts from then, so a deadline inside ``fn`` never includes a peer's start-up on a loaded
    machine. A rank that has not started within ``startup_s`` fails every rank, and nothing runs.
    """
    # fn's module, unless it is the launcher's __main__: each rank re-runs that as __mp_main__ anyway, and
    # finding it preloaded under its own name makes runpy warn.
    prestart((*preload, fn.__module__) if fn.__module__ != "__main__" else preload)
    ctx = mp.get_context(START_METHOD)
    results = ctx.Queue()
    lifeline, lifeline_writer = ctx.Pipe(duplex=False)
    launcher_state = (dict(os.environ), os.getcwd())
    start = None if startup_s is None else (ctx.Queue(), ctx.Event())
    activity = ctx.Array(ctypes.c_char, world_size * _ACTIVITY_SLOT, lock=False)
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, tuple(args), results, lifeline, *launcher_state, start, activity),
            name=f"{name}{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    signals = DeferredSignals()
    outcomes: dict[int, RankOutcome] = {}
    cause = ""
    try:
        if start is not None:
            outcomes.update(_start_together(procs, start, startup_s, signals))
        cause = _supervise(procs, results, outcomes, signals, timeout_s, grace_s)
    finally:
        _reap(procs, outcomes)
        results.close()
        lifeline.close()
        lifeline_writer.close()  # any rank still alive now kills itself
        signals.restore()
    signals.check()  # a signal that came during the clean-up
    for r in range(world_size):
        outcomes.setdefault(r, RankOutcome(r, False, error=f"rank {r} {cause or 'was killed'}", exc_type="Timeout"))
        if not outcomes[r].ok:
            outcomes[r].activity = _read_activity(activity, r)
    return [outcomes[r] for r in range(world_size)]


def _supervise(
    procs: list[Any],
    results: Any,
    outcomes: dict[int, RankOutcome],
    signals: DeferredSignals,
    timeout_s: float | None,
    grace_s: float | None,
) -> str:
    """Collect the ranks' outcomes into ``outcomes`` until every rank has one, or the deadline or the grace after
    the first failure has passed: then the reason the ranks still running are killed ("" when none is)."""
    first_failure: tuple[float, int] | None = None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while len(outcomes) < len(procs):
        signals.check()
        try:
            outcome = results.get(timeout=0.1)
        except queue.Empty:
            outcome = None
        if outcome is not None:
            outcomes[outcome.rank] = outcome
            if not outcome.ok:
                outcome.failed_at = time.monotonic()
                first_failure = first_failure or (outcome.failed_at, outcome.rank)
            continue
        silent_dead = [r for r, p in enumerate(procs) if r not in outcomes and not p.is_alive()]
        if silent_dead:
            _drain(results, outcomes, timeout=0.5)  # a result may still be in the pipe
            for r in silent_dead:
                if r not in outcomes:
                    outcomes[r] = RankOutcome(
                        r,
                        False,
                        error=f"rank {r} died (exit code {procs[r].exitcode})",
                        exc_type="Died",
                        failed_at=time.monotonic(),
                    )
                    first_failure = first_failure or (time.monotonic(), r)
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return f"did not finish within {timeout_s:g}s; killed"
        if first_failure is not None and grace_s is not None and now - first_failure[0] >= grace_s:
            return f"did not exit within {grace_s:g}s after rank {first_failure[1]} failed; killed"
    return ""


def _reap(procs: list[Any], outcomes: dict[int, RankOutcome]) -> None:
    """Every rank's process gone: one that has reported gets a moment to exit, the others are killed."""
    for r, p in enumerate(procs):
        if p.is_alive():
            if r in outcomes:
                p.join(_JOIN_S)
            if p.is_alive():
                p.kill()
        p.join(_JOIN_S)


def _start_together(
    procs: list[Any], start: tuple[Any, Any], startup_s: float, signals: DeferredSignals
) -> dict[int, RankOutcome]:
    """Wait until every rank has started up, then let all run; if one dies or hangs starting, nothing runs and
    every rank gets a failure saying why."""
    ready_queue, go = start
    ready: set[int] = set()
    deadline = time.monotonic() + startup_s
    while len(ready) < len(procs) and time.monotonic() < deadline:
        signals.check()
        try:
            ready.add(ready_queue.get(timeout=0.1))
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
            failed[r] = RankOutcome(
                r, False, error=f"rank {r} started, but a peer did not; stopped", exc_type="Stopped"
            )
        elif not p.is_alive():
            failed[r] = RankOutcome(
                r, False, error=f"rank {r} died during start-up (exit code {p.exitcode})", exc_type="Died"
            )
        else:
            failed[r] = RankOutcome(
                r, False, error=f"rank {r} did not start within {startup_s:g}s; killed", exc_type="Timeout"
            )
    return failed


def _drain(results: Any, outcomes: dict[int, RankOutcome], timeout: float) -> None:
    try:
        while True:
            outcome = results.get(timeout=timeout)
            outcome.failed_at = None if outcome.ok else time.monotonic()
            outcomes[outcome.rank] = outcome
    except queue.Empty:
        return
