"""Delta rounds of a sharded refit: each producer compares only its own pieces with what it sent last round and
sends each consumer only the elements whose bytes changed, exact to the bit. The producers compare in parallel, each
its share of the model.

Per (producer, consumer) pair, a round goes::

    producer                                          consumer
    compare each piece with its snapshot (updated as it goes)
    length, then the pair's records (the delta codec's: one per changed piece; DENSE where a piece changed too much,
    and every piece in the first round), in buffer-sized slices ---->
    each piece's xxh3_64 of its bytes now ---------------------->
                                                      apply the records, hash every piece, compare
                  <---- the pieces whose hash differs (a base written since, even behind torch's back)
    those pieces whole ---------------------------------------->
                                                      apply, hash, compare: a piece that still differs is named
                                                      (RegionMismatch), the round fails

So a consumer never claims a base: what it holds after the round is checked against the producer's bytes, and a
piece that was not what the producer's snapshot says (written since, or anything else) is sent again whole in the
same round. One pass over the consumer's pieces a round (the verification); ``receive`` returns only once every
piece is verified.

Replica chains: a consumer whose replica passes its pieces on to the next one is that one's producer once its own
pieces are exact: it compares what it now holds with what it sent the next replica last round and sends the changes
the same way (records, hashes, the pieces that differ again whole), so each replica is checked against the bytes of
the one before it, which were checked against the producers'. A delta round goes down the chain a replica at a time
(a dense round forwards each piece as it lands).

Memory: a producer keeps a snapshot of the bytes it sent (its shards' share the plan sends, once per distinct
piece), and so does a consumer that relays to the next replica (a copy of its slices); any other consumer keeps
nothing but a count of what it had to repair.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from refit_app.common.errors import one_line
from refit_app.core.delta.codec import DENSE, END, RECORD, Changes, Encoded, apply_record, diff, encode, padded
from refit_app.core.reshard.plan import Box, Transfer, volume
from refit_app.core.reshard.transfer import (
    Held,
    Pair,
    PairGroup,
    RegionMismatch,
    as_words,
    pair_streams,
    wait_for,
)

DEFAULT_APPLY_THREADS = 2
"""Threads a consumer applies and hashes its pairs on (a pair each). Its work comes after the producers', when their
cores are idle, and is most of a round's last stage (from 4 producers of 1 GB: 1 GB applied and hashed, about 0.14
core-seconds); two can halve it where a second core is free, without taking every core of an engine's host. Measured
beside other sessions' work only, where it changed neither the CPU a round costs nor, beyond the noise, its time."""

_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""An integer dtype of each element size, so that numpy can see any tensor's elements (bf16, fp8, bool)."""


def _strided(view: torch.Tensor) -> np.ndarray | None:
    """A non-contiguous piece as a numpy view of its own memory (same strides), or None where its element size has
    no integer dtype. numpy copies it on one thread: torch's copy of a strided tensor splits it over its intra-op
    threads, which costs 100x more where other processes hold the cores (a busy host, or K ranks on one)."""
    same = _SAME_SIZE.get(view.element_size())
    return None if same is None else view.view(same).numpy()


