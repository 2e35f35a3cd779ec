"""A refit group over Ray actors the caller already has, driven from the Ray driver.

::

    group = RayRefitGroup.connect(trainer, [engine1, engine2], consumer_options={"verify": True})
    for step in range(steps):
        ray.get(trainer.train_step.remote(), timeout=600)
        group.refit(lambda t: t.model.named_parameters(), load="load_weights")
    group.close()

How it forms, with no deadlock and no wait without a deadline::

    driver                                    producer actor              consumer actors
    node_address (timeout_s)  --------------> its node's IP, a free port
    join(rank 0) + join(rank k), all launched -> connect + session  <-->   connect + session
    wait for all (timeout_s + margin)
    refit: send + every receive launched ---> session.send         ===>  session.receive(load)
    wait for all (call_timeout_s)
    close: leave on all, launched together --> end of session     --->   receive() -> None, leave

Every call is launched on every actor before any is waited on: the producer's ``connect`` blocks until each
consumer has checked in, so a driver that waited for it first would wait for ever. The group is the same
:func:`refit_app.transport.groups.connect` group as every other role's (a token of its own unless given, the
rendezvous checks, the deadlines), so one rank's failure ends every rank within ``timeout_s``; the driver then
reports the failure that caused the others.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

from refit_app.integrations.ray import member
from refit_app.integrations.ray.calls import raise_on_failure, wait_calls
from refit_app.protocol.session import Round
from refit_app.transport.auth import new_run_id, new_secret
from refit_app.transport.spec import DEFAULT_TIMEOUT_S, GroupSpec

logger = logging.getLogger(__name__)

DEFAULT_CALL_TIMEOUT_S = 600.0
"""How long the driver waits for one refit on every actor: a whole round of a large model may take longer than
the group's ``timeout_s`` (which bounds each step inside it), while a lost rank ends the round far sooner."""
MARGIN_S = 30.0
"""Added to ``timeout_s`` for a wait on calls bounded by it inside the actors: the actors' own deadlines end
them first, with their own errors, which say more than "did not answer"."""


class RayRefitGroup:
    """A producer actor and consumer actors joined in one refit group; made by :meth:`connect`.

    Refits go through :meth:`refit` (the driver asks every actor at once) or through the actors' own methods
    (:func:`refit_app.integrations.ray.member.session` inside the actor gives its session); :meth:`close` (or
    ``with``) ends the session on every actor and leaves the group, and never kills an actor.
    """

    def __init__(
        self, name: str, producer: Any, consumers: Sequence[Any], spec: GroupSpec, call_timeout_s: float
    ) -> None:
        self.name = name
        self.producer = producer
        self.consumers = list(consumers)
        self.spec = spec
        """The group's settings (rank 0's); the token is not shown."""
        self.call_timeout_s = call_timeout_s
        self.labels = ["producer"] + [f"consumer {k}" for k in range(1, len(self.consumers) + 1)]
        self._closed = False

    @property
    def actors(self) -> list[Any]:
        return [self.producer, *self.consumers]

    @classmethod
    def connect(
        cls,
        producer: Any,
        consumers: Sequence[Any],
        *,
        name: str = "refit",
        backend: str = "auto",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        topology: str = "tree",
        token: str | None = None,
        producer_options: dict[str, Any] | None = None,
        consumer_options: dict[str, Any] | None = None,
    ) -> RayRefitGroup:
        """Join ``producer`` (rank 0) and ``consumers`` (ranks 1..N, in order) in a refit group named ``name``.

        The producer's actor gives its node's IP address and a free port; every actor then connects there at once.
        ``backend``, ``timeout_s``, ``topology``: as in :class:`~refit_app.transport.spec.GroupSpec`. ``token``:
        the group's secret; None makes one for this group (it reaches the actors as a call argument).
        ``producer_options`` / ``consumer_options``: keyword arguments of
        :class:`~refit_app.protocol.session.ProducerSession` (``buffer_size_bytes``, ``num_buffers``, ``delta``)
        and of :class:`~refit_app.protocol.session.ConsumerSession` (``verify``, ``num_buffers``). Raises
        :class:`~refit_app.integrations.ray.calls.RayCallError` naming the actor that failed and why.
        """
        if not consumers:
            raise ValueError("a refit group needs at least one consumer actor")
        labels = ["producer"] + [f"consumer {k}" for k in range(1, len(consumers) + 1)]
        # The first call to an actor waits for it to start (its process, its imports: over 60 s on two busy cores),
        # so it has the calls' deadline, not the group's.
        (address,) = raise_on_failure(
            wait_calls([producer.__ray_call__.remote(member.node_address)], labels[:1], call_timeout_s),
            "asking the producer's actor for its address",
        )
        host, port = address
        spec = GroupSpec(
            backend=backend,
            host=host,
            port=port,
            world_size=1 + len(consumers),
            rank=0,
            timeout_s=timeout_s,
            topology=topology,
            token=token or new_secret(),
            run_id=new_run_id(),
        )
        calls = [
            actor.__ray_call__.remote(
                member.join,
                name,
                replace(spec, rank=rank),
                (producer_options if rank == 0 else consumer_options) or {},
            )
            for rank, actor in enumerate([producer, *consumers])
        ]
        raise_on_failure(
            wait_calls(calls, labels, timeout_s + MARGIN_S, grace_s=timeout_s + MARGIN_S),
            f"forming the refit group {name!r} at {spec.address}",
        )
        logger.info("refit group %r formed at %s: 1 producer, %d consumers", name, spec.address, len(consumers))
        return cls(name, producer, consumers, spec, call_timeout_s)

    def refit(
        self,
        tensors: member.TensorsFn,
        load: member.LoadFn,
        *,
        send_options: dict[str, Any] | None = None,
    ) -> list[Round]:
        """One refit: the producer sends what ``tensors`` gives (a function of the actor instance, or the name of
        one of its methods), each consumer hands every batch to ``load`` (a function of the actor instance and the
        batch, or a method's name). Returns each rank's :class:`~refit_app.protocol.session.Round`, the producer's
        first; raises :class:`~refit_app.integrations.ray.calls.RayCallError` if any rank failed (the group is
        then broken: :meth:`close` it)."""
        if self._closed:
            raise RuntimeError("refit() after close()")
        calls = [self.producer.__ray_call__.remote(member.send, self.name, tensors, send_options or {})]
        calls += [c.__ray_call__.remote(member.receive, self.name, load) for c in self.consumers]
        outcomes = wait_calls(calls, self.labels, self.call_timeout_s, grace_s=self.spec.timeout_s + MARGIN_S)
        return raise_on_failure(outcomes, f"refit in group {self.name!r}")

    def close(self) -> None:
        """End the session on every actor and leave the group, all at once; safe to call twice. Raises
        :class:`~refit_app.integrations.ray.calls.RayCallError` where an actor could not leave cleanly."""
        if self._closed:
            return
        self._closed = True
        calls = [actor.__ray_call__.remote(member.leave, self.name) for actor in self.actors]
        timeout = self.spec.timeout_s + MARGIN_S
        raise_on_failure(wait_calls(calls, self.labels, timeout, grace_s=timeout), f"leaving group {self.name!r}")

    def __enter__(self) -> RayRefitGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # the error that brought us here says more
            logger.warning("refit group %r: %s", self.name, e)


__all__ = ["DEFAULT_CALL_TIMEOUT_S", "RayRefitGroup"]
