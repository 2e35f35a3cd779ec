"""Staged refits into ``vllm serve`` through vLLM's own HTTP routes (issue 34): the trainer's client. What vLLM's
``/weight_checker`` should then say is :mod:`refit_app.integrations.vllm.checker`'s.

The server runs with ``VLLM_SERVER_DEV_MODE=1`` (the weight-sync, ``/pause``, ``/resume``, ``/weight_checker`` and
``/reset_prefix_cache`` routes) and ``--weight-transfer-config '{"backend": "refit_app"}'``; the trainer builds its
engine with ``RefitTrainerInitInfo(staged=True)`` and a :class:`StagedHTTPClient`, and runs each round with
:func:`~refit_app.integrations.vllm.staged.send_staged`::

    trainer (send_staged)                      vllm serve (each worker: RefitUpdateInfo.staged)
    stage_weights(k):
      /start_weight_update, /update_weights {round k, staged: start}, /finish_weight_update
                                               a side thread stages round k; the engine core keeps generating
    session.send(source)             ====>     received and verified into the worker's own memory
    apply_staged(version):
      /start_weight_update, /update_weights {staged: wait}
                                               the stage's outcome: an error here (failed verification, a dead
                                               peer) and the round is dropped, the engine never paused
      /pause?mode=keep                 --+     requests in flight frozen, not aborted
      /update_weights {staged: apply}    |     vLLM's layerwise reload from the staged round
      /finish_weight_update {version}    |     the outputs' weight_versions change here
      /reset_prefix_cache?reset_running_requests=true   (prefix_cache="reset"; "keep" skips it)
      /resume                          --+     pause_seconds: from the /pause call to /resume's answer

Each step is a vLLM weight update of its own, so none is open while the trainer sends: a trainer that dies mid-stage
leaves the server as it was (the worker's stage fails within the group's deadline) and the next trainer can start.

This module imports vLLM at its top (the client subclasses vLLM's ``HTTPVLLMWeightSyncClient``), as
:mod:`refit_app.integrations.vllm.engine` does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

from refit_app.common.errors import PeerError, one_line
from refit_app.integrations.vllm.backend import RefitUpdateInfo
from refit_app.integrations.vllm.staged import PREFIX_CACHE_MODES

logger = logging.getLogger(__name__)

DEFAULT_HTTP_TIMEOUT_S = 300.0
"""Of one HTTP call, as vLLM's client: longer than the group's deadline, which bounds the server's waits."""


class StagedHTTPClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP weight-sync client plus the staged pair :func:`~refit_app.integrations.vllm.staged.send_staged`
    calls (:meth:`stage_weights`, :meth:`apply_staged`), :meth:`discard_staged` and :meth:`weight_checksums`.

    ``prefix_cache`` (:data:`~refit_app.integrations.vllm.staged.PREFIX_CACHE_MODES`): ``reset`` clears vLLM's
    prefix cache in the pause and preempts the requests in flight, which recompute their KV with the new weights;
    ``keep`` leaves it (the requests in flight go on from KV computed with the weights before: off-policy tokens,
    which their outputs' ``weight_versions`` count). Every call has ``timeout`` (seconds); a failure is one line
    (:class:`~refit_app.common.errors.PeerError`) naming the route and the server's reason.
    """

    def __init__(self, base_url: str, timeout: float = DEFAULT_HTTP_TIMEOUT_S, *, prefix_cache: str = "reset") -> None:
        if prefix_cache not in PREFIX_CACHE_MODES:
            raise ValueError(f"prefix_cache={prefix_cache!r}: one of {', '.join(PREFIX_CACHE_MODES)}")
        super().__init__(base_url, timeout=timeout)
        self.prefix_cache = prefix_cache
        self._round: int | None = None

    def _call(self, path: str, json: dict[str, Any] | None = None, params: dict[str, str] | None = None) -> Any:
        import requests

        url = f"{self.base_url}/{path}"
        try:
            response = requests.post(url, json=json, params=params, timeout=self.timeout)
        except requests.RequestException as e:
            raise PeerError(f"vLLM server: POST /{path} failed: {one_line(e)}") from e
        if response.status_code >= 400:
            raise PeerError(f"vLLM server: POST /{path} answered {response.status_code}: {_reason(response)}")
        return response.json() if response.content else None

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        # vLLM's own calls (init, start, update, finish, shutdown) with the same one-line errors.
        self._call(path, json)

    def _step(self, step: str) -> None:
        """One staged step as a vLLM weight update of its own (none stays open between steps)."""
        self._call("start_weight_update")
        self._call("update_weights", _update(self._round, step))
        if step != "wait":  # a good wait leaves the update open: the apply goes into it, in the pause
            self._call("finish_weight_update")

    def stage_weights(self, update_info: dict[str, Any]) -> None:
        """Start round ``update_info["round"]``'s stage on every worker; returns at once (the server keeps
        generating while the trainer sends)."""
        self._round = int(update_info["round"])
        self._step("start")

    def apply_staged(self, weight_version: str | None = None) -> dict[str, Any]:
        """Apply the staged round in one pause, or, where a worker did not stage it, drop it without pausing.

        Returns ``applied``, ``round``, ``weight_version``, ``pause_seconds`` (from the ``/pause`` call to the
        answer of ``/resume``: the engine's whole stop as the trainer sees it), ``wait_seconds`` (the stage's
        outcome, asked before the pause), ``apply_seconds`` (the ``apply`` call in the pause) and, where not
        applied, ``error`` (one line)."""
        if self._round is None:
            raise RuntimeError("apply_staged: no round was staged (call stage_weights first)")
        metrics: dict[str, Any] = {"round": self._round, "weight_version": weight_version, "applied": False}
        started = time.perf_counter()
        try:
            self._step("wait")
        except PeerError as e:
            # The worker dropped the round and vLLM closed the update: nothing to undo, the engine never paused.
            metrics["error"] = one_line(e)
            logger.warning("staged round %d not applied, the server keeps its weights: %s", self._round, e)
            self._round = None
            return metrics
        metrics["wait_seconds"] = time.perf_counter() - started
        paused = time.perf_counter()
        try:
            self._call("pause", params={"mode": "keep"})
        except PeerError:
            # The wait left vLLM's update open: drop the round into it and close it.
            self._call("update_weights", _update(self._round, "discard"))
            self._call("finish_weight_update")
            self._round = None
            raise
        try:
            applying = time.perf_counter()
            self._call("update_weights", _update(self._round, "apply"))
            metrics["apply_seconds"] = time.perf_counter() - applying
            self._call("finish_weight_update", {"weight_version": weight_version} if weight_version else None)
            if self.prefix_cache == "reset":
                answer = self._call("reset_prefix_cache", params={"reset_running_requests": "true"})
                if not (answer or {}).get("success"):
                    raise PeerError(f"vLLM server: /reset_prefix_cache did not reset the prefix cache: {answer}")
        finally:
            self._call("resume")
            metrics["pause_seconds"] = time.perf_counter() - paused
            self._round = None
        metrics["applied"] = True
        return metrics

    def discard_staged(self) -> None:
        """Drop the staged round on every worker, once its stage has ended (the trainer's send failed)."""
        if self._round is not None:
            self._step("discard")
            self._round = None

    def weight_checksums(self) -> dict[str, str]:
        """vLLM's ``/weight_checker`` (``action=checksum``): SHA-256 of every parameter's bytes as the engine holds
        them, keyed ``dp0:pp0:pcp0:tp0:<vLLM's parameter name>``."""
        return self._call("weight_checker", {"action": "checksum"})["checksums"]


def _update(round_no: int | None, step: str) -> dict[str, Any]:
    assert round_no is not None
    return {"update_info": asdict(RefitUpdateInfo(round=round_no, staged=step))}


def _reason(response: Any) -> str:
    try:
        body = response.json()
    except ValueError:
        return one_line(response.text) or response.reason
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return one_line(error.get("message", error))
    return one_line(error or body.get("detail") or body)