def _bytes_of(view: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A piece's bytes as a flat uint8 array, and whether it is the piece's own memory (else a copy)."""
    if view.is_contiguous():
        return view.reshape(-1).view(torch.uint8).numpy(), True
    strided = _strided(view)
    if strided is not None:
        return np.ascontiguousarray(strided).reshape(-1).view(np.uint8), False
    return view.contiguous().reshape(-1).view(torch.uint8).numpy(), False


def _hash(data: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(data))


@dataclass
class ProducerDeltas:
    """A producer's state across rounds: the bytes of every piece as last sent (key: tensor name and box), and
    the last round's figures."""

    snapshots: dict[tuple[str, Box], np.ndarray] = field(default_factory=dict)
    changed_elements: int = 0
    """Last round: the elements of this producer's distinct pieces whose bytes changed (every one in the first)."""
    total_elements: int = 0
    """Last round: the elements of this producer's distinct pieces."""
    compare_seconds: float = 0.0
    """Last round: the time spent comparing the pieces with their snapshots and encoding the pairs' records."""


@dataclass
class ConsumerBases:
    """A consumer's state across rounds: how many pieces it had to have sent again whole, last round and in all
    (a base written since, or a round's first)."""

    repaired: int = 0
    repaired_total: int = 0
    apply_seconds: float = 0.0
    """Last round: the time spent applying the records and hashing the pieces (repairs included)."""
    relay: ProducerDeltas = field(default_factory=ProducerDeltas)
    """A consumer that passes its pieces on to the next replica of its chain: what it sent that one last round."""
    written: set[str] = field(default_factory=set)
    """Last round: the tensors some record wrote into (changes, pieces whole, repairs); the others kept their bytes,
    so an engine that loads from its slices need load only these again."""


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
    pairs = pair_streams([t for t in transfers if t.src == group.rank], shards, "dst", buffer_size_bytes, group.rank)
    pieces: dict[tuple[str, Box], _Piece] = {}
    started = time.perf_counter()
    state.changed_elements = state.total_elements = 0
    for pair in pairs:
        for t in pair.regions:
            if (t.name, t.box) not in pieces:
                pieces[(t.name, t.box)] = _compare(t, shards, state)
    blobs, sent = [], 0
    for pair in pairs:
        blob = _pair_blob(pair, range(len(pair.regions)), pieces, shards, dense=False)
        hashes = as_words([pieces[(t.name, t.box)].digest for t in pair.regions])
        blobs.append((pair, blob, hashes))
        sent += blob.numel()
    state.compare_seconds = time.perf_counter() - started
    _send_blobs(group, blobs, buffer_size_bytes, num_buffers)
    # Each consumer answers with the pieces it holds other bytes of; they go again, whole.
    verdicts = {p.peer: torch.zeros(len(p.regions), dtype=torch.int64) for p in pairs}
    for pair in pairs:
        wait_for(group.irecv(verdicts[pair.peer], pair.peer), group, pair.peer, "receiving the verdict from")
    repairs = []
    for pair in pairs:
        bad = [i for i, flag in enumerate(verdicts[pair.peer].tolist()) if flag]
        if bad:
            blob = _pair_blob(pair, bad, pieces, shards, dense=True)
            repairs.append((pair, blob, None))
            sent += blob.numel()
    _send_blobs(group, repairs, buffer_size_bytes, num_buffers)
    return sent


def _pair_blob(
    pair: Pair,
    indices: Sequence[int] | range,
    pieces: Mapping[tuple[str, Box], _Piece],
    shards: Mapping[str, Held],
    *,
    dense: bool,
) -> torch.Tensor:
    """The records of ``pair``'s pieces ``indices`` (whole with ``dense``), ended by the END record."""
    parts: list[bytes | np.ndarray] = []
    for i in indices:
        t = pair.regions[i]
        parts += _record(i, pieces[(t.name, t.box)], shards[t.name].tensor.element_size(), dense)
    parts.append(RECORD.pack(END, 0, 0, 0, 0, 0, 0, 0))
    return _blob(parts)


def _send_blobs(
    group: PairGroup, blobs: list[tuple[Pair, torch.Tensor, torch.Tensor | None]], step: int, num_buffers: int
) -> None:
    """Every pair's length, then its blob in slices (at most ``num_buffers`` in flight a pair, pairs in turn), then
    its hashes (where given)."""
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
        if hashes is not None:
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
    threads: int = DEFAULT_APPLY_THREADS,
) -> int:
    """One round of this consumer's pairs: apply what arrives, verify every piece, have the ones that differ sent
    again whole; returns the bytes received. Raises RegionMismatch where a piece sent whole still differs. The pairs
    are applied and hashed on up to ``threads`` threads, a pair each."""
    pairs = pair_streams([t for t in transfers if t.dst == group.rank], slices, "src", buffer_size_bytes, group.rank)
    blobs = _receive_blobs(group, pairs, slices, buffer_size_bytes, num_buffers)
    received = sum(int(blob.numel()) for blob in blobs.values())
    hashes = {p.peer: torch.empty(len(p.regions), dtype=torch.int64) for p in pairs}
    landing = {p.peer: group.irecv(hashes[p.peer], p.peer) for p in pairs}  # they land as this rank applies
    started = time.perf_counter()
    bases.written = set()  # a set's add holds the GIL: the threads below may share it

    def apply_and_hash(pair: Pair) -> list[int]:
        _apply_checked(group, pair, blobs[pair.peer], slices, bases.written)
        return _digests(pair, slices, range(len(pair.regions)))

    # The pairs' pieces are disjoint, and applying and hashing are C loops that let go of the GIL: one pair a thread.
    with ThreadPoolExecutor(max(1, min(threads, len(pairs)))) as pool:
        digests = dict(zip((p.peer for p in pairs), pool.map(apply_and_hash, pairs)))
    bases.apply_seconds = time.perf_counter() - started
    answers, bad = [], {}
    for pair in pairs:
        peer = pair.peer
        wait_for(landing[peer], group, peer, "receiving the hashes from")
        bad[peer] = (hashes[peer], _differing(digests[peer], hashes[peer], range(len(pair.regions))))
        verdict = torch.zeros(len(pair.regions), dtype=torch.int64)
        verdict[bad[peer][1]] = 1
        answers.append((peer, group.isend(verdict, peer), verdict))
    again = [p for p in pairs if bad[p.peer][1]]
    bases.repaired = sum(len(bad[p.peer][1]) for p in pairs)
    bases.repaired_total += bases.repaired
    repairs = _receive_blobs(group, again, slices, buffer_size_bytes, num_buffers)
    for pair in again:
        started = time.perf_counter()
        _apply_checked(group, pair, repairs[pair.peer], slices, bases.written)
        received += repairs[pair.peer].numel()
        every = range(len(pair.regions))
        still = _differing(_digests(pair, slices, every), bad[pair.peer][0], every)
        bases.apply_seconds += time.perf_counter() - started
        if still:
            t = pair.regions[still[0]]
            raise RegionMismatch(
                f"rank {group.rank}: region {list(t.box)} of tensor {t.name!r} from rank {t.src} holds other bytes "
                "than the producer's even sent whole (checksums differ)"
            )
    for peer, work, _ in answers:
        wait_for(work, group, peer, "sending to")
    if any(t.src == group.rank for t in transfers):  # the next replica of the chain: this one is its producer now
        send_delta(group, transfers, slices, bases.relay, buffer_size_bytes=buffer_size_bytes, num_buffers=num_buffers)
    return received


