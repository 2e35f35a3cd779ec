"""MkDocs hooks (mkdocs.yml ``hooks:``) and the generator of the docs' generated parts: the parts of the pages that
are made from the code, and the pictures, so that they cannot go stale.

Text parts, committed in their pages so that the pages read the same on GitHub as on the site:

- ``configuration.md``: the reference of every key and option, from the schema, as ``python -m refit_app --help``
  prints it (:func:`refit_app.app.reference.markdown_reference`);
- ``metrics.md``: the keys of metrics.json and of each round, from the dataclasses that write it; ``rl-loop.md``:
  the sessions' signatures and a round's fields, from the code;
- ``library.md``, ``index.md``: the README's library and install sections; ``rl-loop.md``, ``ray.md``,
  ``sharded.md``: the examples they show complete (copies rather than ``--8<--`` snippets, which show raw on
  GitHub).

Each part lies between its marker (the keys of :data:`GENERATED`) and :data:`END`. After changing the code they
come from, rewrite them with

    python docs/hooks.py

The build fails on a part that differs from what the code makes now, or whose markers are gone, and so does
tests/test_docs.py, so a stale reference cannot be published or merged.

Pictures, committed in docs/img/ for the same reason: ``img/layers.svg``, the layers and their imports as
tests/test_architecture.py reads them (scripts/draw_layers.py), and the pictures of scripts/draw_figures.py, drawn
from the text and data in docs/figures/ and docs/data/. Each holds the digest of what it was drawn from
(:func:`pictures`); ``python docs/hooks.py`` redraws those whose digest differs, and the build and the test fail on
them as on a stale part.

mkdocs is imported only inside the hooks: tests/test_docs.py imports this file without it.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _config_reference() -> str:
    from refit_app.app.reference import markdown_reference

    return markdown_reference(level=2)


def _readme_section(name: str) -> Callable[[], str]:
    """The README's section ``name`` (between its snippet markers), as the page shows it."""

    def make() -> str:
        text = (ROOT / "README.md").read_text()
        start, end = f"<!-- --8<-- [start:{name}] -->", f"<!-- --8<-- [end:{name}] -->"
        return text[text.index(start) + len(start) : text.index(end)].strip()

    return make


def _file_block(path: str, language: str) -> Callable[[], str]:
    """A file of the repo, complete, as a code block."""
    return lambda: f"```{language}\n{(ROOT / path).read_text().rstrip()}\n```"


def _metrics_table(rounds: bool) -> Callable[[], str]:
    def make() -> str:
        from refit_app.app.metrics import METRICS_KEYS, ROUND_KEYS, markdown_table

        return markdown_table(ROUND_KEYS if rounds else METRICS_KEYS)

    return make


def _session_signatures() -> str:
    """The sessions' constructors and round calls as the code declares them, and the fields of a round."""
    import dataclasses
    import inspect

    from refit_app.protocol.session import ConsumerSession, ProducerSession, Round, StagedRound

    def sig(f: Callable[..., Any]) -> str:
        signature = inspect.signature(f)
        parts, starred = [], False
        for p in list(signature.parameters.values())[1:]:  # not self
            if p.kind is p.KEYWORD_ONLY and not starred:
                parts.append("*")
                starred = True
            text = f"{p.name}: {p.annotation}" if p.annotation is not p.empty else p.name
            parts.append(text if p.default is p.empty else f"{text} = {p.default!r}")
        returns = signature.return_annotation
        return f"({', '.join(parts)})" + ("" if returns in (signature.empty, "None") else f" -> {returns}")

    fields = ", ".join(f.name for f in dataclasses.fields(Round))
    lines = [
        f"ProducerSession{sig(ProducerSession.__init__)}",
        f"ProducerSession.send{sig(ProducerSession.send)}",
        f"ConsumerSession{sig(ConsumerSession.__init__)}",
        f"ConsumerSession.receive{sig(ConsumerSession.receive)}",
        f"ConsumerSession.stage{sig(ConsumerSession.stage)}",
        f"StagedRound.apply{sig(StagedRound.apply)}",
        f"StagedRound.discard{sig(StagedRound.discard)}",
        f"Round: {fields}",
    ]
    return "```text\n" + "\n".join(lines) + "\n```"


