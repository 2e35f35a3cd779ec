"""Run one refit from a composed config: validate, dispatch on the role, write metrics. No Hydra decorators here,
so experiment scripts can call :func:`run` on a config from Hydra's compose API."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from refit_app.app.config import RunSettings, validate
from refit_app.app.metrics import summary_line, write_metrics
from refit_app.common.errors import Interrupted, RefitError, one_line
from refit_app.common.files import write_atomic

logger = logging.getLogger(__name__)

RESOLVED_CONFIG_FILE = "config_resolved.yaml"


def _sweep_job_num() -> int | None:
    """This job's number inside a Hydra multirun, else None."""
    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    return hc.job.num if hc.mode == RunMode.MULTIRUN else None


def _with_job_port(s: RunSettings) -> RunSettings:
    """In a sweep each job rendezvouses on ``group.port + job number``: consecutive jobs never collide with a port
    still in TIME_WAIT, and a producer sweep and a consumer sweep started with the same arguments pair up job by
    job. ``role=local`` picks a free port per job anyway."""
    job = _sweep_job_num()
    if job is None or s.group.port is None:
        return s
    return replace(s, group=replace(s.group, port=s.group.port + job))


def run(cfg: DictConfig, *, output_dir: str | Path | None = None) -> dict[str, Any]:
    """Run the refit that ``cfg`` describes and return its metrics.

    ``output_dir``: where ``metrics.json`` and the resolved config go; by default the Hydra job's output
    directory when running under ``@hydra.main``, else nowhere. Raises :class:`RefitError` on failure, after
    writing the failed run's metrics.
    """
    settings = _with_job_port(validate(cfg))
    # Imported here, not at the top: roles pulls in torch (seconds on a small machine), which `--help`, `--cfg`
    # and a refused config never need, and neither does role=local's supervising process: its ranks get torch
    # from the fork server (refit_app.app.rank_harness), so it never pays for it itself.
    if settings.role == "local":
        from refit_app.app.local import run_local as run_role
    elif settings.role == "ray":
        from refit_app.app.ray_role import run_ray as run_role
    else:
        from refit_app.app.roles import run_role

    if settings.group.port is None and settings.role == "local":
        # role=local's free port, picked here rather than by its launcher so that the saved config names it.
        from refit_app.app.rank_harness import free_port

        settings = replace(settings, group=replace(settings.group, port=free_port()))

    if output_dir is None and HydraConfig.initialized():
        output_dir = HydraConfig.get().runtime.output_dir
    if output_dir is not None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        _write_used_config(output_dir, cfg, settings)
    try:
        metrics = run_role(settings)
    except RefitError as e:
        metrics = getattr(e, "metrics", None) or {"role": settings.role, "rank": settings.rank}
        metrics.update(status="failed", error=str(e))
        _report(metrics, output_dir)
        raise
    except KeyboardInterrupt as e:
        # Ctrl-C or SIGTERM: a failed run like any other (role=local's launcher has stopped its ranks by now).
        reason = str(e) if isinstance(e, Interrupted) else "interrupted by SIGINT"
        _report({"role": settings.role, "rank": settings.rank, "status": "failed", "error": reason}, output_dir)
        raise
    except Exception as e:
        error = one_line(e, with_type=True)
        _report({"role": settings.role, "rank": settings.rank, "status": "failed", "error": error}, output_dir)
        raise
    if output_dir is not None:
        _write_used_config(output_dir, cfg, settings, metrics)
    _report(metrics, output_dir)
    return metrics


def _write_used_config(
    output_dir: str | Path, cfg: DictConfig, s: RunSettings, metrics: dict[str, Any] | None = None
) -> None:
    """config_resolved.yaml: the config as this run used it, so that passing it back repeats the run. Interpolations
    are resolved, and keys left null are replaced by what the run resolved them to: the port and world size
    (before the run), the buffer size, packing mode and number of rounds that the producer chose (after it)."""
    used = OmegaConf.to_container(cfg, resolve=True)
    used["group"].update(port=s.group.port, world_size=s.group.world_size)
    # The secret never goes to disk; left out, a run from this file takes group.token's default (the environment).
    used["group"].pop("token", None)
    used["refit"]["rounds"] = s.refit.rounds
    if metrics is not None:
        for key in ("buffer_size_bytes", "use_legacy_packing"):
            if metrics.get(key) is not None:
                used["refit"][key] = metrics[key]
        used["refit"]["rounds"] = metrics.get("rounds_done") or s.refit.rounds
    write_atomic(Path(output_dir) / RESOLVED_CONFIG_FILE, OmegaConf.to_yaml(used).encode())


def _report(metrics: dict[str, Any], output_dir: str | Path | None) -> None:
    if output_dir is not None:
        path = write_metrics(output_dir, metrics)
        logger.info("metrics: %s", path)
    if metrics.get("status") == "ok":
        logger.info("%s", summary_line(metrics))


__all__ = ["run"]
