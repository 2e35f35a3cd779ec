"""``delta="auto"``: which kind each round is, from what the rounds before it measured.

Three kinds of round (:data:`KINDS`):

- ``delta``: only the changes, against the snapshot (:mod:`refit_app.protocol.delta.send`);
- ``keep``: dense, packed into the snapshot as it is sent (consumers with a copy receive into it), so the round
  after it can be a delta round;
- ``plain``: dense as with ``delta="off"``, through the rotating send buffers, the snapshot left alone: a dense
  round that keeps a snapshot writes the whole model into memory that is not in cache on both sides, which costs
  ~18% of a loopback round here (``python -m refit_app.bench --delta-shares 0.5``). While deltas do not pay,
  ``auto`` sends plain rounds and estimates the changes from a sample it keeps instead (:class:`Sampler`, 1/32 of
  the model).

:class:`AutoPolicy` starts on deltas and measures: the first round (cold: the session's first transfers) is no
reference, so after the first delta round a warm ``keep`` round is timed; a delta round that is not clearly faster
than that (under 3/4 of its time: :data:`CLEARLY_FASTER`) is measured against a plain round. A delta round slower
than the dense reference (the last plain round, else the last warm ``keep`` round), or changes over
:data:`AUTO_SHARE` of the dense bytes, switch it to plain rounds; it tries deltas again (a ``keep`` round, then a
delta round) once the changes are half as many as when it switched, after :data:`AUTO_RETRY_ROUNDS` rounds, or
once a plain round took longer than the last delta round (it lost to a ``keep`` round, which is not always the
dearer: in a sharded refit a plain round can be the slower).
Over a link, where a dense round is the transfer, this costs one extra dense round per session; on loopback, a few.
"""

from __future__ import annotations

import numpy as np

from refit_app.core.delta.codec import DENSE_ABOVE
from refit_app.protocol.defaults import AUTO_RETRY_ROUNDS, AUTO_SHARE

DELTA, KEEP, PLAIN = "delta", "keep", "plain"
KINDS = (DELTA, KEEP, PLAIN)

CLEARLY_FASTER = 0.75
"""A delta round that takes under this share of a ``keep`` round's time is faster than a plain round too (a ``keep``
round costs up to ~18% more than a plain one), so no plain round is measured; one slower than that is measured
against a plain round, and so is every delta round against a plain figure older than :data:`AUTO_RETRY_ROUNDS`
delta rounds unless it is this much faster than it."""
SAMPLE_EVERY = 32
SAMPLE_BLOCK = 64 * 1024
"""The sample: every :data:`SAMPLE_EVERY`-th block of this many bytes of each tensor (the first always)."""


