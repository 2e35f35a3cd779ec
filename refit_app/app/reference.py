"""The reference that ``python -m refit_app --help`` prints: every key with its default and its meaning, and the
values of every choice, generated when ``--help`` asks for it, so it cannot drift from what the app accepts.

Each fact comes from its one home: a key's meaning from its field docstring in :mod:`refit_app.app.schema` (read from
the module's source: Python keeps no field docstrings at run time), its default from the schema dataclass, its
values from the field's ``CHOICES`` metadata (:data:`refit_app.models.presets.PRESETS`, :data:`refit_app.transport.spec.BACKENDS`,
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


def help_reference() -> str:
    """Every key of the config, group by group, as ``key=default  meaning [choices]``, one line each.

    Hydra substitutes ``$NAME`` in its help template, so every ``$`` here is doubled.
    """
    docs = _field_docs()
    defaults = _default_options()
    lines: list[str] = []
    for f in dataclasses.fields(schema.Config):
        if f.name in schema.GROUP_SCHEMAS:
            lines += _group_lines(f.name, defaults.get(f.name), docs)
        else:
            lines.append(f"{f.name}:")
            lines += _key_lines(f.name, f.default_factory(), docs)  # type: ignore[misc]
    for group in _optional_groups():
        lines.append(f"{group}: none by default; choose one with {group}=OPTION")
        lines += [f"{_INDENT}{group}={option}: {_file_doc(group, option)}" for option in group_options(group)]
    return "\n".join(lines).replace("$", "$$")


def group_options(group: str) -> list[str]:
    """The options Hydra accepts for ``group``: its files in conf/, built-in ones (with a schema) first."""
    files = resources.files(schema.CONF_MODULE).joinpath(group).iterdir()
    names = sorted(p.name.removesuffix(".yaml") for p in files if p.name.endswith(".yaml"))
    builtin = [o for o in schema.GROUP_SCHEMAS.get(group, {}) if o in names]
    return builtin + [o for o in names if o not in builtin]


def _group_lines(group: str, default: str | None, docs: dict[str, dict[str, str]]) -> list[str]:
    options = group_options(group)
    base = next(iter(schema.GROUP_SCHEMAS[group].values())).__mro__[1]
    header = f"{group}: choose one with {group}=OPTION ({', '.join(options)}); default {default}."
    lines = [f"{header} {_class_doc(base, docs)}"]
    # The base node's keys (name, _target_, ...) are set by the option: listed once, without a default.
    base_keys = [f.name for f in dataclasses.fields(base)]
    lines += [_line(f"{group}.{name}", "(set by the option)", docs[base.__name__].get(name, ""))
              for name in base_keys]
    for option in options:
        cls = schema.GROUP_SCHEMAS[group].get(option)
        meaning = _class_doc(cls, docs) if cls is not None else _file_doc(group, option)
        lines.append(f"{_INDENT}{group}={option}: {meaning}")
        if cls is not None:
            node = cls()
            lines += _key_lines(group, node, docs, skip=base_keys, depth=2)
        also = _also_sets(group, option)
        if also:
            lines.append(f"{_INDENT * 2}also sets: {' '.join(also)}")
    return lines


def _key_lines(prefix: str, node: Any, docs: dict[str, dict[str, str]], skip: list[str] = (), depth: int = 1
               ) -> list[str]:
    lines = []
    for f in dataclasses.fields(node):
        if f.name in skip:
            continue
        key = f"{prefix}.{f.name}"
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            lines += _key_lines(key, value, docs, depth=depth)
            continue
        meaning = _doc_of(type(node), f.name, docs)
        choices = f.metadata.get(schema.CHOICES)
        if choices:
            meaning += f" [{', '.join(choices)}]"
        lines.append(_line(key, _show(value), meaning, depth))
    return lines


def _line(key: str, shown: str, meaning: str, depth: int = 1) -> str:
    head = f"{_INDENT * depth}{key}={shown}" if not shown.startswith("(") else f"{_INDENT * depth}{key} {shown}"
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
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and p.name not in schema.GROUP_SCHEMAS and any(
                      f.name.endswith(".yaml") for f in p.iterdir()))


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
