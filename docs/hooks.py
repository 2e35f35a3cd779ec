"""MkDocs hooks (mkdocs.yml ``hooks:``): the parts of the site that are made from the code on every build, so that
they cannot go stale.

- ``configuration.md``: the reference of every key and option, from the schema, as ``python -m refit_app --help``
  prints it (:func:`refit_app.app.reference.markdown_reference`);
- ``metrics.md``: the keys of metrics.json and of each round, from the dataclasses that write it;
- ``img/layers.svg``: the layers and their imports, as tests/test_architecture.py reads them
  (scripts/draw_layers.py).

A page marks each generated part with a comment (the keys of :data:`GENERATED`); a marker missing from its page
fails the build, so a part cannot vanish silently. mkdocs is imported only inside the hooks: tests/test_docs.py
imports this file without it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _config_reference() -> str:
    from refit_app.app.reference import markdown_reference

    return markdown_reference(level=2)


def _metrics_table(rounds: bool) -> Callable[[], str]:
    def make() -> str:
        from refit_app.app.metrics import METRICS_KEYS, ROUND_KEYS, markdown_table

        return markdown_table(ROUND_KEYS if rounds else METRICS_KEYS)

    return make


GENERATED: dict[str, dict[str, Callable[[], str]]] = {
    "configuration.md": {"<!-- generated: configuration reference -->": _config_reference},
    "metrics.md": {
        "<!-- generated: metrics.json keys -->": _metrics_table(rounds=False),
        "<!-- generated: round keys -->": _metrics_table(rounds=True),
    },
}
"""Page -> {marker: what replaces it}."""
LAYERS_PICTURE = "img/layers.svg"


def draw_layers() -> str:
    spec = importlib.util.spec_from_file_location("draw_layers", ROOT / "scripts" / "draw_layers.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.from_code()


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, LAYERS_PICTURE, content=draw_layers()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    from mkdocs.exceptions import PluginError

    for marker, make in GENERATED.get(page.file.src_uri, {}).items():
        if markdown.count(marker) != 1:
            raise PluginError(f"{page.file.src_uri} must hold {marker} once (docs/hooks.py fills it)")
        markdown = markdown.replace(marker, make())
    return markdown
