"""The producer's side of delta rounds (:mod:`refit_app.protocol.delta` describes the whole scheme): the snapshot
of what was sent last, and each tensor compared with it and its changes written to the stream. What both sides
share is in :mod:`refit_app.protocol.delta.types`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from refit_app.core.chunks import Chunk
from refit_app.core.delta import codec
from refit_app.core.delta.image import Image, send_image
from refit_app.core.delta.stream import Buffers, ChunkStream
from refit_app.core.group import BroadcastGroup
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import is_dense_host, tensor_bytes
from refit_app.protocol.checksum import Incremental, checksum_function, split_point
from refit_app.protocol.defaults import DELTA_MODES
from refit_app.protocol.delta.auto import DELTA, KEEP, AutoPolicy, Sampler
from refit_app.protocol.delta.types import DeltaStats

logger = logging.getLogger(__name__)


def host_bytes_array(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes as a read-only-by-convention uint8 numpy array on the host: a view of a dense host tensor,
    else a copy (a device tensor, a strided view)."""
    if t.device.type == "cpu" and is_dense_host(t):
        return tensor_bytes(t).numpy()
    return tensor_bytes(t.detach()).cpu().numpy()


# -------------------------------------------------------------------------------------------------------------
# Producer.


class ProducerDelta:
    """A producer session's snapshot and its choice of round (``mode``: see :data:`DELTA_MODES`)."""

    def __init__(self, mode: str, *, compress: bool = True) -> None:
        if mode not in DELTA_MODES:
            raise ValueError(f"delta={mode!r}: choose one of {', '.join(DELTA_MODES)}")
        self.mode = mode
        self.image: Image | None = None
        self._compressor = _zstd_compressor() if compress and mode != "off" else None
        self.auto = AutoPolicy() if mode == "auto" else None
        self.sampler = Sampler()
        self.sampled_fraction: float | None = None
        """``auto``'s estimate of the last dense round's share of changed elements (from its sample)."""
        self.buffers = Buffers()

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def reset(self, metas: list[TensorMeta]) -> None:
        """A fresh manifest: a snapshot for its tensors (filled by the next, dense, round)."""
        self.image = None  # the old one goes first
        self.image = Image(metas)
        self.sampler.drop()
        if self.auto is not None:
            self.auto.share = self.auto.changed = None

    def choose(self, held: list[int]) -> str:
        """This round's kind (:mod:`refit_app.protocol.delta.auto`): a delta round only where every consumer holds
        the round the snapshot holds (:attr:`base`)."""
        image = self.image
        can = bool(self.enabled and image is not None and image.round and all(h == image.round for h in held))
        if not can and image is not None and image.round:
            behind = [
                f"rank {r + 1} holds {'nothing' if h == 0 else f'round {h}'}"
                for r, h in enumerate(held)
                if h != image.round
            ]
            logger.info("a dense round: the snapshot holds round %d but %s", image.round, ", ".join(behind))
        if self.auto is None:
            return DELTA if can else KEEP
        return self.auto.choose(can)

    @property
    def base(self) -> int:
        """The round the snapshot holds: a delta round's base."""
        return self.image.round if self.image is not None else 0

    def observe(self, kind: str, seconds: float, *, cold: bool = False) -> None:
        """A round ended: how long it took, for ``auto``'s choice."""
        if self.auto is not None:
            self.auto.observe(kind, seconds, cold=cold)

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
        sampler = self._begin_sample(round_index)
        holds_last = image.round != 0 and image.round == round_index - 1

        def on_tensor(index: int, t: torch.Tensor) -> None:
            if sampler is not None:
                old = image.tensor_bytes(index) if holds_last else None
                sampler.add(host_bytes_array(t), old, t.element_size())

        def on_chunk_sent(chunk: Chunk) -> None:
            if checksum is not None:
                for index in range(chunk.first, chunk.stop):
                    sums.append(checksum(image.tensor_bytes(index)))

        image.round = 0
        send_image(
            image,
            tensors,
            chunks,
            group,
            src,
            num_buffers=num_buffers,
            device=device,
            on_tensor=on_tensor,
            on_chunk_sent=on_chunk_sent,
        )
        image.round = round_index
        self._end_sample(round_index)
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
        stream = ChunkStream(
            group,
            src,
            chunk_bytes=chunk_bytes,
            num_buffers=num_buffers,
            device=device,
            buffers=self.buffers,
            on_chunk=on_chunk,
        )
        image.round = 0
        count = 0
        try:
            for index, t in enumerate(tensors):
                count += 1
                meta = image.metas[index]
                new = host_bytes_array(t)
                started = time.perf_counter()
                hasher = Incremental(checksum_algorithm, new.size) if checksum_algorithm else None
                changes = _diff(new, image.tensor_bytes(index), meta.dtype.itemsize, hasher, checksum_algorithm)
                if sums is not None:
                    sums.append(hasher.value())
                stats.total_elements += meta.numel
                whole = isinstance(changes, codec.Whole)
                if whole or changes.count:
                    encoded = (
                        codec.Encoded(codec.DENSE, 0, meta.numel, 0, b"")
                        if whole
                        else codec.encode(
                            changes.positions, meta.numel, meta.dtype.itemsize, compressor=self._compressor
                        )
                    )
                    stats.seconds += time.perf_counter() - started
                    _write_record(stream, index, encoded, new if encoded.encoding == codec.DENSE else changes.values)
                    stats.changed_elements += changes.count  # a whole tensor: its estimated share
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
        if self.auto is not None:
            self.auto.share = stats.wire_bytes / image.nbytes if image.nbytes else 0.0
            self.auto.changed = stats.changed_fraction
        return stats, sums

    # -- plain rounds (``auto``) ------------------------------------------------------------------------------

    def plain_round(self, round_index: int) -> Callable[[torch.Tensor], None] | None:
        """A plain dense round begins (sent as without deltas): the snapshot no longer holds the last round sent.
        Returns what to call with each tensor as it is packed, for ``auto``'s estimate (None where not sampling);
        :meth:`end_plain_round` once sent."""
        image = self.image
        holds_last = image is not None and image.round != 0 and image.round == round_index - 1
        if image is not None:
            image.round = 0
        sampler = self._begin_sample(round_index)
        if sampler is None:
            return None
        count = 0

        def sample(t: torch.Tensor) -> None:
            nonlocal count
            old = image.tensor_bytes(count) if holds_last and image is not None else None
            sampler.add(host_bytes_array(t), old, t.element_size())
            count += 1

        return sample

    def end_plain_round(self, round_index: int) -> None:
        self._end_sample(round_index)

    def _begin_sample(self, round_index: int) -> Sampler | None:
        if self.auto is None:
            return None
        self.sampler.begin(round_index)
        return self.sampler

    def _end_sample(self, round_index: int) -> None:
        if self.auto is None:
            return
        estimate = self.sampler.end(round_index)
        self.sampled_fraction = None if estimate is None else estimate[0]
        if estimate is not None:
            self.auto.changed, self.auto.share = estimate


