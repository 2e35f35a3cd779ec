"""The driver's side of actors that Ray restarts, for :class:`~refit_app.integrations.ray.group.RayRefitGroup` and
``role=ray`` alike: which lost actors are being asked back, how often each rank was, and which have answered.

A call sent to an actor while Ray restarts it fails at once ("temporarily unavailable"), and the actor then looked
gone for good although it came back moments later. So a lost actor is asked back with a call that Ray retries
until the actor is back, or has died for good (``max_task_retries=-1``); that call's end is the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from refit_app.integrations.ray.calls import CallOutcome, ended_call


class ActorRestarts:
    """Lost actors by rank, each with the call that answers once Ray has it back, and how often each rank was
    asked back: up to ``max_restarts`` times (None: as often as Ray restarts it)."""

    def __init__(self, labels: Sequence[str], max_restarts: int | None = None) -> None:
        self.labels = list(labels)
        """Whose actor each rank's is ("consumer 2"): the outcomes name it."""
        self.max_restarts = max_restarts
        self.counts = [0] * len(self.labels)
        """How often each rank was asked back."""
        self._asked: dict[int, ray.ObjectRef] = {}

    @property
    def ranks(self) -> list[int]:
        """The ranks asked back whose actors have not answered yet."""
        return sorted(self._asked)

    @property
    def refs(self) -> list[ray.ObjectRef]:
        """Their calls, for a caller's own ``ray.wait`` beside other calls."""
        return list(self._asked.values())

    def ask_back(self, rank: int, method: Any, *args: Any) -> bool:
        """Call ``method`` (a remote method of ``rank``'s actor: ``actor.start``, ``actor.__ray_call__``) with
        ``args`` once Ray has the actor back; False, asking nothing, where the rank's ``max_restarts`` are spent."""
        if self.max_restarts is not None and self.counts[rank] >= self.max_restarts:
            return False
        self.counts[rank] += 1
        self._asked[rank] = method.options(max_task_retries=-1).remote(*args)
        return True

    def answered(self, wait_s: float = 0.0) -> list[tuple[int, CallOutcome]]:
        """The ranks whose actors answered (back, or Ray gave up on them), each with its call's outcome, waiting up
        to ``wait_s`` for every one asked back; they are no longer asked about."""
        if not self._asked:
            return []
        refs = list(self._asked.values())
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=wait_s)[0])
        done = [rank for rank, ref in self._asked.items() if ref in ready]
        return [(rank, ended_call(self._asked.pop(rank), self.labels[rank])) for rank in sorted(done)]

    def forget(self) -> list[int]:
        """Stop asking about every actor not back yet (the run or the group is over); their ranks."""
        ranks = self.ranks
        self._asked.clear()
        return ranks


__all__ = ["ActorRestarts"]
