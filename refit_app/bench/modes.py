"""The four timed modes, one side each: every function or ``run()`` moves the whole model once over the group and
returns the bytes it moved, which the caller checks against the model's size.

- ``refit``: one call of :func:`packed_broadcast_producer` / :func:`packed_broadcast_consumer`;
- ``session``: one steady-state round of a :class:`ProducerSession` / :class:`ConsumerSession`;
- ``limit``: the same chunks, packed beforehand on both sides, broadcast asynchronously back to back;
- ``per_tensor``: one synchronous broadcast per tensor into a freshly allocated tensor.
"""

from __future__ import annotations

import torch

from refit_app.bench.cases import Case, chunks, post_func
from refit_app.core.meta import TensorMeta
from refit_app.models.sources import SyntheticSource
from refit_app.packed_tensor import pack_tensors, packed_broadcast_consumer, packed_broadcast_producer
from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.groups import RefitGroup


class Limit:
    """The model packed once, before any timing, into one buffer per chunk, on both sides.

    Receive buffers are written once, so their pages are resident and every repetition times the transport alone.
    The refit allocates its buffers anew in every call, so the ratio refit/limit includes what that costs.
    """

    def __init__(self, rank: int, source: SyntheticSource, metas: list[TensorMeta], case: Case) -> None:
        plan = chunks(metas, case)
        if rank == 0:
            post = post_func(case.post)
            tensors = [post(item) for item in source.tensors()]
            self.buffers = [pack_tensors(tensors[i] for i in chunk) for chunk in plan]
        else:
            self.buffers = [torch.zeros(sum(metas[i].nbytes for i in chunk), dtype=torch.uint8) for chunk in plan]

    def run(self, rg: RefitGroup) -> int:
        works = [rg.group.broadcast_async(buffer, 0) for buffer in self.buffers if buffer.numel()]
        for work in works:
            work.wait()
        return sum(buffer.numel() for buffer in self.buffers)


def refit(rg: RefitGroup, source: SyntheticSource, metas: list[TensorMeta], case: Case) -> int:
    moved = 0

    def count(nbytes: int, ntensors: int) -> None:
        nonlocal moved
        moved += nbytes

    settings = {"buffer_size_bytes": case.buffer_size_bytes, "num_buffers": case.num_buffers, "on_chunk": count}
    if rg.rank == 0:
        packed_broadcast_producer(source.tensors(), rg.group, 0, post_func(case.post), **settings)
    else:
        packed_broadcast_consumer(((m.name, (m.shape, m.dtype)) for m in metas), rg.group, 0, discard, **settings)
    return moved


class Session:
    """One session per rank for the whole case: an untimed first round carries the manifest and records the plan,
    so every timed round is a steady-state one."""

    def __init__(self, rg: RefitGroup, source: SyntheticSource, metas: list[TensorMeta], case: Case) -> None:
        self._source, self._metas, self._post = source, metas, post_func(case.post)
        if rg.rank == 0:
            self._side: ProducerSession | ConsumerSession = ProducerSession(
                rg, buffer_size_bytes=case.buffer_size_bytes, num_buffers=case.num_buffers
            )
        else:
            self._side = ConsumerSession(rg, num_buffers=case.num_buffers)
        self.run()

    def run(self) -> int:
        if isinstance(self._side, ProducerSession):
            named = ((name, self._post((name, t))) for name, t in self._source.tensors())
            return self._side.send(named, metas=self._metas).bytes
        return self._side.receive(discard).bytes

    def close(self) -> None:
        """End the session on every rank (the consumers' last receive() sees the producer's end)."""
        if isinstance(self._side, ProducerSession):
            self._side.close()
        elif self._side.receive(discard) is not None:
            raise RuntimeError("the producer's session did not end when expected")


def discard(batch: list[tuple[str, torch.Tensor]]) -> None:
    """What ``sink=discard`` does: nothing, so the transfer alone is timed."""


def per_tensor(rg: RefitGroup, source: SyntheticSource, metas: list[TensorMeta], case: Case) -> int:
    moved = 0
    if rg.rank == 0:
        post = post_func(case.post)
        for item in source.tensors():
            t = post(item).contiguous()
            rg.group.broadcast(t, 0)
            moved += t.numel() * t.element_size()
    else:
        for m in metas:
            t = torch.empty(m.shape, dtype=m.dtype)
            rg.group.broadcast(t, 0)
            moved += m.nbytes
    return moved


def barrier(rg: RefitGroup) -> None:
    """Every rank has finished what came before: each rank's tiny broadcast completes only once it has joined."""
    flag = torch.zeros(1, dtype=torch.uint8)
    for src in range(rg.world_size):
        rg.group.broadcast(flag, src)
