"""Delta rounds of a sharded refit: each producer compares only its own pieces with what it sent last round and
sends each consumer only the elements whose bytes changed, exact to the bit. The producers compare in parallel, each
its share of the model.

Per (producer, consumer) pair, a round goes::

    consumer                                          producer
    base flag (1: my pieces hold last round's bytes) ---->
                                                       compare each piece with its snapshot (updated as it goes)
                  <---- length, then the pair's records (the delta codec's, one per changed piece; DENSE where a
                        piece changed too much, or every piece where the flag was 0), in buffer-sized slices
                  <---- each piece's xxh3_64 of its bytes now
    apply the records, hash each piece, compare: a piece that differs is named (RegionMismatch)

The consumer vouches for its base by the bytes it holds: the hashes it checked last round are what its pieces must
still hash to, so a piece written since (a load that writes through ``.data`` included) makes its pair dense rather
than wrong. Every round is verified, delta or dense: the hashes are of the pieces' whole bytes after the round, so
a wrong base or a lost record can never pass silently. Replica chains are not served by delta rounds yet.

Memory: a producer keeps a snapshot of the bytes it sent (its shards' share the plan sends, once per distinct
piece); a consumer keeps one hash per piece.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from refit_app.core.delta.codec import DENSE, END, RECORD, Changes, Encoded, apply_record, diff, encode, padded
from refit_app.core.reshard.plan import Box, LayoutError, Transfer
from refit_app.core.reshard.transfer import (
    Held,
    Pair,
    PairGroup,
    RegionMismatch,
    as_words,
    pair_streams,
    wait_for,
)


def _bytes_of(view: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A piece's bytes as a flat uint8 array, and whether it is the piece's own memory (else a copy)."""
    if view.is_contiguous():
        return view.reshape(-1).view(torch.uint8).numpy(), True
    return view.contiguous().reshape(-1).view(torch.uint8).numpy(), False


def _hash(data: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(data))


@dataclass
class ProducerDeltas:
    """A producer's state across rounds: the bytes of every piece as last sent (key: tensor name and box)."""

    snapshots: dict[tuple[str, Box], np.ndarray] = field(default_factory=dict)
    changed_elements: int = 0
    total_elements: int = 0


@dataclass
class ConsumerBases:
    """A consumer's state across rounds: each piece's hash as verified at the end of the last round."""

    hashes: dict[tuple[str, Box], int] = field(default_factory=dict)


@dataclass
class _Piece:
    """One piece this round on the producer: its records' parts and its hash, computed once for every pair."""

    changes: Changes | None  # None: the piece goes whole
    current: np.ndarray
    digest: int


def _compare(t: Transfer, held: Mapping[str, Held], state: ProducerDeltas) -> _Piece:
    view = held[t.name].region(t.box)
    current, _ = _bytes_of(view)
    itemsize = view.element_size()
    key = (t.name, t.box)
    snapshot = state.snapshots.get(key)
    hasher = xxhash.xxh3_64()
    state.total_elements += current.size // itemsize
    if snapshot is None:
        state.snapshots[key] = current.copy()
        hasher.update(memoryview(current))
        state.changed_elements += current.size // itemsize
        return _Piece(None, current, hasher.intdigest())
    found = diff(current, snapshot, itemsize, update=True, hasher=hasher)
    state.changed_elements += found.count
    return _Piece(found if isinstance(found, Changes) else None, current, hasher.intdigest())


def _record(index: int, piece: _Piece, itemsize: int, dense: bool) -> list[bytes | np.ndarray]:
    """One piece's record: its header, positions and values, each padded as the codec's stream format says."""
    numel = piece.current.size // itemsize
    if dense or piece.changes is None:
        encoded, values = Encoded(DENSE, 0, numel, 0, b""), piece.current
    else:
        if not piece.changes.count:
            return []
        encoded = encode(piece.changes.positions, numel, itemsize)
        values = piece.current if encoded.encoding == DENSE else piece.changes.values
    parts: list[bytes | np.ndarray] = [encoded.header(index, values.size)]
    for section in (np.frombuffer(bytes(encoded.positions), dtype=np.uint8), values):
        parts += [section, bytes(padded(section.size) - section.size)]
    return parts


