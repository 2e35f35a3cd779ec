"""Staged refits for the ``refit_app`` vLLM backend: each worker receives round N+1 on a side thread while the engine
keeps generating with round N, then the engine stops only to apply it (issue 34; the library side is
:mod:`refit_app.protocol.staging`).

Set ``RefitTrainerInitInfo(staged=True)`` (and ``delta="on"`` or ``"auto"`` for delta rounds after the first):
every worker's session then keeps no mirror, and the rounds are driven by :func:`send_staged` (trainer) and
:class:`StagedLLM` (the process that owns an offline ``LLM``), not by ``send_weights``::

    trainer (rank 0)                    engine process (StagedLLM)           each vLLM worker
    client.stage_weights(k)    --->     stage(k): an RPC that returns  --->  a side thread: session.stage(held)
    session.send(source)      ====>     the engine keeps stepping            receives + verifies beside ``held``
                                                                             (which keeps round N), then builds
                                                                             the round's layers on shadows
    client.apply_staged(k)     --->     wait for the stage (not paused)
                                        pause (mode=keep) ------------------> swap the prepared layers in
                                        set_weight_version(k), prefix cache reset (or kept), resume
                                        settle ----------------------------> side thread: the round into ``held``

The worker keeps ``held``, a host copy of the model in the trainer's (checkpoint) names: the staged rounds' targets
(a delta round's base) and what a layer a delta round touches is rebuilt from. vLLM's CPU linear layers repack their
weights, so the engine's own parameters cannot be the targets. Once a round is verified the side thread builds its
layers in vLLM's kernel layout (:mod:`refit_app.integrations.vllm.prepare`: vLLM's own loaders and
``process_weights_after_loading`` on shadows of the layers; a dense round every layer, a delta round only the
layers its changes load into), and the pause only swaps them in; a layer that cannot be prepared is reloaded in the
pause (the metrics' ``fallback`` names it and why). ``held`` is written after the resume, on the side thread.
``StagedLLM(prepare=False)`` keeps the path before: the pause writes ``held`` and runs vLLM's layerwise reload of
the whole model from it.

Memory on a worker while a round is staged: ``held`` (one host copy of the model), the session's staged copy (a
dense round: one more; a delta round: its changes), and the prepared layers (about one processed copy of the layers
the round touches; ``max_prepared_bytes`` bounds it), besides the engine's own weights.

A round that fails verification (or whose producer dies mid-stage) is never applied: :meth:`StagedLLM.apply` reports
it (``applied`` False, ``error`` one line) and never pauses the engine, which keeps serving round N.
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
from refit_app.integrations.vllm.defaults import PREFIX_CACHE_MODES
from refit_app.protocol.manifest import Manifest
from refit_app.protocol.session import Round
from refit_app.protocol.staging import APPLIED, StagedRound

logger = logging.getLogger(__name__)

ATTRIBUTE = "_refit_staged"
"""Where a worker's :class:`StagedWorker` lives on its refit_app weight-transfer engine."""


