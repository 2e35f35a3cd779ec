"""Sharded refits over one process group: ranks ``[0, K)`` are a sharded trainer's producers, each holding only its
shards; the other ranks are engine ranks, each needing only its slices. The library's entry points, on
:mod:`refit_app.core.reshard`::

    producer rank p (of K)                         consumer rank c
    specs, shards = from_tensors(model, rank=p)     needs = tp_needs(expects, c, tp_rank, tp_size, rule)
    plan = agree(pg, p, specs=specs)         <--->  plan = agree(pg, c, needs=needs, expects=expects)
    send(pg, p, plan, shards)               -----> slices = allocate(expects, needs); receive(pg, c, plan, slices)

:func:`agree` is the one collective before any data byte: every rank gives what it knows (a producer its layout of
every tensor, a consumer the boxes it needs and the dtype and global shape it expects of each), every rank gets all
of it and makes the same plan, with the settings both ends of a pair must share (buffer size, checksum, delta
rounds). A producer whose layout differs from producer 0's, or a consumer that expects another dtype or shape, or
needs a tensor nobody has, or a rank with other settings, makes every rank raise the same one-line
:class:`~refit_app.common.errors.HandshakeError` naming the first difference, within the group's timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from refit_app.common.errors import HandshakeError, PeerError
from refit_app.core.reshard.delta import ConsumerBases, ProducerDeltas, receive_delta, send_delta
from refit_app.core.reshard.plan import (
    LayoutError,
    Need,
    TensorSpec,
    Transfer,
    describe,
    digest,
    first_difference,
    plan,
    volume,
)
from refit_app.core.reshard.transfer import Held, receive_regions, send_regions
from refit_app.protocol.checksum import PIECED, checksum_function
from refit_app.protocol.delta.auto import DELTA, FACTS, KEEP, PLAIN, AgreedAuto
from refit_app.protocol.sharded_layout import (
    COLUMN,
    ROW,
    WHOLE,
    Declared,
    Expected,
    allocate,
    expected_of,
    from_tensors,
    tp_needs,
)
from refit_app.transport.pairs import TorchPairs

DEFAULT_BUFFER_BYTES = 64 << 20
DEFAULT_NUM_BUFFERS = 2
DEFAULT_CHECKSUM = PIECED
"""Plain rounds are verified by default: every region hashed by its source and checked where it lands."""


@dataclass(frozen=True)
class ShardedPlan:
    """What every rank agreed on: the transfers, and the settings both ends of every pair must share (the buffer
    size cuts the pieces and chunks, the checksum adds a trailer, delta rounds change the messages): :func:`send` and
    :func:`receive` take them from here, so the two ends cannot differ."""

    transfers: list[Transfer]
    buffer_size_bytes: int
    checksum: str | None
    """The checksum algorithm of plain rounds (:mod:`refit_app.protocol.checksum`), or None: not verified."""
    delta: bool
    digest: str
    auto: bool = False
    """Agreed with ``delta="auto"``: every round's kind chosen by all ranks together (:class:`AgreedAuto`), a delta
    round while deltas pay, else a plain round exactly as without deltas (:attr:`delta` is then True as well)."""

    def checksum_function(self) -> Callable[[Any], int] | None:
        """The function of :attr:`checksum`, or None where plain rounds are not verified."""
        return checksum_function(self.checksum) if self.checksum else None


def _check_settings(buffer_size_bytes: Any, checksum: Any) -> None:
    if buffer_size_bytes is None:
        return  # a consumer's: it takes the producers' (checked there)
    if not (isinstance(buffer_size_bytes, int) and 1 <= buffer_size_bytes <= 1 << 40):
        raise ValueError(f"buffer_size_bytes={buffer_size_bytes!r}: give a number of bytes from 1 to 1 TiB")
    if checksum is not None:
        checksum_function(checksum)  # a HandshakeError naming it where this host cannot compute it


def agree(
    pg: Any,
    rank: int,
    *,
    specs: Sequence[TensorSpec] | None = None,
    needs: Sequence[Need] = (),
    expects: Sequence[Expected] = (),
    chains: Sequence[Sequence[int]] = (),
    buffer_size_bytes: int | None = DEFAULT_BUFFER_BYTES,
    checksum: str | None = DEFAULT_CHECKSUM,
    delta: bool | str | None = False,
    names: Mapping[str, str] | None = None,
) -> ShardedPlan:
    """The plan, the same on every rank of ``pg``, before any data byte. A producer passes ``specs``
    (:func:`from_tensors`); a consumer passes ``needs`` (its own rank's) and, in ``expects``, the dtype and global
    shape it expects of each tensor it needs (the engine's model; the layout part is not compared). Every rank passes
    the same ``chains`` (replica chains, see :func:`refit_app.core.reshard.plan.plan`) and the same ``delta``
    (whether its rounds will be delta rounds: ``send(delta=...)``/``receive(bases=...)``; ``"auto"``: each round's
    kind chosen by every rank together, from what the producers measured, :class:`AgreedAuto`).

    ``buffer_size_bytes``, ``checksum`` (an algorithm of :mod:`refit_app.protocol.checksum`, or None) and ``delta``
    must be the same on every rank; the plan carries them to :func:`send` and :func:`receive`. A consumer may pass
    ``buffer_size_bytes=None`` and ``delta=None``: it takes the producers'.

    Raises HandshakeError on every rank, naming the first difference, where the ranks disagree. ``names``: what the
    caller's users set for a setting (``buffer_size_bytes``, ``checksum``, ``delta``, ``chains``), for those
    messages to name instead of this function's arguments (an application's configuration keys)."""
    if specs is not None and (buffer_size_bytes is None or delta is None):
        raise ValueError("a producer gives its buffer_size_bytes and delta; only a consumer may leave them None")
    _check_settings(buffer_size_bytes, checksum)
    if delta not in (True, False, "auto", None):
        raise ValueError(f"delta={delta!r}: give True, False or 'auto' (a consumer: None, the producers')")
    for what, items, kind in (
        ("specs", specs or (), TensorSpec),
        ("needs", needs, Need),
        ("expects", expects, Expected),
    ):
        wrong = [x for x in items if not isinstance(x, kind)]
        if wrong:
            raise TypeError(f"agree({what}=...) takes {kind.__name__} objects, not {type(wrong[0]).__name__}")
    mine = {
        "rank": rank,
        "specs": list(specs) if specs is not None else None,
        "needs": list(needs),
        "expects": [(s.name, s.dtype, tuple(s.shape)) for s in expects],
        "chains": [list(c) for c in chains],
        "settings": {
            "buffer_size_bytes": buffer_size_bytes,
            "checksum": checksum,
            "delta": delta if delta in (None, "auto") else bool(delta),
        },
    }
    gathered: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(gathered, mine, group=pg)
    transfers = _plan_from(gathered, names or {})
    # The same inputs make the same plan only where every rank runs the same planner: compare what each made.
    producers = [g for g in gathered if g["specs"] is not None]
    mine_digest = plan_digest(producers[0]["specs"], [n for g in gathered for n in g["needs"]], transfers)
    digests: list[Any] = [None] * len(gathered)
    dist.all_gather_object(digests, (rank, mine_digest), group=pg)
    for other, theirs in digests:
        if theirs != mine_digest:
            raise HandshakeError(
                f"rank {other} made another plan from the same layouts (plan digest {theirs[:12]}, here "
                f"{mine_digest[:12]}): run the same refit_app version on every rank"
            )
    settings = producers[0]["settings"]  # the same on every rank, where a consumer did not leave it None
    delta = settings["delta"]
    return ShardedPlan(
        transfers, settings["buffer_size_bytes"], checksum, bool(delta), mine_digest, auto=delta == "auto"
    )


def _plan_from(gathered: list[dict[str, Any]], names: Mapping[str, str]) -> list[Transfer]:
    """What every rank does with what all ranks gave: the same checks, in the same order, so the same outcome."""
    producers = [g for g in gathered if g["specs"] is not None]
    if not producers:
        raise HandshakeError("no rank of the group gave its tensors: a sharded refit needs at least one producer")
    first = producers[0]
    lines = describe(first["specs"], [])
    for g in producers[1:]:
        why = first_difference(lines, describe(g["specs"], []), rank=g["rank"])
        if why is not None:
            raise HandshakeError(f"producers {first['rank']} and {g['rank']} disagree on the tensors: {why}")
    known = {s.name: (s.dtype, tuple(s.shape)) for s in first["specs"]}
    producer_ranks = {g["rank"] for g in producers}
    for spec in first["specs"]:
        strangers = sorted(set(spec.layout.ranks) - producer_ranks)
        if strangers:
            raise HandshakeError(
                f"tensor {spec.name!r} lies over ranks {list(spec.layout.ranks)}, but rank {strangers[0]} gave no "
                f"tensors (the producers are ranks {sorted(producer_ranks)})"
            )
    for g in gathered:
        for key, value in g["settings"].items():
            if value != first["settings"][key] and not (value is None and key != "checksum" and g["specs"] is None):
                if key in names:
                    fix = f"give every rank the same {names[key]}"
                else:
                    fix = f"pass the same {key}= to agree() on every rank"
                raise HandshakeError(
                    f"ranks {first['rank']} and {g['rank']} disagree on {names.get(key, key)}: "
                    f"{first['settings'][key]!r} and {value!r}; {fix}"
                )
        others = sorted({n.rank for n in g["needs"]} - {g["rank"]})
        if others:
            raise HandshakeError(
                f"rank {g['rank']} gave needs for rank {others[0]}: a consumer gives its own needs only"
            )
        if g["needs"] and g["specs"] is not None:
            raise HandshakeError(f"rank {g['rank']} gave tensors and needs: a rank is a producer or a consumer")
        if g["chains"] != first["chains"]:
            fix = f": give every rank the same {names['chains']}" if "chains" in names else ""
            raise HandshakeError(
                f"ranks {first['rank']} and {g['rank']} disagree on the replica chains: {first['chains']} and "
                f"{g['chains']}{fix}"
            )
        for name, dtype, shape in g["expects"]:
            if known.get(name) != (dtype, shape):
                have = "no such tensor" if name not in known else f"{known[name][0]} {list(known[name][1])}"
                raise HandshakeError(
                    f"consumer rank {g['rank']} expects tensor {name!r} as {dtype} {list(shape)}, the producers "
                    f"have {have}"
                )
    needs = [n for g in gathered for n in g["needs"]]
    try:
        transfers = plan(first["specs"], needs, chains=first["chains"])
    except LayoutError as e:
        raise HandshakeError(str(e)) from None
    return transfers


def plan_digest(specs: Sequence[TensorSpec], needs: Sequence[Need], transfers: Sequence[Transfer]) -> str:
    """The digest of a plan and the layouts it was made from (:func:`refit_app.core.reshard.plan.digest`)."""
    return digest(describe(specs, needs), transfers)


def _check_buffers(num_buffers: Any) -> None:
    if not (isinstance(num_buffers, int) and 1 <= num_buffers <= 64):
        raise ValueError(f"num_buffers={num_buffers!r}: give 1 to 64 buffers in flight a pair")


def send(
    pg: Any,
    rank: int,
    plan: ShardedPlan,
    shards: dict[str, Held],
    *,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
    delta: ProducerDeltas | None = None,
    auto: AgreedAuto | None = None,
) -> int:
    """Send this producer's regions of ``plan``; the bytes sent. A plan agreed with ``delta=True`` takes the
    producer's state across rounds here (:class:`~refit_app.core.reshard.delta.ProducerDeltas`): only the changed
    elements of each piece go, every piece is verified and any that differs is sent again whole. One agreed with
    ``delta="auto"`` takes ``auto`` too (:class:`AgreedAuto`, kept across rounds like ``delta``): the round is of
    the kind every rank chooses at its start (:func:`choose_round`, where a session's word did not already)."""
    _check_buffers(num_buffers)
    _check_mode(plan, delta, "send(delta=ProducerDeltas())")
    _check_auto(plan, auto, "send(delta=ProducerDeltas(), auto=AgreedAuto())")
    group = TorchPairs(rank, pg)
    if auto is not None and delta is not None:
        return _send_auto(pg, group, plan, shards, num_buffers, delta, auto)
    if delta is not None:
        return _send_deltas(group, plan, shards, num_buffers, delta)
    return _send_plain(group, plan, shards, num_buffers)


def _send_plain(group: TorchPairs, plan: ShardedPlan, shards: dict[str, Held], num_buffers: int) -> int:
    return send_regions(
        group,
        plan.transfers,
        shards,
        buffer_size_bytes=plan.buffer_size_bytes,
        num_buffers=num_buffers,
        checksum=plan.checksum_function(),
    )


def _send_deltas(
    group: TorchPairs, plan: ShardedPlan, shards: dict[str, Held], num_buffers: int, delta: ProducerDeltas
) -> int:
    return send_delta(
        group, plan.transfers, shards, delta, buffer_size_bytes=plan.buffer_size_bytes, num_buffers=num_buffers
    )


def receive(
    pg: Any,
    rank: int,
    plan: ShardedPlan,
    slices: dict[str, Held],
    *,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
    bases: ConsumerBases | None = None,
    auto: AgreedAuto | None = None,
) -> int:
    """Receive this consumer's regions of ``plan`` into ``slices`` (and relay its replica's); the bytes received. A
    plan agreed with ``delta=True`` takes this consumer's state across rounds here
    (:class:`~refit_app.core.reshard.delta.ConsumerBases`); one agreed with ``delta="auto"`` takes ``auto`` too."""
    _check_buffers(num_buffers)
    _check_mode(plan, bases, "receive(bases=ConsumerBases())")
    _check_auto(plan, auto, "receive(bases=ConsumerBases(), auto=AgreedAuto())")
    group = TorchPairs(rank, pg)
    if auto is not None and bases is not None:
        kind = choose_round(pg, auto)
        started = time.perf_counter()
        if kind == PLAIN:
            moved = _receive_plain(group, plan, slices, num_buffers)
        else:
            if kind == KEEP:  # a relay's snapshot of what it sent the next replica is stale after plain rounds
                bases.relay.snapshots.clear()
            moved = receive_delta(
                group, plan.transfers, slices, bases, buffer_size_bytes=plan.buffer_size_bytes, num_buffers=num_buffers
            )
        auto.done(time.perf_counter() - started)
        return moved
    if bases is not None:
        return receive_delta(
            group, plan.transfers, slices, bases, buffer_size_bytes=plan.buffer_size_bytes, num_buffers=num_buffers
        )
    return _receive_plain(group, plan, slices, num_buffers)


def _receive_plain(group: TorchPairs, plan: ShardedPlan, slices: dict[str, Held], num_buffers: int) -> int:
    return receive_regions(
        group,
        plan.transfers,
        slices,
        buffer_size_bytes=plan.buffer_size_bytes,
        num_buffers=num_buffers,
        checksum=plan.checksum_function(),
    )


def choose_round(pg: Any, auto: AgreedAuto) -> str:
    """This round's kind under ``delta="auto"``, the same on every rank of ``pg``: every rank's facts about the last
    round gathered (one small all-gather, which every rank joins at the round's start) and decided on
    (:meth:`AgreedAuto.decide`); the kind already decided this round where a session's word carried the facts."""
    if auto.kind is None:
        rows = [torch.zeros(FACTS, dtype=torch.int64) for _ in range(dist.get_world_size(pg))]
        dist.all_gather(rows, torch.tensor(auto.facts(), dtype=torch.int64), group=pg)
        auto.decide([r.tolist() for r in rows])
    assert auto.kind is not None
    return auto.kind


def _send_auto(
    pg: Any,
    group: TorchPairs,
    plan: ShardedPlan,
    shards: dict[str, Held],
    num_buffers: int,
    delta: ProducerDeltas,
    auto: AgreedAuto,
) -> int:
    """One round of ``delta="auto"`` on a producer: a plain round as without deltas (its changes estimated from a
    sample of this producer's shards), or a delta round, or a dense round into the snapshot (``keep``: the snapshot
    emptied first, so every piece goes whole and is copied into it); this producer's measures then go into the next
    round's choice."""
    kind = choose_round(pg, auto)
    mine = [t for t in plan.transfers if t.src == group.rank]
    dense = sum(volume(t.box) * shards[t.name].tensor.element_size() for t in mine)
    started = time.perf_counter()
    if kind == PLAIN:
        sent = _send_plain(group, plan, shards, num_buffers)
        sampling = time.perf_counter()
        estimate = _sampled(auto, shards, sorted({t.name for t in mine}))
        delta.compare_seconds = time.perf_counter() - sampling
        elements = delta.total_elements  # this producer's distinct pieces, counted in the first round
        if estimate is None:
            auto.done(time.perf_counter() - started)
        else:
            changed, share = estimate
            delta.changed_elements = round(changed * elements)
            auto.done(
                time.perf_counter() - started,
                changes=round(share * dense),
                dense=dense,
                changed=delta.changed_elements,
                elements=elements,
            )
        return sent
    if kind == KEEP:
        delta.snapshots.clear()  # every piece whole, into a fresh snapshot
    sent = _send_deltas(group, plan, shards, num_buffers, delta)
    measured = kind == DELTA
    auto.done(
        time.perf_counter() - started,
        changes=sent if measured else 0,
        dense=dense if measured else 0,
        changed=delta.changed_elements if measured else 0,
        elements=delta.total_elements if measured else 0,
    )
    return sent


def _sampled(auto: AgreedAuto, shards: dict[str, Held], names: list[str]) -> tuple[float, float] | None:
    """A plain round's sample of this producer's shards (every 32nd block, :class:`~refit_app.protocol.delta.auto.
    Sampler`): the estimated share of changed elements and of the dense bytes a delta round would have taken, where
    the sample holds the last round to compare with."""
    sampler, k = auto.sampler, auto.rounds + 1
    sampler.begin(k)
    for name in names:
        t = shards[name].tensor
        flat = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)
        sampler.add(flat.numpy(), None, t.element_size())
    return sampler.end(k)


GOING = 1
ENDING = 2
REGROUP = 3
"""A rank's word at the start of a :class:`ShardedSession` round: it takes part in the round, ends the session, or
ends it for the ranks to form another group (an elastic session's round boundary with ranks asking to join)."""


class ShardedSession:
    """Rounds over one agreed plan (the layouts and the plan agreed once, as a one-producer session sends its
    manifest once), each opened by every rank's word: the round it is at and whether it goes on. A producer's
    :meth:`close` ends the session on every rank (a consumer's :meth:`receive` returns None); ranks at different
    rounds, a producer that ends while another sends, or a consumer that leaves while the producers send, make every
    rank raise in one line at that round's start, before its data. Delta state (a plan agreed with ``delta=True``)
    is kept here across rounds; under ``delta="auto"`` the word also carries every rank's facts about the last
    round, from which every rank chooses the round's kind alike (:class:`AgreedAuto`)::

        session = ShardedSession(pg, rank, plan, producer=rank < k)
        producer: for each step: session.send(shards)  ...  session.close()
        consumer: while session.receive(slices) is not None: use(slices)

    Every rank of ``pg`` must hold a session over the same plan: each round's word is a collective.
    """

    def __init__(
        self, pg: Any, rank: int, plan: ShardedPlan, *, producer: bool, num_buffers: int = DEFAULT_NUM_BUFFERS
    ):
        _check_buffers(num_buffers)
        self.pg, self.rank, self.plan, self.producer = pg, rank, plan, producer
        self.wire = pg
        """What the rounds' transfers go over: ``pg``, or a wrapper of its ``send``/``recv`` (a test's fault hooks);
        the words go over ``pg``."""
        self.num_buffers = num_buffers
        self.rounds = 0
        """Rounds done."""
        self.closed = False
        self.regrouping = False
        """The session ended at a producer's :meth:`regroup`, not for good."""
        self.deltas = ProducerDeltas() if plan.delta and producer else None
        self.bases = ConsumerBases() if plan.delta and not producer else None
        self.auto = AgreedAuto() if plan.auto else None
        """``delta="auto"``'s choice: :attr:`AgreedAuto.last` and :attr:`AgreedAuto.reason` say what the last round
        was, and why."""

    def send(self, shards: dict[str, Held]) -> int | None:
        """One round of this producer's regions; the bytes sent, or None where a producer ended the session to
        regroup (:meth:`regroup`) at its start."""
        if not self._opened("send", producer=True):
            return None
        moved = send(
            self.wire, self.rank, self.plan, shards, num_buffers=self.num_buffers, delta=self.deltas, auto=self.auto
        )
        self.rounds += 1
        return moved

    def receive(self, slices: dict[str, Held]) -> int | None:
        """One round into ``slices``; the bytes received, or None once a producer ended the session."""
        if not self._opened("receive", producer=False):
            return None
        moved = receive(
            self.wire, self.rank, self.plan, slices, num_buffers=self.num_buffers, bases=self.bases, auto=self.auto
        )
        self.rounds += 1
        return moved

    def regroup(self) -> None:
        """End the session at this round boundary for every rank to form another group (a producer's call, in an
        elastic session: :mod:`refit_app.protocol.sharded_elastic`): every rank's next ``send``/``receive`` returns
        None with :attr:`regrouping` set."""
        if not self.producer:
            raise ValueError(f"rank {self.rank}: regroup() is a producer's call")
        if not self.closed:
            self._word(REGROUP)
            self.closed = self.regrouping = True

    def close(self) -> None:
        """End the session on every rank (a producer's, called by every producer together; a consumer's: it
        leaves, and the producers' next round stops in one line). A no-op once the session is over."""
        if not self.closed:
            self._word(ENDING)
            self.closed = True

    def _opened(self, call: str, *, producer: bool) -> bool:
        if producer != self.producer:
            raise ValueError(f"rank {self.rank}: {call}() is a {'producer' if producer else 'consumer'}'s call")
        if self.closed:
            if producer:
                raise RuntimeError(f"rank {self.rank}: the session is closed: no round to send")
            return False
        return self._word(GOING)

    def _word(self, word: int) -> bool:
        """Every rank's word at round ``rounds + 1``; True where the round goes on."""
        k = self.rounds + 1
        facts = self.auto.facts() if self.auto is not None else []
        mine = torch.tensor([k, word, int(self.producer), *facts], dtype=torch.int64)
        words = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.pg))]
        dist.all_gather(words, mine, group=self.pg)
        said = [(r, *(int(x) for x in w[:3])) for r, w in enumerate(words)]
        for r, at, _, _ in said:
            if at != k:
                raise PeerError(f"rank {r} is at round {at} of the session, rank {self.rank} at round {k}")
        if any(w == REGROUP for _, _, w, _ in said):
            self.closed = self.regrouping = True
            return False
        ending = [(r, is_producer) for r, _, w, is_producer in said if w == ENDING]
        if not ending:
            if self.auto is not None:
                self.auto.decide([w[3:].tolist() for w in words])
            return True
        self.closed = True
        going = [r for r, _, w, is_producer in said if w == GOING and is_producer]
        enders = [r for r, is_producer in ending if is_producer]
        if enders and going:
            raise PeerError(f"producer {enders[0]} ended the session at round {k} while producer {going[0]} sent it")
        if not enders:
            if word == ENDING:
                return False
            raise PeerError(f"consumer {ending[0][0]} left the session before round {k}")
        return False


def _check_auto(plan: ShardedPlan, auto: AgreedAuto | None, how: str) -> None:
    if plan.auto and auto is None:
        raise ValueError(f"the plan was agreed with delta='auto': call {how}")
    if not plan.auto and auto is not None:
        raise ValueError("the plan was agreed without delta='auto': agree(..., delta='auto') on every rank first")


def _check_mode(plan: ShardedPlan, state: Any, how: str) -> None:
    if plan.delta and state is None:
        raise ValueError(f"the plan was agreed with delta=True: call {how}")
    if not plan.delta and state is not None:
        raise ValueError("the plan was agreed without delta rounds: agree(..., delta=True) on every rank first")


__all__ = [
    "COLUMN",
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_CHECKSUM",
    "DEFAULT_NUM_BUFFERS",
    "ROW",
    "WHOLE",
    "Declared",
    "Expected",
    "ShardedPlan",
    "ShardedSession",
    "agree",
    "allocate",
    "choose_round",
    "expected_of",
    "from_tensors",
    "plan_digest",
    "receive",
    "send",
    "tp_needs",
]