def _blob(parts: list[bytes | np.ndarray]) -> torch.Tensor:
    out = np.empty(sum(len(p) if isinstance(p, bytes) else p.size for p in parts), dtype=np.uint8)
    at = 0
    for p in parts:
        n = len(p) if isinstance(p, bytes) else p.size
        out[at : at + n] = np.frombuffer(p, dtype=np.uint8) if isinstance(p, bytes) else p
        at += n
    return torch.from_numpy(out)


def _slices(n: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _no_chains(transfers: Sequence[Transfer]) -> None:
    if any(t.relayed for t in transfers):
        raise LayoutError("delta rounds of a sharded refit do not serve replica chains yet: send dense rounds")


def send_delta(
    group: PairGroup,
    transfers: Sequence[Transfer],
    shards: Mapping[str, Held],
    state: ProducerDeltas,
    *,
    buffer_size_bytes: int,
    num_buffers: int,
) -> int:
    """One round of this producer's pairs as delta records (dense for a pair whose consumer cannot vouch for its
    base, and in the first round); returns the bytes sent."""
    _no_chains(transfers)
    pairs = pair_streams([t for t in transfers if t.src == group.rank], shards, "dst", buffer_size_bytes)
    flags = {p.peer: torch.zeros(1, dtype=torch.int64) for p in pairs}
    asked = [(p.peer, group.irecv(flags[p.peer], p.peer)) for p in pairs]
    pieces: dict[tuple[str, Box], _Piece] = {}
    for pair in pairs:
        for t in pair.regions:
            if (t.name, t.box) not in pieces:
                pieces[(t.name, t.box)] = _compare(t, shards, state)
    for peer, work in asked:
        wait_for(work, group, peer, "receiving the base flag from")
    blobs, sent = [], 0
    for pair in pairs:
        dense = not int(flags[pair.peer])
        parts: list[bytes | np.ndarray] = []
        for i, t in enumerate(pair.regions):
            parts += _record(i, pieces[(t.name, t.box)], shards[t.name].tensor.element_size(), dense)
        parts.append(RECORD.pack(END, 0, 0, 0, 0, 0, 0, 0))
        blob = _blob(parts)
        hashes = as_words([pieces[(t.name, t.box)].digest for t in pair.regions])
        blobs.append((pair, blob, hashes))
        sent += blob.numel()
    _send_blobs(group, blobs, buffer_size_bytes, num_buffers)
    return sent


def _send_blobs(
    group: PairGroup, blobs: list[tuple[Pair, torch.Tensor, torch.Tensor]], step: int, num_buffers: int
) -> None:
    """Every pair's length, then its blob in slices (at most ``num_buffers`` in flight a pair, pairs in turn), then
    its hashes."""
    works = []
    for pair, blob, _ in blobs:
        length = torch.tensor([blob.numel()], dtype=torch.int64)
        works.append((pair.peer, group.isend(length, pair.peer), length))
    queues = [(pair, blob, _slices(blob.numel(), step), hashes) for pair, blob, hashes in blobs]
    in_flight: dict[int, list] = {pair.peer: [] for pair, *_ in blobs}
    position = dict.fromkeys(in_flight, 0)
    while any(position[p.peer] < len(s) for p, _, s, _ in queues):
        for pair, blob, slices, _ in queues:
            if position[pair.peer] >= len(slices):
                continue
            mine = in_flight[pair.peer]
            if len(mine) >= num_buffers:
                wait_for(mine.pop(0), group, pair.peer, "sending to")
            a, b = slices[position[pair.peer]]
            mine.append(group.isend(blob[a:b], pair.peer))
            position[pair.peer] += 1
    for pair, _, _, hashes in queues:
        works.append((pair.peer, group.isend(hashes, pair.peer), hashes))
    for peer, flying in in_flight.items():
        for work in flying:
            wait_for(work, group, peer, "sending to")
    for peer, work, _ in works:
        wait_for(work, group, peer, "sending to")


def receive_delta(
    group: PairGroup,
    transfers: Sequence[Transfer],
    slices: Mapping[str, Held],
    bases: ConsumerBases,
    *,
    buffer_size_bytes: int,
    num_buffers: int,
    check_base: bool = True,
) -> int:
    """One round of this consumer's pairs: say whether its pieces hold last round's bytes (with ``check_base``, by
    hashing them), apply what arrives, verify every piece; returns the bytes received."""
    _no_chains(transfers)
    pairs = pair_streams([t for t in transfers if t.dst == group.rank], slices, "src", buffer_size_bytes)
    flags = {}
    for pair in pairs:
        ok = all((t.name, t.box) in bases.hashes for t in pair.regions)
        if ok and check_base:
            ok = all(
                _hash(_bytes_of(slices[t.name].region(t.box))[0]) == bases.hashes[(t.name, t.box)] for t in pair.regions
            )
        flags[pair.peer] = torch.tensor([int(ok)], dtype=torch.int64)
    told = [(p.peer, group.isend(flags[p.peer], p.peer)) for p in pairs]
    lengths = {p.peer: torch.zeros(1, dtype=torch.int64) for p in pairs}
    for pair in pairs:
        wait_for(group.irecv(lengths[pair.peer], pair.peer), group, pair.peer, "receiving from")
    blobs = {p.peer: torch.empty(int(lengths[p.peer]), dtype=torch.uint8) for p in pairs}
    queues = {p.peer: _slices(blobs[p.peer].numel(), buffer_size_bytes) for p in pairs}
    position = dict.fromkeys(blobs, 0)
    in_flight: dict[int, list] = {peer: [] for peer in blobs}
    while any(position[peer] < len(queues[peer]) or in_flight[peer] for peer in blobs):
        for peer, blob in blobs.items():
            mine = in_flight[peer]
            while position[peer] < len(queues[peer]) and len(mine) < num_buffers:
                a, b = queues[peer][position[peer]]
                mine.append(group.irecv(blob[a:b], peer))
                position[peer] += 1
            if mine:
                wait_for(mine.pop(0), group, peer, "receiving from")
    received = 0
    for pair in pairs:
        _apply(pair, blobs[pair.peer], slices)
        received += blobs[pair.peer].numel()
        theirs = torch.empty(len(pair.regions), dtype=torch.int64)
        wait_for(group.irecv(theirs, pair.peer), group, pair.peer, "receiving the hashes from")
        _verify(group, pair, theirs, slices, bases)
    for peer, work in told:
        wait_for(work, group, peer, "sending to")
    return received


def _apply(pair: Pair, blob: torch.Tensor, slices: Mapping[str, Held]) -> None:
    """Write a pair's records into the pieces they name."""
    data, at = blob.numpy(), 0
    while True:
        if at + RECORD.size > data.size:
            raise ValueError(f"the delta records from rank {pair.peer} end without their end record")
        index, encoding, flags, _, count, escapes, positions_nbytes, values_nbytes = RECORD.unpack_from(data, at)
        at += RECORD.size
        if index == END:
            return
        if index >= len(pair.regions) or flags or at + padded(positions_nbytes) + padded(values_nbytes) > data.size:
            raise ValueError(
                f"a delta record from rank {pair.peer} is not one this round sends (piece {index} of "
                f"{len(pair.regions)}, flags {flags}, {positions_nbytes} + {values_nbytes} bytes)"
            )
        t = pair.regions[index]
        view = slices[t.name].region(t.box)
        target, own = _bytes_of(view)
        section = data[at : at + positions_nbytes]
        at += padded(positions_nbytes)
        values = data[at : at + values_nbytes]
        at += padded(values_nbytes)
        if encoding == DENSE:
            if values.size != target.size:
                raise ValueError(f"a dense record of {values.size} bytes for a piece of {target.size}")
            np.copyto(target, values)
        else:
            apply_record(target, encoding, section, count, escapes, values, view.element_size())
        if not own:
            view.copy_(torch.from_numpy(target).view(view.dtype).view(view.shape))


def _verify(
    group: PairGroup, pair: Pair, theirs: torch.Tensor, slices: Mapping[str, Held], bases: ConsumerBases
) -> None:
    for t, sent in zip(pair.regions, theirs.tolist()):
        mine = _hash(_bytes_of(slices[t.name].region(t.box))[0])
        if as_words([mine]).item() != sent:
            bases.hashes.pop((t.name, t.box), None)
            raise RegionMismatch(
                f"rank {group.rank}: region {list(t.box)} of tensor {t.name!r} from rank {t.src} holds other bytes "
                "than the producer's after a delta round (checksums differ)"
            )
        bases.hashes[(t.name, t.box)] = mine


__all__ = ["ConsumerBases", "ProducerDeltas", "receive_delta", "send_delta"]