class StagedWorker:
    """One vLLM worker's staged rounds: :meth:`start` a round's stage on a side thread, :meth:`wait` for it,
    :meth:`apply` it in the engine's pause, :meth:`settle` it after the resume.

    With ``prepare`` (the default), the side thread also builds the round's layers in vLLM's kernel layout once the
    round is verified (:func:`~refit_app.integrations.vllm.prepare.prepare`: a dense round every layer, a delta round
    the layers its changes touch), so that :meth:`apply` only swaps them in; a layer it cannot prepare is reloaded
    in the pause, and the metrics name it. Without, :meth:`apply` writes the round into :attr:`held` and reloads
    the whole model from it in the pause (vLLM's layerwise reload)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        """The worker's :class:`~refit_app.integrations.vllm.engine.RefitWeightTransferEngine`."""
        self.held: dict[str, torch.Tensor] = {}
        """The model as the engine serves it, in the trainer's names, on the host: the staged rounds' targets
        (the base a delta round's changes apply to, and the tensors a layer it touches is rebuilt from)."""
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-vllm-stage")
        self._future: concurrent.futures.Future[StagedRound] | None = None
        self._settling: concurrent.futures.Future[dict[str, Any]] | None = None
        self._prepared: Any = None
        """The round's :class:`~refit_app.integrations.vllm.prepare.Prepared` (None: reload in the pause)."""
        self._facts: dict[str, Any] = {}
        self._old: list[Any] = []
        self._unsettled: StagedRound | None = None
        self.last: dict[str, Any] | None = None
        """The metrics of the round applied last."""
        self.last_prepared: list[str] = []
        """The vLLM layers the round applied last swapped in, prepared (empty: none)."""
        self._load_seconds = 0.0
        self._report: Any = None

    def targets(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """:attr:`held`, shaped as ``manifest`` says (made anew where it is not): the staged rounds' targets."""
        metas: list[TensorMeta] = manifest.tensors
        if [(n, t.shape, t.dtype) for n, t in self.held.items()] != [(m.name, m.shape, m.dtype) for m in metas]:
            self.held = {m.name: torch.empty(m.shape, dtype=m.dtype) for m in metas}
        return self.held

    def start(self, round_no: int, prepare: bool = True, max_prepared_bytes: int | None = None) -> None:
        session = self.engine.session
        if session is None:
            raise RuntimeError("refit_app weight transfer is not initialized: call init_weight_transfer_engine first")
        if session.mirror:
            raise RuntimeError("staged rounds need RefitTrainerInitInfo(staged=True)")
        if self._future is not None:
            raise RuntimeError(f"round {round_no}: a staged round is still pending: apply it first")
        # Queued behind the last round's settle (the held copy written), which the stage reads.
        self._future = self._pool.submit(self._stage, round_no, prepare, max_prepared_bytes)

    def _stage(self, round_no: int, prepare: bool, max_prepared_bytes: int | None) -> StagedRound:
        session = self.engine.session
        staged = session.stage(lambda: self.targets(session.manifest))
        if staged is None:
            raise StagingError(f"round {round_no}: the trainer closed the refit_app session")
        if staged.version != round_no:
            staged.discard()
            raise StagingError(f"round {round_no}: the session staged round {staged.version}; not applied")
        self._prepared, self._facts = None, {"prepared": False}
        if prepare:
            self._prepare(staged, max_prepared_bytes)
        return staged

    def _prepare(self, staged: StagedRound, max_prepared_bytes: int | None) -> None:
        """Build the round's layers beside the engine (the engine keeps serving its own)."""
        from vllm.config import set_current_vllm_config

        from refit_app.integrations.vllm import prepare

        loader = self.engine.loader
        changed = staged.changed
        names: list[str] | set[str] = list(self.held)
        if staged.base_round and all(n in loader.routes for n in changed):
            layers = set().union(*(loader.routes[n] for n in changed))
            _, names = loader.closure(layers, self.held)
            names = [n for n in self.held if n in names]
        size = sum(self.held[n].numel() * self.held[n].element_size() for n in names)
        if max_prepared_bytes is not None and size > max_prepared_bytes:
            self._facts = {"prepared": False, "fallback": {"*": f"{size} bytes to prepare, over {max_prepared_bytes}"}}
            return
        try:
            with set_current_vllm_config(self.engine.vllm_config):
                prepared = prepare.prepare(loader.model, staged.tensors(names), loader.routes or None)
        except Exception as e:
            logger.warning("preparing round %d failed; it is reloaded in the pause: %s", staged.version, one_line(e))
            self._facts = {"prepared": False, "fallback": {"*": f"preparing it failed: {one_line(e)}"}}
            return
        loader.routes.update(prepared.routes)
        self._prepared = prepared
        self._facts = {
            "prepared": True,
            "prepared_layers": len(prepared.layers),
            "prepared_bytes": prepared.prepared_bytes,
            "prepare_seconds": prepared.prepare_seconds,
            "fallback": dict(prepared.fallback),
        }

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
        """Apply the staged round (called in the engine's pause). Prepared: swap the prepared layers in, reload
        only the layers that could not be prepared; :meth:`settle` then writes ``held`` after the resume. Not
        prepared: write ``held`` and reload the whole model from it. Returns the round's metrics plus
        ``load_seconds`` (the reload in the pause), ``swap_seconds`` and ``applied``."""
        future, self._future = self._future, None
        if future is None or not future.done() or future.exception() is not None:
            raise StagingError("no staged round is ready: call wait() outside the pause first")
        staged = future.result()
        loader = self.engine.loader
        prepared, self._prepared = self._prepared, None
        facts = dict(self._facts)
        self.last_prepared = []
        if prepared is None and "*" not in facts.get("fallback", {}):
            return self._write_and_reload(staged, facts)
        from refit_app.integrations.vllm import loader as loading
        from refit_app.integrations.vllm import prepare

        entered = time.perf_counter()
        swap_seconds = load_seconds = 0.0
        try:
            if prepared is None:  # nothing prepared: the whole model from the staged round, in the pause
                with _loading(self, loader, staged.tensors(list(self.held))):
                    pass
                load_seconds = self._load_seconds
            else:
                self.last_prepared = list(prepared.layers)
                self._old = prepare.swap(prepared)
                swap_seconds = time.perf_counter() - entered
                if prepared.fallback:
                    started = time.perf_counter()
                    layers, names = loader.closure(set(prepared.fallback), self.held)
                    loading.reload_layers(
                        loader.model,
                        loader.model_config,
                        [loader._layers[n] for n in layers if n in loader._layers],
                        staged.tensors([n for n in self.held if n in names]),
                    )
                    load_seconds = time.perf_counter() - started
        except BaseException:
            staged.discard()  # the engine holds neither round: the next one comes dense
            raise
        metrics = staged.metrics()
        metrics.update(
            facts,
            state=APPLIED,
            applied=True,
            worker_pause_seconds=time.perf_counter() - entered,
            swap_seconds=swap_seconds,
            load_seconds=load_seconds,
        )
        self._unsettled = staged
        self.engine.last_round = staged.round
        self.last = metrics
        return metrics

    def apply_alone(self, staged: StagedRound) -> dict[str, Any]:
        """Apply a round its caller staged into :meth:`targets` itself, on an engine that serves nothing yet (the
        first round of ``sink=vllm sink.staged=true``, whose manifest builds the engine): written into
        :attr:`held`, the whole model loaded from it."""
        if self._future is not None:
            raise StagingError(f"round {staged.version}: a staged round is still pending: apply it first")
        return self._write_and_reload(staged, {"prepared": False})

    def _write_and_reload(self, staged: StagedRound, facts: dict[str, Any]) -> dict[str, Any]:
        """The round into :attr:`held`, then the whole model reloaded from it, both in the pause."""
        metrics = staged.apply(pause=_loading(self, self.engine.loader, self.held.items()))
        metrics.update(facts, applied=True, load_seconds=self._load_seconds, swap_seconds=0.0)
        self.engine.last_round = staged.round
        self.engine.last_load = self._report
        self.last = metrics
        return metrics

    def settle(self) -> None:
        """After the resume: start writing the applied round into ``held`` on the side thread (a stage started next
        waits for it)."""
        staged, self._unsettled = self._unsettled, None
        if staged is not None:
            self._settling = self._pool.submit(self._settle, staged)

    def _settle(self, staged: StagedRound) -> dict[str, Any]:
        """After the resume, on the side thread: the round into ``held`` (the next round's base), and the layers'
        previous state dropped."""
        self._old = []
        try:
            return staged.apply()
        except StagingError as e:  # held holds neither round: the next round comes dense, the engine serves this one
            logger.warning("round %d: the worker's copy of the model was not updated: %s", staged.version, e)
            return {"error": one_line(e)}

    def settled(self, timeout_s: float) -> dict[str, Any] | None:
        """Wait for the last round's :meth:`_settle` (None where there was none)."""
        if self._settling is None:
            return None
        return self._settling.result(timeout=timeout_s)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


@contextlib.contextmanager
def _loading(worker: StagedWorker, loader: Any, weights: Any) -> Iterator[None]:
    """StagedRound.apply's pause on the worker: once ``held`` is written, load it into vLLM's model (a dense round
    through the layerwise reload, the path of an unstaged dense round)."""
    yield
    started = time.perf_counter()
    loader.begin()
    try:
        loader.load(weights)
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
        staged.settle()  # the worker's copy written on the side thread, beside the resume and what follows
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


def worker_start(worker: Any, round_no: int, prepare: bool = True, max_prepared_bytes: int | None = None) -> None:
    _worker(worker).start(round_no, prepare, max_prepared_bytes)


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


def worker_settle(worker: Any) -> None:
    _worker(worker).settle()


def worker_held(worker: Any, timeout_s: float = 120.0) -> dict[str, torch.Tensor]:
    """The worker's host copy of the model it serves (a copy), once the last round is written into it."""
    staged = _worker(worker)
    staged.settled(timeout_s)
    return {n: t.clone() for n, t in staged.held.items()}


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

    ``prepare`` (default True): each worker builds the round's layers in vLLM's kernel layout during the stage, and
    the pause only swaps them in (:class:`StagedWorker`); False: the pause writes the round and reloads the whole
    model (vLLM's layerwise reload), as before. ``max_prepared_bytes`` bounds what one worker prepares (the
    checkpoint bytes of the layers a round touches, about the size of the processed copy it holds until the pause):
    a round over it is reloaded in the pause instead.
    """

    def __init__(
        self,
        llm: Any,
        *,
        prefix_cache: str = "reset",
        timeout_s: float = 120.0,
        prepare: bool = True,
        max_prepared_bytes: int | None = None,
    ) -> None:
        if prefix_cache not in PREFIX_CACHE_MODES:
            raise ValueError(f"prefix_cache={prefix_cache!r}: one of {', '.join(PREFIX_CACHE_MODES)}")
        if max_prepared_bytes is not None and max_prepared_bytes < 0:
            raise ValueError(f"max_prepared_bytes={max_prepared_bytes}: must be 0 or more, or None for no bound")
        self.llm = llm
        self.prefix_cache = prefix_cache
        self.timeout_s = timeout_s
        self.prepare = prepare
        self.max_prepared_bytes = max_prepared_bytes

    def stage(self, round_no: int) -> None:
        self.llm.collective_rpc(worker_start, args=(round_no, self.prepare, self.max_prepared_bytes))

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
        metrics["pause_seconds"], worker_pause = time.perf_counter() - paused, metrics["pause_seconds"]
        metrics.setdefault("worker_pause_seconds", worker_pause)
        self.llm.collective_rpc(worker_settle)  # the workers' copies written beside generation, not in the pause
        metrics["weight_version"] = weight_version
        return metrics


def _discard(worker: Any) -> None:
    _discard_staged(_worker(worker))


def _discard_staged(staged: StagedWorker) -> None:
    future, staged._future = staged._future, None
    if staged._prepared is not None:
        from refit_app.integrations.vllm import prepare

        prepare.release(staged._prepared)
        staged._prepared = None
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
