"""Sessions that go on when consumers come and go (``refit.on_consumer_loss=continue``).

:class:`ElasticProducerSession` and :class:`ElasticConsumerSession` have the session API (``send`` per step on the
trainer, ``receive`` on each engine: they satisfy :class:`~refit_app.protocol.session_api.ProducerSessionLike` and
:class:`~refit_app.protocol.session_api.ConsumerSessionLike`, forwarding to the current generation's session
explicitly) and connect themselves from a :class:`~refit_app.transport.spec.GroupSpec`:
the group changes under them, generation by generation (:mod:`refit_app.transport.elastic`). Inside a generation
each side runs a plain :class:`~refit_app.protocol.session.ProducerSession` or
:class:`~refit_app.protocol.session.ConsumerSession`; what happens between generations:

- **A consumer is lost** (it died, stalled past a deadline, or failed for a reason of its own) in round k: the
  round fails on every member, as in any session, and nobody counts it. Each survivor drops the generation's group
  and asks the producer for the next; the producer drops its own, waits up to ``group.timeout_s`` for the members
  to ask, forms the next generation from those that did, and sends round k again to them.
- **A consumer joins** (started late, or restarted with the run's id and token): the producer reads its request
  at the next round boundary, ends the generation with a header saying so, and forms the next one with it.
- **Every generation starts afresh**: a fresh manifest (each consumer's ``on_manifest`` runs again) and a dense
  round, because a survivor whose round was cut may hold some tensors of the new round and some of the old (a
  delta round against that would be wrong), and a joiner holds nothing. Delta rounds resume after it.
- **The producer is lost**: a consumer's collective or store call fails within the deadline, as in any session,
  and it stops with one line. **Every consumer is lost**: the producer stops with one line once none asked to
  go on within ``group.timeout_s``.

- **A generation does not form** (a joiner admitted to it died, stalled, or could not connect, before its group
  formed; or a member was lost in its handshake): as for a consumer lost in a round. Every member drops it and asks
  again; those that do not ask within ``group.timeout_s`` are lost, and the next generation forms from the rest.
  Where every member asked again, the failure is the new members' (the others formed a group before): they are
  dropped. A generation of members that all asked again and that still failed twice in a row drops them all. So each
  attempt loses somebody or is one of at most two, and every attempt has the group's deadline. A consumer that cannot
  open its own gloo socket says so before it asks to join, and is never admitted.

A round's :attr:`~refit_app.protocol.rounds.Round.members` lists the consumers that took part in it.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import torch

from refit_app.common.errors import HandshakeError, PeerError, RefitError, one_line
from refit_app.core.meta import TensorMeta
from refit_app.protocol.consumer_session import ConsumerSession
from refit_app.protocol.manifest import Manifest
from refit_app.protocol.producer_session import ProducerSession
from refit_app.protocol.rounds import Round
from refit_app.transport.control import Poller, ranks_text
from refit_app.transport.elastic import ConsumerMembership, FormError, ProducerMembership, abandon
from refit_app.transport.groups import RefitGroup
from refit_app.transport.spec import GroupSpec

logger = logging.getLogger(__name__)

MAX_STUCK_FORMS = 2
"""How many generations in a row may fail to form while every member asks again (nobody lost: no change explains the
failure) before the producer drops them all; bounds the retries where the fault is nobody's in particular."""

_LOST = (PeerError, HandshakeError)
"""What a round raises on the producer when a consumer was lost or refused (a PeerError: a collective broke, a gather
missed its deadline or a consumer published its failure; a HandshakeError: a consumer refused the manifest). The
producer's own failures (its source, say) are other errors, and end the session."""


S = TypeVar("S")


def release_group() -> None:
    """Free what is left of a generation's group once it is dropped: only destroying its gloo backend closes its
    sockets, and until they close a peer blocked on this rank waits out its deadline instead of failing at once (and
    then asks for the next generation too late to be in it). What still holds it after the last reference went
    (frames of the failed call, in reference cycles) goes now."""
    gc.collect()


