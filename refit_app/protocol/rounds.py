"""What a session round is made of: its header words, its figures (:class:`Round`), and how a failure names it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from refit_app.common.errors import PeerError, RefitError
from refit_app.common.sizes import gb_per_s
from refit_app.core.chunks import Chunk, ChunkCallback, plan_chunks
from refit_app.protocol.manifest import Manifest

ROUND_MAGIC = 0x5245_4649_5433  # "REFIT3"
"""First word of every round header: a peer that is not a refit_app session of this version is caught at once."""
MANIFEST = 1
"""Header flag: a fresh manifest follows."""
END = 2
"""Header flag: the session is over."""
DELTA = 4
"""Header flag: the round is a delta round, based on the round in the header's last word."""
PLAIN = 8
"""Header flag: a dense round the producer keeps no snapshot of (``delta="auto"`` while deltas do not pay): consumers
receive it as without deltas, and a session's copy of the model no longer holds a round."""
REGROUP = 16
"""Header flag (elastic sessions): this generation ends before the round; its members form the generation in the
header's last word (:mod:`refit_app.transport.elastic`)."""
HEADER_WORDS = 5
"""magic, round, flags, extra payload bytes, base round (0: dense)."""


@dataclass
class Round:
    """What one round moved, as both sides report it."""

    round: int
    """1 for the first round."""
    bytes: int = 0
    """The model's bytes this round brought up to date (all of them, also in a delta round)."""
    seconds: float = 0.0
    """Wall time of the data transfer, from the first chunk to the last, manifest and trailers excluded."""
    num_tensors: int = 0
    num_chunks: int = 0
    num_broadcasts: int = 0
    """Chunks that went over the wire (the planner skips empty chunks in bounded mode)."""
    manifest_sent: bool = False
    """Whether this round carried a manifest (the first round, or the tensor list changed)."""
    handshake_seconds: float = 0.0
    """Time to send and agree on the manifest; 0 where none was sent."""
    checksums: list[int] | None = None
    """The producer's per-tensor checksums, where it sent them."""
    verified: bool | None = None
    """True when this consumer checked every tensor bit for bit; None where it did not check."""
    extra: bytes = b""
    """The producer's extra payload for this round (a model probe)."""
    facts: dict[str, Any] = field(default_factory=dict)
    """Whatever ``on_round_end`` (consumer) or the caller (producer) adds: a training loss, a model check."""
    wire_bytes: int = 0
    """What crossed the group for the round's data: the packed chunks, or a delta round's stream with its chunk
    headers (round header, manifest, checksums and probe not counted)."""
    base_round: int = 0
    """The round a delta round was based on; 0 for a dense round."""
    plain: bool = False
    """A dense round sent as without deltas, the snapshot left alone (``delta="auto"`` while deltas do not pay)."""
    changed_elements: int | None = None
    """Elements whose bytes changed since the base round (delta rounds)."""
    total_elements: int | None = None
    encodings: dict[str, int] = field(default_factory=dict)
    """How many tensors went as each encoding (``dense``, ``bitmask``, ``gaps8``, ``gaps16``) in a delta round."""
    delta_seconds: float = 0.0
    """Producer: comparing and encoding (diff). Consumer: decoding and applying."""
    members: list[int] | None = None
    """The consumer ranks that took part in this round (an elastic session's generation); None otherwise."""

    @property
    def delta(self) -> bool:
        return self.base_round != 0

    @property
    def changed_fraction(self) -> float | None:
        if self.changed_elements is None or not self.total_elements:
            return None
        return self.changed_elements / self.total_elements

    @property
    def gb_per_s(self) -> float | None:
        return gb_per_s(self.bytes, self.seconds)


class ChunkCounter:
    """Counts what went over the wire in one round and forwards each chunk to the caller's callback."""

    def __init__(self, round_: Round, forward: ChunkCallback | None) -> None:
        self._round = round_
        self._forward = forward

    def __call__(self, nbytes: int, ntensors: int) -> None:
        self._round.bytes += nbytes
        self._round.num_chunks += 1
        self._round.num_tensors += ntensors
        if self._forward is not None:
            self._forward(nbytes, ntensors)


def plan_manifest(manifest: Manifest) -> list[Chunk]:
    """``manifest``'s chunks, as the chunk planner decides them (``chunk.broadcast``: which go over the wire)."""
    sizes = (t.nbytes for t in manifest.tensors)
    return plan_chunks(sizes, manifest.buffer_size_bytes, manifest.use_legacy_packing)


def round_error(round_index: int, exc: BaseException) -> str:
    """This rank's failure as the line every rank reports: the round it happened in, then the reason."""
    text = str(exc) if isinstance(exc, RefitError) else f"{type(exc).__name__}: {exc}"
    return text if text.startswith("round ") else f"round {round_index}: {text}"


def with_round(round_index: int, exc: BaseException) -> BaseException:
    """``exc`` with the round prefixed, keeping its type (a peer's error already names the round)."""
    if isinstance(exc, PeerError) or not isinstance(exc, RefitError) or str(exc).startswith(("round ", "rank ")):
        return exc
    return type(exc)(round_error(round_index, exc))
