"""refit_app: packed weight refit from a trainer to inference engines.

The library's entry point is :mod:`refit_app.packed_tensor` (the spec's API); sessions, groups and the application
build on it in layer subpackages (see ``docs/architecture.md``). :func:`run` runs the application on a composed
config.
"""

from typing import Any

__all__ = ["run"]


def __getattr__(name: str) -> Any:
    # Importing the application (Hydra, sources, sinks) only when asked keeps `refit_app.packed_tensor` light.
    if name == "run":
        from refit_app.app.runner import run

        return run
    raise AttributeError(f"module 'refit_app' has no attribute {name!r}")
