"""A tensor-parallel vLLM engine as the consumers of a sharded refit (issue 33): K trainer ranks each send their own
shards, and each of the engine's workers receives only the part of every checkpoint tensor it loads.

Which part that is, vLLM decides: a worker's weight loaders narrow each checkpoint tensor to its tensor-parallel
rank's rows (``ColumnParallelLinear``, the q, k and v parts of ``QKVParallelLinear``, the gate and up parts of
``MergedColumnParallelLinear``, ``VocabParallelEmbedding``'s vocabulary rows), its columns (``RowParallelLinear``),
or take it whole (norms). :func:`loaded_boxes` asks the loaders themselves, the way vLLM's own layerwise reload
counts what a loader copies: every layer back in its checkpoint format on the meta device, ``model.load_weights``
given one meta tensor per checkpoint tensor, and every ``copy_`` out of one recorded as the box it reads; the
layers' own tensors are put back untouched. No table of layer classes or names.

Each round the worker receives its boxes (:func:`refit_app.protocol.sharded.receive`: every region hashed where it
was packed and checked where it lands) into tensors of each checkpoint tensor's whole shape, of which only the
boxes are ever written, and loads them through vLLM's own ``load_weights`` in the layerwise reload
(:class:`~refit_app.integrations.vllm.loader.EngineLoader`): the loaders narrow exactly the boxes that arrived, the
fused parameters included, and vLLM's CPU linear layers repack as after any reload. Those tensors are allocated once,
whole, but pages outside the boxes are never touched: the worker's resident memory grows by its slices (a
row-parallel box, the columns of every row, touches the pages its rows span).

One refit group, ``K + W`` ranks (W the workers of every data-parallel replica): ranks ``[0, K)`` are the trainer's
producers, each worker joins as ``K`` + its global vLLM rank, exactly as the one-producer backend's workers join
after its one trainer (:class:`~refit_app.integrations.vllm.backend.RefitWorkerInitInfo` with ``producers=K``)::

    trainer rank p < K                                   vLLM worker w (rank K + w)
    ShardedProducer(info, p, specs)   <--- agree --->    init_weight_transfer_engine(info): loaded_boxes -> needs
    producer.send(shards)             ---- regions --->  update_weights({"round": n}): receive, load_weights, finish

This module imports vLLM only inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from refit_app.common.errors import HandshakeError, PeerError, VerificationError, one_line
from refit_app.core.reshard.delta import ConsumerBases, ProducerDeltas
from refit_app.core.reshard.plan import Box, Need, TensorSpec, volume, whole
from refit_app.core.reshard.transfer import Held, RegionMismatch
from refit_app.integrations.vllm.backend import RefitUpdateInfo, RefitWorkerInitInfo, group_token
from refit_app.protocol.checksum import PIECED
from refit_app.protocol.defaults import agreed_delta
from refit_app.protocol.delta.auto import DELTA, AgreedAuto
from refit_app.protocol.session import TensorDelta
from refit_app.protocol.sharded import Expected, agree, receive, send
from refit_app.transport.groups import GroupSpec, RefitGroup, connect

logger = logging.getLogger(__name__)

__all__ = ["ShardedProducer", "ShardedWorker", "loaded_boxes", "sharded_facts", "sharded_init_info"]


def sharded_init_info(
    *,
    master_address: str,
    master_port: int,
    producers: int,
    workers: int,
    tensors: Iterable[tuple[str, torch.dtype | str, Sequence[int]]],
    buffer_size_bytes: int,
    num_buffers: int = 2,
    timeout_s: float = 120.0,
    checksums: bool = True,
    token: str | None = None,
    delta: str = "off",
) -> RefitWorkerInitInfo:
    """The settings of a sharded refit into a vLLM engine, for its workers (``init_weight_transfer_engine``'s
    ``init_info``) and for the trainer's :class:`ShardedProducer` ranks alike: ``producers`` trainer ranks, then the
    engine's ``workers`` (every worker of every data-parallel replica); ``tensors`` the checkpoint's names, dtypes
    and global shapes, which every worker's loaders are asked about (the producers' agreement checks them);
    ``token`` the secret every rank proves at the rendezvous (``group.token``; None: each process's own
    ``REFIT_APP_TOKEN``, and without one a loopback address only); ``delta`` the rounds' kind (``off``; ``on``: every
    round after the first a delta round, each producer comparing only its own shards; ``auto``: the kind every rank
    chooses each round, :class:`~refit_app.protocol.delta.auto.AgreedAuto`)."""
    if not (isinstance(producers, int) and producers >= 1 and isinstance(workers, int) and workers >= 1):
        raise ValueError(f"producers={producers!r}, workers={workers!r}: give at least one of each")
    listed = [[name, str(dtype).removeprefix("torch."), [int(n) for n in shape]] for name, dtype, shape in tensors]
    return RefitWorkerInitInfo(
        master_address=master_address,
        master_port=master_port,
        rank_offset=producers,
        world_size=producers + workers,
        buffer_size_bytes=buffer_size_bytes,
        num_buffers=num_buffers,
        group_backend="gloo",
        timeout_s=timeout_s,
        checksums=checksums,
        producers=producers,
        tensors=listed,
        token=token,
        delta=delta,
    )


def _group(info: RefitWorkerInitInfo, rank: int) -> RefitGroup:
    if info.group_backend not in ("gloo", "auto"):
        raise HandshakeError(f"a sharded refit runs over gloo, not group_backend={info.group_backend!r}")
    return connect(
        GroupSpec(
            backend="gloo",
            host=info.master_address,
            port=info.master_port,
            world_size=info.world_size,
            rank=rank,
            timeout_s=info.timeout_s,
            token=group_token(info.token),
        )
    )


def _expected(info: RefitWorkerInitInfo) -> list[Expected]:
    if not info.tensors:
        raise HandshakeError("a sharded refit's init_info lists no tensors: build it with sharded_init_info")
    return [Expected(name, dtype, tuple(shape)) for name, dtype, shape in info.tensors]


def _fail(rg: RefitGroup, rank: int, error: BaseException) -> None:
    """Tell the other ranks why, and drop the group now, so that they fail at once instead of at their deadline."""
    with contextlib.suppress(Exception):
        rg.control.publish_error(rank, one_line(error))
    rg.abandon()


@contextlib.contextmanager
def _failing_together(rg: RefitGroup, rank: int, who: str) -> Iterator[None]:
    """A failure here fails every rank: this rank publishes its reason and drops the group. A lost peer (gloo's own
    error, or the transfer's :class:`PeerError` naming it) becomes one line with the reason the failing rank
    published, where it did; a region that arrived other than it was sent a :class:`VerificationError`."""
    try:
        yield
    except RegionMismatch as e:
        error = VerificationError(f"{who} rank {rank}: {e}")
        _fail(rg, rank, error)
        raise error from e
    except PeerError as e:  # a lost peer, named where its send or receive failed: add why, where it published why
        reason = rg.control.explain(e)
        if one_line(e) in reason:  # nobody published a reason: the symptom, as it was
            _fail(rg, rank, e)
            raise
        error = PeerError(f"{one_line(e)}; the reason: {reason}")
        _fail(rg, rank, error)
        raise error from e
    except RuntimeError as e:
        error = PeerError(f"{who} rank {rank}: {rg.control.explain(e)}")
        _fail(rg, rank, error)
        raise error from e
    except BaseException as e:
        _fail(rg, rank, e)
        raise


class ShardedProducer:
    """One trainer rank of a sharded refit into a vLLM engine: joins the group as ``rank`` (< ``info.producers``;
    rank 0 hosts the rendezvous), agrees on the plan with every worker from ``specs`` (this rank's
    :func:`~refit_app.protocol.sharded.from_tensors`), then :meth:`send` once a round, as the engine's
    ``update_weights`` receives it."""

    def __init__(self, info: RefitWorkerInitInfo, rank: int, specs: Sequence[TensorSpec]) -> None:
        if not 0 <= rank < info.producers:
            raise ValueError(f"rank {rank} is not a producer of this refit (ranks 0 to {info.producers - 1})")
        self.rank = rank
        self.num_buffers = info.num_buffers
        self.rg = _group(info, rank)
        with _failing_together(self.rg, rank, "trainer"):
            self.pg = self.rg.group.process_group()
            self.plan = agree(
                self.pg,
                rank,
                specs=specs,
                buffer_size_bytes=info.buffer_size_bytes,
                checksum=PIECED if info.checksums else None,
                delta=agreed_delta(info.delta),
            )
        self.rounds = 0
        self.deltas = ProducerDeltas() if self.plan.delta else None
        """Delta rounds: this rank's snapshot of what it sent, and the last round's figures."""
        self.auto = AgreedAuto() if self.plan.auto else None
        """``delta="auto"``: the kind of the last round (``last``) and why (``reason``)."""

    def send(self, shards: Mapping[str, Held]) -> int:
        """Send this rank's regions of one round from ``shards`` (the live shards); the bytes sent."""
        with _failing_together(self.rg, self.rank, "trainer"):
            sent = send(
                self.pg,
                self.rank,
                self.plan,
                dict(shards),
                num_buffers=self.num_buffers,
                delta=self.deltas,
                auto=self.auto,
            )
        self.rounds += 1
        return sent

    def close(self) -> None:
        self.pg = None
        self.rg.close()


# ----------------------------------------------------------------------------------------------------------------
# Which part of each checkpoint tensor a worker loads: vLLM's weight loaders, run on the meta device.


class _CopyRecorder(TorchDispatchMode):
    """Records the box of ``probe`` that every ``copy_`` reads (``probe`` a contiguous meta tensor of the checkpoint
    tensor's shape, the copies' sources its views), and performs none of them. Any other write to a tensor that is
    not on the meta device is refused: the probe must leave the engine's weights as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.probe: torch.Tensor | None = None
        self.boxes: list[Box | None] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if not dst.is_meta:
                raise RuntimeError(f"the probe of vLLM's loaders would write a real tensor {list(dst.shape)}")
            self.boxes.append(self._box(src))
            return dst
        if func._schema.is_mutable and any(isinstance(a, torch.Tensor) and not a.is_meta for a in args):
            raise RuntimeError(f"the probe of vLLM's loaders would modify a real tensor ({func})")
        return func(*args, **kwargs)

    def _box(self, src: torch.Tensor) -> Box | None:
        """The box of the probe that ``src`` is, or None: not a plain view of it (the loader read all of it, as far
        as this can tell)."""
        probe = self.probe
        assert probe is not None
        if src.untyped_storage()._cdata != probe.untyped_storage()._cdata or src.dim() != probe.dim():
            return None
        rest, starts = src.storage_offset(), []
        for stride in probe.stride():
            starts.append(rest // stride if stride else 0)
            rest = rest % stride if stride else rest
        box = tuple((s, s + n) for s, n in zip(starts, src.shape))
        if any(b > n for (_, b), n in zip(box, probe.shape)):
            return None
        if any(n > 1 and a != b for n, a, b in zip(src.shape, src.stride(), probe.stride())):
            return None
        return box


def _bounding(boxes: list[Box]) -> Box:
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))


@torch.no_grad()
def loaded_boxes(
    model: torch.nn.Module,
    tensors: Sequence[Expected],
    load_weights: Callable[[torch.nn.Module, Iterable[tuple[str, torch.Tensor]]], Any] | None = None,
) -> dict[str, Box]:
    """The box of every checkpoint tensor this worker's ``model`` loads (a tensor it loads nothing of is left out: a
    tied LM head, say), as vLLM's own weight loaders narrow it: each layer is put back in its checkpoint format on
    the meta device (vLLM's :func:`restore_layer_on_meta`, from the metadata it recorded at load time),
    ``model.load_weights`` is given one meta tensor per checkpoint tensor, and every copy out of it is recorded as
    the box it reads (one it cannot place, or several, give their bounding box or the whole tensor: never less than
    the loader reads). The layers' own tensors (the CPU linear layers' packed kernels) are put back as they were;
    nothing real is written, and a loader that tries is refused."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_tensors

    from refit_app.integrations.vllm.loader import load

    load_weights = load_weights or load
    swapped: list[tuple[torch.nn.Module, tuple[dict, dict], set[str]]] = []
    recorder = _CopyRecorder()
    out: dict[str, Box] = {}
    try:
        for layer in model.modules():
            info = get_layerwise_info(layer)
            if not any(info.restore_metadata):
                continue
            swapped.append((layer, get_layer_params_buffers(layer), set(layer._non_persistent_buffers_set)))
            restore_layer_on_meta(layer, info)
        for spec in tensors:
            dtype = getattr(torch, spec.dtype)
            recorder.probe = torch.empty(spec.shape, dtype=dtype, device="meta")
            recorder.boxes = []
            with recorder:
                load_weights(model, [(spec.name, recorder.probe)])
            read = [b if b is not None else whole(spec.shape) for b in recorder.boxes]
            read = [b for b in read if volume(b) or not spec.shape]
            if read:
                out[spec.name] = _bounding(read) if spec.shape else ()
    finally:
        for layer, (params, buffers), non_persistent in reversed(swapped):
            for name in get_layer_tensors(layer):
                delattr(layer, name)
            for name, param in params.items():
                layer.register_parameter(name, param)
            for name, buffer in buffers.items():
                layer.register_buffer(name, buffer, persistent=name not in non_persistent)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The worker's side.


