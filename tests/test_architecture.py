"""The package's folders are its layers: every import of refit_app code, at the top of a module or inside a
function, points down the list below or stays inside its own layer, and no modules import each other in a circle.
A new module goes in the lowest layer whose imports it needs (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import refit_app

PACKAGE = Path(refit_app.__file__).parent

LAYERS = [
    "common",  # errors, sizes, files, settings checks: imports nothing of refit_app
    "core",  # wire format, chunk plans, buffers, the two loops, TensorMeta
    "packed_tensor",  # the spec's API over the core
    "transport",  # group settings, auth, rendezvous, control, backends, chain, groups
    "protocol",  # manifest, handshake, checksums, verification, sessions
    "checkpoint",  # safetensors headers, reading, writing, atomic publish
    "models",  # presets, sources, sinks, probes
    "integrations",  # vLLM
    "app",  # the Hydra application
    "bench",  # the benchmark
    "__main__",
]
"""Bottom first. ``refit_app/__init__.py`` (lazy ``run``) stands outside."""
OUTSIDE = {"refit_app"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> int:
    top = module.split(".")[1]
    return LAYERS.index(top)


def _imports(path: Path, module: str) -> set[str]:
    """Every refit_app module that ``path`` imports, wherever in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("refit_app."))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base == "refit_app" or base.startswith("refit_app."):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(
                        sub
                        if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                        or (PACKAGE.parent / sub.replace(".", "/")).is_dir()
                        else base
                    )
    return {m for m in found if m not in ("refit_app", module)}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: _imports(p, m) for m, p in modules.items() if m not in OUTSIDE}


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{m} ({LAYERS[_layer(m)]}) imports {dep} ({LAYERS[_layer(dep)]})"
        for m, deps in _graph().items()
        for dep in deps
        if dep not in OUTSIDE and _layer(dep) > _layer(m)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    graph = _graph()
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == 1:
                circles.append([*path[path.index(dep) :], dep] if dep in path else [m, dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_every_module_is_in_a_layer():
    for m in _graph():
        assert m.split(".")[1] in LAYERS, f"{m} is in no layer of LAYERS"


def test_the_check_sees_an_upward_import(tmp_path):
    # The check itself: a function-level import of a higher layer is found.
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from refit_app.app.config import validate\n")
    assert _imports(src, "refit_app.core.x") == {"refit_app.app.config"}


def test_the_docs_picture_shows_every_layer_bottom_first_and_every_module_in_its_layer():
    # docs/architecture.md's picture (scripts/draw_layers.py, committed as docs/img/layers.svg) reads this module.
    import importlib.util
    import xml.etree.ElementTree as ET

    path = PACKAGE.parent / "scripts" / "draw_layers.py"
    spec = importlib.util.spec_from_file_location("draw_layers", path)
    draw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(draw)
    graph = _graph()
    rows = draw.layer_table(LAYERS, graph, OUTSIDE)
    assert [layer for layer, _, _ in rows] == LAYERS
    for layer, modules, used in rows:
        inside = {m.split(".", 2)[2] for m in graph if m.split(".")[1] == layer and m.count(".") >= 2}
        assert set(modules) == inside, layer
        assert all(LAYERS.index(u) < LAYERS.index(layer) for u in used), (layer, used)
    elements = list(ET.fromstring(draw.layers_svg(rows)).iter("{http://www.w3.org/2000/svg}text"))
    texts = [t.text for t in elements]
    names = [t.text for t in elements if t.get("font-weight") == "bold" and t.text in LAYERS]  # not the chips
    assert names == LAYERS[::-1], "the top layer first, the bottom one last"
    assert {m for _, modules, _ in rows for m in modules} <= set(texts)
