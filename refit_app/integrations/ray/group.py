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

With ``on_consumer_loss="continue"`` the actors run elastic sessions (:mod:`refit_app.protocol.elastic`) instead:
a consumer lost in a refit (its actor died, or Ray killed it) is left out of that refit's result, which the others
complete; the driver asks the lost actor at once whether it is back. An actor Ray restarted (``max_restarts``; or
``ray.kill(actor, no_restart=False)``) is a fresh process that holds no group: it is asked to join again, with its
rank, the run's id and token, and takes part in the round its producer sends again, if it asks in time, else from
the next refit; its first round is dense. A lost actor that is alive and still holds its failed session, or one
that died for good, stays out::

    refit k:  send + receives           consumer 2's actor dies mid-round
              status(2)                 retried by Ray until the actor is back (or gone for good)
              status(2) says ABSENT  -> join(2); the producer, waiting for the members to ask again, admits it
              join(2) returns        -> receive(2) with refit k's load: round k again, dense, with consumers 1, 2, 3
    (a restart slower than the producer's wait: round k without consumer 2, which is admitted at refit k+1)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

import ray

from refit_app.integrations.ray import member
from refit_app.integrations.ray.calls import (
    POLL_S,
    CallOutcome,
    RayCallError,
    ended_call,
    raise_on_failure,
    wait_calls,
)
from refit_app.integrations.ray.restarts import ActorRestarts
from refit_app.protocol.session import Round
from refit_app.transport.auth import new_run_id, new_secret
from refit_app.transport.elastic import answer_wait_s, check_elastic
from refit_app.transport.spec import DEFAULT_ON_CONSUMER_LOSS, DEFAULT_TIMEOUT_S, ON_CONSUMER_LOSS, GroupSpec

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
        self,
        name: str,
        producer: Any,
        consumers: Sequence[Any],
        spec: GroupSpec,
        call_timeout_s: float,
        *,
        elastic: bool = False,
        consumer_options: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.producer = producer
        self.consumers = list(consumers)
        self.spec = spec
        """The group's settings (rank 0's); the token is not shown."""
        self.call_timeout_s = call_timeout_s
        self.labels = ["producer"] + [f"consumer {k}" for k in range(1, len(self.consumers) + 1)]
        self.elastic = elastic
        """``on_consumer_loss="continue"``: a lost consumer is left out and may come back."""
        self.members = list(range(1, len(self.consumers) + 1))
        """The consumer ranks in the session now (all of them, unless the group is elastic and lost some)."""
        self._consumer_options = consumer_options or {}
        self._lost = ActorRestarts(self.labels)
        """Elastic: lost consumer ranks, each asked for its status once its actor is back (Ray decides how often)."""
        self._joining: dict[int, tuple[ray.ObjectRef, ray.ObjectRef | None]] = {}
        """Elastic: ranks asked to join again: their join call and the receive queued behind it on the actor."""
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
        on_consumer_loss: str = DEFAULT_ON_CONSUMER_LOSS,
    ) -> RayRefitGroup:
        """Join ``producer`` (rank 0) and ``consumers`` (ranks 1..N, in order) in a refit group named ``name``.

        The producer's actor gives its node's IP address and a free port; every actor then connects there at once.
        ``backend``, ``timeout_s``, ``topology``: as in :class:`~refit_app.transport.spec.GroupSpec`. ``token``:
        the group's secret; None makes one for this group (it reaches the actors as a call argument).
        ``producer_options`` / ``consumer_options``: keyword arguments of
        :class:`~refit_app.protocol.session.ProducerSession` (``buffer_size_bytes``, ``num_buffers``, ``delta``)
        and of :class:`~refit_app.protocol.session.ConsumerSession` (``verify``, ``num_buffers``).
        ``on_consumer_loss``: ``"fail"``, any rank's failure fails the refit on every rank; ``"continue"``, elastic
        sessions (gloo and ``topology="tree"`` only): consumers lost in a refit are left out of it, and actors Ray
        restarts join again (see the module's docstring). Raises
        :class:`~refit_app.integrations.ray.calls.RayCallError` naming the actor that failed and why (with
        ``"continue"``, only where the producer or every consumer failed).
        """
        if not consumers:
            raise ValueError("a refit group needs at least one consumer actor")
        if on_consumer_loss not in ON_CONSUMER_LOSS:
            raise ValueError(f"on_consumer_loss={on_consumer_loss!r}: choose one of {', '.join(ON_CONSUMER_LOSS)}")
        elastic = on_consumer_loss == "continue"
        labels = ["producer"] + [f"consumer {k}" for k in range(1, len(consumers) + 1)]
        # The first call to an actor waits for it to start (its process, and refit_app's and torch's imports: over
        # 60 s on two busy cores), so it has the calls' deadline, not the group's: every actor is ready before the
        # group's deadlines start (the producer's wait for its consumers would otherwise count their start-up).
        calls = [producer.__ray_call__.remote(member.node_address)]
        calls += [c.__ray_call__.remote(member.status, name) for c in consumers]
        address, *_ = raise_on_failure(
            wait_calls(calls, labels, call_timeout_s), "asking the actors whether they are ready"
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
        if elastic:
            check_elastic(spec)
        calls = [
            actor.__ray_call__.remote(
                member.join,
                name,
                replace(spec, rank=rank),
                (producer_options if rank == 0 else consumer_options) or {},
                elastic,
            )
            for rank, actor in enumerate([producer, *consumers])
        ]
        # An elastic consumer waits for the producer's answer up to answer_wait_s.
        wait_s = (answer_wait_s(timeout_s) if elastic else timeout_s) + MARGIN_S
        outcomes = wait_calls(calls, labels, wait_s, grace_s=wait_s)
        what = f"forming the refit group {name!r} at {spec.address}"
        group = cls(name, producer, consumers, spec, call_timeout_s, elastic=elastic, consumer_options=consumer_options)
        if not elastic or not outcomes[0].ok or not any(o.ok for o in outcomes[1:]):
            raise_on_failure(outcomes, what)
        for rank, outcome in enumerate(outcomes[1:], start=1):
            if not outcome.ok:
                group._lose(rank, outcome)
        logger.info("refit group %r formed at %s: 1 producer, consumers %s", name, spec.address, group.members)
        return group

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
        then broken: :meth:`close` it). Elastic (``on_consumer_loss="continue"``): a consumer that took no part
        in the refit has None in its place, and only the producer's failure raises; the producer's round says who
        took part (:attr:`~refit_app.protocol.rounds.Round.members`)."""
        if self._closed:
            raise RuntimeError("refit() after close()")
        what = f"refit in group {self.name!r}"
        if not self.elastic:
            calls = [self.producer.__ray_call__.remote(member.send, self.name, tensors, send_options or {})]
            calls += [c.__ray_call__.remote(member.receive, self.name, load) for c in self.consumers]
            outcomes = wait_calls(calls, self.labels, self.call_timeout_s, grace_s=self.spec.timeout_s + MARGIN_S)
            return raise_on_failure(outcomes, what)
        return self._elastic_refit(tensors, load, send_options or {}, what)

    # -- elastic groups ---------------------------------------------------------------------------------------------

    def _elastic_refit(
        self, tensors: member.TensorsFn, load: member.LoadFn, send_options: dict[str, Any], what: str
    ) -> list[Round | None]:
        self._take_back(load)
        send = self.producer.__ray_call__.remote(
            member.send, self.name, tensors, send_options, list(self._joining), self.spec.timeout_s
        )
        receives = {r: self._actor(r).__ray_call__.remote(member.receive, self.name, load) for r in self.members}
        results: list[Round | None] = [None] * (len(self.consumers) + 1)
        # While the producer sends, a consumer lost now is asked about at once: an actor Ray restarts in time asks
        # to join while the producer waits (up to timeout_s) for the survivors to ask again, and takes part in the
        # round the producer sends again. A consumer that fails or stalls never holds the refit beyond the
        # producer's own deadlines: once its send has returned, only the round's members are waited for.
        deadline = time.monotonic() + self.call_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.members = []
                raise RayCallError(f"{what} failed: the producer did not answer within {self.call_timeout_s:g}s")
            ready, _ = ray.wait([send, *receives.values()], num_returns=1, timeout=min(POLL_S, left))
            for rank in [r for r, ref in receives.items() if ref in ready]:
                self._settle(rank, ended_call(receives.pop(rank), self.labels[rank]), results)
            self._take_back(load)
            if send in ready:
                break
        sent_outcome = ended_call(send, self.labels[0])
        if not sent_outcome.ok:
            self.members = []
            raise RayCallError(f"{what} failed: {sent_outcome}", [sent_outcome])
        sent: Round = sent_outcome.value
        results[0] = sent
        took_part = set(sent.members or [])
        # The round's members completed it: their receives end within moments. Any other call still running is a
        # consumer that stalled or was cut out of the round: it is left out.
        waited = [r for r in receives if r in took_part]
        outcomes = wait_calls([receives[r] for r in waited], [self.labels[r] for r in waited], self.spec.timeout_s)
        for rank, outcome in zip(waited, outcomes):
            self._settle(rank, outcome, results)
        for rank in [r for r in receives if r not in took_part]:
            self._lose(rank, CallOutcome(self.labels[rank], False, error="took no part in the round (stalled?)"))
        for rank in [r for r in self._joining if r in took_part]:
            # It took part: it was admitted, and its receive launched (it received the round).
            _, receive = self._joining.pop(rank)
            assert receive is not None
            label = self.labels[rank]
            (received,) = wait_calls([receive], [label], self.spec.timeout_s + MARGIN_S)
            if received.ok:
                results[rank] = received.value
                self.members.append(rank)
                logger.info("refit group %r: %s is back from round %d", self.name, label, sent.round)
            else:
                self._lose(rank, received)
        self.members.sort()
        return results

    def _settle(self, rank: int, outcome: CallOutcome, results: list[Round | None]) -> None:
        """A member's receive ended: its round, or it is lost."""
        if outcome.ok:
            results[rank] = outcome.value
        else:
            self._lose(rank, outcome)

    def await_restarts(self, timeout_s: float) -> list[int]:
        """Wait up to ``timeout_s`` until every lost consumer's actor is back (Ray restarted it) or known gone; the
        ranks that join at the next :meth:`refit`. For a loop that would rather wait for an engine it knows is
        restarting than refit without it; :meth:`refit` itself never waits for a restart."""
        self._take_back(wait_s=timeout_s)
        return sorted(self._joining)

    def _actor(self, rank: int) -> Any:
        return self.actors[rank]

    def _lose(self, rank: int, outcome: CallOutcome) -> None:
        """Leave consumer ``rank`` out, and ask its actor (once Ray has it back, if it restarts it) for its status."""
        logger.warning("refit group %r: %s left out (%s)", self.name, self.labels[rank], outcome.error)
        if rank in self.members:
            self.members.remove(rank)
        self._lost.ask_back(rank, self._actor(rank).__ray_call__, member.status, self.name)

    def _take_back(self, load: member.LoadFn | None = None, *, wait_s: float = 0.0) -> None:
        """Ask every lost actor that has answered its status call (waiting up to ``wait_s`` for them), and has no
        group (a restarted one), to join; with ``load`` (inside a refit), launch the receive of each one the producer
        has admitted since: its first round is this refit's, so it gets this refit's ``load``, never an earlier
        one's. An actor still restarting, or busy, is looked at again at the next call."""
        for rank, answer in self._lost.answered(wait_s):
            if not answer.ok or answer.value != member.ABSENT:
                why = answer.error if not answer.ok else "its actor still holds its failed session"
                logger.warning("refit group %r: %s stays out (%s)", self.name, self.labels[rank], why)
                continue
            spec = replace(self.spec, rank=rank)
            join = self._actor(rank).__ray_call__.remote(member.join, self.name, spec, self._consumer_options, True)
            self._joining[rank] = (join, None)
        for rank, (join, receive) in list(self._joining.items()):
            if receive is not None or not ray.wait([join], timeout=0)[0]:
                continue  # receiving already, or not admitted yet (the producer admits at a round boundary)
            answer = ended_call(join, self.labels[rank])
            if not answer.ok:
                del self._joining[rank]  # it could not join (say, no answer in time): ask again after its status
                self._lose(rank, answer)
            elif load is not None:
                self._joining[rank] = (join, self._actor(rank).__ray_call__.remote(member.receive, self.name, load))

    def close(self) -> None:
        """End the session on every actor and leave the group, all at once; safe to call twice. Raises
        :class:`~refit_app.integrations.ray.calls.RayCallError` where an actor could not leave cleanly."""
        if self._closed:
            return
        self._closed = True
        ranks = [0, *self.members]
        calls = [self._actor(r).__ray_call__.remote(member.leave, self.name) for r in ranks]
        # A consumer out of the session may still hold a failed one (its own error, a stall that ended, a lost
        # producer), which would refuse the actor a group of this name later: it leaves too, after any join or
        # receive queued on it (an actor asked to join learns from the producer's close that the session is over).
        # A dead actor's, or a stuck one's, is not waited for past the deadline, and is no failure of the close.
        others = [r for r in range(1, len(self.consumers) + 1) if r not in self.members]
        strays = [self._actor(r).__ray_call__.remote(member.leave, self.name) for r in others]
        timeout = self.spec.timeout_s + MARGIN_S
        outcomes = wait_calls(calls, [self.labels[r] for r in ranks], timeout, grace_s=timeout)
        if strays:
            ray.wait(strays, num_returns=len(strays), timeout=self.spec.timeout_s)
        self._joining.clear()
        self._lost.forget()
        raise_on_failure(outcomes, f"leaving group {self.name!r}")

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