class ShardedWorker:
    """One vLLM worker of a sharded refit: joins the group as ``rank``, asks its loaders which box of each
    checkpoint tensor it loads (:func:`loaded_boxes`), agrees on the plan with every rank, and each round receives
    its boxes into tensors of the whole shapes and hands them to ``load`` (the worker engine's loader)."""

    def __init__(
        self,
        info: RefitWorkerInitInfo,
        rank: int,
        model: torch.nn.Module,
        boxes: Callable[[torch.nn.Module, Sequence[Expected]], dict[str, Box]] = loaded_boxes,
    ) -> None:
        self.rank = rank
        self.num_buffers = info.num_buffers
        expects = _expected(info)
        self.rg = _group(info, rank)
        with _failing_together(self.rg, rank, "vLLM worker"):
            self.pg = self.rg.group.process_group()
            self.boxes = boxes(model, expects)
            needs = [Need(rank, name, box) for name, box in self.boxes.items()]
            self.plan = agree(
                self.pg,
                rank,
                needs=needs,
                expects=expects,
                buffer_size_bytes=info.buffer_size_bytes,
                checksum=PIECED if info.checksums else None,
                delta=agreed_delta(info.delta),
            )
        self.bases = ConsumerBases() if self.plan.delta else None
        """Delta rounds: what this worker had sent again whole, and which tensors the last round wrote; its base is
        :attr:`tensors` itself, kept across rounds."""
        self.auto = AgreedAuto() if self.plan.auto else None
        by_name = {e.name: e for e in expects}
        # Whole-shaped, written only in the boxes: what vLLM's loaders narrow (torch.empty touches no page).
        self.tensors = {
            name: torch.empty(by_name[name].shape, dtype=getattr(torch, by_name[name].dtype)) for name in self.boxes
        }
        self.slices = {
            name: Held(t[tuple(slice(a, b) for a, b in self.boxes[name])] if t.dim() else t, self.boxes[name])
            for name, t in self.tensors.items()
        }
        self.slice_bytes = sum(volume(box) * self.tensors[name].element_size() for name, box in self.boxes.items())
        """What this worker receives a round."""
        self.model_bytes = sum(math.prod(e.shape) * getattr(torch, e.dtype).itemsize for e in expects)
        """The whole checkpoint's bytes."""
        self.rounds = 0
        self.last_bytes = 0
        self.last_seconds = 0.0
        self.last_delta = False
        """Whether the last round was a delta round (its changes patched into :attr:`tensors`)."""
        self.last_loaded = 0
        """The checkpoint tensors the last round loaded into the engine (a delta round: only those it wrote)."""

    def receive_round(
        self,
        update: RefitUpdateInfo,
        load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
        complete: Callable[[], Any],
    ) -> int:
        """Receive round ``update.round`` (the next one) and load it: ``load`` gets ``(name, whole-shaped tensor)``
        for every tensor this worker loads a part of, then ``complete`` finishes the reload. The bytes received.

        A delta round patches this worker's own slices (its base: what it received, checked against the producers'
        hashes of every piece, a piece that differs sent again whole) and ``load`` gets only the tensors the round
        wrote, each as a :class:`~refit_app.protocol.session.TensorDelta` that came whole with :attr:`tensors` as
        its mirror: the worker engine's loader reloads their layers through vLLM's ``load_weights`` (fused
        parameters with their other parts from the mirror), the rest of the engine left as it is."""
        if update.round != self.rounds + 1:
            error = HandshakeError(
                f"the trainer's update_weights says round {update.round}, this worker has received {self.rounds}; "
                "call init_weight_transfer_engine again"
            )
            _fail(self.rg, self.rank, error)
            raise error
        started = time.perf_counter()
        with _failing_together(self.rg, self.rank, "vLLM worker"):
            moved = receive(
                self.pg,
                self.rank,
                self.plan,
                self.slices,
                num_buffers=self.num_buffers,
                bases=self.bases,
                auto=self.auto,
            )
            self.last_seconds = time.perf_counter() - started
            self.last_delta = self._delta_round()
            if self.last_delta:
                assert self.bases is not None
                written = [name for name in self.tensors if name in self.bases.written]
                load(self._changes(written))
                self.last_loaded = len(written)
            else:
                load(iter(self.tensors.items()))
                self.last_loaded = len(self.tensors)
            complete()
        self.rounds += 1
        self.last_bytes = moved
        return moved

    def _delta_round(self) -> bool:
        """Whether the round just received was a delta round (the first of ``on`` and every ``keep`` or ``plain``
        round of ``auto`` are dense: every tensor loaded again)."""
        if self.auto is not None:
            return self.auto.last == DELTA
        return self.bases is not None and self.rounds >= 1

    def _changes(self, names: Sequence[str]) -> Iterator[tuple[str, TensorDelta]]:
        for name in names:
            t = self.tensors[name]
            yield name, TensorDelta(name, tuple(t.shape), t.dtype, None, t.reshape(-1), mirror=self.tensors)

    def facts(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "delta": self.last_delta,
            "loaded": self.last_loaded,
            "rounds": self.rounds,
            "bytes": self.last_bytes,
            "slice_bytes": self.slice_bytes,
            "model_bytes": self.model_bytes,
            "seconds": self.last_seconds,
            "boxes": {name: [list(b) for b in box] for name, box in self.boxes.items()},
        }

    def close(self) -> None:
        self.pg = None
        self.rg.close()


def sharded_facts(worker: Any) -> dict[str, Any]:
    """Run on a vLLM worker (``llm.collective_rpc(sharded_facts)``): what its sharded refit received and loads."""
    engine = worker.weight_transfer_engine
    if engine.sharded is None:
        raise RuntimeError("this worker is not in a sharded refit: init_weight_transfer_engine with producers > 0")
    return engine.sharded.facts()
