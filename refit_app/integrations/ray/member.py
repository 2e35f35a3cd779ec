"""What runs inside each actor of a refit group over Ray: the functions the driver sends through ``__ray_call__``
(each gets the actor instance first), and the sessions they keep between calls.

An actor process holds its groups in a registry keyed by the group's name, so the actor class needs no attribute
or method of refit_app's, and one actor may belong to several groups. Every call here blocks the actor for its
duration (a refit is a collective: every rank is inside it at once), and everything in it has the group's
deadline (``GroupSpec.timeout_s``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from refit_app.common.errors import RefitError
from refit_app.protocol.elastic import ElasticConsumerSession, ElasticProducerSession
from refit_app.protocol.session import ConsumerSession, ProducerSession, Round
from refit_app.transport.groups import RefitGroup, connect
from refit_app.transport.spec import GroupSpec

logger = logging.getLogger(__name__)

TensorsFn = Callable[[Any], Iterable[tuple[str, Any]]] | str
"""What the producer sends: a function of the actor instance returning ``(name, tensor)`` pairs, or the name of a
method of the actor that returns them (``"named_parameters"`` on an actor that is a ``torch.nn.Module``'s holder
needs a function: ``lambda actor: actor.model.named_parameters()``)."""
LoadFn = Callable[[Any, list[tuple[str, Any]]], None] | str
"""What a consumer does with each batch of ``(name, tensor)``: a function of the actor instance and the batch, or
the name of a method of the actor taking the batch. The tensors are views of receive buffers: copy what you keep."""


Session = ProducerSession | ConsumerSession | ElasticProducerSession | ElasticConsumerSession

JOINED = "joined"
FAILED = "failed"
ABSENT = "absent"
"""What :func:`status` says: in the group, in it with a failed round behind, or not in it (never joined, left, or a
restarted actor's fresh process)."""


@dataclass
class _Member:
    group: RefitGroup | None
    """None in an elastic session, which forms a group of its own for every generation of members."""
    session: Session
    failed: bool = False
    """A round failed: the group is broken, and leaving skips the end-of-session exchange."""


_MEMBERS: dict[str, _Member] = {}
"""This process's refit groups by name."""


def node_address(actor: Any = None) -> tuple[str, int]:
    """This actor's node address as Ray knows it, and a port that is free there now: where the producer's
    rendezvous listens. (``actor`` is the instance ``__ray_call__`` passes; unused.)"""
    host = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return host, sock.getsockname()[1]


def join(actor: Any, name: str, spec: GroupSpec, options: dict[str, Any], elastic: bool = False) -> None:
    """Connect as ``spec.rank`` and open this rank's session with ``options`` (the keyword arguments of
    :class:`~refit_app.protocol.session.ProducerSession` on rank 0, of
    :class:`~refit_app.protocol.session.ConsumerSession` elsewhere). Opening a session is itself a collective, so
    every rank of the group must be inside this call at once.

    ``elastic``: an elastic session (``on_consumer_loss="continue"``) instead. The producer waits up to the
    group's ``timeout_s`` for the consumers and starts with those that came; a consumer returns once the producer
    admitted it, at its start or, joining later (an actor Ray restarted), at the next round boundary."""
    if name in _MEMBERS:
        raise RefitError(f"this actor is already in the refit group {name!r}; leave it first")
    if elastic:
        elastic_session = (ElasticProducerSession if spec.rank == 0 else ElasticConsumerSession)(spec, **options)
        if elastic_session.closed:  # a consumer that asked after the producer's last round
            raise RefitError(f"the refit group {name!r} ended before this consumer could join it")
        _MEMBERS[name] = _Member(None, elastic_session)
        return
    with contextlib.ExitStack() as on_failure:
        group = on_failure.enter_context(connect(spec))  # a failed session start closes the group, telling peers
        session = (ProducerSession if group.is_producer else ConsumerSession)(group, **options)
        on_failure.pop_all()
    _MEMBERS[name] = _Member(group, session)


def status(actor: Any, name: str) -> str:
    """Whether this actor is in the group ``name``: :data:`JOINED`, :data:`FAILED` or :data:`ABSENT`. The driver
    asks an actor that failed a round: one Ray restarted answers :data:`ABSENT` (a fresh process) and may join
    again."""
    member = _MEMBERS.get(name)
    if member is None:
        return ABSENT
    return FAILED if member.failed else JOINED


def session(name: str) -> Session:
    """This actor's session in the group ``name``, for an actor's own methods that send or receive themselves."""
    try:
        return _MEMBERS[name].session
    except KeyError:
        raise RefitError(f"this actor is not in a refit group named {name!r} (joined: {sorted(_MEMBERS)})") from None


def send(
    actor: Any,
    name: str,
    tensors: TensorsFn,
    options: dict[str, Any],
    joiners: Sequence[int] = (),
    joiners_wait_s: float = 0.0,
) -> Round:
    """The producer's side of one refit: ``ProducerSession.send`` of what ``tensors`` returns, with ``options``
    (``metas``, ``metadata``, ``extra``, ...). ``joiners`` (elastic sessions): consumer ranks whose actors were
    asked to join; the round waits up to ``joiners_wait_s`` for their requests, so that they take part in it."""
    member = _member(name)
    named = getattr(actor, tensors)() if isinstance(tensors, str) else tensors(actor)
    try:
        if joiners:
            assert isinstance(member.session, ElasticProducerSession)
            if not member.session.wait_for_joiners(joiners, joiners_wait_s):
                logger.warning(
                    "ranks %s did not ask to join within %gs; this round goes without them",
                    list(joiners),
                    joiners_wait_s,
                )
        return member.session.send(named, **options)
    except BaseException:
        member.failed = True
        raise


def receive(actor: Any, name: str, load: LoadFn) -> Round:
    """A consumer's side of one refit: ``ConsumerSession.receive`` with each batch given to ``load``."""
    member = _member(name)
    consume = getattr(actor, load) if isinstance(load, str) else (lambda batch: load(actor, batch))
    try:
        received = member.session.receive(consume)
    except BaseException:
        member.failed = True
        raise
    if received is None:
        member.failed = True
        raise RefitError("the producer ended the session while this consumer waited for a round")
    return received


def leave(actor: Any, name: str) -> None:
    """End this rank's session and leave the group; every rank must be inside this call at once (the producer
    tells the consumers that the session is over). A rank that is not in the group has nothing to do."""
    member = _MEMBERS.pop(name, None)
    if member is None:
        return
    with member.group or member.session:  # an elastic session closes itself
        if member.failed:
            return
        if isinstance(member.session, (ProducerSession, ElasticProducerSession)):
            member.session.close()
        elif member.session.receive(_no_round) is not None:
            raise RefitError("the producer sent a round while the group was closing")


def _no_round(batch: Any) -> None:
    raise RefitError("the producer sent a round while the group was closing")


def _member(name: str) -> _Member:
    member = _MEMBERS.get(name)
    if member is None:
        raise RefitError(f"this actor is not in a refit group named {name!r} (joined: {sorted(_MEMBERS)})")
    if member.failed:
        raise RefitError(f"the refit group {name!r} failed in an earlier round; leave it and join again")
    return member
