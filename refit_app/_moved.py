"""Import paths of refit_app 0.1, which kept every module flat in the package: each still imports, with a
``DeprecationWarning`` naming the new path, until 0.3. The modules themselves live in the layer subpackages; this
table is the only trace of the old layout."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED = {
    f"refit_app.{old}": f"refit_app.{new}"
    for old, new in {
        "errors": "common.errors",
        "sizes": "common.sizes",
        "files": "common.files",
        "settings": "transport.spec",
        "auth": "transport.auth",
        "control": "transport.control",
        "rendezvous": "transport.rendezvous",
        "backends": "transport.backends",
        "chain": "transport.chain",
        "groups": "transport.groups",
        "process_group": "transport.process_group",
        "checksum": "protocol.checksum",
        "manifest": "protocol.manifest",
        "handshake": "protocol.handshake",
        "verify": "protocol.verify",
        "session": "protocol.session",
        "safetensors_io": "checkpoint",
        "presets": "models.presets",
        "plugins": "models.plugins",
        "sources": "models.sources",
        "sinks": "models.sinks",
        "probe": "models.probe",
        "hf_model": "models.hf",
        "vllm_backend": "integrations.vllm.backend",
        "vllm_sink": "integrations.vllm.sink",
        "schema": "app.schema",
        "reference": "app.reference",
        "config": "app.config",
        "cli": "app.cli",
        "roles": "app.roles",
        "local": "app.local",
        "launch": "app.rank_harness",
        "metrics": "app.metrics",
        "progress": "app.progress",
        "sweep_summary": "app.sweep_summary",
        "environment": "app.launcher_env",
        "devices": "app.devices",
    }.items()
}
"""Old module path -> the module that holds its names now."""


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path, warns once, and hands the import the module at the new path (the same object, so that
    classes and their isinstance checks are shared)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a throw-away module; exec_module puts the real one in its place

    def exec_module(self, module: ModuleType) -> None:
        new = MOVED[module.__name__]
        warnings.warn(
            f"{module.__name__} is deprecated: import {new} (the old path goes in refit_app 0.3)",
            DeprecationWarning,
            stacklevel=2,
        )
        # The import returns whatever sys.modules holds under the name once this returns.
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once); ``refit_app/__init__.py`` calls it."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