class ProducerGenerations(Generic[S]):
    """Rank 0's side of the generations, whatever session runs inside each (a one-producer
    :class:`ProducerSession`, a sharded plan's rounds: :mod:`refit_app.protocol.sharded_elastic`): it forms each
    generation from the ranks that ask, starts its session with ``start(group, first_round)``, and decides who is
    lost. ``required`` ranks (a sharded refit's other producers, whose shards exist nowhere else) must be in every
    generation: one that does not ask within ``group.timeout_s`` ends the session with ``missing(k, ranks, cause)``.
    """

    def __init__(
        self,
        spec: GroupSpec,
        start: Callable[[RefitGroup, int], S],
        *,
        required: Sequence[int] = (),
        missing: Callable[[int, list[int], BaseException | None], PeerError] | None = None,
    ) -> None:
        self.spec = spec
        self._start = start
        self._required = sorted(required)
        self._missing = missing
        self.membership = ProducerMembership(spec)
        self.session: S | None = None
        self._established: dict[int, str] = {}
        """The members of the last generation that formed and started (rank -> incarnation): what a joiner is told
        apart from when a generation with it in does not form."""
        self._stuck = 0
        """Generations in a row that did not form although every member asked again."""

    @property
    def members(self) -> list[int]:
        """The ranks of the current generation but rank 0."""
        return self.membership.members

    def first(self) -> None:
        """Wait up to ``group.timeout_s`` for every rank, then form the first generation from those that joined."""
        self.membership.gather(list(range(1, self.spec.world_size)), self.spec.timeout_s)
        self._check_required(1, list(range(1, self.spec.world_size)), None)
        self._next_generation(1, None)

    def admit(self, k: int, close: Callable[[], None]) -> None:
        """A round boundary with ranks asking to join: ``close()`` ends the generation with a word that says so (the
        members then ask for the next one); the next forms with everyone who asked."""
        previous = self.members
        try:
            close()
        except PeerError as e:
            logger.warning("round %d: a member was lost before the round (%s)", k, one_line(e))
        self.membership.gather(previous, self.spec.timeout_s)
        self._check_required(k, previous, None)
        self._next_generation(k, None)

    def lost(self, k: int, e: BaseException, *, release: Callable[[], None] | None = None) -> None:
        """Round ``k`` failed on a member: drop the generation at once (members still blocked in it fail now, not at
        their deadline), wait for the survivors to ask again, and form the next generation from them. ``release``
        frees what else of the generation's group the caller held, once it is dropped here."""
        previous = self.members
        logger.warning(
            "round %d failed (%s); going on with the members that ask to (a lost consumer is left out)", k, one_line(e)
        )
        abandon(self.membership.group)
        self.membership.group = None
        self.session = None
        if release is not None:
            release()
        self.membership.gather(previous, self.spec.timeout_s)
        self._check_required(k, previous, e)
        self._next_generation(k, (previous, e))

    def _check_required(self, k: int, expected: list[int], cause: BaseException | None) -> None:
        gone = [r for r in self._required if r in expected and not self.membership.asking([r])]
        if gone and self._missing is not None:
            abandon(self.membership.group)
            self.membership.group = None
            raise self._missing(k, gone, cause)

    def _next_generation(self, k: int, lost: tuple[list[int], BaseException] | None) -> None:
        while True:
            self.session = None
            try:
                rg = self.membership.form(k)
            except FormError as e:  # a member (a joiner, mostly) did not form the group: once more without it
                lost = self._not_formed(k, e)
                continue
            if rg is None:
                if lost is None:
                    raise PeerError(
                        f"no consumer joined the producer at {self.spec.address} within "
                        f"{self.spec.timeout_s:g}s; start the consumers with this group.host/group.port, "
                        f"group.world_size={self.spec.world_size} and refit.on_consumer_loss=continue"
                    )
                previous, e = lost
                raise PeerError(
                    f"round {k}: every consumer was lost ({ranks_text(previous)}: {one_line(e)}); none asked to go on "
                    f"within group.timeout_s={self.spec.timeout_s:g}s"
                )
            if lost is not None:
                gone = [r for r in lost[0] if r not in self.members]
                # With only the other producers left there is nobody to go on with: starting says so.
                if gone and any(r not in self._required for r in self.members):
                    logger.warning("round %d: lost %s; going on with %s", k, ranks_text(gone), ranks_text(self.members))
            try:
                session = self._start(rg, k)
            except PeerError as e:  # a member lost while the generation formed: once more without it
                del rg  # the group goes with membership.group in _not_formed, before it waits (see release_group)
                lost = self._not_formed(k, e)
                continue
            self.session = session
            self._established = dict(self.membership.holders)
            self._stuck = 0
            return

    def _not_formed(self, k: int, e: BaseException) -> tuple[list[int], BaseException]:
        """The generation just formed for round ``k`` did not start (its group or its handshake failed): drop it,
        wait up to ``group.timeout_s`` for its members to ask again, and drop those the failure is put down to.
        Returns the attempt's members and the cause, for the next attempt to report."""
        gen, attempt = self.membership.gen, dict(self.membership.holders)
        ranks = sorted(attempt)
        logger.warning("generation %d did not start (%s)", gen, one_line(e))
        abandon(self.membership.group)
        self.membership.group = None
        release_group()
        self.membership.gather(ranks, self.spec.timeout_s)
        self._check_required(k, ranks, e)
        if len(self.membership.asking(ranks)) < len(ranks):
            return ranks, e  # those that did not ask are lost, as in a round: the rest go on
        # Everyone asked again. Members new to this generation are what changed since a group last formed.
        joiners = [r for r in ranks if self._established.get(r) != attempt[r]]
        if joiners and len(joiners) < len(ranks):
            self.membership.drop(
                joiners,
                f"generation {gen} could not form its group with consumer {ranks_text(joiners)} new in it "
                f"({one_line(e)}); it is dropped from the session and may ask again with a new process",
            )
            return ranks, e
        self._stuck += 1
        if self._stuck >= MAX_STUCK_FORMS:
            why = (
                f"round {k}: generation {gen} ({ranks_text(ranks)}) could not form its group {self._stuck} times in "
                f"a row with every member present ({one_line(e)})"
            )
            self.membership.drop(ranks, f"{why}; every consumer is dropped from the session")
            raise PeerError(f"{why}; ending the session")
        return ranks, e

    def end(self, rounds: int, error: str | None) -> None:
        """The session is over: a rank still waiting for an answer learns it; the store stops."""
        self.membership.end(rounds, error)
        self.membership.release()