class AutoPolicy:
    """The state behind ``auto``'s choice: :meth:`choose` before a round, :meth:`observe` after it."""

    def __init__(self) -> None:
        self.share: float | None = None
        """The last round's share of the dense bytes that its changes took (measured in a delta round, else
        estimated from the sample); None before any."""
        self.changed: float | None = None
        """The last round's share of changed elements (counted in a delta round, else estimated); None before any."""
        self.plain = False
        """Deltas did not pay: plain rounds until :meth:`_retry` says try again."""
        self._lost_at: float = 0.0
        self._since_loss = 0
        self._dense: dict[str, float | None] = {KEEP: None, PLAIN: None}
        """The last warm dense round's seconds, by kind."""
        self._probe: str | None = None
        """A dense round to measure next, by kind."""
        self._since_reference = 0
        self._delta: float | None = None
        """The last delta round's seconds."""
        self._lost_why = ""
        self._plain_slower = ""
        """Why to try deltas again at once: a plain round took longer than the last delta round (the dense round
        it lost to was one into the snapshot, and plain rounds are not always the cheaper: a sharded refit's)."""
        self.reason = ""
        """Why :meth:`choose` chose what it last chose, in a few words (a round's metrics carry it)."""

    def choose(self, can_delta: bool) -> str:
        """This round's kind; ``can_delta``: the snapshot holds the round every consumer holds."""
        if self.plain:
            if self._retry():
                return KEEP
            self.reason = (
                self._share_why()
                if self.share is not None and self.share >= AUTO_SHARE
                else f"deltas did not pay: {self._lost_why}"
            )
            return PLAIN
        if not can_delta:
            self.reason = "a dense round into the snapshot: it does not hold the last round"
            return KEEP
        if self.share is not None and self.share >= AUTO_SHARE:
            self._lose(self._share_why())
            self.reason = self._lost_why
            return PLAIN
        probe, self._probe = self._probe, None
        if probe == KEEP:
            self.reason = "a warm dense round into the snapshot, to time the delta rounds against"
        elif probe == PLAIN:
            self.reason = "a plain round, to time the last delta round against"
        else:
            self.reason = (
                "a delta round: nothing measured yet says deltas do not pay"
                if self.share is None
                else f"deltas pay: the changes took {self.share:.1%} of the dense bytes"
            )
        return probe or DELTA

    def observe(self, kind: str, seconds: float, *, cold: bool = False) -> None:
        """A round of ``kind`` took ``seconds``; ``cold``: it was the first round of a fresh snapshot (its time is
        no reference: the first transfers of a session cost more)."""
        if kind != DELTA:
            if cold:
                return
            self._dense[kind] = seconds
            if kind == PLAIN and self.plain and self._delta is not None and seconds > self._delta:
                self._plain_slower = f"a plain round took {seconds:.3g} s, the last delta round {self._delta:.3g} s"
            if kind == PLAIN and not self.plain and self._delta is not None and self._delta > seconds:
                # the plain round measured after a delta round: the delta round was slower
                self._lose(f"a delta round took {self._delta:.3g} s, a plain one {seconds:.3g} s")
            return
        self._delta = seconds
        self._since_reference += 1
        plain, keep = self._dense[PLAIN], self._dense[KEEP]
        reference = plain if plain is not None else keep
        if reference is None:
            self._probe = KEEP  # only the cold first round to go by: measure a warm dense one
        elif seconds > reference:
            self._lose(f"a delta round took {seconds:.3g} s, a dense one {reference:.3g} s")
        elif seconds > CLEARLY_FASTER * reference and (plain is None or self._since_reference >= AUTO_RETRY_ROUNDS):
            # Not clearly faster than a dense round that wrote the snapshot, or than a plain round measured long
            # ago: measure a plain one now.
            self._probe = PLAIN
            self._since_reference = 0

    def _share_why(self) -> str:
        return f"the changes took {self.share:.0%} of the dense bytes ({AUTO_SHARE:.0%} or more)"

    def _lose(self, why: str) -> None:
        self.plain = True
        self._lost_why = why
        self._probe = None
        self._lost_at = self.changed or 0.0
        self._since_loss = 0

    def _retry(self) -> bool:
        """In plain rounds: whether to try deltas again (from the next round, a ``keep`` one)."""
        self._since_loss += 1
        slower, self._plain_slower = self._plain_slower, ""
        if self.share is not None and self.share >= AUTO_SHARE:
            return False
        sparser = self.changed is not None and self.changed < 0.5 * self._lost_at
        if slower or sparser or self._since_loss >= AUTO_RETRY_ROUNDS:
            self.plain = False
            if slower:
                why = slower
            elif sparser:
                why = f"{self.changed:.2%} of the elements changed, under half of {self._lost_at:.2%}"
            else:
                why = f"{self._since_loss} plain rounds"
            self.reason = f"trying deltas again ({why}): a dense round into the snapshot first"
            return True
        return False


FACTS = 5
"""A rank's facts about the last round of a sharded refit, as integers (:meth:`AgreedAuto.facts`): its seconds in
nanoseconds; a producer's bytes of changes, its dense bytes, its changed elements and its elements (all 0 where it
measured nothing)."""


