"""The reference that ``python -m refit_app --help`` prints: every key with its default and its meaning, and the
values of every choice, generated when ``--help`` asks for it, so it cannot drift from what the app accepts.

Each fact comes from its one home: a key's meaning from its field docstring in :mod:`refit_app.app.schema` (read from
the module's source: Python keeps no field docstrings at run time), its default from the schema dataclass, its
values from the field's ``CHOICES`` metadata (:data:`refit_app.models.presets.PRESETS`,
:data:`refit_app.transport.spec.BACKENDS`,
...), a group's options from the files Hydra reads in conf/, and the keys an option sets beyond its own node (a
role's group.rank, say) from that option's file.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from importlib import resources
from typing import Any

from omegaconf import MISSING, OmegaConf

from refit_app.app import schema

HELP_RESOLVER = "refit_app.help"
"""``${refit_app.help:}`` in conf/config.yaml's help template: the reference of every key and option, generated
from the schema when ``--help`` prints it."""

_INDENT = "  "
_KEY_COLUMN = 40
"""Where a key's meaning starts, so that the meanings line up."""
_ENV_DEFAULT = re.compile(r"^\$\{oc\.env:(?P<var>\w+),(?P<default>[^}]*)\}$")


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One key of the reference: ``shown`` is its default as typed on the command line, ``(required)`` or
    ``(set by the option)``; ``env`` the environment variable that overrides that default; ``choices`` the values
    it takes, where the schema names them."""

    key: str
    shown: str
    meaning: str
    choices: tuple[str, ...] = ()
    env: str | None = None


@dataclasses.dataclass(frozen=True)
class OptionDoc:
    """One option of a config group: its own keys, and what it sets beyond its node (a role's group.rank)."""

    option: str
    meaning: str
    keys: list[KeyDoc]
    also_sets: list[str]


@dataclasses.dataclass(frozen=True)
class SectionDoc:
    """A top-level part of the config. ``kind`` is ``node`` (refit, group: keys only), ``group`` (role, source,
    sink: ``keys`` are the ones every option sets, then each option's own) or ``optional`` (a group the schema has
    no node for, such as hparams_search: options only, none chosen by default)."""

    name: str
    kind: str
    meaning: str
    default: str | None
    keys: list[KeyDoc]
    options: list[OptionDoc]


def reference() -> list[SectionDoc]:
    """Every key and option of the config, in the schema's order, optional groups last: what both renderings
    (:func:`help_reference`, :func:`markdown_reference`) show."""
    docs = _field_docs()
    defaults = _default_options()
    sections: list[SectionDoc] = []
    for f in dataclasses.fields(schema.Config):
        if f.name in schema.GROUP_SCHEMAS:
            sections.append(_group_section(f.name, defaults.get(f.name), docs))
        else:
            keys = _keys(f.name, f.default_factory(), docs)  # type: ignore[misc]
            sections.append(SectionDoc(f.name, "node", "", None, keys, []))
    for group in _optional_groups():
        options = [OptionDoc(option, _file_doc(group, option), [], []) for option in group_options(group)]
        sections.append(SectionDoc(group, "optional", "", None, [], options))
    return sections


def help_reference() -> str:
    """Every key of the config, group by group, as ``key=default  meaning [choices]``, one line each.

    Hydra substitutes ``$NAME`` in its help template, so every ``$`` here is doubled.
    """
    lines: list[str] = []
    for section in reference():
        name = section.name
        if section.kind == "node":
            lines.append(f"{name}:")
        elif section.kind == "group":
            options = ", ".join(o.option for o in section.options)
            lines.append(
                f"{name}: choose one with {name}=OPTION ({options}); default {section.default}. {section.meaning}"
            )
        else:
            lines.append(f"{name}: none by default; choose one with {name}=OPTION")
        lines += [_line(k) for k in section.keys]
        for option in section.options:
            lines.append(f"{_INDENT}{name}={option.option}: {option.meaning}")
            lines += [_line(k, depth=2) for k in option.keys]
            if option.also_sets:
                lines.append(f"{_INDENT * 2}also sets: {' '.join(option.also_sets)}")
    return "\n".join(lines).replace("$", "$$")


def markdown_reference(level: int = 2) -> str:
    """The same reference as Markdown for the docs site: a heading per section and per option (``level`` and one
    below it), a table of keys under each. docs/hooks.py puts it into docs/configuration.md when the site is built.
    """
    head, sub = "#" * level, "#" * (level + 1)
    out: list[str] = []
    for section in reference():
        name = section.name
        out += [f"{head} `{name}`", ""]
        if section.kind == "group":
            options = ", ".join(
                f"`{o.option}`" + (" (default)" if o.option == section.default else "") for o in section.options
            )
            out += [f"{_md(section.meaning)} Choose one with `{name}=OPTION`: {options}.", ""]
        elif section.kind == "optional":
            out += [f"None by default; choose one with `{name}=OPTION`.", ""]
        if section.keys:
            out += [*_md_table(section.keys), ""]
        for option in section.options:
            out += [f"{sub} `{name}={option.option}`", "", _md(option.meaning), ""]
            if option.keys:
                out += [*_md_table(option.keys), ""]
            if option.also_sets:
                out += ["Also sets: " + ", ".join(f"`{a}`" for a in option.also_sets) + ".", ""]
    return "\n".join(out)


def _md_table(keys: list[KeyDoc]) -> list[str]:
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for k in keys:
        shown = k.shown.strip("()") if k.shown.startswith("(") else f"`{k.shown}`"
        if k.env:
            shown += f", or `${k.env}`"
        meaning = _md(k.meaning)
        if k.choices:
            meaning += " One of " + ", ".join(f"`{c}`" for c in k.choices) + "."
        rows.append(f"| `{k.key}` | {shown} | {meaning} |")
    return rows


_MD_SPECIAL = re.compile(r"([\\*_|\[\]<>])")


def _md(text: str) -> str:
    """``text`` as literal Markdown: what would format (``*``, ``_``, ``|`` in a table, ``<``) is escaped outside
    the text's own ``code`` spans, which stay code."""
    parts = text.split("`")
    return "`".join(part if i % 2 else _MD_SPECIAL.sub(r"\\\1", part) for i, part in enumerate(parts))


def group_options(group: str) -> list[str]:
    """The options Hydra accepts for ``group``: its files in conf/, built-in ones (with a schema) first."""
    files = resources.files(schema.CONF_MODULE).joinpath(group).iterdir()
    names = sorted(p.name.removesuffix(".yaml") for p in files if p.name.endswith(".yaml"))
    builtin = [o for o in schema.GROUP_SCHEMAS.get(group, {}) if o in names]
    return builtin + [o for o in names if o not in builtin]


def _group_section(group: str, default: str | None, docs: dict[str, dict[str, str]]) -> SectionDoc:
    base = next(iter(schema.GROUP_SCHEMAS[group].values())).__mro__[1]
    # The base node's keys (name, _target_, ...) are set by the option: listed once, without a default.
    base_keys = [f.name for f in dataclasses.fields(base)]
    keys = [KeyDoc(f"{group}.{name}", "(set by the option)", docs[base.__name__].get(name, "")) for name in base_keys]
    options = []
    for option in group_options(group):
        cls = schema.GROUP_SCHEMAS[group].get(option)
        meaning = _class_doc(cls, docs) if cls is not None else _file_doc(group, option)
        own = _keys(group, cls(), docs, skip=base_keys) if cls is not None else []
        options.append(OptionDoc(option, meaning, own, _also_sets(group, option)))
    return SectionDoc(group, "group", _class_doc(base, docs), default, keys, options)


def _keys(prefix: str, node: Any, docs: dict[str, dict[str, str]], skip: list[str] = ()) -> list[KeyDoc]:
    keys = []
    for f in dataclasses.fields(node):
        if f.name in skip:
            continue
        key = f"{prefix}.{f.name}"
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            keys += _keys(key, value, docs)
            continue
        choices = tuple(f.metadata.get(schema.CHOICES) or ())
        env = _ENV_DEFAULT.match(str(value))
        shown = _show(env["default"]) if env else _show(value)
        keys.append(KeyDoc(key, shown, _doc_of(type(node), f.name, docs), choices, env["var"] if env else None))
    return keys


def _line(k: KeyDoc, depth: int = 1) -> str:
    meaning = k.meaning + (f" [{', '.join(k.choices)}]" if k.choices else "")
    shown = f"{k.shown} (or ${k.env})" if k.env else k.shown
    head = f"{_INDENT * depth}{k.key}={shown}" if not shown.startswith("(") else f"{_INDENT * depth}{k.key} {shown}"
    return f"{head:<{_KEY_COLUMN - 1}} {meaning}".rstrip()


def _show(value: Any) -> str:
    """A default as it is typed on the command line; an environment default names its variable."""
    if value is MISSING or value == "???":
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    env = _ENV_DEFAULT.match(str(value))
    if env:
        return f"{env['default']} (or ${env['var']})"
    return str(value)


def _doc_of(cls: type, name: str, docs: dict[str, dict[str, str]]) -> str:
    for klass in cls.__mro__:
        if name in docs.get(klass.__name__, {}):
            return docs[klass.__name__][name]
    return ""


def _class_doc(cls: type, docs: dict[str, dict[str, str]]) -> str:
    return docs.get(cls.__name__, {}).get("", "")


def _field_docs() -> dict[str, dict[str, str]]:
    """``{class name: {field name: its docstring on one line}}`` for every class of the schema module; the class's
    own docstring (written, not the one dataclasses generates) under ``""``."""
    tree = ast.parse(inspect.getsource(schema))
    docs: dict[str, dict[str, str]] = {}
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        found = {"": _one_line(ast.get_docstring(cls) or "")}
        for stmt, after in zip(cls.body, cls.body[1:]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and _is_text(after):
                found[stmt.target.id] = _one_line(after.value.value)  # type: ignore[attr-defined]
        docs[cls.name] = found
    return docs


def _is_text(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _one_line(text: str) -> str:
    """A docstring on one line, with each ``{NAME}`` of :data:`schema.DOC_VALUES` replaced by its value."""
    for name, value in schema.DOC_VALUES.items():
        text = text.replace(f"{{{name}}}", str(value))
    return " ".join(text.replace("``", "").split())


def _conf_text(path: str) -> str:
    return resources.files(schema.CONF_MODULE).joinpath(path).read_text(encoding="utf-8")


def _optional_groups() -> list[str]:
    """Groups of conf/ that the schema has no node for (hparams_search): they set only Hydra's own keys."""
    root = resources.files(schema.CONF_MODULE)
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and p.name not in schema.GROUP_SCHEMAS and any(f.name.endswith(".yaml") for f in p.iterdir())
    )


def _file_doc(group: str, option: str) -> str:
    """An option without a schema (custom, a search): the comment its file opens with, on one line."""
    lines = []
    for line in _conf_text(f"{group}/{option}.yaml").splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text.startswith("@package"):
            lines.append(text)
    return _one_line(" ".join(lines))


def _default_options() -> dict[str, str]:
    """The option each group takes when none is chosen, from the primary config's defaults list."""
    chosen = {}
    for entry in OmegaConf.create(_conf_text(f"{schema.CONFIG_NAME}.yaml")).get("defaults", []):
        if isinstance(entry, str) or not hasattr(entry, "items"):
            continue
        for group, option in entry.items():
            chosen[str(group)] = str(option)
    return chosen


def _also_sets(group: str, option: str) -> list[str]:
    """``key=value`` for every key a global-package option file sets (a role also sets group.rank, say); a file
    in its group's own package sets only its node's keys, which the schema lists already."""
    text = _conf_text(f"{group}/{option}.yaml")
    if "# @package _global_" not in text:
        return []
    values = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    values.pop("defaults", None)
    flat: list[str] = []

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            flat.append(f"{prefix}={_show(node)}")

    walk("", values)
    return flat


def register_help_resolver() -> None:
    """Make ``${refit_app.help:}`` known to OmegaConf (``python -m refit_app`` does, before Hydra reads ``--help``).
    Idempotent."""
    if not OmegaConf.has_resolver(HELP_RESOLVER):
        OmegaConf.register_new_resolver(HELP_RESOLVER, help_reference)