PARALLEL_MIN_BYTES = 8 << 20
"""Tensors at least this large are compared in two halves at once: the C comparison releases the GIL, and a
round's critical path is this comparison while the consumer waits for the changes."""
_HELPER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-diff")


def _diff(
    new: np.ndarray, old: np.ndarray, itemsize: int, hasher: Incremental | None, algorithm: str | None
) -> codec.Changes | codec.Whole:
    """:func:`refit_app.core.delta.codec.diff` of one tensor, its second half on a helper thread where it is large.
    Where the checksum can be taken in two parts (:func:`~refit_app.protocol.checksum.split_point`), each thread
    hashes its half as it compares it; else the second half is hashed after the helper's comparison."""
    n = new.size
    if n < PARALLEL_MIN_BYTES or codec.kernel is None:
        return codec.diff(new, old, itemsize, hasher=hasher)
    split = split_point(algorithm, n) if hasher is not None and algorithm is not None else None
    half = split if split is not None else n // 2 - (n // 2) % 16
    rest_hasher = Incremental(algorithm, n, start=half) if split is not None else None
    second = _HELPER.submit(codec.diff, new[half:], old[half:], itemsize, hasher=rest_hasher)
    try:
        first = codec.diff(new[:half], old[:half], itemsize, hasher=hasher)
    finally:
        rest = second.result()
    if rest_hasher is not None:
        hasher.join(rest_hasher)
    elif hasher is not None:
        # After the helper, not beside it: hashing the second half while the helper compares it made a 256 MiB
        # tensor's diff 70 ms instead of 60 (both threads then wait on memory), and more where a consumer shares the
        # cores.
        hasher.update(new[half:])
    if isinstance(first, codec.Whole) or isinstance(rest, codec.Whole):
        # Both halves' snapshots are up to date: each half copied or patched its own.
        return codec.Whole(first.count + rest.count)
    offset = half // itemsize
    return codec.Changes(
        np.concatenate([first.positions, rest.positions + offset]), np.concatenate([first.values, rest.values])
    )


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
