"""The docs site's generated parts and the README's commands, checked without building the site (CI builds it with
``mkdocs build --strict``, which also fails on a broken link, anchor or snippet): every generated part has its
marker on its page, the configuration page lists exactly the keys ``--help`` lists, and the README installs and
tests exactly as CI does."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from refit_app.app.reference import _md, group_options, help_reference, markdown_reference, reference

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    return _hooks()


def test_every_generated_part_has_its_marker_once_on_its_page(hooks: ModuleType) -> None:
    assert hooks.GENERATED, "nothing generated?"
    for page, parts in hooks.GENERATED.items():
        text = (DOCS / page).read_text()
        for marker, make in parts.items():
            assert text.count(marker) == 1, f"{page}: {marker}"
            assert make().startswith(("#", "|", "```", "`")), f"{page}: {marker} made nothing"


def _help_keys() -> list[tuple[str, str]]:
    """``(key, default as shown)`` for every key line of ``--help``, in order."""
    found = []
    for line in help_reference().replace("$$", "$").splitlines():
        m = re.match(r"\s+([a-z_]+(?:\.[a-z_]+)+)(=| )(\S+)", line)
        if m:
            shown = m[3] if m[2] == "=" else line.split(None, 1)[1].split("  ")[0].strip()
            found.append((m[1], shown))
    return found


def _page_keys() -> list[tuple[str, str]]:
    found = []
    for line in markdown_reference().splitlines():
        m = re.match(r"\| `([a-z_.]+)` \| (.+?) \| ", line)
        if m and m[1] != "key":
            found.append((m[1], m[2]))
    return found


def test_the_configuration_page_lists_the_keys_of_help_with_their_defaults() -> None:
    page, shown = _page_keys(), _help_keys()
    assert [k for k, _ in page] == [k for k, _ in shown]
    assert len(page) > 30, page
    for (key, on_page), (_, in_help) in zip(page, shown):
        if in_help.startswith("("):  # (required), (set by the option)
            assert on_page == in_help.strip("()"), key
        else:
            assert on_page.startswith(f"`{in_help}`"), (key, on_page, in_help)
    # An environment default names its variable on both.
    assert ("refit.num_buffers", "`2`, or `$NRL_REFIT_NUM_BUFFERS`") in page


def test_the_configuration_page_has_a_heading_per_option() -> None:
    text = markdown_reference()
    for section in reference():
        assert f"## `{section.name}`" in text
        for option in group_options(section.name) if section.kind != "node" else []:
            assert f"### `{section.name}={option}`" in text


def test_markdown_text_is_escaped_outside_its_code_spans() -> None:
    assert _md("a _target_ `x_y` a|b <c> *d*") == r"a \_target\_ `x_y` a\|b \<c\> \*d\*"


def _pip_lines(text: str) -> list[str]:
    return [
        " ".join(w for w in line.split() if w != "-q")
        for line in text.splitlines()
        if line.strip().startswith("pip install")
    ]


TEST_COMMAND = "python -m pytest -q -n 2 --dist loadgroup\n"
"""The whole suite, as CI runs it: two pytest-xdist workers, a module's tests on one (tests/conftest.py)."""


def test_the_readme_installs_and_tests_as_ci_does() -> None:
    ci, readme = (ROOT / ".ci" / "run").read_text(), (ROOT / "README.md").read_text()
    ci_installs = [line for line in _pip_lines(ci) if "[docs]" not in line]
    assert len(ci_installs) == 2, ci_installs
    assert ci_installs == _pip_lines(readme)[:2]
    assert TEST_COMMAND in ci and TEST_COMMAND in readme
    assert "mkdocs build --strict" in ci and "mkdocs build --strict" in readme


def test_the_readme_sections_the_docs_include_are_marked() -> None:
    readme = (ROOT / "README.md").read_text()
    included = set()
    for page in DOCS.glob("*.md"):
        included |= set(re.findall(r'--8<-- "README\.md:(\w+)"', page.read_text()))
        included |= set(re.findall(r"<!-- generated: README\.md section (\w+) -->", page.read_text()))
    assert "library" in included, included
    assert "install" in included, included
    for name in included:
        start, end = f"--8<-- [start:{name}]", f"--8<-- [end:{name}]"
        assert readme.count(start) == 1 and readme.count(end) == 1 and readme.index(start) < readme.index(end)
        # The site cannot resolve the README's own links to docs/*.md: a section it includes has none.
        assert "](docs/" not in readme[readme.index(start) : readme.index(end)], name


