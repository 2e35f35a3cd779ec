"""Who is in an elastic session (``refit.on_consumer_loss=continue``), generation by generation.

A gloo process group cannot be used again after one of its collectives failed, and it has a fixed size. So the
members of an elastic session form one group per **generation**: the producer and the consumers it admitted. When a
consumer is lost (it died, stalled past a deadline, or failed for a reason of its own) or one asks to join, the
producer ends the generation and forms the next one from the consumers that ask for it; a consumer keeps its rank
number (``group.rank``) across generations, and its index in each generation's group is its place among the
members. Every record below lies in the producer's store, under the run's prefix, at a name only a key holder can
form, and is signed (both by :class:`~refit_app.transport.records.RunStore`)::

    consumer                                        producer
    greeting checked (token, run id, continue) <--- greeting (as for every session, marked elastic)
    join request: rank, incarnation ------------->  read at the next round boundary (or while it forms a generation)
                                                    plan of generation g: members, their incarnations, the round
    answer: g, or why it is refused <-------------  (one per request)
    generation g's group: a gloo group and a control channel under a prefix of g's own, formed by every member

A consumer's **incarnation** is a random id drawn when its process joins: a rank whose process was replaced is
told apart from the one before, and of two live processes that ask for the same rank, the one that holds it keeps
it. A stranger cannot take part: without the run's token it cannot read the greeting as the producer's (it is
refused there, in one line), name a join request where the producer reads, or read the answers; so it can neither
join, nor rejoin, nor take a lost rank's place.

Deadlines: the producer waits for a generation's members to ask for the next one at most ``group.timeout_s``
(:meth:`ProducerMembership.gather`); a consumer waits for its answer at most :func:`answer_wait_s`; forming a group
has the group's deadline. Continue needs the run's token (else anyone on the port could take a lost rank's place),
gloo, and ``group.topology=tree`` (:func:`check_elastic`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial
from typing import Any

import torch.distributed as dist

from refit_app.common.errors import ConfigError, PeerError, one_line
from refit_app.transport.auth import new_secret
from refit_app.transport.backends import gloo_devices, make_group
from refit_app.transport.control import Control, DeadlineStore, Poller, ranks_text
from refit_app.transport.groups import ERROR_LINGER_S, RefitGroup
from refit_app.transport.records import RecordError, RecordKind, RunStore, need
from refit_app.transport.rendezvous import (
    announce,
    await_producer,
    join_store,
    run_store,
    start_store,
)
from refit_app.transport.signed_store import backend_store
from refit_app.transport.spec import PRODUCER_RANK, GroupSpec, elastic_problem

logger = logging.getLogger(__name__)

BACKEND = "gloo"
_K_JOINS = "elastic/joins"
_K_ENDED = "elastic/ended"


def _k_join(n: int) -> str:
    return f"elastic/join/{n}"


def _k_answer(rank: int, incarnation: str, slot: int) -> str:
    # One per request: a consumer asks again after every generation, and must not read the last one's answer.
    return f"elastic/answer/{rank}/{incarnation}/{slot}"


def _k_read(rank: int, incarnation: str, slot: int) -> str:
    # The consumer read its answer: a counter it adds to (the producer waits for it before it goes, see end()).
    return f"elastic/read/{rank}/{incarnation}/{slot}"


def _k_plan(gen: int) -> str:
    return f"elastic/plan/{gen}"


def _k_generation(gen: int) -> str:
    return f"elastic/gen/{gen}"


_PLAN = RecordKind("plan", "an elastic plan record")
_ANSWER = RecordKind("answer", "an elastic answer record")
_ENDED = RecordKind("ended", "an elastic ended record")
_JOIN = RecordKind("join", "a join request")
"""A join request as its consumer writes it; the producer checks its fields against the session."""


def _check_join(doc: dict[str, Any], run_id: str, world_size: int) -> None:
    rank = need(doc, "rank", int)
    need(doc, "incarnation", str), need(doc, "producer_address", str)
    if not 0 < rank < world_size or need(doc, "run_id", str) != run_id:
        raise RecordError("names a rank or run that is not this session's")
    if not isinstance(doc.get("ask", {}), dict):
        raise RecordError("asks with something other than a mapping")


def answer_wait_s(timeout_s: float) -> float:
    """How long a consumer waits for the producer's answer to its request: the producer notices a lost consumer
    within one deadline (a collective's), then waits up to one more for the others to ask again."""
    return 2 * timeout_s


def check_elastic(spec: GroupSpec) -> None:
    """Refuse, in one line, a group that ``continue`` cannot run on."""
    problem = elastic_problem(spec)
    if problem is not None:
        raise ConfigError(problem)


class FormError(PeerError):
    """A generation's group did not form with its peers (a member died, stalled or could not connect): the members
    that ask again go on in another generation. A rank that cannot open its own gloo socket raises a
    :class:`ConfigError` instead: it is out of the session."""


def _lost_producer(spec: GroupSpec, e: BaseException) -> PeerError:
    return PeerError(f"lost the producer (rank {PRODUCER_RANK}) at {spec.address}; it may have died ({one_line(e)})")


class _Generation:
    """What both sides build a generation's group from."""

    def __init__(self, spec: GroupSpec, records: RunStore) -> None:
        self.spec = spec
        self.auth = records.auth
        self.records = records
        self._lent: dist.Store | None = None

    def group(self, plan: dict[str, Any], rank: int, address: str, *, producer: bool) -> RefitGroup:
        """This rank's group of generation ``plan["gen"]``: a fresh gloo group under the generation's own prefix
        (a failed one cannot be reused, and its keys must not meet the next one's), and a control channel there."""
        members = plan["members"]
        store = self.records.prefix_store(_k_generation(plan["gen"]))
        spec = replace(self.spec, rank=members.index(rank), world_size=len(members), backend=BACKEND)
        control_store = store if producer else DeadlineStore(store, spec.timeout_s)
        control = Control(control_store, rank, len(members), spec.timeout_s, self.spec.address, self.auth, members)
        try:
            group = make_group(BACKEND, backend_store(store, self.auth, BACKEND), spec, control, address=address)
        except ConfigError:
            control.failed = True  # this rank's own socket: it cannot be a member of any generation
            raise
        except (RuntimeError, dist.DistError) as e:
            control.failed = True
            raise FormError(
                f"generation {plan['gen']} ({ranks_text(members[1:])}) could not form its group: {one_line(e)}"
            ) from e
        return RefitGroup(spec, BACKEND, group, control)

    def store(self, prefix: str) -> dist.Store:
        """The run's store under ``prefix``, every value signed with the run's key, for a process group of the
        caller's among this run's ranks that outlives the generations (a sharded refit's trainer over its
        producers), as :meth:`RefitGroup.store` lends a fixed group's."""
        if self._lent is None:
            # Held here: a store written in Python lives only while its Python object does, whatever holds it in C++.
            self._lent = backend_store(self.records.prefix_store("run"), self.auth, BACKEND)
        return dist.PrefixStore(f"refit/{prefix}", self._lent)


def abandon(rg: RefitGroup | None) -> None:
    """Drop a generation's group after a failure: its sockets close now, so that members still blocked in one of
    its collectives fail at once instead of at their deadline. Never raises (the next generation is what counts)."""
    if rg is not None:
        rg.abandon()


class ProducerMembership:
    """The producer's side: its store and greeting, the join requests it has read, and the generations it forms."""

    def __init__(self, spec: GroupSpec) -> None:
        check_elastic(spec)
        self.spec = spec
        self._store = start_store(spec)
        self.auth = announce(self._store, spec, elastic=True)
        self._records = RunStore(run_store(self._store, self.auth), self.auth, spec.address)
        self._join = replace(_JOIN, check=partial(_check_join, run_id=self.auth.run_id, world_size=spec.world_size))
        self._generation = _Generation(spec, self._records)
        self._read = 0
        """Join slots read so far."""
        self._requests: dict[int, dict[str, dict[str, Any]]] = {}
        """Unanswered requests: rank -> incarnation -> request, in the order they arrived."""
        self.holders: dict[int, str] = {}
        """The members of the current generation: rank -> incarnation."""
        self.gen = 0
        self.group: RefitGroup | None = None
        self.context: dict[str, Any] = {}
        """What every plan record carries besides its members, for the session run inside (a sharded refit: the
        producers' tensors, which a trainer's consumers take)."""
        self.plan: dict[str, Any] | None = None
        """The current generation's plan record (its members, and what each asked with: ``asks``)."""
        self._unread: list[str] = []
        """The keys that say a consumer read the answer that sent it away (refused, dropped), not yet seen set."""
        self._address = spec.host
        logger.info(
            "rank 0: elastic session (refit.on_consumer_loss=continue) at %s, run %s: consumers may join at any "
            "round boundary",
            spec.address,
            self.auth.run_id,
        )

    @property
    def members(self) -> list[int]:
        return sorted(self.holders)

    def poll(self) -> None:
        """Read the join requests that arrived since the last poll: one store read when none did."""
        count = self._records.count(_K_JOINS)
        for n in range(self._read + 1, count + 1):
            if not self._records.check([_k_join(n)]):
                break  # counted and not yet written: read at the next poll
            self._read = n
            doc = self._records.get_record(_k_join(n), self._join)
            if doc is not None:
                self._requests.setdefault(doc["rank"], {})[doc["incarnation"]] = {**doc, "slot": n}

    def newcomers(self) -> list[int]:
        """Ranks that asked to join and hold no place in the current generation (a joiner, a restarted consumer)."""
        self.poll()
        return sorted(r for r, asked in self._requests.items() if r not in self.holders and asked)

    def refuse_taken(self) -> None:
        """After a round every member completed: a request for a rank that a live member holds is refused (two
        processes claim the rank; the one that has it keeps it)."""
        for rank, asked in self._requests.items():
            holder = self.holders.get(rank)
            for incarnation in [i for i in asked if holder is not None and i != holder]:
                self._answer(
                    asked.pop(incarnation),
                    {
                        "refused": f"group.rank={rank} is held by a live consumer of this run; give this consumer "
                        "another group.rank, one no live consumer holds"
                    },
                )

    def gather(self, expected: list[int], window_s: float) -> None:
        """Wait until every rank of ``expected`` (the last generation's members) has asked for the next generation,
        or ``window_s`` passed; those that do not ask by then are lost."""
        deadline = time.monotonic() + window_s
        poller = Poller()
        while True:
            self.poll()
            if all(self._requests.get(r) for r in expected) or time.monotonic() >= deadline:
                return
            poller.sleep(deadline)

    def form(self, next_round: int) -> RefitGroup | None:
        """End the current generation and form the next from the requests read; None when nobody asked.
        A member that asked again keeps its rank; a rank nobody holds goes to the first process that asked for it."""
        chosen: dict[int, str] = {}
        for rank, asked in sorted(self._requests.items()):
            if not asked:
                continue
            holder = self.holders.get(rank)
            incarnation = holder if holder in asked else next(iter(asked))
            chosen[rank] = incarnation
            for other in [i for i in asked if i != incarnation]:
                self._answer(
                    asked.pop(other),
                    {"refused": f"group.rank={rank} was claimed twice at once; the other consumer got it"},
                )
        if self.group is not None:
            abandon(self.group)
            self.group = None
        self.holders = {}
        self.plan = None
        if not chosen:
            return None
        self.gen += 1
        requests = {r: self._requests[r][i] for r, i in chosen.items()}
        plan = {
            "gen": self.gen,
            "members": [PRODUCER_RANK, *sorted(chosen)],
            "incarnations": {str(r): i for r, i in chosen.items()},
            "round": next_round,
            "context": self.context,
            "asks": {str(r): requests[r].get("ask", {}) for r in sorted(chosen)},
        }
        self._records.put(_k_plan(self.gen), _PLAN, plan)
        self.plan = plan
        for rank, incarnation in chosen.items():
            self._answer(self._requests[rank].pop(incarnation), {"gen": self.gen})
        self.holders = chosen
        # Where consumers reached this producer (gloo listens there), as in the rendezvous: the first one's.
        address = requests[min(chosen)]["producer_address"] or self.spec.host
        logger.info("rank 0: generation %d from round %d: %s", self.gen, next_round, ranks_text(sorted(chosen)))
        self.group = self._generation.group(plan, PRODUCER_RANK, address, producer=True)
        return self.group

    def store(self, prefix: str) -> dist.Store:
        """:meth:`_Generation.store`: the run's store under ``prefix``, for a process group that outlives the
        generations."""
        return self._generation.store(prefix)

    def asking(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that asked for a place in the next generation and have no answer yet."""
        return [r for r in ranks if self._requests.get(r)]

    def drop(self, ranks: list[int], reason: str) -> None:
        """Answer the pending requests of ``ranks`` with ``reason``: they are out of the session (each such
        consumer exits with that line), and no generation waits for them again until one of them asks anew."""
        for rank in ranks:
            asked = self._requests.get(rank, {})
            for incarnation in list(asked):
                self._answer(asked.pop(incarnation), {"dropped": reason})
            self.holders.pop(rank, None)

    def _answer(self, request: dict[str, Any], doc: dict[str, Any]) -> None:
        where = (request["rank"], request["incarnation"], request["slot"])
        self._records.put(_k_answer(*where), _ANSWER, doc)
        if "gen" not in doc:  # the consumer leaves with this answer's reason: it must be able to read it
            self._unread.append(_k_read(*where))

    def end(self, rounds: int, error: str | None) -> None:
        """The session is over (after ``rounds`` rounds, or failed with ``error``): a consumer still waiting for an
        answer learns it at once. The current generation closes as any group does."""
        try:
            self._records.put(_K_ENDED, _ENDED, {"rounds": rounds, "error": error})
        except dist.DistError as e:  # the store is this process's own; only a stranger's flood gets here
            logger.warning("rank 0: could not record the end of the session: %s", one_line(e))
        if error is not None and any(self._requests.values()):
            # Ranks waiting for an answer poll for the end: keep the store up a moment, so that they read why
            # rather than find the producer gone.
            deadline, poller = time.monotonic() + ERROR_LINGER_S, Poller()
            while time.monotonic() < deadline:
                poller.sleep(deadline)
        else:
            self._linger_for_readers()
        if self.group is not None:
            if error is not None:
                self.group.control.failed = True
            self.group.close()
        else:
            self.release()

    def _linger_for_readers(self) -> None:
        """Keep the store up, at most ``ERROR_LINGER_S``, until each consumer sent away (refused, dropped) has read
        why: one dropped just before the last round would otherwise find the producer gone and say so instead."""
        deadline, poller = time.monotonic() + ERROR_LINGER_S, Poller()
        try:
            while self._unread and time.monotonic() < deadline:
                self._unread = [key for key in self._unread if not self._records.check([key])]
                if self._unread:
                    poller.sleep(deadline)
        except dist.DistError as e:  # the store is this process's own; nothing to keep up
            logger.warning("rank 0: could not wait for consumers to read their answers: %s", one_line(e))

    def release(self) -> None:
        """Stop the store (frees the port): nothing else holds it once the generations' groups are gone."""
        self._store = None
        self._records = None


class ConsumerMembership:
    """A consumer's side: it joins (the first time, after a restart, or later than the others) and asks again after
    every generation that ended."""

    def __init__(self, spec: GroupSpec) -> None:
        check_elastic(spec)
        self.spec = spec
        deadline = time.monotonic() + spec.timeout_s
        store, self._route = join_store(spec, deadline)
        try:
            self.auth, size = await_producer(store, spec, deadline, elastic=True)
        except dist.DistError as e:
            raise _lost_producer(spec, e) from e
        if size != spec.world_size:
            raise ConfigError(
                f"group.world_size differs: the producer has {size}, consumer rank {spec.rank} has "
                f"{spec.world_size}; set the same group.world_size on every rank"
            )
        # A consumer that cannot open a gloo socket (a bogus GLOO_SOCKET_IFNAME, an interface that is down) says
        # so now, before it asks: once admitted, it would make every member wait a deadline for it to form a group.
        gloo_devices(spec, self._route.local)
        self._store = store  # held: the prefix stores below do not keep the connection alive on their own
        rstore = run_store(store, self.auth)
        self._records = RunStore(DeadlineStore(rstore, spec.timeout_s), self.auth, spec.address)
        self._generation = _Generation(spec, RunStore(rstore, self.auth, spec.address))
        self.incarnation = new_secret()[:16]
        self.plan: dict[str, Any] | None = None
        self.ask: dict[str, Any] = {}
        """What this member asks with, every time (small, JSON): producer 0 puts every member's in the plan record
        (``asks``), where each member of the generation reads the others'."""

    def join(self) -> RefitGroup | None:
        """Ask for a place in the next generation and return its group; None where the session has ended
        normally. Raises a one-line error where the producer is lost, failed, refused this consumer or did not
        answer within :func:`answer_wait_s`."""
        spec, auth = self.spec, self.auth
        wait_s = answer_wait_s(spec.timeout_s)
        request = {
            "rank": spec.rank,
            "run_id": auth.run_id,
            "incarnation": self.incarnation,
            "producer_address": self._route.producer,
            "ask": self.ask,
        }
        records = self._records
        deadline = time.monotonic() + wait_s
        try:
            n = records.add(_K_JOINS, 1)
            records.put(_k_join(n), _JOIN, request)
            poller = Poller()
            while True:
                answer = records.find_record(_k_answer(spec.rank, self.incarnation, n), _ANSWER)
                if answer is not None:
                    if "gen" not in answer:  # sent away: the producer may go once this is read
                        records.add(_k_read(spec.rank, self.incarnation, n), 1)
                    break
                ended = records.find_record(_K_ENDED, _ENDED)
                if ended is not None:
                    if ended.get("error"):
                        raise PeerError(f"rank {PRODUCER_RANK} failed: {ended['error']}")
                    logger.info("rank %d: the session ended after round %s", spec.rank, ended.get("rounds"))
                    return None
                if time.monotonic() >= deadline:
                    raise PeerError(
                        f"the producer at {spec.address} did not admit consumer rank {spec.rank} within {wait_s:g}s "
                        f"(2 x group.timeout_s); it admits consumers at round boundaries"
                    )
                poller.sleep(deadline)
            if "refused" in answer:
                raise ConfigError(str(answer["refused"]))
            if "dropped" in answer:
                raise PeerError(str(answer["dropped"]))
            gen = need(answer, "gen", int)
            plan = records.get_record(_k_plan(gen), _PLAN)
        except dist.DistError as e:
            raise _lost_producer(spec, e) from e
        if plan is None or plan.get("incarnations", {}).get(str(spec.rank)) != self.incarnation:
            raise PeerError(f"generation {gen}'s plan at {spec.address} does not list this consumer; refusing it")
        self.plan = plan
        logger.info(
            "rank %d: admitted to generation %d from round %d (%s)",
            spec.rank,
            gen,
            plan["round"],
            ranks_text(plan["members"][1:]),
        )
        return self._generation.group(plan, spec.rank, self._route.local, producer=False)

    def store(self, prefix: str) -> dist.Store:
        """:meth:`_Generation.store`: the run's store under ``prefix``, for a process group that outlives the
        generations."""
        return self._generation.store(prefix)

    def release(self) -> None:
        self._store = None
        self._records = None