def _receive_blobs(
    group: PairGroup, pairs: Sequence[Pair], slices: Mapping[str, Held], buffer_size_bytes: int, num_buffers: int
) -> dict[int, torch.Tensor]:
    """Each pair's length, then its blob in buffer-sized slices, ``num_buffers`` in flight a pair."""
    lengths = {p.peer: torch.zeros(1, dtype=torch.int64) for p in pairs}
    for pair in pairs:
        wait_for(group.irecv(lengths[pair.peer], pair.peer), group, pair.peer, "receiving from")
    for pair in pairs:  # a stream is never larger than its pieces sent whole: refuse before allocating
        most = (
            sum(RECORD.size + padded(volume(t.box) * slices[t.name].tensor.element_size()) for t in pair.regions)
            + RECORD.size
        )
        if not 0 <= int(lengths[pair.peer]) <= most:
            raise ValueError(
                f"rank {group.rank}: rank {pair.peer} announces {int(lengths[pair.peer])} bytes of delta records, more "
                f"than its {len(pair.regions)} pieces whole ({most})"
            )
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
    return blobs


def _digests(pair: Pair, slices: Mapping[str, Held], indices: range) -> list[int]:
    """The hashes of the bytes this rank holds of ``pair``'s pieces ``indices``."""
    return [_hash(_bytes_of(slices[pair.regions[i].name].region(pair.regions[i].box))[0]) for i in indices]


def _differing(mine: list[int], theirs: torch.Tensor, indices: range) -> list[int]:
    """The pieces ``indices`` whose hashes here (``mine``, in that order) differ from what their producer sent."""
    sent = theirs.tolist()
    return [i for i, digest in zip(indices, mine) if digest != sent[i] % (1 << 64)]  # sent as signed words


def _apply_checked(
    group: PairGroup, pair: Pair, blob: torch.Tensor, slices: Mapping[str, Held], written: set[str]
) -> None:
    """:func:`_apply`, a stream whose records cannot be read (bytes changed in transit) named as a mismatch."""
    try:
        _apply(pair, blob, slices, written)
    except (ValueError, IndexError) as e:
        raise RegionMismatch(
            f"rank {group.rank}: the delta records from rank {pair.peer} arrived unreadable ({one_line(e)}): "
            "changed in transit"
        ) from e


def _apply(pair: Pair, blob: torch.Tensor, slices: Mapping[str, Held], written: set[str]) -> None:
    """Write a pair's records into the pieces they name (their tensors' names added to ``written``)."""
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
        written.add(t.name)
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
            strided = _strided(view)
            if strided is not None:
                np.copyto(strided, target.view(strided.dtype).reshape(strided.shape))
            else:
                view.copy_(torch.from_numpy(target).view(view.dtype).view(view.shape))


__all__ = ["ConsumerBases", "ProducerDeltas", "receive_delta", "send_delta"]
