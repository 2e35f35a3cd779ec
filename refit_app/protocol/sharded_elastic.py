"""Sharded refits that go on when consumers come and go (``refit.on_consumer_loss=continue``).

:class:`ElasticShardedSession` runs a :class:`~refit_app.protocol.sharded.ShardedSession` per **generation** of
members, as the one-producer elastic session runs a session per generation (:mod:`refit_app.protocol.elastic`, whose
generations it shares: :class:`~refit_app.protocol.elastic.ProducerGenerations` on producer 0, which hosts the
run's store, :class:`~refit_app.protocol.elastic.MemberGenerations` on every other rank, producers included)::

    generation g: a gloo group of producer 0, every other producer and the consumers that asked
      agree: the plan for the ranks present (each numbered by its place among the members), its digest compared
      round k: every rank's word, the transfers, then every rank's "done" (a round counts once all completed it)
    a consumer lost in round k (killed, past a deadline, failed on its own)
      -> every rank drops generation g and asks again; producer 0 forms g + 1 from those that asked within
         group.timeout_s; the plan is made anew without the lost rank (a replica chain through it re-planned: the
         next replica takes its slices from the one before the lost rank, or from the producers), round k again,
         dense
    a consumer asks to join (restarted with the run's group.run_id and token) -> producer 0 ends the generation at
      the next round boundary (the word REGROUP), the next forms with it, its first round dense
    a producer lost -> producer 0 ends the session with one line, which every rank waiting for a place reads; its
      shards exist nowhere else

Every generation starts with a fresh plan and a dense round (a delta plan's state is per pair and per generation:
a round cut midway leaves some pieces new and some old, and a joiner holds nothing). Every wait is bounded by the
group's deadline, and so is the number of generations tried without progress (``MAX_STUCK_FORMS``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from refit_app.common.errors import (
    ConfigError,
    HandshakeError,
    PeerError,
    RefitError,
    VerificationError,
    one_line,
)
from refit_app.core.reshard.plan import Layout, Need, TensorSpec
from refit_app.core.reshard.transfer import Held, RegionMismatch
from refit_app.protocol.delta.auto import DELTA
from refit_app.protocol.elastic import EndsOnError, MemberGenerations, ProducerGenerations, release_group
from refit_app.protocol.sharded import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_CHECKSUM,
    DEFAULT_NUM_BUFFERS,
    Expected,
    ShardedSession,
    agree,
)
from refit_app.transport.backends import masked_gloo_error
from refit_app.transport.control import Poller, ranks_text
from refit_app.transport.elastic import abandon
from refit_app.transport.groups import RefitGroup
from refit_app.transport.spec import PRODUCER_RANK, GroupSpec

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """One generation as a rank runs it: its group, the process group the plan runs over, the ranks in it (refit
    ranks, in the order of their places), the session over its plan and the round it started at (with delta rounds,
    a dense one)."""

    rg: RefitGroup
    pg: Any
    ranks: list[int]
    session: ShardedSession
    first: int


_FINISH = "finish"
"""The run's store prefix under which the finishers of :meth:`ElasticShardedSession.finish` exchange their values."""


def _finish_key(what: str, rank: int) -> str:
    return f"{what}/{rank}"


def _not_posted(store: dist.Store, what: str, ranks: list[int], seconds: float) -> list[int]:
    """Those of ``ranks`` that have not posted their ``what`` (:func:`_finish_key`) within ``seconds``; [] as soon
    as every one has."""
    deadline, poller = time.monotonic() + seconds, Poller()
    while not store.check([_finish_key(what, r) for r in ranks]):
        if time.monotonic() >= deadline:
            return [r for r in ranks if not store.check([_finish_key(what, r)])]
        poller.sleep(deadline)
    return []


def _gloo_lost(e: BaseException) -> BaseException | None:
    """The lost peer behind ``e``, where ``e`` says a peer of the generation was lost (its group is then unusable);
    None for anything else."""
    if isinstance(e, RegionMismatch):
        return None  # bytes that arrived wrong: this rank's own finding, not a lost peer
    if isinstance(e, (PeerError, RuntimeError, dist.DistError)):
        return e
    if isinstance(e, ValueError):
        return masked_gloo_error(e)
    return None


