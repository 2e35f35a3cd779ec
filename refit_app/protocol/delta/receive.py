"""The consumer's side of delta rounds: which round its tensors hold, and each record applied as it arrives
into them (see :mod:`refit_app.protocol.delta` for the whole scheme)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from refit_app.common.errors import HandshakeError, some_of
from refit_app.core.chunks import Chunk
from refit_app.core.delta import codec
from refit_app.core.delta.image import Image, receive_image
from refit_app.core.delta.stream import HEADER_BYTES, Buffers, receive_stream
from refit_app.core.group import BroadcastGroup
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import host_bytes, tensor_bytes
from refit_app.protocol.checksum import available_algorithms, checksum_all, checksum_function, default_algorithm
from refit_app.protocol.delta.types import DeltaStats, TensorDelta, apply_positions

logger = logging.getLogger(__name__)


class Target:
    """Where one tensor's bytes live on the consumer: a numpy byte view (host) or a device tensor."""

    __slots__ = ("array", "tensor")

    def __init__(self, tensor: torch.Tensor | None = None, array: np.ndarray | None = None) -> None:
        self.tensor = tensor
        self.array = (
            array
            if array is not None
            else (tensor_bytes(tensor).numpy() if tensor is not None and tensor.device.type == "cpu" else None)
        )

    def write_dense(self, data: np.ndarray) -> None:
        if self.array is not None:
            self.array[:] = data
        else:
            tensor_bytes(self.tensor).copy_(torch.from_numpy(data).to(self.tensor.device))

    def apply_record(
        self, encoding: int, section: np.ndarray, count: int, escapes: int, values: np.ndarray, itemsize: int
    ) -> None:
        """A host target's record, its positions decoded on the way
        (:func:`refit_app.core.delta.codec.apply_record`)."""
        assert self.array is not None
        codec.apply_record(self.array, encoding, section, count, escapes, values, itemsize)

    def apply(self, positions: np.ndarray, values: np.ndarray, itemsize: int) -> None:
        if self.array is not None:
            codec.apply(self.array, positions, values, itemsize)
        else:
            apply_positions(
                self.tensor,
                torch.from_numpy(positions).to(self.tensor.device),
                torch.from_numpy(values).to(self.tensor.device),
            )


class Fingerprint(NamedTuple):
    """What a consumer's tensors held as a round's data was in: their identity and versions (a cheap first check),
    and their per-tensor checksums in ``algorithm`` (None: not checked, ``check_base=False``)."""

    identity: Any
    algorithm: str = ""
    checksums: list[int] | None = None


