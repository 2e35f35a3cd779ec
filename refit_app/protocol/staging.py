"""Refits beside generation: a round staged in memory the consumer session owns, then applied in a short pause.

:meth:`ConsumerSession.stage <refit_app.protocol.consumer_session.ConsumerSession.stage>` receives round N+1 while the
caller's tensors (an engine's weights, the ``targets``) keep serving round N, untouched, and verifies it there; the
:class:`StagedRound` it returns writes it into the targets in :meth:`StagedRound.apply`, the only step during which an
engine has to stop::

    engine                  side thread: session.stage(targets)          producer
    serves round N          held round N ---------------------------->   (changes against N, or dense)
      ...                   dense: every chunk into a host copy <------  data
      ...                   delta: each changed tensor's changes <-----  records
      ...                   verify (the session's checksums) <--------   checksum trailer
      ...                   "done" <-------------------------------->    "done"
    pause -> staged.apply(pause=...): dense: copy each tensor; delta: scatter the changes -> resume
    serves round N+1        (the targets hold N+1: the next round's base)

What a staged round holds, on the host, until it is applied or discarded: a dense round one copy of the model (an
:class:`~refit_app.core.delta.image.Image`, its pages touched as it is allocated); a delta round only each changed
tensor's changes (positions and values), or the tensor whole where that is smaller. Either way never more than one
host copy of the model, which is what ``max_staging_bytes`` is checked against before a round moves.

A round that fails verification, or whose producer dies while it is staged, is never applied: :meth:`stage` raises
:class:`~refit_app.common.errors.StagingError` naming the round and the reason, and the targets keep round N. A round
staged but not applied (refused, failed or discarded) never becomes the base the consumer claims, so the producer's
next round is dense.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from refit_app.common.errors import StagingError, one_line
from refit_app.core.chunks import Chunk
from refit_app.core.delta import codec
from refit_app.core.delta.image import Image, receive_image
from refit_app.core.group import BroadcastGroup
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import tensor_bytes
from refit_app.protocol.delta.receive import Target
from refit_app.protocol.delta.types import TensorDelta
from refit_app.protocol.rounds import Round

logger = logging.getLogger(__name__)

Batch = list[tuple[str, Any]]

STAGED = "staged"
APPLIED = "applied"
DISCARDED = "discarded"
BROKEN = "broken"
"""A staged round's states: waiting; written into the targets; dropped unwritten; failed while being written (the
targets then hold neither round)."""


@dataclass(frozen=True)
class StagedChange:
    """One tensor's changes in a staged delta round, on the host: ``values`` (uint8, the new elements' bytes) at
    ``positions`` (int64 flat element indices, increasing), or, with ``positions`` None, the whole tensor's bytes."""

    index: int
    positions: np.ndarray | None
    values: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + (self.positions.nbytes if self.positions is not None else 0)


def stage_dense(
    metas: list[TensorMeta],
    chunks: list[Chunk],
    group: BroadcastGroup,
    src: int,
    *,
    num_buffers: int,
    device: torch.device,
    on_chunk: Callable[[Chunk], None],
    show: Callable[[Batch], Any] | None,
) -> Image:
    """A dense round received into a host copy of its own, each chunk in place; ``show`` gets each chunk's tensors
    (views of the copy) as they land, for the verifier and the base's hashes."""
    image = Image(metas)
    for chunk in receive_image(image, chunks, group, src, num_buffers=num_buffers, device=device):
        on_chunk(chunk)
        if show is not None:
            show([(metas[i].name, image.view(i)) for i in range(chunk.first, chunk.stop)])
    return image


def stage_changes(
    rounds: Iterator[tuple[list[int], list[int], list[TensorDelta]]],
    metas: list[TensorMeta],
    targets: Mapping[str, torch.Tensor],
    *,
    show: Callable[[Batch], Any] | None,
) -> list[StagedChange]:
    """A delta round's changes kept, tensor by tensor, as ``rounds`` (:meth:`ConsumerDelta.receive_delta
    <refit_app.protocol.delta.receive.ConsumerDelta.receive_delta>` handing out every change) yields them. ``show``
    gets every tensor as the round leaves it, once final: an unchanged one as its target holds it, a changed one
    patched in a host scratch copy of its target (one tensor at a time, the scratch reused). A change whose positions
    and values take more bytes than the tensor is kept as the patched tensor whole: a delta round never stages more
    than one copy of the model."""
    changes: list[StagedChange] = []
    scratch = np.empty(max((m.nbytes for m in metas), default=0), dtype=np.uint8)
    for final, _, deltas in rounds:
        by_name = {d.name: d for d in deltas}
        for i in final:
            meta = metas[i]
            target = targets[meta.name]
            delta = by_name.pop(meta.name, None)
            if delta is None:
                if show is not None:
                    show([(meta.name, target)])
                continue
            change = StagedChange(
                i,
                None if delta.positions is None else delta.positions.numpy(),
                tensor_bytes(delta.values).numpy(),
            )
            patched = change.values
            if change.positions is not None and (show is not None or change.nbytes > meta.nbytes):
                patched = scratch[: meta.nbytes]
                patched[:] = tensor_bytes(target.detach()).cpu().numpy()
                codec.apply(patched, change.positions, change.values, meta.dtype.itemsize)
                if change.nbytes > meta.nbytes:
                    change = StagedChange(i, None, patched.copy())
            changes.append(change)
            if show is not None:
                show([(meta.name, torch.from_numpy(patched).view(meta.dtype).view(meta.shape))])
        if by_name:
            raise AssertionError(f"changes for tensors not yet final: {sorted(by_name)}")
    return changes