class AgreedAuto:
    """``auto`` over a sharded plan, where K producers each compare only their own shards: every rank of the group
    holds one, and before each round every rank's :meth:`facts` about the last round are gathered (one small
    collective every rank takes part in anyway) and given to :meth:`decide` on every rank, which feeds one
    :class:`AutoPolicy` the same combined figures everywhere, so every rank makes the same choice without another
    message: the round's time is its slowest rank's, the share of the dense bytes the changes took and the share of
    changed elements the producers' sums (each measured its own shards, in a delta round by its records, in a plain
    round estimated from its :class:`Sampler`)."""

    def __init__(self) -> None:
        self.policy = AutoPolicy()
        self.sampler = Sampler()
        self.rounds = 0
        """Rounds done."""
        self.kind: str | None = None
        """This round's kind once decided (:meth:`decide`), until it is done (:meth:`done`)."""
        self.last: str | None = None
        """The last round's kind."""
        self.reason = ""
        """Why this round is of its kind."""
        self._facts = [0] * FACTS

    @property
    def measured(self) -> bool:
        """This rank measured its shards' changes in its last round (a delta round, or a plain round whose sample
        had the round before it to compare with)."""
        return self._facts[2] != 0

    def facts(self) -> list[int]:
        """This rank's facts about its last round (:data:`FACTS`)."""
        return list(self._facts)

    def decide(self, rows: list[list[int]]) -> str:
        """This round's kind, from every rank's :meth:`facts` (the same ``rows`` on every rank: the same kind)."""
        if self.kind is not None:
            raise RuntimeError("decide() twice for one round: a round's kind is decided once, then done()")
        if self.rounds:
            dense, elements = sum(r[2] for r in rows), sum(r[4] for r in rows)
            if dense and elements:  # the producers measured the last round (not a plain one without a sample)
                self.policy.share = sum(r[1] for r in rows) / dense
                self.policy.changed = sum(r[3] for r in rows) / elements
            assert self.last is not None
            self.policy.observe(self.last, max(r[0] for r in rows) / 1e9, cold=self.rounds == 1)
        self.kind = self.policy.choose(self.last in (DELTA, KEEP))
        self.reason = self.policy.reason if self.rounds else "the first round: dense, into the snapshot"
        return self.kind

    def done(self, seconds: float, *, changes: int = 0, dense: int = 0, changed: int = 0, elements: int = 0) -> None:
        """This rank's round is done: it took ``seconds``; a producer that measured its shards gives its bytes of
        ``changes`` against its ``dense`` bytes and its ``changed`` elements of ``elements``."""
        self._facts = [round(seconds * 1e9), changes, dense, changed, elements]
        self.last, self.kind = self.kind, None
        self.rounds += 1


class Sampler:
    """A sample of the last round's bytes (every :data:`SAMPLE_EVERY`-th block of each tensor), to estimate each
    round's changes without a snapshot: the share of changed elements, and the share of the dense bytes a delta
    round would take (a tensor over :data:`~refit_app.core.delta.codec.DENSE_ABOVE` changed goes whole; else each change
    takes its value and about a byte of position)."""

    def __init__(self) -> None:
        self.round = 0
        """The round the kept sample holds (0: none)."""
        self._kept: list[np.ndarray] = []
        self._new: list[np.ndarray] = []
        self._compare = False
        self._sums = [0.0, 0, 0.0, 0]  # changed elements, elements, delta bytes, dense bytes

    def begin(self, round_index: int) -> None:
        """Round ``round_index`` begins: its tensors follow, in order, through :meth:`add`."""
        self._new, self._sums = [], [0.0, 0, 0.0, 0]
        self._compare = self.round != 0 and self.round == round_index - 1

    def add(self, new: np.ndarray, old: np.ndarray | None, itemsize: int) -> None:
        """The next tensor's bytes; ``old``: its last round's bytes in full where the snapshot holds them, else
        the kept sample is compared (where it holds the last round)."""
        blocks = sample_blocks(new)
        index = len(self._new)
        self._new.append(blocks)
        if old is not None:
            before = sample_blocks(old)
        elif self._compare and index < len(self._kept):
            before = self._kept[index]
        else:
            return
        words = blocks.size // 8
        if not words or before.size != blocks.size:
            return
        changed = int(np.count_nonzero(blocks[: words * 8].view(np.uint64) != before[: words * 8].view(np.uint64)))
        lanes = max(1, 8 // itemsize)
        # Words that changed -> elements that changed, were the changes spread evenly.
        fraction = 1 - (1 - changed / words) ** (1 / lanes)
        elements = new.size // itemsize
        whole = new.size > SAMPLE_BLOCK and fraction > DENSE_ABOVE
        sums = self._sums
        sums[0] += fraction * elements
        sums[1] += elements
        sums[2] += new.size if whole else min(new.size, fraction * elements * (itemsize + 1))
        sums[3] += new.size

    def end(self, round_index: int) -> tuple[float, float] | None:
        """The round is sent: its sample is kept; returns its estimated (share of changed elements, share of the
        dense bytes as a delta round), where the sample had the last round to compare with."""
        self._kept, self._new = self._new, []
        self.round = round_index
        changed, elements, delta_bytes, dense_bytes = self._sums
        return (changed / elements, delta_bytes / dense_bytes) if elements and dense_bytes else None

    def drop(self) -> None:
        self._kept, self._new, self.round = [], [], 0


def sample_blocks(data: np.ndarray) -> np.ndarray:
    """Every :data:`SAMPLE_EVERY`-th block of :data:`SAMPLE_BLOCK` bytes of ``data`` (uint8), copied into one
    array."""
    if data.size <= SAMPLE_BLOCK:
        return data.copy()
    step = SAMPLE_BLOCK * SAMPLE_EVERY
    return np.concatenate([data[start : start + SAMPLE_BLOCK] for start in range(0, data.size, step)])