GENERATED: dict[str, dict[str, Callable[[], str]]] = {
    "configuration.md": {"<!-- generated: configuration reference -->": _config_reference},
    "metrics.md": {
        "<!-- generated: metrics.json keys -->": _metrics_table(rounds=False),
        "<!-- generated: round keys -->": _metrics_table(rounds=True),
    },
    "library.md": {"<!-- generated: README.md section library -->": _readme_section("library")},
    "index.md": {"<!-- generated: README.md section install -->": _readme_section("install")},
    "rl-loop.md": {
        "<!-- generated: examples/session_loop.py -->": _file_block("examples/session_loop.py", "python"),
        "<!-- generated: session signatures -->": _session_signatures,
    },
    "ray.md": {"<!-- generated: examples/ray_refit.py -->": _file_block("examples/ray_refit.py", "python")},
    "sharded.md": {"<!-- generated: examples/sharded_fsdp.py -->": _file_block("examples/sharded_fsdp.py", "python")},
}
"""Page -> {marker: what lies between it and :data:`END`}."""
END = "<!-- end of generated part: python docs/hooks.py rewrites it -->"
LAYERS_PICTURE = "img/layers.svg"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def figures() -> dict[str, Callable[[], str]]:
    """The site's ``img/<name>`` -> what draws it (scripts/draw_figures.py)."""
    return _script("draw_figures").FIGURES


class Picture(NamedTuple):
    draw: Callable[[], str]
    digest: Callable[[], str]
    by: str  # the script that draws it


def pictures() -> dict[str, Picture]:
    """Every committed picture, ``img/<name>`` -> how it is drawn and the digest of what it is drawn from."""
    layers, drawn = _script("draw_layers"), _script("draw_figures")
    out = {LAYERS_PICTURE: Picture(layers.from_code, layers.digest, "scripts/draw_layers.py")}
    for name, draw in drawn.FIGURES.items():
        out[f"img/{name}"] = Picture(draw, lambda name=name: drawn.digest(name), "scripts/draw_figures.py")
    return out


def _stamp(picture: Picture) -> str:
    return f"<!-- drawn by {picture.by}, digest {picture.digest()}: python docs/hooks.py redraws it -->"


def stamped(picture: Picture) -> str:
    """The picture as committed: drawn, with its stamp after the XML declaration."""
    svg = picture.draw()
    head, sep, rest = svg.partition("\n") if svg.startswith("<?xml") else ("", "", svg)
    return f"{head}{sep}{_stamp(picture)}\n{rest}"


def stale_pictures() -> list[str]:
    """The committed pictures (paths under docs/) that are missing or drawn from other sources than today's."""
    return [
        path
        for path, picture in pictures().items()
        if not (DOCS / path).is_file() or _stamp(picture) not in (DOCS / path).read_text()
    ]


def _span(text: str, marker: str) -> tuple[int, int]:
    """Where the part after ``marker`` lies in ``text``: from the end of the marker's line to the start of END."""
    if text.count(marker) != 1:
        raise ValueError(f"must hold {marker} once")
    start = text.index(marker) + len(marker)
    end = text.find(END, start)
    if end < 0:
        raise ValueError(f"{marker} has no {END} after it")
    return start, end


def filled(text: str, parts: dict[str, Callable[[], str]]) -> str:
    """``text`` with every part between its marker and END made afresh."""
    for marker, make in parts.items():
        start, end = _span(text, marker)
        text = text[:start] + "\n\n" + make().strip() + "\n\n" + text[end:]
    return text


def stale_pages() -> list[str]:
    """The pages whose committed parts differ from what the code makes now."""
    return [
        page
        for page, parts in GENERATED.items()
        if filled((DOCS / page).read_text(), parts) != (DOCS / page).read_text()
    ]


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.exceptions import PluginError

    stale = stale_pictures()
    if stale:
        raise PluginError(f"stale pictures {', '.join(stale)}: run `python docs/hooks.py`")
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    from mkdocs.exceptions import PluginError

    parts = GENERATED.get(page.file.src_uri, {})
    try:
        fresh = filled(markdown, parts)
    except ValueError as e:
        raise PluginError(f"{page.file.src_uri}: {e}") from None
    if fresh != markdown:
        raise PluginError(f"{page.file.src_uri}: a generated part is stale; run `python docs/hooks.py`")
    return markdown


def main() -> int:
    """Rewrite every generated part in its page; print the pages that changed."""
    for page, parts in GENERATED.items():
        path = DOCS / page
        text = path.read_text()
        fresh = filled(text, parts)
        if fresh != text:
            path.write_text(fresh)
            print(f"rewrote docs/{page}")
    for path in stale_pictures():
        (DOCS / path).write_text(stamped(pictures()[path]))
        print(f"redrew docs/{path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
