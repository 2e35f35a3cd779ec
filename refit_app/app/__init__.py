"""The Hydra application, ``python -m refit_app``: the typed schema and its ``--help`` reference, validation into
typed settings, the roles each rank plays, the launchers that start ranks (``role=local``, ``role=auto``), metrics,
progress and the sweep summary. :func:`run` runs one refit from a composed config (Hydra's compose API included).
"""

from typing import Any

__all__ = ["run"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the schema (``--help``, a refused config) does not import the runner.
    if name == "run":
        from refit_app.app.runner import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