def _expects_of(specs: Sequence[TensorSpec]) -> list[Expected]:
    """The tensors a producer's specs describe, as a consumer expects them."""
    return [Expected(s.name, s.dtype, tuple(s.shape)) for s in specs]


def renumbered(
    ranks: Sequence[int],
    specs: Sequence[TensorSpec] | None,
    needs: Sequence[Need],
    chains: Sequence[Sequence[int]],
) -> tuple[list[TensorSpec] | None, list[Need], list[list[int]]]:
    """The layouts with every refit rank replaced by its place in a generation of ``ranks``: the producers' meshes,
    a consumer's needs, and the replica chains without the ranks that are not there (a chain through a lost rank
    goes on from the one before it; one without its head starts from the producers)."""
    place = {r: i for i, r in enumerate(ranks)}
    out_specs = None
    if specs is not None:
        out_specs = [
            TensorSpec(
                s.name,
                s.dtype,
                s.shape,
                s.itemsize,
                Layout(s.layout.mesh, tuple(place[r] for r in s.layout.ranks), s.layout.placements),
            )
            for s in specs
        ]
    out_needs = [Need(place[n.rank], n.name, n.box) for n in needs]
    out_chains = [[place[r] for r in chain if r in place] for chain in chains]
    return out_specs, out_needs, [c for c in out_chains if len(c) > 1]


