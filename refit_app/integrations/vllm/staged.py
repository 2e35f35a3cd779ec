"""Staged refits for the ``refit_app`` vLLM backend: each worker receives round N+1 on a side thread while the engine
keeps generating with round N, then the engine stops only to apply it (issue 34; the library side is
:mod:`refit_app.protocol.staging`).

Set ``RefitTrainerInitInfo(staged=True)``: every worker's session then keeps no mirror and takes dense rounds only,
and the rounds are driven by :func:`send_staged` (trainer) and :class:`StagedLLM` (the process that owns an offline
``LLM``), not by ``send_weights``::

    trainer (rank 0)                    engine process (StagedLLM)           each vLLM worker
    client.stage_weights(k)    --->     stage(k): an RPC that returns  --->  a side thread: session.stage(held)
    session.send(source)      ====>     the engine keeps stepping            receives + verifies into its own
                                                                             host copy (held keeps round N)
    client.apply_staged(k)     --->     wait for the stage (not paused)
                                        pause (mode=keep) ------------------> StagedRound.apply into ``held``,
                                                                              vLLM's layerwise reload from it
                                        set_weight_version(k), prefix cache reset (or kept), resume

The worker keeps ``held``, a host copy of the model in the trainer's (checkpoint) names: the staged round's
targets. vLLM's CPU linear layers repack their weights, so the engine's own parameters cannot be the targets; the
apply writes ``held`` and loads it through the dense round's path (:class:`~refit_app.integrations.vllm.loader.
EngineLoader`, vLLM's layerwise reload). Memory: ``held`` (one host copy of the model) plus, while a round is staged,
the session's staged copy (one more).

A round that fails verification (or whose producer dies mid-stage) is never applied: :meth:`StagedLLM.apply` reports
it (``applied`` False, ``error`` one line) and never pauses the engine, which keeps serving round N.

Delta rounds are not staged yet (the worker's session does not accept them, so the trainer sends dense rounds).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch

from refit_app.common.errors import StagingError, one_line
from refit_app.core.meta import TensorMeta
from refit_app.integrations.vllm.backend import RefitUpdateInfo
from refit_app.protocol.manifest import Manifest
from refit_app.protocol.session import Round
from refit_app.protocol.staging import StagedRound

logger = logging.getLogger(__name__)

PREFIX_CACHE_MODES = ("reset", "keep")
"""What :class:`StagedLLM` does with vLLM's KV cache at a refit: ``reset`` clears the prefix cache and preempts the
requests in flight, which recompute their KV with the new weights when generation resumes (no token of round N+1 is
computed from round N's KV); ``keep`` leaves it all (the requests in flight go on from KV computed with round N:
off-policy tokens, which their outputs' ``weight_versions`` spans count)."""

ATTRIBUTE = "_refit_staged"
"""Where a worker's :class:`StagedWorker` lives on its refit_app weight-transfer engine."""


class StagedWorker:
    """One vLLM worker's staged rounds: :meth:`start` a round's stage on a side thread, :meth:`wait` for it,
    :meth:`apply` it in the engine's pause."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        """The worker's :class:`~refit_app.integrations.vllm.engine.RefitWeightTransferEngine`."""
        self.held: dict[str, torch.Tensor] = {}
        """The model as the engine serves it, in the trainer's names, on the host: the staged rounds' targets."""
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-vllm-stage")
        self._future: concurrent.futures.Future[StagedRound] | None = None
        self.last: dict[str, Any] | None = None
        """The metrics of the round applied last."""
        self._load_seconds = 0.0
        self._report: Any = None

    def _targets(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        metas: list[TensorMeta] = manifest.tensors
        if [(n, t.shape, t.dtype) for n, t in self.held.items()] != [(m.name, m.shape, m.dtype) for m in metas]:
            self.held = {m.name: torch.empty(m.shape, dtype=m.dtype) for m in metas}
        return self.held

    def start(self, round_no: int) -> None:
        session = self.engine.session
        if session is None:
            raise RuntimeError("refit_app weight transfer is not initialized: call init_weight_transfer_engine first")
        if session.mirror:
            raise RuntimeError("staged rounds need RefitTrainerInitInfo(staged=True)")
        if self._future is not None:
            raise RuntimeError(f"round {round_no}: a staged round is still pending: apply it first")
        self._future = self._pool.submit(self._stage, round_no)

    def _stage(self, round_no: int) -> StagedRound:
        session = self.engine.session
        staged = session.stage(lambda: self._targets(session.manifest))
        if staged is None:
            raise StagingError(f"round {round_no}: the trainer closed the refit_app session")
        if staged.version != round_no:
            staged.discard()
            raise StagingError(f"round {round_no}: the session staged round {staged.version}; not applied")
        return staged

    def staging(self) -> bool:
        """Whether a stage is under way (started, not finished)."""
        return self._future is not None and not self._future.done()

    def wait(self, timeout_s: float) -> StagedRound | str:
        """The staged round, or why there is none (one line); waits at most ``timeout_s``."""
        if self._future is None:
            return "no round was staged"
        try:
            return self._future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            return f"the stage did not finish within {timeout_s:g}s"
        except Exception as e:
            self._future = None
            return one_line(e)

    def apply(self) -> dict[str, Any]:
        """Apply the staged round (called in the engine's pause): into ``held``, then into vLLM's model through
        the layerwise reload. Returns the round's metrics plus ``load_seconds`` (the reload) and ``applied``."""
        future, self._future = self._future, None
        if future is None or not future.done() or future.exception() is not None:
            raise StagingError("no staged round is ready: call wait() outside the pause first")
        staged = future.result()
        loader = self.engine.loader
        metrics = staged.apply(pause=_loading(self, loader))
        metrics.update(applied=True, load_seconds=self._load_seconds)
        self.engine.last_round = staged.round
        self.engine.last_load = self._report
        self.last = metrics
        return metrics

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


@contextlib.contextmanager
def _loading(worker: StagedWorker, loader: Any) -> Iterator[None]:
    """StagedRound.apply's pause on the worker: once ``held`` is written, load it into vLLM's model (a dense round
    through the layerwise reload, the path of an unstaged dense round)."""
    yield
    started = time.perf_counter()
    loader.begin()
    try:
        loader.load(worker.held.items())
        worker._report = loader.finish()
    except BaseException:
        loader.abort()
        raise
    worker._load_seconds = time.perf_counter() - started


def _worker(worker: Any) -> StagedWorker:
    engine = worker.weight_transfer_engine
    if engine is None:
        raise RuntimeError("no weight-transfer engine: start vLLM with weight_transfer_config={'backend': 'refit_app'}")
    return _staged_of(engine)


def _staged_of(engine: Any) -> StagedWorker:
    staged = getattr(engine, ATTRIBUTE, None)
    if staged is None:
        staged = StagedWorker(engine)
        setattr(engine, ATTRIBUTE, staged)
    return staged


# The worker engine's update_weights with RefitUpdateInfo.staged set: how `vllm serve` drives a staged round. Its
# /update_weights route returns nothing of the call but its failure, so a step that cannot go on raises, one line.


def update_staged(engine: Any, update: RefitUpdateInfo) -> None:
    """One step of a staged round on this worker (:attr:`RefitUpdateInfo.staged`): ``start`` returns at once (the
    engine core goes on stepping generation while the side thread receives); ``wait`` returns once the round is
    staged and raises :class:`~refit_app.common.errors.StagingError` (one line) where it will not be applied, the
    round dropped; ``apply`` applies it (the caller has paused the engine); ``discard`` drops it, once its stage
    has ended. ``wait`` and ``discard`` wait at most the group's deadline."""
    staged = _staged_of(engine)
    if engine.session is None:
        raise RuntimeError("refit_app weight transfer is not initialized: call init_weight_transfer_engine first")
    timeout_s = engine.session.group.spec.timeout_s
    k = update.round
    if update.staged == "start":
        drop_pending(engine)
        staged.start(k)
    elif update.staged == "wait":
        result = staged.wait(timeout_s)
        if isinstance(result, str):
            raise StagingError(f"round {k}: not applied, the engine keeps its weights: {result}")
        if result.version != k:
            _drop(staged, 0)
            raise StagingError(f"round {k}: the worker staged round {result.version}; not applied")
    elif update.staged == "apply":
        metrics = staged.apply()
        logger.info("refit_app worker: staged round %d applied: %s", k, metrics)
    elif update.staged == "discard":
        logger.info("refit_app worker: staged round %d dropped: %s", k, _drop(staged, timeout_s))
    else:
        raise ValueError(f"RefitUpdateInfo.staged={update.staged!r}")


def drop_pending(engine: Any) -> None:
    """Drop the round a trainer left staged (it died mid-stage, or never applied it), never applying it: waits for
    its stage to end, within its group's deadline (the worker engine calls this before it joins a new trainer)."""
    staged = getattr(engine, ATTRIBUTE, None)
    if staged is None or staged._future is None:
        return
    timeout_s = engine.session.group.spec.timeout_s if engine.session is not None else 0.0
    logger.warning("refit_app worker: the round staged before was not applied: %s", _drop(staged, timeout_s))


def _drop(staged: StagedWorker, timeout_s: float) -> str:
    """Drop the worker's staged round, unapplied, once its stage has ended (within ``timeout_s``); returns why it
    was not applied (one line)."""
    result = staged.wait(timeout_s)
    if staged.staging():
        raise StagingError(f"the staged round did not end within {timeout_s:g}s; it stays pending")
    _discard_staged(staged)
    return result if isinstance(result, str) else f"round {result.version}: staged, never applied"


# Worker-side functions, run through collective_rpc (each gets the vLLM worker).


def worker_start(worker: Any, round_no: int) -> None:
    _worker(worker).start(round_no)


def worker_staging(worker: Any) -> bool:
    return _worker(worker).staging()


def worker_wait(worker: Any, timeout_s: float) -> str | None:
    """None once the round is staged; else why it will not be applied."""
    result = _worker(worker).wait(timeout_s)
    return result if isinstance(result, str) else None


def worker_apply(worker: Any) -> dict[str, Any]:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        return _worker(worker).apply()


def worker_held(worker: Any) -> dict[str, torch.Tensor]:
    """The worker's host copy of the model it serves (a copy)."""
    return {n: t.clone() for n, t in _worker(worker).held.items()}


# --------------------------------------------------------------------------------------------------------------
# The engine process's side (an offline LLM), and the trainer's.


class StagedLLM:
    """Drives staged rounds on an offline ``vllm.LLM``.

    Tested with the engine core in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). With it in a process
    of its own the worker-side functions travel to the workers pickled: one round ran that way (stage, pause, apply,
    resume; with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` set), but no test covers it.

    :meth:`stage` returns at once (the workers receive on side threads; the caller keeps generating, e.g. stepping
    ``llm.llm_engine``); :meth:`apply` waits for the stage outside any pause, then pauses the engine (``mode=keep``:
    requests in flight are frozen, not aborted), applies, sets vLLM's weight version, resets the prefix cache
    (``prefix_cache``, :data:`PREFIX_CACHE_MODES`) and resumes.
    """

    def __init__(self, llm: Any, *, prefix_cache: str = "reset", timeout_s: float = 120.0) -> None:
        if prefix_cache not in PREFIX_CACHE_MODES:
            raise ValueError(f"prefix_cache={prefix_cache!r}: one of {', '.join(PREFIX_CACHE_MODES)}")
        self.llm = llm
        self.prefix_cache = prefix_cache
        self.timeout_s = timeout_s

    def stage(self, round_no: int) -> None:
        self.llm.collective_rpc(worker_start, args=(round_no,))

    def staging(self) -> bool:
        """Whether any worker is still receiving."""
        return any(self.llm.collective_rpc(worker_staging))

    def apply(self, weight_version: str | None = None) -> dict[str, Any]:
        """Apply the staged round on every worker in one pause; returns worker 0's metrics, with ``pause_seconds``
        replaced by the engine's whole stop (pause to resume, version and cache reset included; the worker's own
        is ``worker_pause_seconds``). A round not staged on every worker is applied on none: ``applied`` False and
        ``error``, the engine never paused."""
        errors = [e for e in self.llm.collective_rpc(worker_wait, args=(self.timeout_s,)) if e is not None]
        if errors:
            # A worker whose round did stage drops it: no worker serves a round another does not.
            self.llm.collective_rpc(_discard)
            logger.warning("staged round not applied, the engine keeps its weights: %s", errors[0])
            return {"applied": False, "error": errors[0]}
        engine = self.llm.llm_engine
        paused = time.perf_counter()
        engine.sleep(level=0, mode="keep")
        try:
            metrics = self.llm.collective_rpc(worker_apply)[0]
            if weight_version is not None:
                engine.set_weight_version(weight_version)
            if self.prefix_cache == "reset":
                engine.reset_prefix_cache(reset_running_requests=True)
        finally:
            engine.wake_up(tags=["scheduling"])
        metrics["worker_pause_seconds"] = metrics["pause_seconds"]
        metrics["pause_seconds"] = time.perf_counter() - paused
        metrics["weight_version"] = weight_version
        return metrics


def _discard(worker: Any) -> None:
    _discard_staged(_worker(worker))


def _discard_staged(staged: StagedWorker) -> None:
    future, staged._future = staged._future, None
    if future is not None and future.done() and future.exception() is None:
        future.result().discard()


def send_staged(trainer: Any, weight_version: str | None = None) -> tuple[Round, dict[str, Any]]:
    """One staged round from a :class:`~refit_app.integrations.vllm.engine.RefitTrainerWeightTransferEngine` built
    with ``staged=True``, through its client, which must also have ``stage_weights(update_info)`` (returns once
    the workers' stage has started) and ``apply_staged(weight_version) -> metrics`` (:class:`StagedLLM`'s
    :meth:`~StagedLLM.stage` and :meth:`~StagedLLM.apply` on the engine's side; for ``vllm serve``,
    :class:`~refit_app.integrations.vllm.server.StagedHTTPClient`), and may have ``discard_staged()``, called where
    the send fails. Returns the producer's round and the engine's metrics."""
    session = trainer.session
    if session is None:
        raise RuntimeError("refit_app trainer engine is not connected (trainer_init failed or shutdown ran)")
    metas = [TensorMeta(m.name, tuple(m.shape), m.dtype) for m in trainer.source.metadata()]
    update = RefitUpdateInfo(round=session.rounds + 1)
    trainer.client.stage_weights(asdict(update))
    try:
        sent = session.send(trainer.source, metas=metas, source="vLLM trainer engine (staged)")
    except BaseException:
        discard = getattr(trainer.client, "discard_staged", None)
        if discard is not None:  # the engine drops the round, once the workers' stage has failed too
            try:
                discard()
            except Exception as e:
                logger.warning("the engine could not drop the staged round: %s", e)
        raise
    trainer.last_round = sent
    metrics = trainer.client.apply_staged(weight_version)
    return sent, metrics