class MemberGenerations(Generic[S]):
    """The side of every other rank (a consumer; a sharded refit's other producers too): it asks for a place in
    each generation and starts that generation's session with ``start(group, plan)``."""

    def __init__(self, spec: GroupSpec, start: Callable[[RefitGroup, dict[str, Any]], S]) -> None:
        self.spec = spec
        self._start = start
        self.membership = ConsumerMembership(spec)
        self.rg: RefitGroup | None = None
        self.session: S | None = None
        self.ended = False
        """The session ended normally (no generation to join)."""

    @property
    def members(self) -> list[int]:
        """The ranks of the current generation but rank 0."""
        plan = self.membership.plan
        return [] if plan is None else list(plan["members"][1:])

    def join(self) -> bool:
        """Ask for a place in the next generation and start its session; False where the session has ended."""
        while True:
            self.rg = self.session = None
            try:
                rg = self.membership.join()
            except FormError as e:  # a peer did not form the generation: ask for the next (the producer bounds it)
                self.drop(e)
                continue
            if rg is None:
                self.ended = True
                return False
            self.rg = rg
            plan = self.membership.plan
            assert plan is not None
            try:
                self.session = self._start(rg, plan)
            except PeerError as e:
                del rg  # see release_group
                self.drop(e)
                continue
            return True

    def drop(self, e: BaseException) -> None:
        """Leave the current generation after ``e``: its group goes at once; :meth:`join` asks for the next."""
        logger.warning(
            "rank %d: generation %d ended (%s); asking the producer at %s to go on",
            self.spec.rank,
            (self.membership.plan or {}).get("gen", 0),
            one_line(e),
            self.spec.address,
        )
        abandon(self.rg)
        self.rg = self.session = None
        release_group()

    def close(self) -> None:
        if self.rg is not None:
            self.rg.close()
            self.rg = None
        self.membership.release()