class ElasticShardedSession(EndsOnError):
    """One rank of a sharded refit that goes on without a lost consumer: ranks ``[0, producers)`` of ``spec`` are
    the producers (producer 0 hosts the run's store), the others consumers. Connects itself from ``spec``
    (``group.token`` required, gloo, no topology), agrees the plan with the ranks there (at most
    ``group.timeout_s`` for the others to join) and then, per round, :meth:`send` (every producer) or
    :meth:`receive` (every consumer) as :class:`~refit_app.protocol.sharded.ShardedSession` does.

    ``specs`` (a producer's, :func:`~refit_app.protocol.sharded.from_tensors`), ``needs`` and ``expects`` (a
    consumer's own), ``chains``, ``buffer_size_bytes``, ``checksum``, ``delta`` and ``names`` are those of
    :func:`~refit_app.protocol.sharded.agree`, in refit ranks (``spec.rank``): each generation renumbers them for
    the ranks present (:func:`renumbered`). ``wire(pg, round)``, where given, wraps a generation's process group for
    one round's transfers (a test's fault hooks).

    A trainer's producers give ``specs`` as a function of a store, called once every rank is connected and before
    the first plan: the run's store under a prefix of its own, where the producers set up the process group their
    trainer runs over (it outlives the generations; a consumer lost never breaks it). A consumer that cannot know
    the tensors (a trainer's) gives ``expects=None`` and ``needs`` as a function of them (or of ``expects``, where
    it gives them): producer 0's tensors, which every generation's plan record carries (:attr:`expects`). With
    ``extras=True`` (on every rank alike) each round carries one object from each producer to every rank
    (:meth:`send`'s ``extra``, :attr:`extras`) once its transfers completed: a trainer's keyed sums, which a
    consumer checks its slices against. Every rank but producer 0 may join with ``ask``, a small JSON mapping that
    the plan record of each generation it is in carries to every rank (:attr:`asks`): what a consumer wants of the
    producers' extras (a model's probe of so many positions). Producer 0's ``context`` (small, JSON) reaches every
    rank in the same records (:attr:`context`). Consumers that join with ``"finish": True`` in their ``ask`` end
    together: each tells the others a value once the producers ended the session (:meth:`finish`)."""

    def __init__(
        self,
        spec: GroupSpec,
        *,
        producers: int,
        specs: Sequence[TensorSpec] | Callable[[dist.Store], Sequence[TensorSpec]] | None = None,
        needs: Sequence[Need] | Callable[[list[Expected]], Sequence[Need]] = (),
        expects: Sequence[Expected] | None = (),
        chains: Sequence[Sequence[int]] = (),
        buffer_size_bytes: int | None = DEFAULT_BUFFER_BYTES,
        checksum: str | None = DEFAULT_CHECKSUM,
        delta: bool | None = False,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        wire: Callable[[Any, int], Any] | None = None,
        extras: bool = False,
        names: Mapping[str, str] | None = None,
        ask: Mapping[str, Any] | None = None,
        context: Mapping[str, Any] | None = None,
    ) -> None:
        if not (isinstance(producers, int) and 1 <= producers < spec.world_size):
            raise ValueError(f"producers={producers!r}: give 1 to group.world_size - 1 ({spec.world_size - 1})")
        self.rank = spec.rank
        self.producer = spec.rank < producers
        if self.producer != (specs is not None):
            raise ValueError(f"rank {spec.rank}: a producer (rank < {producers}) gives specs=, a consumer needs=")
        if self.producer and expects is None:
            raise ValueError(f"rank {spec.rank}: expects=None is a consumer's (it takes the producers' tensors)")
        if expects is None and not callable(needs):
            raise ValueError(f"rank {spec.rank}: with expects=None give needs= as a function of the producers' tensors")
        if expects is not None and callable(needs):
            needs = needs(list(expects))
        self.spec, self.producers = spec, producers
        self._specs_from = specs if callable(specs) else None
        self._needs_from = needs if callable(needs) else None
        self._layouts: tuple[list[TensorSpec] | None, list[Need], list[list[int]]] = (
            list(specs) if specs is not None and not callable(specs) else None,
            [] if callable(needs) else list(needs),
            [list(c) for c in chains],
        )
        self.expects: list[Expected] | None = None if expects is None else list(expects)
        """The tensors a consumer expects (its own, or producer 0's where it gave ``expects=None``: known once it
        is in a generation)."""
        self._agree = {
            "buffer_size_bytes": buffer_size_bytes,
            "checksum": checksum,
            "delta": delta,
            "names": names,
        }
        self._num_buffers = num_buffers
        self._wire = wire
        self._extras = extras
        self.extras: dict[int, Any] = {}
        """Each producer's ``extra`` of the last round (producer rank -> object), with ``extras=True``."""
        self.context: dict[str, Any] = dict(context or {}) if spec.rank == PRODUCER_RANK else {}
        """Producer 0's ``context`` (small, JSON), on every rank once it is in a generation: what the session's
        consumers need to know of the producers before the first round (a trainer's model config)."""
        self.rounds = 0
        """Rounds completed (a consumer: the last round it received)."""
        self.generation: Generation | None = None
        self.closed = False
        self._host: ProducerGenerations[Generation] | None = None
        self._member: MemberGenerations[Generation] | None = None
        try:
            if spec.rank == PRODUCER_RANK:
                self._host = ProducerGenerations(
                    spec, self._start_host, required=range(1, producers), missing=self._lost_producers
                )
                self._set_up(self._host.membership.store)
                self._host.membership.context = {
                    "expects": [[e.name, e.dtype, list(e.shape)] for e in _expects_of(self._layouts[0] or [])],
                    "extras": extras,
                    "context": self.context,
                }
                self._host.first()
                self.generation = self._host.session
            else:
                self._member = MemberGenerations(spec, self._start_member)
                self._member.membership.ask = dict(ask or {})
                self._set_up(self._member.membership.store)
                self._join()
        except BaseException as e:
            self._end(one_line(e))
            raise

    @property
    def delta_round(self) -> bool:
        """Whether the last round went as delta records: a plan agreed with ``delta=True`` past its generation's
        first round (every generation starts dense), or the kind ``delta="auto"`` chose."""
        gen = self.generation
        if gen is None or not gen.session.plan.delta or self.rounds <= gen.first:
            return False
        return gen.session.auto is None or gen.session.auto.last == DELTA

    @property
    def asks(self) -> dict[int, dict[str, Any]]:
        """What each rank of the current generation but producer 0 asked to join it with (its ``ask``), by refit
        rank: the same on every rank of the generation."""
        side = self._host or self._member
        plan = side.membership.plan if side is not None and self.generation is not None else None
        return {} if plan is None else {int(r): a for r, a in (plan.get("asks") or {}).items()}

    @property
    def needs(self) -> list[Need]:
        """A consumer's needs, in refit ranks (made from producer 0's tensors where it gave ``expects=None``)."""
        return list(self._layouts[1])

    @property
    def members(self) -> list[int]:
        """The consumer ranks of the current generation."""
        return [] if self.generation is None else [r for r in self.generation.ranks if r >= self.producers]

    @property
    def finishers(self) -> list[int]:
        """The consumer ranks of the current (at the end, the last) generation that joined with ``"finish": True``
        in their ``ask``: those that exchange a value in :meth:`finish` once the producers ended the session."""
        return sorted(r for r, a in self.asks.items() if r >= self.producers and a.get("finish"))

    def finish(self, value: Any) -> dict[int, Any]:
        """A consumer's, once :meth:`receive` returned None (the producers ended the session): post ``value``
        (small, JSON) to every other member of :attr:`finishers` and return every one's, by refit rank. For
        consumers that end together, such as savers that publish their files only once every one has sealed its own.

        Two steps, each within ``group.timeout_s``: every finisher posts its value and waits for the others', then
        says it has them and waits until every one has said so; only then does it return. A finisher lost in the
        first step never says so, and the others raise (a value posted by a process that died meanwhile does not
        count), as a barrier would; what is left is one lost between its word of the second step and its return.
        Producer 0 keeps the run's store up until each finisher is through, at most 3 x ``group.timeout_s`` after
        it ended the session. Raises PeerError naming the finishers that did not come, or producer 0 lost."""
        if self.producer or self._member is None or not self.closed or self.generation is None:
            raise ValueError(f"rank {self.rank}: finish() is a consumer's, once receive() returned None")
        finishers = self.finishers
        if self.rank not in finishers:
            raise ValueError(f"rank {self.rank}: finish() is for the members that joined with ask={{'finish': True}}")
        store = self._member.membership.store(_FINISH)
        try:
            store.set(_finish_key("value", self.rank), json.dumps(value))
            try:
                self._await_all(store, "value", finishers, "did not finish")
                values = {r: json.loads(store.get(_finish_key("value", r))) for r in finishers}
                store.set(_finish_key("seen", self.rank), "1")
                self._await_all(store, "seen", finishers, "did not confirm it had every finisher's value")
            finally:  # through, either way: producer 0 need not keep its store up for this rank any longer
                store.add(_finish_key("read", self.rank), 1)
        except dist.DistError as e:
            raise PeerError(
                f"rank {self.rank}: lost producer 0 at {self.spec.address} while finishing ({one_line(e)})"
            ) from None
        return values

    def _await_all(self, store: dist.Store, what: str, finishers: list[int], failed: str) -> None:
        """Wait up to ``group.timeout_s`` until every finisher posted its ``what``; a PeerError naming those that
        did not."""
        timeout_s = self.spec.timeout_s
        missing = _not_posted(store, what, finishers, timeout_s)
        if missing:
            raise PeerError(
                f"rank {self.rank}: consumer {ranks_text(missing)} of the last generation {failed} within "
                f"group.timeout_s={timeout_s:g}s of this rank (lost after the last round?)"
            )

    def _await_finishers(self) -> None:
        """Producer 0's, as it ends the session: keep the run's store up until every finisher is through
        :meth:`finish` (its two steps, and the consumers' own work before it), at most 3 x ``group.timeout_s``."""
        finishers = self.finishers
        if self._host is None or not finishers:
            return
        store = self._host.membership.store(_FINISH)
        try:
            unread = _not_posted(store, "read", finishers, 3 * self.spec.timeout_s)
            if unread:
                logger.warning("rank 0: consumer %s did not finish; the session ends anyway", ranks_text(unread))
        except dist.DistError as e:  # the store is this process's own; nothing to keep up
            logger.warning("rank 0: could not wait for the consumers to finish: %s", one_line(e))

    def wait_for_joiners(self, ranks: Sequence[int], timeout_s: float) -> bool:
        """Producer 0's: wait up to ``timeout_s`` until each of ``ranks`` is a member or has asked to join (it is
        then admitted at the next :meth:`send`); whether they all did. For a loop that would rather wait for an
        engine rank it knows is restarting than send a round without it."""
        if self._host is None:
            raise ValueError(f"rank {self.rank}: wait_for_joiners() is producer 0's call")
        wanted, membership = set(ranks), self._host.membership
        deadline = time.monotonic() + timeout_s
        poller = Poller()
        while not wanted <= set(self.members) | set(membership.newcomers()):
            if time.monotonic() >= deadline:
                return False
            poller.sleep(deadline)
        return True

    def _set_up(self, store: Callable[[str], dist.Store]) -> None:
        """A trainer's producers: their specs, once they set up their trainer over the run's store."""
        if self._specs_from is not None:
            specs = list(self._specs_from(store("trainer")))
            self._layouts = (specs, *self._layouts[1:])

    def _take_context(self, plan: dict[str, Any]) -> None:
        """What producer 0's plan record says of the session: its tensors (a consumer that gave none takes them;
        its needs follow) and whether rounds carry extras (every rank must do as producer 0 does)."""
        context = plan.get("context") or {}
        if bool(context.get("extras")) != self._extras:
            raise ConfigError(
                f"rank {self.rank}: producer 0's rounds carry keyed sums (a trainer's, source=model) and this rank "
                "checks against a source of its own: give every rank the same source"
                if context.get("extras")
                else f"rank {self.rank}: this rank expects a trainer's rounds (source=model: keyed sums, its "
                "model's config) and producer 0 trains none: give every rank the same source"
            )
        self.context = dict(context.get("context") or {})
        if self.expects is None and self._needs_from is not None:
            self.expects = [Expected(name, dtype, tuple(shape)) for name, dtype, shape in context["expects"]]
            self._layouts = (self._layouts[0], list(self._needs_from(self.expects)), self._layouts[2])

    def _lost_producers(self, k: int, ranks: list[int], cause: BaseException | None) -> PeerError:
        why = f" ({one_line(cause)})" if cause is not None else ""
        return PeerError(
            f"round {k}: lost producer {ranks_text(ranks)}{why}: it did not ask to go on within "
            f"group.timeout_s={self.spec.timeout_s:g}s, and a sharded refit cannot go on without a producer (its "
            "shards exist nowhere else)"
        )

    def _start_host(self, rg: RefitGroup, k: int) -> Generation:
        assert self._host is not None
        ranks = [PRODUCER_RANK, *self._host.members]
        if all(r < self.producers for r in ranks):  # the producers alone: nobody to send to
            raise RefitError(
                f"round {k}: no consumer {'joined' if k == 1 and self.generation is None else 'is left'} (none asked "
                f"to {'join' if k == 1 and self.generation is None else 'go on'} within "
                f"group.timeout_s={self.spec.timeout_s:g}s); the producers stop"
            )
        return self._start(rg, ranks, k)

    def _start_member(self, rg: RefitGroup, plan: dict[str, Any]) -> Generation:
        k = int(plan["round"])
        if self.producer and k != self.rounds + 1:
            # Its trainer has moved on (or not): it cannot send producer 0's round. Not a lost peer: this producer
            # leaves, and producer 0 ends the session for everyone, naming it.
            raise ConfigError(
                f"producer {self.rank}: generation {plan['gen']} starts at round {k}, but this producer's next round "
                f"is {self.rounds + 1}"
            )
        self._take_context(plan)
        return self._start(rg, list(plan["members"]), k)

    def _start(self, rg: RefitGroup, ranks: list[int], k: int) -> Generation:
        """Agree the plan for ``ranks`` over the generation's group (its digest compared on every rank, as at any
        start) and open the session at round ``k``. A member lost meanwhile is a PeerError: the generation did not
        form, and the next is tried."""
        pg = rg.group.process_group()
        place = ranks.index(self.rank)
        specs, needs, chains = renumbered(ranks, *self._layouts)
        expects = [] if self.producer or self.expects is None else self.expects
        why = None
        try:
            plan = agree(pg, place, specs=specs, needs=needs, chains=chains, expects=expects, **self._agree)
        except (RuntimeError, dist.DistError, ValueError) as e:
            lost = _gloo_lost(e)
            if lost is None:
                raise
            why = f"rank {self.rank}: a member was lost while the plan was agreed ({one_line(lost)})"
            del lost
        except HandshakeError as e:
            if k == 1:
                raise  # the run's first plan: the ranks as started disagree, and every rank stops in one line
            # Past round 1 the ranks of the last generation agreed: a rank new in this one (a consumer restarted
            # with other settings) disagrees. Not the run's end: producer 0 drops the newcomers and goes on without
            # them (ProducerGenerations._not_formed), and they stop in one line naming the difference.
            raise PeerError(
                f"rank {self.rank}: generation from round {k} did not agree on the plan: {one_line(e)}"
            ) from e
        if why is not None:
            # Raised with nothing of the group in reach (no chained exception, this frame's references dropped): a
            # member still blocked on this rank fails once the caller abandons the group, not at its deadline.
            del pg, rg
            raise PeerError(why)
        session = ShardedSession(pg, place, plan, producer=self.producer, num_buffers=self._num_buffers)
        session.rounds = k - 1
        logger.info(
            "rank %d: generation of %s from round %d, plan %s (%d transfers)",
            self.rank,
            ranks_text(ranks),
            k,
            plan.digest[:12],
            len(plan.transfers),
        )
        return Generation(rg, pg, ranks, session, k)

    def _join(self) -> None:
        assert self._member is not None
        if self._member.join():
            self.generation = self._member.session
        else:
            self.generation = None
            self.closed = True

    def send(self, shards: dict[str, Held], *, extra: Any = None) -> int:
        """One round of this producer's regions to the consumers there; the bytes sent (of the last try: a round a
        consumer was lost in is sent again, dense, to the others). Consumers that asked to join are admitted first
        (producer 0 decides; every producer follows). With ``extras=True``, ``extra`` goes to every rank of the
        generation that completes the round (:attr:`extras`); a callable is called with the generation's
        :attr:`asks` before each try of the round (every producer's at the same point: it may run a collective of
        the producers' own group), and what it returns goes."""
        if not self.producer:
            raise ValueError(f"rank {self.rank}: send() is a producer's call")
        if self.closed:
            raise RuntimeError("send() after close()")
        k = self.rounds + 1
        try:
            while True:
                if self._host is not None and self._host.membership.newcomers():
                    self._host.admit(k, self._say_regroup)
                    self.generation = self._host.session
                moved = self._round(k, lambda s: s.send(shards), extra(self.asks) if callable(extra) else extra)
                if moved is not None:
                    break
        except BaseException as e:
            self._end(one_line(e))
            raise
        self.rounds = k
        if self._host is not None:
            self._host.membership.refuse_taken()
        return moved

    def receive(self, slices: dict[str, Held]) -> int | None:
        """One round into ``slices``; the bytes received, or None once the producers ended the session. A round cut
        by a lost peer is received again, in full, from the next generation: only a round that every rank of its
        generation completed returns. A consumer's own failure (bytes that arrived other than their source hashed
        them) raises here, and the others go on without it."""
        if self.producer:
            raise ValueError(f"rank {self.rank}: receive() is a consumer's call")
        while not self.closed:
            k = self._session().rounds + 1
            moved = self._round(k, lambda s: s.receive(slices))
            if moved is not None:
                self.rounds = k
                return moved
        return None

    def _say_regroup(self) -> None:
        """Producer 0's word at a round boundary with ranks asking to join: every rank leaves the generation."""
        try:
            self._session().regroup()
        except (RuntimeError, dist.DistError, ValueError) as e:
            lost = _gloo_lost(e)
            if lost is None:
                raise
            raise PeerError(one_line(lost)) from e

    def _session(self) -> ShardedSession:
        assert self.generation is not None
        return self.generation.session

    def _round(self, k: int, run: Callable[[ShardedSession], int | None], extra: Any = None) -> int | None:
        """Round ``k`` over the current generation: its bytes, once every rank of the generation completed it;
        None where the generation ended (a regroup, a lost peer: the caller tries again in the next) or the session
        did (:attr:`closed`)."""
        gen = self.generation
        assert gen is not None
        gen.session.wire = self._wire(gen.pg, k) if self._wire is not None else gen.pg
        try:
            moved = run(gen.session)
            if moved is not None:
                # Every rank completed the round: only then does it count. With extras, their gather is that
                # collective (a round cut here goes again, extras too).
                if self._extras:
                    parts: list[Any] = [None] * len(gen.ranks)
                    dist.all_gather_object(parts, extra, group=gen.pg)
                    self.extras = {r: parts[i] for i, r in enumerate(gen.ranks) if r < self.producers}
                else:
                    dist.barrier(group=gen.pg)
                return moved
            if not gen.session.regrouping:
                self.closed = True  # the producers ended the session
                return None
            why = None  # producer 0 admits a rank at this boundary
        except RegionMismatch as e:
            abandon(gen.rg)  # this rank's own failure: it leaves, and the others go on without it
            self.generation = None
            self.closed = True
            raise VerificationError(str(e)) from e
        except (RuntimeError, dist.DistError, PeerError, ValueError) as e:
            lost = _gloo_lost(e)
            if lost is None:
                raise
            why = PeerError(one_line(lost))  # its message alone: the traceback would keep the generation's group
            del lost  # ``e`` or made from it: its traceback's frames hold the session and so the group (release_group)
        del gen, run
        self._next(k, why)
        return None

    def _next(self, k: int, why: BaseException | None) -> None:
        """The generation ended in round ``k`` (``why``: a lost peer; None: producer 0 regroups, a member's word):
        on to the next."""
        self.generation = None  # the last reference to its process group: see release_group
        if self._host is not None:
            assert why is not None  # producer 0 regroups before a round, in send()
            self._host.lost(k, why, release=release_group)
            self.generation = self._host.session
            return
        assert self._member is not None
        if why is None:
            abandon(self._member.rg)
            self._member.rg = self._member.session = None
            release_group()
        else:
            self._member.drop(why)  # releases it too
        self._join()
        if self.closed and self.producer:
            raise PeerError(f"producer {self.rank}: the session ended while round {k} was cut")

    def close(self) -> None:
        """End the session (every producer together: each consumer's next :meth:`receive` returns None), or leave
        it (a consumer: the others go on without it). A no-op after the first call."""
        if self.closed:
            self._end(None)
            return
        self.closed = True
        if self.producer and self.generation is not None:
            try:
                self.generation.session.close()
            except (RuntimeError, dist.DistError, PeerError, ValueError) as e:
                if _gloo_lost(e) is None:
                    raise
                # The rounds are done; a consumer lost now changes nothing they delivered.
                logger.warning("rank %d: a member was lost at the end of the session (%s)", self.rank, one_line(e))
                self.generation.rg.control.failed = True
            self._await_finishers()
        self._end(None)

    def _end(self, error: str | None) -> None:
        self.closed = True
        if self._host is not None:
            host, self._host = self._host, None
            host.end(self.rounds, error)
        if self._member is not None:
            member, self._member = self._member, None
            if error is not None and member.rg is not None:
                abandon(member.rg)
                member.rg = None
            member.close()
        self.generation = None


__all__ = ["ElasticShardedSession", "Generation", "renumbered"]