def test_the_committed_generated_parts_are_what_the_code_makes(hooks: ModuleType) -> None:
    # configuration.md and metrics.md hold their generated parts, so that they read on GitHub too; after a change
    # to the schema, conf/ or the metrics dataclasses, `python docs/hooks.py` rewrites them.
    assert hooks.stale_pages() == [], "stale: run `python docs/hooks.py`"
    for page, parts in hooks.GENERATED.items():
        text = (DOCS / page).read_text()
        assert "--8<--" not in text, page  # nothing that shows raw without the site
        for marker in parts:
            start, end = hooks._span(text, marker)
            assert text[start:end].strip().startswith(("#", "|", "```", "`")), (page, marker)


def test_every_picture_is_an_svg_without_scripts_shown_on_a_page(hooks: ModuleType) -> None:
    pages = "\n".join(p.read_text() for p in DOCS.glob("*.md"))
    drawn = hooks.figures()
    assert len(drawn) >= 5, drawn
    for name, draw in drawn.items():
        svg = draw()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg, name
        assert "<script" not in svg and 'href="http' not in svg, name  # shown without a network
        assert f"(img/{name})" in pages, f"img/{name} is drawn but on no page"


def test_the_committed_pictures_are_drawn_from_todays_sources(hooks: ModuleType, tmp_path: Path) -> None:
    # The pages show docs/img/*.svg on GitHub as on the site; a picture whose source (or drawing script) changed
    # since it was committed is stale until `python docs/hooks.py` redraws it.
    assert hooks.stale_pictures() == [], "stale: run `python docs/hooks.py`"
    for path in hooks.pictures():
        svg = (DOCS / path).read_text()
        assert "<svg" in svg and "<script" not in svg and 'href="http' not in svg, path
    # and the check can fail: a source that changes changes the digest its picture is stamped with
    drawn = hooks._script("draw_figures")
    name = next(iter(drawn.SOURCES))
    before = drawn.digest(name)
    (source,) = drawn.SOURCES[name]
    changed = tmp_path / source.name
    changed.write_bytes(source.read_bytes() + b"\n# one more line\n")
    drawn.SOURCES[name] = (changed,)
    assert drawn.digest(name) != before


_LAB_LOG = {
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "an issue number": re.compile(r"\bissue \d+", re.IGNORECASE),
    "a load figure": re.compile(r"\bload(?: average)?(?: of| about| was)? ~?\d", re.IGNORECASE),
}


def test_dates_issues_and_machine_load_only_on_the_results_page() -> None:
    # A page that explains states what holds; when and under what load a figure was measured is the record's, on
    # results.md (README.md, the first screen, may say when its one headline figure was measured there too).
    found = []
    for page in sorted(DOCS.glob("*.md")):
        if page.name == "results.md":
            continue
        for n, line in enumerate(page.read_text().splitlines(), 1):
            found += [f"{page.name}:{n}: {what}: {line.strip()}" for what, rx in _LAB_LOG.items() if rx.search(line)]
    assert found == [], "\n".join(found)


def test_every_environment_variable_the_project_reads_or_sets_is_in_the_table() -> None:
    # The *_ENV constants are the one home of each variable's name (a variable used without one is a finding too).
    names, bare = set(), []
    for path in (ROOT / "refit_app").rglob("*.py"):
        text = path.read_text()
        for match in re.finditer(r'^[A-Z_]+_ENVS? = \(?((?:"[A-Za-z0-9_]+",? ?)+)\)?$', text, re.M):
            names |= set(re.findall(r'"([A-Za-z0-9_]+)"', match.group(1)))
        bare += [f"{path.name}: {m}" for m in re.findall(r'environ(?:\.get|\.setdefault|\[)\(?"([A-Za-z0-9_]+)"', text)]
    assert bare == [], "name these variables in an *_ENV constant"
    expected = {"REFIT_APP_TOKEN", "NRL_REFIT_NUM_BUFFERS", "RAY_DEDUP_LOGS", "RAY_worker_niceness", "SLURM_PROCID"}
    assert expected <= names, names
    table = (DOCS / "configuration.md").read_text().split("## Environment variables", 1)[1]
    assert sorted(n for n in names if f"`{n}`" not in table) == []