class ConsumerDelta:
    """A consumer session's side of delta rounds: which round its tensors hold, and applying records to them.

    ``mirror``: the session keeps its own copy of the model (an :class:`Image`) and hands out views of it; else the
    caller's ``targets`` are patched, or, with neither, each change goes to the callback as a
    :class:`TensorDelta`. A mirror can hand out the changes too (each :class:`TensorDelta` then carries the copy,
    :class:`MirrorViews`).

    ``check_base``: vouch for the held tensors by their checksums before claiming them as a delta round's base
    (:meth:`held`); False trusts torch's version counter alone, for an engine that never writes them by other
    means.
    """

    def __init__(self, *, mirror: bool, check_base: bool = True) -> None:
        self.mirror = mirror
        self.check_base = check_base
        self.image: Image | None = None
        self.views: MirrorViews | None = None
        self.held_round = 0
        self._metas: list[TensorMeta] = []
        self._fingerprint: Fingerprint | None = None
        self.buffers = Buffers()

    def reset(self, metas: list[TensorMeta]) -> None:
        self.held_round = 0
        self._metas = metas
        self._fingerprint = None
        if self.mirror:
            self.image = self.views = None
            self.image = Image(metas)
            self.views = MirrorViews(self.image)

    def held(self, targets: Mapping[str, torch.Tensor] | None) -> int:
        """The round this consumer's tensors hold, or 0 where it cannot vouch for them: it vouches by their bytes
        (their checksums equal those of the round they held), not by torch's version counter alone, which misses
        writes through ``t.data`` (vLLM's ``default_weight_loader``) or ``t.numpy()``; a delta applied to other
        bytes than its base's would leave wrong weights, or, verified, fail the run."""
        if not self.held_round:
            return 0
        fingerprint = self._fingerprint
        reason = ""
        if fingerprint is None or fingerprint.identity != self._identity(targets):
            reason = "written to in place, or other tensors given"
        elif fingerprint.checksums is not None:
            now = self._checksums(fingerprint.algorithm, targets)
            differ = [m.name for m, a, b in zip(self._metas, now, fingerprint.checksums) if a != b]
            if differ:
                reason = f"the bytes of {some_of([repr(n) for n in differ])} changed, unseen by torch's version counter"
        if reason:
            logger.info("the tensors changed since round %d (%s): asking for a dense round", self.held_round, reason)
            self.held_round = 0
        return self.held_round

    def intact(self, targets: Mapping[str, torch.Tensor] | None) -> bool:
        """Whether ``targets`` are still the tensors that hold :attr:`held_round`, unwritten through torch since
        (their identity and version counters only: a check cheap enough for an engine's pause)."""
        fingerprint = self._fingerprint
        return bool(self.held_round) and fingerprint is not None and fingerprint.identity == self._identity(targets)

    def bytes_intact(self, targets: Mapping[str, torch.Tensor], indices: list[int]) -> bool | None:
        """Whether the targets of manifest tensors ``indices`` still hold the bytes :attr:`held_round` left there, as
        its fingerprint hashed them (what :meth:`intact` cannot see: a write behind torch's version counter, through
        ``.data``, numpy or another process); None where there are no checksums to compare (``check_base=False``)."""
        fingerprint = self._fingerprint
        if not self.held_round or fingerprint is None or fingerprint.checksums is None:
            return None
        function = checksum_function(fingerprint.algorithm)
        held = fingerprint.checksums
        return all(function(host_bytes(targets[self._metas[i].name])) == held[i] for i in indices)

    def fingerprint(
        self,
        targets: Mapping[str, torch.Tensor] | None,
        *,
        checksums: list[int] | None = None,
        algorithm: str | None = None,
    ) -> Fingerprint:
        """What the tensors hold as the round's data is in, to vouch for them as the next round's base.

        ``checksums``: the producer's per-tensor checksums of this round, in ``algorithm``, where the round carried
        them: the tensors must then hold exactly the producer's bytes to be claimed (no hashing here); else the
        tensors are hashed now, on two threads."""
        identity = self._identity(targets)
        if not self.check_base or identity is None:
            return Fingerprint(identity)
        if checksums is None or algorithm not in available_algorithms() or len(checksums) != len(self._metas):
            algorithm = default_algorithm()
            checksums = self._checksums(algorithm, targets)
        return Fingerprint(identity, algorithm, list(checksums))

    def completed(
        self,
        round_index: int,
        targets: Mapping[str, torch.Tensor] | None,
        *,
        kept: bool = True,
        fingerprint: Fingerprint | None = None,
    ) -> None:
        """The round ended everywhere: the tensors now hold it (``kept=False``: a plain round passed the copy by).
        ``fingerprint``: :meth:`fingerprint` taken as its data was in (default: now)."""
        self.held_round = round_index if kept else 0
        self._fingerprint = None
        if self.held_round:
            self._fingerprint = fingerprint if fingerprint is not None else self.fingerprint(targets)

    def failed(self) -> None:
        self.held_round = 0
        self._fingerprint = None

    def _identity(self, targets: Mapping[str, torch.Tensor] | None) -> Any:
        # torch bumps a tensor's version on every in-place write through it or any view of it: a cheap first check.
        if self.image is not None:
            return ("mirror", id(self.image), self.image.buffer._version)
        if targets is not None:
            return tuple((name, t.data_ptr(), t._version) for name, t in targets.items())
        return None

    def _checksums(self, algorithm: str, targets: Mapping[str, torch.Tensor] | None) -> list[int]:
        """Each manifest tensor's checksum as held (the mirror's slice, or its target), in manifest order."""
        if self.image is not None:
            return checksum_all(algorithm, [self.image.tensor_bytes(i) for i in range(len(self._metas))])
        assert targets is not None
        held = [targets[m.name] for m in self._metas]
        if all(t.device.type == "cpu" for t in held):
            return checksum_all(algorithm, [host_bytes(t) for t in held])
        # Device tensors are copied to the host one at a time: never a second copy of the model there.
        function = checksum_function(algorithm)
        return [function(host_bytes(t)) for t in held]

    def targets_for(self, metas: list[TensorMeta], targets: Mapping[str, torch.Tensor] | None) -> list[Target] | None:
        """Each manifest tensor's target, checked (every one present, with its shape and dtype, contiguous)."""
        if self.image is not None:
            return [Target(array=self.image.tensor_bytes(i)) for i in range(len(metas))]
        if targets is None:
            return None
        problems = []
        out = []
        for m in metas:
            t = targets.get(m.name)
            if t is None:
                problems.append(f"{m.name!r} has no target")
            elif tuple(t.shape) != m.shape or t.dtype != m.dtype or not t.is_contiguous():
                problems.append(
                    f"{m.name!r} is {list(t.shape)} {t.dtype}{'' if t.is_contiguous() else ' strided'}, "
                    f"the manifest says {list(m.shape)} {m.dtype}"
                )
            out.append(Target(tensor=t) if t is not None else None)
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
        targets: list[Target] | None,
        chunk_bytes: int,
        on_chunk: Callable[[int], None] | None = None,
        hand_out: bool = False,
    ) -> Iterator[tuple[list[int], list[int], list[TensorDelta]]]:
        """Receive and apply a delta round, filling ``stats``. Yields ``(final, changed, deltas)`` after each chunk:
        ``final`` are the indices of the tensors now final for the round (in order, changed or not: everything up to
        the last record applied), ``changed`` those of them that a record changed, ``deltas`` the changes handed
        over where there are no targets, or with ``hand_out`` (applied to the targets first)."""
        stats.total_elements = sum(m.numel for m in metas)
        reader = _RecordReader(
            metas,
            targets,
            stats,
            hand_out=hand_out or targets is None,
            mirror=self.views if targets is not None else None,
        )

        def counted(nbytes: int) -> None:
            stats.wire_bytes += HEADER_BYTES + nbytes
            if on_chunk is not None:
                on_chunk(nbytes)

        chunks = receive_stream(
            group, src, device=device, buffers=self.buffers, max_chunk=chunk_bytes, on_chunk=counted
        )
        for chunk in chunks:
            reader.feed(chunk)
            taken = reader.take()
            if taken[0] or taken[2]:
                yield taken
        reader.finish()
        taken = reader.take()
        if taken[0] or taken[2]:
            yield taken


