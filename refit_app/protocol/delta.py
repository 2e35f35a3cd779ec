"""Delta rounds in a session: the producer's snapshot, the consumer's copy, and each round's choice between them.

A producer session with ``delta="on"`` or ``"auto"`` keeps an :class:`~refit_app.core.image.Image` of the bytes it
sent last (one host copy of the sent model). Before each round every consumer says which round its tensors hold
(:meth:`ConsumerDelta.held`): 0 when it holds nothing it can vouch for (a fresh consumer, tensors written to since,
another set of tensors). The round is a delta round only when the manifest is unchanged and every consumer holds
the round the snapshot holds; it then names that round as its base. Otherwise it is dense, and the producer packs
each tensor into the snapshot as it sends it (the copy it would make into a send buffer anyway).

A delta round is a stream of records (:mod:`refit_app.core.delta`, :mod:`refit_app.core.stream`): each tensor is
compared with its snapshot slice block by block, hashed in the same pass where a consumer verifies, and its
changes are written to the stream while the chunks before them are on the wire. A consumer applies each record as
it arrives into the tensors it holds: its own (``targets``), the session's copy (``mirror``), or, for an engine
that applies changes through its own loader, hands the change itself (:class:`TensorDelta`) to its callback. With
verification on, it then hashes every tensor in full, changed or not, and compares with the producer's checksums
of the full tensors: what is verified is the reconstructed model, not the payload.

``auto`` sends a round as a delta only where the changes are expected to take less than :data:`AUTO_SHARE` of the
dense bytes: measured in each delta round, and estimated from a sample (1/32 of the words) while packing each
dense round, for the next round.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from refit_app.common.errors import HandshakeError
from refit_app.core import delta as codec
from refit_app.core.chunks import Chunk
from refit_app.core.group import BroadcastGroup
from refit_app.core.image import Image, receive_image, send_image
from refit_app.core.meta import TensorMeta
from refit_app.core.stream import HEADER_BYTES, Buffers, ChunkStream, receive_stream
from refit_app.core.wire import is_dense_host, tensor_bytes
from refit_app.protocol.checksum import Incremental, checksum_function
from refit_app.protocol.defaults import AUTO_SHARE, DELTA_MODES

logger = logging.getLogger(__name__)

_SAMPLE_EVERY = 32


def host_bytes_array(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes as a read-only-by-convention uint8 numpy array on the host: a view of a dense host tensor,
    else a copy (a device tensor, a strided view)."""
    if t.device.type == "cpu" and is_dense_host(t):
        return tensor_bytes(t).numpy()
    return tensor_bytes(t.detach()).cpu().numpy()


@dataclass
class DeltaStats:
    """What a round's delta work measured (both sides fill what they see)."""

    wire_bytes: int = 0
    changed_elements: int = 0
    total_elements: int = 0
    changed_tensors: int = 0
    encodings: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    """Producer: comparing and encoding. Consumer: decoding and applying."""

    @property
    def changed_fraction(self) -> float | None:
        return self.changed_elements / self.total_elements if self.total_elements else None


# -------------------------------------------------------------------------------------------------------------
# Producer.


