"""The Hydra application, ``python -m refit_app``: the typed schema and its ``--help`` reference, validation into
typed settings, the roles each rank plays, the ways ranks are started (``role=local``, ``role=auto``,
``role=ray``), metrics, progress and the sweep summary. :func:`run` runs one refit from a composed config (Hydra's
compose API included).

Starting ranks: :mod:`~refit_app.app.rank_harness` is the one harness that starts and supervises ranks as processes
on this machine (``role=local`` in :mod:`~refit_app.app.local`, the benchmark and the tests use it);
:mod:`~refit_app.app.launcher_env` reads the group settings a launcher (torchrun, SLURM, submitit) gives a task under
``role=auto``; :mod:`~refit_app.app.ray_role` is ``role=ray``, the application's side of the Ray room
(:mod:`refit_app.integrations.ray`).
"""

from typing import Any

__all__ = ["run"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the schema (``--help``, a refused config) does not import the runner.
    if name == "run":
        from refit_app.app.runner import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