class EndsOnError:
    """A session whose ``with`` block closes it where the block ends cleanly, and otherwise ends it with the error
    that left the block (``_end(error)``: every rank told why)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
        else:
            self._end(one_line(exc))

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _end(self, error: str | None) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class ElasticProducerSession(EndsOnError):
    """The trainer's side of an elastic session: connects as the producer of ``spec`` and waits up to
    ``group.timeout_s`` for the consumers (it starts with those that joined by then, at least one).

    ``session_options``: those of :class:`~refit_app.protocol.session.ProducerSession`. Use it as a context
    manager, or :meth:`close` it: a consumer still waiting to join then learns that the session is over."""

    def __init__(self, spec: GroupSpec, **session_options: Any) -> None:
        self._spec = spec
        self._options = session_options
        self._generations: ProducerGenerations[ProducerSession] = ProducerGenerations(spec, self._start)
        self._membership = self._generations.membership
        self.rounds = 0
        """Rounds completed."""
        self.closed = False
        try:
            self._generations.first()
        except BaseException as e:
            self._end(one_line(e))
            raise

    def _start(self, rg: RefitGroup, k: int) -> ProducerSession:
        session = ProducerSession(rg, **self._options)
        session.rounds = k - 1
        return session

    @property
    def members(self) -> list[int]:
        """The consumer ranks of the current generation."""
        return self._membership.members

    @property
    def session(self) -> ProducerSession:
        """The current generation's session."""
        assert self._generations.session is not None
        return self._generations.session

    @property
    def group(self) -> RefitGroup:
        assert self._membership.group is not None
        return self._membership.group

    # The current generation's figures (ProducerSessionLike); anything else of it is on :attr:`session`.

    @property
    def manifest(self) -> Manifest | None:
        """The current generation's manifest in force."""
        return self.session.manifest

    @property
    def num_chunks(self) -> int:
        """Chunks of the current generation's manifest."""
        return self.session.num_chunks

    @property
    def probe_tokens(self) -> int:
        """The longest model probe a consumer of the current generation asked for (0: none)."""
        return self.session.probe_tokens

    @property
    def checksums_needed(self) -> bool:
        """Whether some consumer of the current generation verifies."""
        return self.session.checksums_needed

    def wait_for_joiners(self, ranks: Iterable[int], timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until each of ``ranks`` is a member or has asked to join (it is then admitted
        at the next :meth:`send`); returns whether they all did. For a loop that would rather wait for an engine it
        knows is restarting than send a round without it."""
        wanted = set(ranks)
        deadline = time.monotonic() + timeout_s
        poller = Poller()
        while not wanted <= set(self.members) | set(self._membership.newcomers()):
            if time.monotonic() >= deadline:
                return False
            poller.sleep(deadline)
        return True

    def send(
        self,
        named_tensors: Iterable[tuple[str, Any]] | Callable[[], Iterable[tuple[str, Any]]],
        *,
        metas: list[TensorMeta] | None = None,
        metadata: dict[str, str] | None = None,
        files: dict[str, str | bytes] | None = None,
        source: str = "",
        extra: bytes | Callable[[], bytes] = b"",
    ) -> Round:
        """Send one round to the current members (:meth:`ProducerSession.send`'s arguments) and return it once
        they all have it; consumers that asked to join are admitted first. A round a consumer was lost in is sent
        again to the others, so ``named_tensors`` is read again: give a list, or a function that returns the
        tensors (a lazy source), and ``extra`` likewise (a probe for a generation's consumers)."""
        if self.closed:
            raise RuntimeError("send() after close()")
        if not callable(named_tensors) and iter(named_tensors) is named_tensors:
            named_tensors = list(named_tensors)  # references: a one-pass iterator cannot be sent again
        k = self.rounds + 1
        try:
            if self._membership.newcomers():
                self._generations.admit(k, lambda: self.session.close(regroup_to=self._membership.gen + 1))
            while True:
                tensors = named_tensors() if callable(named_tensors) else named_tensors
                payload = extra() if callable(extra) else extra
                try:
                    result = self.session.send(
                        tensors, metas=metas, metadata=metadata, files=files, source=source, extra=payload
                    )
                    break
                except _LOST as e:
                    self._generations.lost(k, e)
        except BaseException as e:
            self._end(one_line(e))
            raise
        result.members = self.members
        self.rounds = k
        self._membership.refuse_taken()
        return result

    def close(self) -> None:
        """End the session: every member's :meth:`ElasticConsumerSession.receive` returns None, and a consumer
        still waiting for an answer learns that the session is over."""
        if self.closed:
            return
        try:
            self.session.close()
        except PeerError as e:  # the rounds are done; a consumer lost now changes nothing they delivered
            logger.warning("rank 0: a consumer was lost at the end of the session (%s)", one_line(e))
            self.group.control.failed = True
        self._end(None)

    def _end(self, error: str | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._generations.end(self.rounds, error)


class ElasticConsumerSession:
    """An engine's side of an elastic session: joins the producer of ``spec`` (at its start, later, or after a
    restart) and receives every round from the one it is admitted at.

    ``session_options``: those of :class:`~refit_app.protocol.session.ConsumerSession`."""

    def __init__(self, spec: GroupSpec, **session_options: Any) -> None:
        self._spec = spec
        self._options = session_options
        self._generations: MemberGenerations[ConsumerSession] = MemberGenerations(spec, self._start)
        self.rounds = 0
        """Rounds received."""
        self._manifest: Manifest | None = None
        self.last_round: Round | None = None
        self.closed = False
        try:
            self._join()
        except BaseException:
            self.close()
            raise

    def _start(self, rg: RefitGroup, plan: dict[str, Any]) -> ConsumerSession:
        session = ConsumerSession(rg, **self._options)
        session.rounds = plan["round"] - 1
        return session

    @property
    def members(self) -> list[int]:
        return self._generations.members

    @property
    def session(self) -> ConsumerSession:
        assert self._generations.session is not None
        return self._generations.session

    @property
    def manifest(self) -> Manifest | None:
        """The manifest in force: the current generation's, else the last round's (None before any)."""
        session = self._generations.session
        return session.manifest if session is not None and session.manifest else self._manifest

    @property
    def num_chunks(self) -> int:
        """Chunks of the current generation's manifest (ConsumerSessionLike); anything else of the generation's
        session is on :attr:`session`."""
        return self.session.num_chunks

    def _join(self) -> None:
        if not self._generations.join():
            self.closed = True

    def receive(
        self,
        post_unpack_func: Callable[[list[tuple[str, Any]]], None] | None = None,
        return_iterator: bool = False,
        *,
        on_manifest: Callable[[Manifest], None] | None = None,
        on_round_end: Callable[[Round], dict[str, Any] | None] | None = None,
        targets: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]] | None = None,
    ) -> Round | None:
        """Receive one round (:meth:`ConsumerSession.receive`'s arguments); None once the producer ended the
        session. A round cut by a lost peer is received again, in full, from the next generation: the callbacks may
        see a round's tensors more than once, and only a round that every member completed is returned. Not as an
        iterator: a cut round could not be handed out again."""
        if return_iterator:
            raise ValueError("an elastic session receives with callbacks only (a round cut by a lost peer comes again)")
        while not self.closed:
            rg = self._generations.rg
            try:
                result = self.session.receive(
                    post_unpack_func, on_manifest=on_manifest, on_round_end=on_round_end, targets=targets
                )
            except RefitError as e:
                assert rg is not None
                if not isinstance(e, PeerError) and rg.control.failed_rank() == self._spec.rank:
                    abandon(rg)  # this consumer's own failure: it leaves the session with it
                    self._generations.rg = self._generations.session = None
                    self.closed = True
                    raise
                self._generations.drop(e)
                self._join()
                continue
            if result is None:
                if self.session.regroup_to:  # the producer forms another generation: ask for a place in it
                    abandon(rg)
                    self._join()
                    continue
                self.closed = True
                return None
            result.members = self.members
            self.rounds = result.round
            self._manifest = self.session.manifest
            self.last_round = result
            return result
        return None

    def close(self) -> None:
        """Leave the session (after its end, or to stop receiving)."""
        self.closed = True
        self._generations.close()

    def __iter__(self) -> Iterator[Round]:
        while (r := self.receive()) is not None:
            yield r

    def __enter__(self) -> ElasticConsumerSession:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