def _write_dense(image: Image, metas: list[TensorMeta], targets: Mapping[str, torch.Tensor]) -> None:
    for i, meta in enumerate(metas):
        if meta.nbytes:
            Target(tensor=targets[meta.name]).write_dense(image.tensor_bytes(i))


def _write_changes(changes: list[StagedChange], metas: list[TensorMeta], targets: Mapping[str, torch.Tensor]) -> None:
    for change in changes:
        meta = metas[change.index]
        target = Target(tensor=targets[meta.name])
        if change.positions is None:
            target.write_dense(change.values)
        else:
            target.apply(change.positions, change.values, meta.dtype.itemsize)


class StagedRound:
    """A round received and verified beside the targets, not written into them yet: :meth:`apply` it, or
    :meth:`discard` it (the session stages or receives no other round until one of them is called).

    Built by :meth:`ConsumerSession.stage <refit_app.protocol.consumer_session.ConsumerSession.stage>`. ``round``
    holds the transfer's figures as :meth:`receive` reports them. The metrics (:meth:`metrics`): ``stage_seconds``
    (the whole stage, from the call to the round's "done", the engine serving throughout), ``pause_seconds`` (from
    the moment :meth:`apply` is called, the engine's pause entered, until it returns, its resume left),
    ``apply_seconds`` (the writes into the targets alone) and ``version``, the round the targets hold once applied.
    """

    def __init__(
        self,
        round_: Round,
        metas: list[TensorMeta],
        targets: Mapping[str, torch.Tensor],
        *,
        image: Image | None,
        changes: list[StagedChange] | None,
        held_round: int,
        stage_seconds: float,
        settle: Callable[[str], None],
        base_intact: Callable[[], bool],
        check_targets: Callable[[], object] | None = None,
        base_bytes_intact: Callable[[list[int]], bool | None] | None = None,
    ) -> None:
        self.round = round_
        self.held_round = held_round
        """The round the targets held as this one was staged (0: none the session vouched for)."""
        self.stage_seconds = stage_seconds
        self.pause_seconds: float | None = None
        self.apply_seconds: float | None = None
        self.state = STAGED
        self.staged_bytes = image.nbytes if image is not None else sum(c.nbytes for c in changes or [])
        """Host memory the round holds until it is applied or discarded."""
        self._metas = metas
        self._targets = targets
        self._image = image
        self._changes = changes
        self._settle = settle
        self._base_intact = base_intact
        self._check_targets = check_targets
        """Raises where the targets no longer match the manifest (a name gone, another shape, dtype or layout)."""
        self._base_bytes_intact = base_bytes_intact
        """Whether the targets of the given tensors still hash to the base (None: nothing to compare with)."""
        self.base_check_seconds = 0.0
        """The base's bytes checked before the pause (a delta round's patched tensors hashed)."""

    @property
    def version(self) -> int:
        """The round (the weight version) the targets hold once this one is applied."""
        return self.round.round

    @property
    def base_round(self) -> int:
        """The round a delta round's changes apply to (the targets must still hold it); 0 for a dense round."""
        return self.round.base_round

    @property
    def changed(self) -> list[str]:
        """The names of the tensors this round writes: every tensor of a dense round, a delta round's changed ones."""
        self._check_staged("read")
        if self._image is not None:
            return [m.name for m in self._metas]
        return [self._metas[c.index].name for c in self._changes or []]

    def tensors(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of what the targets will hold once this round is applied, without writing them: for
        an engine that builds its own state from the round beside generation. A dense round's tensors are views of
        its staged copy (valid until it is applied or discarded); a delta round's changed tensor is a fresh copy of
        its target with the changes written in (one tensor's memory each), an unchanged one its target itself."""
        self._check_staged("read")
        index = {m.name: i for i, m in enumerate(self._metas)}
        changes = {c.index: c for c in self._changes or []}
        for name in names:
            i = index[name]
            meta = self._metas[i]
            if self._image is not None:
                yield name, self._image.view(i)
                continue
            change = changes.get(i)
            target = self._targets[name]
            if change is None:
                yield name, target
            elif change.positions is None:
                yield name, torch.from_numpy(change.values.copy()).view(meta.dtype).view(meta.shape)
            else:
                new = target.detach().cpu().clone().contiguous()
                codec.apply(tensor_bytes(new).numpy(), change.positions, change.values, meta.dtype.itemsize)
                yield name, new

    def apply(self, pause: AbstractContextManager[Any] | None = None) -> dict[str, Any]:
        """Write the round into the targets (a copy per tensor for a dense round, a scatter of the changed elements
        for a delta round); returns :meth:`metrics`.

        ``pause``: the engine's stop, a context manager entered before the first write and left after the last
        (``engine.paused()``): its whole time, resume included, is ``pause_seconds``. The session claims the
        targets as this round's (the next round's base) inside it, before the engine can write them. A delta round
        whose targets were written to since it was staged is not applied (StagingError; the next round comes dense);
        a failure half-way through the writes leaves the targets holding neither round (StagingError too; the next
        round comes dense)."""
        self._check_staged("apply")
        self._check_base_bytes()
        entered = time.perf_counter()
        failure: StagingError | None = None
        with pause if pause is not None else nullcontext():
            try:
                self._write()
            except StagingError as e:
                failure = e
                raise
        if failure is not None:  # the pause swallowed it (its __exit__ returned True): the round is still not applied
            raise failure
        self.pause_seconds = time.perf_counter() - entered
        self._image = self._changes = None  # freed after the pause: returning a model's pages takes tens of ms
        logger.info(
            "round %d applied (%s): pause %.4f s, writes %.4f s, staged in %.3f s",
            self.version,
            f"changes to round {self.base_round}" if self.base_round else "dense",
            self.pause_seconds,
            self.apply_seconds,
            self.stage_seconds,
        )
        return self.metrics()

    def _check_base_bytes(self) -> None:
        """Before the pause: a delta round's scatter goes only onto the bytes it was staged against. The version
        counters checked in the pause miss writes behind torch (``.data``, numpy, another process); the tensors the
        round patches are hashed here instead, while the engine still serves, and compared with the base's hashes."""
        if not self.base_round or self._base_bytes_intact is None or not self._changes or not self._base_intact():
            return  # (a write through torch: the pause's check refuses it, saying so)
        started = time.perf_counter()
        patched = [c.index for c in self._changes if c.positions is not None]
        intact = self._base_bytes_intact(patched) if patched else True
        self.base_check_seconds = time.perf_counter() - started
        if intact is False:
            self._end(BROKEN)
            raise StagingError(
                f"round {self.version}: not applied: the targets no longer hold round {self.base_round}'s bytes it "
                "was staged against (written behind torch's version counter); they are untouched by it, and the "
                "next round comes dense"
            )

    def _write(self) -> None:
        """The checks and the writes, in the pause: StagingError where the round is not applied."""
        started = time.perf_counter()
        try:
            if self._check_targets is not None:
                self._check_targets()  # the mapping or its tensors may have changed since the stage
        except Exception as e:
            self._end(BROKEN)
            raise StagingError(
                f"round {self.version}: not applied: {one_line(e)}; they are untouched by it, and the next round "
                "comes dense"
            ) from e
        if self.base_round and not self._base_intact():
            self._end(BROKEN)
            raise StagingError(
                f"round {self.version}: not applied: the targets were written to since it was staged as changes "
                f"to round {self.base_round}; they are untouched by it, and the next round comes dense"
            )
        try:
            if self._image is not None:
                _write_dense(self._image, self._metas, self._targets)
            else:
                _write_changes(self._changes or [], self._metas, self._targets)
        except Exception as e:
            self._end(BROKEN)
            raise StagingError(
                f"round {self.version}: applying it failed half-way ({one_line(e, with_type=True)}); the targets "
                "hold neither round, and the next round comes dense"
            ) from e
        self.apply_seconds = time.perf_counter() - started
        self._end(APPLIED, release=False)

    def discard(self) -> None:
        """Drop the round unwritten: the targets keep the round they hold, and the next round comes dense (the
        producer's last round is not theirs). A no-op once applied or discarded."""
        if self.state == STAGED:
            self._end(DISCARDED)
            logger.info("round %d discarded: the targets keep round %d", self.version, self.held_round)

    def metrics(self) -> dict[str, Any]:
        """This round's figures: what staging and applying it took, and the version the targets hold after it."""
        return {
            "round": self.round.round,
            "version": self.version,
            "state": self.state,
            "base_round": self.base_round,
            "stage_seconds": self.stage_seconds,
            "pause_seconds": self.pause_seconds,
            "apply_seconds": self.apply_seconds,
            "base_check_seconds": self.base_check_seconds,
            "staged_bytes": self.staged_bytes,
            "transfer_seconds": self.round.seconds,
            "wire_bytes": self.round.wire_bytes,
            "changed_elements": self.round.changed_elements,
            "verified": self.round.verified,
        }

    def _check_staged(self, what: str) -> None:
        if self.state != STAGED:
            raise StagingError(f"round {self.version}: cannot {what} it: it was {self.state} already")

    def _end(self, state: str, *, release: bool = True) -> None:
        self.state = state
        if release:  # the staged memory goes now, not with the last reference to this object
            self._image = self._changes = None
        self._settle(state)