class MirrorViews(Mapping[str, torch.Tensor]):
    """A mirror's tensors by name, each a view of it made when asked (so it shows the mirror as it is then)."""

    def __init__(self, image: Image) -> None:
        self._image = image
        self._index = {m.name: i for i, m in enumerate(image.metas)}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._image.view(self._index[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class _RecordReader:
    """Parses a round's records from its chunks, whatever their boundaries, and applies each once complete."""

    def __init__(
        self,
        metas: list[TensorMeta],
        targets: list[Target] | None,
        stats: DeltaStats,
        *,
        hand_out: bool,
        mirror: MirrorViews | None,
    ) -> None:
        self._metas = metas
        self._targets = targets
        self._stats = stats
        self._hand_out = hand_out
        self._mirror = mirror
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
            if not last < index < len(metas):
                raise HandshakeError(
                    f"a delta record for tensor {index} (after {last}, of {len(metas)}): the producer's stream is "
                    "not in step with this consumer's manifest"
                )
            meta = metas[index]
            itemsize, numel = meta.dtype.itemsize, meta.numel
            # Every size in the header is checked against the tensor before the reads below allocate by it.
            try:
                codec.check_header(encoding, flags, count, escapes, pos_nbytes, values_nbytes, numel, itemsize)
            except ValueError as e:
                raise HandshakeError(f"the delta record of {meta.name!r}: {e}") from e
            self._final_upto = index  # every tensor before this one has no record this round: final
            target = self._targets[index] if self._targets is not None else None
            positions = section = None
            # A host target takes the record as it is (decoded on the way); a device target or a hand-out needs
            # the positions as an array.
            on_host = target is not None and target.array is not None and not self._hand_out
            if encoding != codec.DENSE:
                section = yield from self._read(codec.padded(pos_nbytes))
                section = section[:pos_nbytes]
                if flags & codec.ZSTD:
                    raw_nbytes = codec.raw_positions_nbytes(encoding, count, escapes, numel)
                    section = self._decompress(section, raw_nbytes, meta.name)
                if not on_host:
                    try:
                        positions = codec.decode_positions(encoding, section, count, escapes, numel)
                    except ValueError as e:
                        raise HandshakeError(f"the delta record of {meta.name!r}: {e}") from e
            direct = target is not None and target.array is not None and encoding == codec.DENSE
            values = yield from self._read(values_nbytes, into=target.array if direct else None)
            yield from self._read(codec.padded(values_nbytes) - values_nbytes)
            started = time.perf_counter()
            if target is not None and not direct:
                _apply(target, meta, encoding, section, positions, count, escapes, values)
            if self._hand_out:
                self._deltas.append(self._delta(meta, positions, values))
            self._stats.seconds += time.perf_counter() - started
            self._stats.changed_elements += count
            self._stats.changed_tensors += 1
            self._stats.encodings[codec.ENCODING_NAMES[encoding]] += 1
            self._changed.append(index)
            self._final_upto = index + 1
            last = index

    def _delta(self, meta: TensorMeta, positions: np.ndarray | None, values: np.ndarray) -> TensorDelta:
        """One record as the change handed out. A dense record read straight into the mirror hands out a view of
        it (no copy), unless the tensor's offset there is not aligned for its dtype."""
        raw = torch.from_numpy(values)
        if raw.data_ptr() % meta.dtype.itemsize:
            raw = raw.clone()
        return TensorDelta(
            meta.name,
            meta.shape,
            meta.dtype,
            None if positions is None else torch.from_numpy(positions),
            raw.view(meta.dtype) if values.size else torch.empty(0, dtype=meta.dtype),
            mirror=self._mirror,
        )

    def _decompress(self, section: np.ndarray, raw_nbytes: int, name: str) -> np.ndarray:
        if self._decompressor is None:
            import zstandard

            self._decompressor = zstandard.ZstdDecompressor()
        import zstandard

        compressed = section.tobytes()
        try:
            # The frame's own content size decides what decompress() allocates (and writes: 4 bytes of RLE block
            # make 128 KiB), whatever max_output_size says: checked first, so a forged frame is no memory bomb.
            declared = zstandard.frame_content_size(compressed)
            if declared not in (-1, raw_nbytes):
                raise ValueError(f"its frame declares {declared} bytes")
            data = self._decompressor.decompress(compressed, max_output_size=raw_nbytes)
        except Exception as e:
            raise HandshakeError(
                f"the delta record of {name!r}: its compressed positions do not decompress: {e}"
            ) from e
        if len(data) != raw_nbytes:
            raise HandshakeError(
                f"the delta record of {name!r}: its positions decompress to {len(data)} bytes, not {raw_nbytes}"
            )
        return np.frombuffer(data, dtype=np.uint8)


def _apply(
    target: Target,
    meta: TensorMeta,
    encoding: int,
    section: np.ndarray | None,
    positions: np.ndarray | None,
    count: int,
    escapes: int,
    values: np.ndarray,
) -> None:
    """One record written into its tensor: a host target decodes the positions section on the way, a dense record
    is written whole, else the decoded positions take the values."""
    if section is not None and positions is None:
        try:
            target.apply_record(encoding, section, count, escapes, values, meta.dtype.itemsize)
        except ValueError as e:
            raise HandshakeError(f"the delta record of {meta.name!r}: {e}") from e
    elif positions is None:
        target.write_dense(values)
    else:
        target.apply(positions, values, meta.dtype.itemsize)
