"""The ``refit_app`` backend's two vLLM engines: :class:`RefitWeightTransferEngine` (each vLLM worker) and
:class:`RefitTrainerWeightTransferEngine` (the trainer).

This module imports vLLM at its top, so it imports only where vLLM is installed, and nothing in refit_app imports
it: vLLM's weight-transfer factories do, by path, on the first engine they create.
:func:`refit_app.integrations.vllm.backend.register` registers this module's path and the two class names with them,
never the classes, so ``import refit_app.integrations.vllm.backend`` needs no vLLM. The settings, the sessions and
one worker round are vLLM-free and live in :mod:`refit_app.integrations.vllm.backend`, which describes a round.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)

from refit_app.common.errors import PeerError
from refit_app.core.meta import TensorMeta
from refit_app.integrations.vllm.backend import (
    RefitTrainerInitInfo,
    RefitUpdateInfo,
    RefitWorkerInitInfo,
    consumer_session,
    producer_session,
    receive_round,
    worker_init_info,
)
from refit_app.integrations.vllm.loader import EngineLoader, LoadReport
from refit_app.integrations.vllm.sharded import ShardedWorker
from refit_app.integrations.vllm.staged import drop_pending, update_staged
from refit_app.protocol.session import ConsumerSession, ProducerSession, Round
from refit_app.transport.spec import DEFAULT_TIMEOUT_S, PRODUCER_RANK

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.parallel import ParallelConfig

__all__ = ["RefitTrainerWeightTransferEngine", "RefitWeightTransferEngine"]

logger = logging.getLogger(__name__)


def _worker_rank(parallel_config: ParallelConfig) -> int:
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


# The init and update infos are plain dataclasses in backend.py, which must import without vLLM, so they do not
# subclass vLLM's WeightTransferInitInfo / WeightTransferUpdateInfo / TrainerInitInfo (empty bases, or ``rank`` and
# ``backend``, which RefitTrainerInitInfo has): type checkers see the type arguments outside the bounds.
class RefitWeightTransferEngine(WeightTransferEngine[RefitWorkerInitInfo, RefitUpdateInfo]):  # type: ignore[type-var]
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

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.session: ConsumerSession | None = None
        self.sharded: ShardedWorker | None = None
        """This worker's part of a sharded refit (``init_info.producers`` > 0), instead of :attr:`session`."""
        self.last_round: Round | None = None
        self.last_load: LoadReport | None = None
        self.loaded: set[str] = set()
        self._completed = False
        self._failed = False
        self._loaders: dict[int, EngineLoader] = {}
        self.staged = False
        """Whether the trainer stages its rounds (``RefitWorkerInitInfo.staged``): they load in their apply."""

    @property
    def loader(self) -> EngineLoader:
        """The loader of the model this update targets."""
        loader = self._loaders.get(id(self.model))
        if loader is None or loader.model is not self.model:
            loader = self._loaders[id(self.model)] = EngineLoader(self.model, self.model_config)
        return loader

    def init_transfer_engine(self, init_info: RefitWorkerInitInfo) -> None:
        drop_pending(self)  # a round the trainer before left staged ends first (within its group's deadline)
        self.shutdown()
        rank = init_info.rank_offset + _worker_rank(self.parallel_config)
        self.staged = init_info.staged
        if init_info.producers:
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(self.vllm_config):  # the loaders it asks may read the current config
                self.sharded = ShardedWorker(init_info, rank, self.model)
            return
        self.session = consumer_session(init_info, rank)

    def start_weight_update(self) -> None:
        self._completed = self._failed = False
        if not self.staged:  # a staged round loads in its apply, inside the engine's pause, not beside generation
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
        if update_info.staged is not None:
            if not self.staged:
                raise RuntimeError(
                    f"update_weights(staged={update_info.staged!r}): this engine's trainer did not set staged=True"
                )
            update_staged(self, update_info)
            return
        if self.sharded is not None:
            try:
                self.sharded.receive_round(update_info, self.load, self.complete)
            except BaseException:
                self._failed = True
                raise
            logger.info("refit_app worker: sharded round %d, %d bytes", update_info.round, self.sharded.last_bytes)
            return
        if self.session is None:
            raise RuntimeError("refit_app weight transfer is not initialized: call init_weight_transfer_engine first")
        try:
            self.last_round = receive_round(self.session, update_info, self.load, complete=self.complete)
        except BaseException:
            self._failed = True
            raise
        logger.info("refit_app worker: %s", self.last_round)

    def shutdown(self) -> None:
        if self.sharded is not None:
            sharded, self.sharded = self.sharded, None
            sharded.close()
        if self.session is not None:
            session, self.session = self.session, None
            _close(session)


class RefitTrainerWeightTransferEngine(TrainerWeightTransferEngine[RefitTrainerInitInfo]):  # type: ignore[type-var]
    """Trainer side: hosts the refit_app group as rank 0 and drives each round through ``client``."""

    init_info_cls = RefitTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None,
        is_sender: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.session: ProducerSession | None = None
        self.timeout_s = timeout_s
        self.last_round: Round | None = None

    @classmethod
    def trainer_init(
        cls, init_info: RefitTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> RefitTrainerWeightTransferEngine:
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
            futures: list[concurrent.futures.Future[Any]] = [remote, local]
            done, _ = concurrent.futures.wait(
                futures, timeout=init_info.timeout_s + 30.0, return_when=concurrent.futures.FIRST_EXCEPTION
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
