"""Draw refit_app's layers as an SVG picture, from the code: the layer order is ``LAYERS`` and the imports are the
graph that tests/test_architecture.py checks (the test's own functions read it), so the picture shows what the test
enforces and cannot drift from either. It is committed as docs/img/layers.svg, so that docs/architecture.md shows it
on GitHub too; ``python docs/hooks.py`` redraws it, and the docs build and tests/test_docs.py fail while it is stale
(see :func:`digest`). To draw it elsewhere:

    python scripts/draw_layers.py layers.svg

Each band is a layer, the lowest at the bottom; it lists the layer's modules and the lower layers they import.
SVG rather than a PNG: a small text file whose text stays searchable, and it needs no JavaScript or network to show
(a Mermaid diagram loads mermaid.js in the reader's browser).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Mapping
from html import escape
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE_TEST = ROOT / "tests" / "test_architecture.py"

_WIDTH = 760
_NAME_W = 112  # the layer's name
_USES_X = 470  # where the imported layers start
_CHIP_H = 20
_GAP = 6
_PAD = 9
_CHAR_W = 7.3  # 12 px monospace, with a margin
_BAND_FILLS = ("#eef3fb", "#e2ebf8")
_MODULE_FILL = "#ffffff"
_USES_FILL = "#fdf1dc"


def architecture_test() -> ModuleType:
    """tests/test_architecture.py as a module (it imports refit_app and nothing of pytest's)."""
    spec = importlib.util.spec_from_file_location("refit_app_architecture_test", ARCHITECTURE_TEST)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def layer_table(
    layers: list[str], graph: Mapping[str, set[str]], outside: set[str]
) -> list[tuple[str, list[str], list[str]]]:
    """``(layer, its modules, the lower layers they import)`` for every layer, bottom first. A module is named
    below its layer (``core.wire`` as ``wire``); a layer that is one module (``packed_tensor``) lists none."""

    def layer_of(module: str) -> str:
        return module.split(".")[1]

    rows = []
    for layer in layers:
        modules = sorted(m.split(".", 2)[2] for m in graph if layer_of(m) == layer and m.count(".") >= 2)
        used = {
            layer_of(dep)
            for m, deps in graph.items()
            if layer_of(m) == layer
            for dep in deps
            if dep not in outside and layer_of(dep) != layer
        }
        rows.append((layer, modules, sorted(used, key=layers.index)))
    return rows


def _chips(words: list[str], x0: float, x1: float) -> list[list[tuple[float, str]]]:
    """Rows of ``(x, word)``: each word a chip, as many to a row as fit between ``x0`` and ``x1``."""
    rows: list[list[tuple[float, str]]] = [[]]
    x = x0
    for word in words:
        w = len(word) * _CHAR_W + 2 * _GAP
        if rows[-1] and x + w > x1:
            rows.append([])
            x = x0
        rows[-1].append((x, word))
        x += w + _GAP
    return rows


def layers_svg(rows: list[tuple[str, list[str], list[str]]]) -> str:
    """The picture of ``rows`` (from :func:`layer_table`): the last row at the top, the first at the bottom."""
    bands = []
    for layer, modules, used in reversed(rows):
        module_rows = _chips(modules, _NAME_W, _USES_X - 3 * _GAP)
        uses_rows = _chips(used, _USES_X + 62, _WIDTH - _PAD)
        bands.append((layer, module_rows, uses_rows, max(len(module_rows), len(uses_rows))))
    row_h = _CHIP_H + _GAP
    height = 34 + sum(n * row_h + 2 * _PAD - _GAP for *_, n in bands)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
        f'viewBox="0 0 {_WIDTH} {height}" font-family="sans-serif" font-size="13">',
        "<title>refit_app's layers, bottom first: each imports only the layers below it</title>",
        f'<text x="{_PAD}" y="20" font-weight="bold">layer</text>',
        f'<text x="{_NAME_W}" y="20" font-weight="bold">its modules: refit_app.LAYER.MODULE</text>',
        f'<text x="{_USES_X}" y="20" font-weight="bold">imports from the layers below</text>',
    ]
    y = 28
    for i, (layer, module_rows, uses_rows, n) in enumerate(bands):
        h = n * row_h + 2 * _PAD - _GAP
        out.append(
            f'<rect x="0.5" y="{y}" width="{_WIDTH - 1}" height="{h}" fill="{_BAND_FILLS[i % 2]}" stroke="#9db2d3"/>'
        )
        out.append(f'<text x="{_PAD}" y="{y + _PAD + 14}" font-weight="bold">{escape(layer)}</text>')
        out.append(
            f'<text x="{_USES_X}" y="{y + _PAD + 14}" fill="#5a4a2a">'
            f"{'imports' if uses_rows[0] else 'imports nothing of refit_app'}</text>"
        )
        for chips, fill, font in (
            (module_rows, _MODULE_FILL, 'font-family="monospace" font-size="12"'),
            (uses_rows, _USES_FILL, 'font-family="monospace" font-size="12"'),
        ):
            for r, row in enumerate(chips):
                cy = y + _PAD + r * row_h
                for x, word in row:
                    w = len(word) * _CHAR_W + 2 * _GAP
                    out.append(
                        f'<rect x="{x:.1f}" y="{cy}" width="{w:.1f}" height="{_CHIP_H}" rx="4" '
                        f'fill="{fill}" stroke="#9db2d3"/>'
                    )
                    out.append(f'<text x="{x + _GAP:.1f}" y="{cy + 14}" {font}>{escape(word)}</text>')
        y += h
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _rows_now() -> list[tuple[str, list[str], list[str]]]:
    test = architecture_test()
    return layer_table(test.LAYERS, test._graph(), test.OUTSIDE)


def from_code() -> str:
    """The picture of the package as it is now, read the way tests/test_architecture.py reads it."""
    return layers_svg(_rows_now())


def digest() -> str:
    """What the picture is drawn from, as one hash: the layers, modules and imports now, and this script (see
    docs/hooks.py, which keeps it in the committed picture)."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(repr(_rows_now()).encode())
    return h.hexdigest()[:16]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/draw_layers.py OUT.svg")
    Path(sys.argv[1]).write_text(from_code(), encoding="utf-8")