class ProducerDelta:
    """A producer session's snapshot and its choice of round (``mode``: see :data:`DELTA_MODES`)."""

    def __init__(self, mode: str, *, compress: bool = True) -> None:
        if mode not in DELTA_MODES:
            raise ValueError(f"delta={mode!r}: choose one of {', '.join(DELTA_MODES)}")
        self.mode = mode
        self.image: Image | None = None
        self.share: float | None = None
        """The last round's share of the dense bytes that its changes took (measured, or estimated from a
        sample); None before any."""
        self._compressor = _zstd_compressor() if compress and mode != "off" else None
        self._sample: list[int] = [0, 0]
        self.buffers = Buffers()

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def reset(self, metas: list[TensorMeta]) -> None:
        """A fresh manifest: a snapshot for its tensors (filled by the next, dense, round)."""
        self.image = None  # the old one goes first
        self.image = Image(metas)
        self.share = None

    def base_for(self, held: list[int]) -> int:
        """The round a delta round would be based on, where every consumer holds it; else 0 (a dense round)."""
        image = self.image
        if not self.enabled or image is None or image.round == 0:
            return 0
        if any(h != image.round for h in held):
            behind = [f"rank {r + 1} holds {'nothing' if h == 0 else f'round {h}'}"
                      for r, h in enumerate(held) if h != image.round]
            logger.info("a dense round: the snapshot holds round %d but %s", image.round, ", ".join(behind))
            return 0
        if self.mode == "auto" and self.share is not None and self.share >= AUTO_SHARE:
            return 0
        return image.round

    def invalidate(self) -> None:
        """A round failed half-way: the snapshot may hold parts of two rounds, so the next round is dense."""
        if self.image is not None:
            self.image.round = 0

    # -- dense rounds -----------------------------------------------------------------------------------------

    def send_dense(
        self,
        tensors: Iterable[torch.Tensor],
        chunks: list[Chunk],
        group: BroadcastGroup,
        src: int,
        *,
        num_buffers: int,
        device: torch.device,
        checksum_algorithm: str | None,
        round_index: int,
    ) -> list[int] | None:
        """Send a dense round from the snapshot; returns the per-tensor checksums where asked for."""
        image = self.image
        assert image is not None
        checksum = checksum_function(checksum_algorithm) if checksum_algorithm else None
        sums: list[int] = []
        sampling = self.mode == "auto" and image.round != 0
        self._sample = [0, 0]

        def on_tensor(index: int, t: torch.Tensor) -> None:
            if sampling and t.numel():
                old = image.tensor_bytes(index)
                changed, compared = codec.estimate_changed(host_bytes_array(t), old, every=_SAMPLE_EVERY)
                lanes = max(1, 8 // t.element_size())
                # Words that changed -> elements that changed, were the changes spread evenly.
                share = 1 - (1 - changed / compared) ** (1 / lanes) if compared else 0.0
                self._sample[0] += share * t.numel() * t.element_size()
                self._sample[1] += t.numel() * t.element_size()

        def on_chunk_sent(chunk: Chunk) -> None:
            if checksum is not None:
                for index in range(chunk.first, chunk.stop):
                    sums.append(checksum(image.tensor_bytes(index)))

        image.round = 0
        send_image(image, tensors, chunks, group, src, num_buffers=num_buffers, device=device,
                   on_tensor=on_tensor, on_chunk_sent=on_chunk_sent)
        image.round = round_index
        if sampling and self._sample[1]:
            changed_share = self._sample[0] / self._sample[1]
            self.share = min(1.0, changed_share * 1.5)  # values plus about a byte of position per 2-byte element
        return sums if checksum is not None else None

    # -- delta rounds -----------------------------------------------------------------------------------------

    def send_delta(
        self,
        tensors: Iterable[torch.Tensor],
        group: BroadcastGroup,
        src: int,
        *,
        chunk_bytes: int,
        num_buffers: int,
        device: torch.device,
        checksum_algorithm: str | None,
        round_index: int,
        on_chunk: Callable[[int], None] | None = None,
    ) -> tuple[DeltaStats, list[int] | None]:
        """Send a delta round against the snapshot (updating it); returns its figures and the checksums of the
        full tensors where asked for."""
        image = self.image
        assert image is not None
        stats = DeltaStats()
        sums: list[int] | None = [] if checksum_algorithm else None
        stream = ChunkStream(group, src, chunk_bytes=chunk_bytes, num_buffers=num_buffers, device=device,
                             buffers=self.buffers, on_chunk=on_chunk)
        image.round = 0
        count = 0
        try:
            for index, t in enumerate(tensors):
                count += 1
                meta = image.metas[index]
                new = host_bytes_array(t)
                started = time.perf_counter()
                hasher = Incremental(checksum_algorithm) if checksum_algorithm else None
                changes = _diff(new, image.tensor_bytes(index), meta.dtype.itemsize, hasher)
                if sums is not None:
                    sums.append(hasher.value())
                stats.total_elements += meta.numel
                if changes is None or changes.count:
                    encoded = codec.Encoded(codec.DENSE, 0, meta.numel, 0, b"") if changes is None else codec.encode(
                        changes.positions, meta.numel, meta.dtype.itemsize, compressor=self._compressor)
                    stats.seconds += time.perf_counter() - started
                    _write_record(stream, index, encoded, new if encoded.encoding == codec.DENSE else changes.values)
                    stats.changed_elements += encoded.count
                    stats.changed_tensors += 1
                    stats.encodings[codec.ENCODING_NAMES[encoded.encoding]] += 1
                else:
                    stats.seconds += time.perf_counter() - started
            if count != len(image.metas):
                raise ValueError(f"{count} tensors were sent, the manifest has {len(image.metas)}")
            stream.write(codec.RECORD.pack(codec.END, 0, 0, 0, 0, 0, 0, 0))
            stream.close()
        except BaseException:
            stream.abort()
            raise
        image.round = round_index
        stats.wire_bytes = stream.wire_bytes
        self.share = stats.wire_bytes / image.nbytes if image.nbytes else 0.0
        return stats, sums


PARALLEL_MIN_BYTES = 8 << 20
"""Tensors at least this large are compared in two halves at once: the C comparison releases the GIL, and a
round's critical path is this comparison while the consumer waits for the changes."""
_HELPER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-diff")


def _diff(new: np.ndarray, old: np.ndarray, itemsize: int, hasher: Any) -> codec.Changes | None:
    """:func:`refit_app.core.delta.diff` of one tensor, its second half on a helper thread where it is large."""
    n = new.size
    half = n // 2 - (n // 2) % 16
    if n < PARALLEL_MIN_BYTES or codec.kernel is None:
        return codec.diff(new, old, itemsize, hasher=hasher)
    second = _HELPER.submit(codec.diff, new[half:], old[half:], itemsize)
    try:
        first = codec.diff(new[:half], old[:half], itemsize, hasher=hasher)
    finally:
        rest = second.result()
    if hasher is not None:
        hasher.update(new[half:])
    if first is None or rest is None:
        return None  # both halves' snapshots are up to date: each half copied or patched its own
    offset = half // itemsize
    return codec.Changes(np.concatenate([first.positions, rest.positions + offset]),
                         np.concatenate([first.values, rest.values]))


def _write_record(stream: ChunkStream, index: int, encoded: codec.Encoded, values: np.ndarray) -> None:
    stream.write(encoded.header(index, values.size))
    if len(encoded.positions):
        stream.write(encoded.positions)
        stream.pad(codec.padded(len(encoded.positions)) - len(encoded.positions))
    stream.write(values)
    stream.pad(codec.padded(values.size) - values.size)


def _zstd_compressor() -> Any:
    import zstandard

    return zstandard.ZstdCompressor(level=codec.ZSTD_LEVEL)


# -------------------------------------------------------------------------------------------------------------
# Consumer.


@dataclass
class TensorDelta:
    """One tensor's changes in a delta round, for a consumer that applies them itself (an engine's loader).

    ``positions`` (int64, flat element indices) is None where the tensor came whole (``values`` is then the
    tensor); else ``values`` holds the new elements at those positions, in order.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    positions: torch.Tensor | None
    values: torch.Tensor

    def apply_to(self, t: torch.Tensor) -> None:
        """Write the changes into ``t`` (this tensor's previous round, on any device), bit for bit."""
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise ValueError(f"{self.name}: changes for {list(self.shape)} {self.dtype} cannot apply to "
                             f"{list(t.shape)} {t.dtype}")
        if self.positions is None:
            tensor_bytes(t).copy_(tensor_bytes(self.values.to(t.device)))
            return
        apply_positions(t, self.positions.to(t.device), self.values.to(t.device))


def apply_positions(t: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """``t.flatten()[positions] = values`` on the raw bits (integer views: NaN payloads and -0.0 stay exact)."""
    if not t.is_contiguous():
        raise ValueError("changes apply to contiguous tensors only")
    itemsize = t.element_size()
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(itemsize)
    if int_type is not None:
        flat = t.view(-1).view(int_type) if t.dtype != int_type else t.view(-1)
        flat[positions] = values.reshape(-1).view(int_type)
    else:
        rows = t.view(-1).view(torch.uint8).view(-1, itemsize)
        rows[positions] = values.reshape(-1).view(torch.uint8).view(-1, itemsize)


class _Target:
    """Where one tensor's bytes live on the consumer: a numpy byte view (host) or a device tensor."""

    __slots__ = ("array", "tensor")

    def __init__(self, tensor: torch.Tensor | None = None, array: np.ndarray | None = None) -> None:
        self.tensor = tensor
        self.array = array if array is not None else (
            tensor_bytes(tensor).numpy() if tensor is not None and tensor.device.type == "cpu" else None)

    def write_dense(self, data: np.ndarray) -> None:
        if self.array is not None:
            self.array[:] = data
        else:
            tensor_bytes(self.tensor).copy_(torch.from_numpy(data).to(self.tensor.device))

    def apply(self, positions: np.ndarray, values: np.ndarray, itemsize: int) -> None:
        if self.array is not None:
            codec.apply(self.array, positions, values, itemsize)
        else:
            apply_positions(self.tensor, torch.from_numpy(positions).to(self.tensor.device),
                            torch.from_numpy(values).to(self.tensor.device))


class ConsumerDelta:
    """A consumer session's side of delta rounds: which round its tensors hold, and applying records to them.

    ``mirror``: the session keeps its own copy of the model (an :class:`Image`) and hands out views of it; else the
    caller's ``targets`` are patched, or, with neither, each change goes to the callback as a
    :class:`TensorDelta`.
    """

    def __init__(self, *, mirror: bool) -> None:
        self.mirror = mirror
        self.image: Image | None = None
        self.held_round = 0
        self._fingerprint: Any = None
        self.buffers = Buffers()

    def reset(self, metas: list[TensorMeta]) -> None:
        self.held_round = 0
        if self.mirror:
            self.image = None
            self.image = Image(metas)

    def held(self, targets: Mapping[str, torch.Tensor] | None) -> int:
        """The round this consumer's tensors hold, or 0 where it cannot vouch for them."""
        if self.held_round and self._fingerprint != self._take_fingerprint(targets):
            logger.info("the tensors changed since round %d (written to, or others given): asking for a dense round",
                        self.held_round)
            self.held_round = 0
        return self.held_round

    def completed(self, round_index: int, targets: Mapping[str, torch.Tensor] | None) -> None:
        """The round ended everywhere: the tensors now hold it."""
        self.held_round = round_index
        self._fingerprint = self._take_fingerprint(targets)

    def failed(self) -> None:
        self.held_round = 0

    def _take_fingerprint(self, targets: Mapping[str, torch.Tensor] | None) -> Any:
        # torch bumps a tensor's version on every in-place write through it or any view of it.
        if self.image is not None:
            return ("mirror", id(self.image), self.image.buffer._version)
        if targets is not None:
            return tuple((name, t.data_ptr(), t._version) for name, t in targets.items())
        return None

    def targets_for(self, metas: list[TensorMeta], targets: Mapping[str, torch.Tensor] | None) -> list[_Target] | None:
        """Each manifest tensor's target, checked (every one present, with its shape and dtype, contiguous)."""
        if self.image is not None:
            return [_Target(array=self.image.tensor_bytes(i)) for i in range(len(metas))]
        if targets is None:
            return None
        problems = []
        out = []
        for m in metas:
            t = targets.get(m.name)
            if t is None:
                problems.append(f"{m.name!r} has no target")
            elif tuple(t.shape) != m.shape or t.dtype != m.dtype or not t.is_contiguous():
                problems.append(f"{m.name!r} is {list(t.shape)} {t.dtype}{'' if t.is_contiguous() else ' strided'}, "
                                f"the manifest says {list(m.shape)} {m.dtype}")
            out.append(_Target(tensor=t) if t is not None else None)
        if problems:
            raise HandshakeError("the targets do not match the manifest: " + "; ".join(problems[:5]))
        return out

    def view(self, metas: list[TensorMeta], index: int, targets: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
        if self.image is not None:
            return self.image.view(index)
        assert targets is not None
        return targets[metas[index].name]

    def receive_dense(
        self, chunks: list[Chunk], group: BroadcastGroup, src: int, *, num_buffers: int, device: torch.device
    ) -> Iterator[Chunk]:
        """A dense round into the mirror, each chunk received in place; yields each chunk as it lands."""
        assert self.image is not None
        self.image.round = 0
        yield from receive_image(self.image, chunks, group, src, num_buffers=num_buffers, device=device)

    def receive_delta(
        self,
        metas: list[TensorMeta],
        group: BroadcastGroup,
        src: int,
        stats: DeltaStats,
        *,
        device: torch.device,
        targets: list[_Target] | None,
        on_chunk: Callable[[int], None] | None = None,
    ) -> Iterator[tuple[list[int], list[int], list[TensorDelta]]]:
        """Receive and apply a delta round, filling ``stats``. Yields ``(final, changed, deltas)`` after each chunk:
        ``final`` are the indices of the tensors now final for the round (in order, changed or not: everything up to
        the last record applied), ``changed`` those of them that a record changed, ``deltas`` the changes handed
        over where there are no targets."""
        stats.total_elements = sum(m.numel for m in metas)
        reader = _RecordReader(metas, targets, stats)

        def counted(nbytes: int) -> None:
            stats.wire_bytes += HEADER_BYTES + nbytes
            if on_chunk is not None:
                on_chunk(nbytes)

        for chunk in receive_stream(group, src, device=device, buffers=self.buffers, on_chunk=counted):
            reader.feed(chunk)
            taken = reader.take()
            if taken[0] or taken[2]:
                yield taken
        reader.finish()
        taken = reader.take()
        if taken[0] or taken[2]:
            yield taken


class _RecordReader:
    """Parses a round's records from its chunks, whatever their boundaries, and applies each once complete."""

    def __init__(self, metas: list[TensorMeta], targets: list[_Target] | None, stats: DeltaStats) -> None:
        self._metas = metas
        self._targets = targets
        self._stats = stats
        self._chunk = np.empty(0, dtype=np.uint8)
        self._pos = 0
        self._final_upto = 0  # tensors below this index are final for the round
        self._reported = 0
        self._changed: list[int] = []
        self._deltas: list[TensorDelta] = []
        self._ended = False
        self._parser = self._parse()
        next(self._parser)
        self._decompressor: Any = None

    def feed(self, chunk: np.ndarray) -> None:
        if self._ended:
            raise HandshakeError("the producer's delta stream goes on after its end record")
        self._chunk, self._pos = chunk, 0
        self._parser.send(None)

    def take(self) -> tuple[list[int], list[int], list[TensorDelta]]:
        final = list(range(self._reported, self._final_upto))
        self._reported = self._final_upto
        changed, self._changed = self._changed, []
        deltas, self._deltas = self._deltas, []
        return final, changed, deltas

    def finish(self) -> None:
        if not self._ended:
            raise HandshakeError("the producer's delta stream ended without its end record")
        self._final_upto = len(self._metas)

    def _read(self, n: int, into: np.ndarray | None = None) -> Iterator[None]:
        out = into if into is not None else np.empty(n, dtype=np.uint8)
        got = 0
        while got < n:
            if self._pos == self._chunk.size:
                yield
                continue
            take = min(n - got, self._chunk.size - self._pos)
            out[got : got + take] = self._chunk[self._pos : self._pos + take]
            self._pos += take
            got += take
        return out

    def _parse(self) -> Iterator[None]:
        metas, last = self._metas, -1
        while True:
            raw = yield from self._read(codec.RECORD.size)
            index, encoding, flags, _, count, escapes, pos_nbytes, values_nbytes = codec.RECORD.unpack(raw.tobytes())
            if index == codec.END:
                self._ended = True
                if self._pos != self._chunk.size:
                    raise HandshakeError("the producer's delta stream goes on after its end record")
                self._final_upto = len(metas)
                while True:
                    yield
                    raise HandshakeError("the producer's delta stream goes on after its end record")
            if not last < index < len(metas) or encoding not in codec.ENCODING_NAMES:
                raise HandshakeError(f"a delta record for tensor {index} (after {last}) with encoding {encoding}: the "
                                     "producer's stream is not in step with this consumer's manifest")
            meta = metas[index]
            itemsize, numel = meta.dtype.itemsize, meta.numel
            want_values = numel * itemsize if encoding == codec.DENSE else count * itemsize
            if values_nbytes != want_values or count > numel:
                raise HandshakeError(f"the delta record of {meta.name!r} carries {values_nbytes} value bytes for "
                                     f"{count} of {numel} elements")
            self._final_upto = index  # every tensor before this one has no record this round: final
            target = self._targets[index] if self._targets is not None else None
            positions = None
            if encoding != codec.DENSE:
                section = yield from self._read(codec.padded(pos_nbytes))
                section = section[:pos_nbytes]
                if flags & codec.ZSTD:
                    section = self._decompress(section, codec.raw_positions_nbytes(encoding, count, escapes, numel))
                try:
                    positions = codec.decode_positions(encoding, section, count, escapes, numel)
                except ValueError as e:
                    raise HandshakeError(f"the delta record of {meta.name!r}: {e}") from e
            direct = target is not None and target.array is not None and encoding == codec.DENSE
            values = yield from self._read(values_nbytes, into=target.array if direct else None)
            yield from self._read(codec.padded(values_nbytes) - values_nbytes)
            started = time.perf_counter()
            if target is not None and not direct:
                if positions is None:
                    target.write_dense(values)
                else:
                    target.apply(positions, values, itemsize)
            elif target is None:
                self._deltas.append(TensorDelta(
                    meta.name, meta.shape, meta.dtype,
                    None if positions is None else torch.from_numpy(positions),
                    torch.from_numpy(values).view(meta.dtype) if values.size else torch.empty(0, dtype=meta.dtype),
                ))
            self._stats.seconds += time.perf_counter() - started
            self._stats.changed_elements += count
            self._stats.changed_tensors += 1
            self._stats.encodings[codec.ENCODING_NAMES[encoding]] += 1
            self._changed.append(index)
            self._final_upto = index + 1
            last = index

    def _decompress(self, section: np.ndarray, raw_nbytes: int) -> np.ndarray:
        if self._decompressor is None:
            import zstandard

            self._decompressor = zstandard.ZstdDecompressor()
        try:
            data = self._decompressor.decompress(section.tobytes(), max_output_size=raw_nbytes)
        except Exception as e:
            raise HandshakeError(f"a delta record's compressed positions do not decompress: {e}") from e
        if len(data) != raw_nbytes:
            raise HandshakeError(f"a delta record's positions decompress to {len(data)} bytes, not {raw_nbytes}")
        return np.frombuffer(data, dtype=np.uint8)

