"""Waiting on actor calls from the driver, always with a deadline.

A ``ray.get`` without a timeout hangs for good when the actor that should answer is gone or stuck (NeMo-RL's design
notes record it), so every wait here has one: :func:`wait_calls` collects what every call returned or raised, reports
an actor that died or did not answer in time as a failure of its own, and never kills anything (the actors are the
caller's). Once one call has failed, the others get ``grace_s`` to end with their own errors, which name the
cause (a refit group fails every rank within its ``timeout_s`` when one rank is lost).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from refit_app.common.errors import PeerError, RefitError, one_line

POLL_S = 0.2
"""How often a wait looks at the signals (``check``) while nothing has answered."""
TIMEOUT = "Timeout"
""":attr:`CallOutcome.exc_type` of a call that had not answered by its deadline."""
DIED = "Died"
""":attr:`CallOutcome.exc_type` of a call whose actor died (or could not be reached) before it answered."""


@dataclass
class CallOutcome:
    """How one actor call ended: what it returned, or why it failed."""

    label: str
    """Whose call it was ("producer", "consumer 2"): every message names it."""
    ok: bool
    value: Any = None
    """What the call returned, where ``ok``."""
    error: str = ""
    """The failure in one line: a :class:`RefitError`'s own message, else the exception's type and message."""
    exc_type: str = ""
    """The exception's class name; :data:`DIED` or :data:`TIMEOUT` where there was none to carry."""
    exc: BaseException | None = None
    """The actor's exception itself, where Ray could carry it back."""
    failed_at: float | None = None
    """When the driver learned of the failure (``time.monotonic()``): which call failed first."""

    def __str__(self) -> str:
        return f"{self.label}: ok" if self.ok else f"{self.label}: {self.error}"


class RayCallError(RefitError):
    """Actor calls failed; the message is the failure that caused the others, ``outcomes`` has every call's."""

    def __init__(self, message: str, outcomes: Sequence[CallOutcome] = ()) -> None:
        super().__init__(message)
        self.outcomes = list(outcomes)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.outcomes))


def wait_calls(
    refs: Sequence[ray.ObjectRef],
    labels: Sequence[str],
    timeout_s: float,
    *,
    grace_s: float | None = None,
    check: Callable[[], None] | None = None,
) -> list[CallOutcome]:
    """Wait for every call in ``refs`` (launched already, all of them, so that none waits on a peer not yet asked)
    for at most ``timeout_s``; outcomes in the order of ``refs``.

    ``grace_s``: after the first failure, how long the other calls may take to end before they count as not
    answering. ``check``: called between polls, to raise on a signal the driver deferred.
    """
    if len(refs) != len(labels):
        raise ValueError(f"{len(refs)} calls but {len(labels)} labels")
    outcomes: list[CallOutcome | None] = [None] * len(refs)
    pending = {ref: i for i, ref in enumerate(refs)}
    deadline = time.monotonic() + timeout_s
    first_failure: float | None = None
    while pending:
        if check is not None:
            check()
        now = time.monotonic()
        limit = deadline if first_failure is None or grace_s is None else min(deadline, first_failure + grace_s)
        if now >= limit:
            break
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=min(POLL_S, limit - now))
        for ref in ready:
            i = pending.pop(ref)
            outcome = ended_call(ref, labels[i])
            if not outcome.ok:
                outcome.failed_at = time.monotonic()
                first_failure = first_failure or outcome.failed_at
            outcomes[i] = outcome
    for i in pending.values():
        waited = "" if first_failure is None else f" (after a peer failed, it had {grace_s:g}s more)"
        outcomes[i] = CallOutcome(
            labels[i], False, error=f"{labels[i]} did not answer within {timeout_s:g}s{waited}", exc_type=TIMEOUT
        )
    return [o for o in outcomes if o is not None]


def ended_call(ref: ray.ObjectRef, label: str) -> CallOutcome:
    """The outcome of a call that has ended (``ray.wait`` says it is ready)."""
    try:
        return CallOutcome(label, True, ray.get(ref, timeout=0))
    except RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else e
        message = str(cause) if isinstance(cause, RefitError) else one_line(cause, with_type=True)
        return CallOutcome(label, False, error=message, exc_type=type(cause).__name__, exc=cause)
    except RayActorError as e:
        return CallOutcome(label, False, error=f"{label}'s actor died ({_actor_death(e)})", exc_type=DIED, exc=e)
    except GetTimeoutError:  # ray.wait said it was ready; a lost object on a dead node can still say otherwise
        return CallOutcome(label, False, error=f"{label}'s result could not be fetched", exc_type=DIED)
    except RayError as e:
        return CallOutcome(label, False, error=one_line(e, with_type=True), exc_type=type(e).__name__, exc=e)


def _actor_death(e: RayActorError) -> str:
    """Ray's account of a dead actor in a few words: its first sentence, and the exit detail where it gives one."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    detail = next((line for line in lines if line.startswith(("Worker exit detail", "The actor is dead because"))), "")
    first = lines[0] if lines else type(e).__name__
    return one_line(f"{first} {detail}".strip())


def root_failure(outcomes: Sequence[CallOutcome]) -> str:
    """One line for failed calls: the failure that caused the others. That is the first one the driver learned of
    that is the actor's own (not a peer's failure reported, not a call that only did not answer), else the first
    one; the line names whose it was."""
    failures = sorted((o for o in outcomes if not o.ok), key=lambda o: o.failed_at or float("inf"))
    if not failures:
        return ""
    secondary = (PeerError.__name__, TIMEOUT)
    root = next((f for f in failures if f.exc_type not in secondary), failures[0])
    return root.error if root.error.startswith(root.label) else f"{root.label}: {root.error}"


def raise_on_failure(outcomes: Sequence[CallOutcome], what: str) -> list[Any]:
    """The calls' values, or :class:`RayCallError` naming ``what`` failed and why."""
    if all(o.ok for o in outcomes):
        return [o.value for o in outcomes]
    raise RayCallError(f"{what} failed: {root_failure(outcomes)}", outcomes)
