"""A griffe extension (mkdocs.yml, mkdocstrings' ``extensions:``) for the Sphinx roles the docstrings use
(``:func:`name```, ``:class:`~refit_app.core.chunks.Chunk```), which the Google-style parser would show as text:
each becomes a link to the object where the site documents it, and plain code where it does not. The links are
autorefs' optional ones, so a name the site does not document is no warning under ``--strict``.
"""

from __future__ import annotations

import re
from html import escape
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = _ROLE.sub(lambda m, obj=obj: _link(obj, m), obj.docstring.value)


def _objects(obj: griffe.Object) -> Any:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)  # type: ignore[arg-type]


def _link(obj: griffe.Object, match: re.Match[str]) -> str:
    short, name = match[1] == "~", match[2].removesuffix("()")
    title = name.rsplit(".", 1)[-1] if short else name
    try:
        target = obj.resolve(name)
    except (griffe.NameResolutionError, ValueError, KeyError):
        target = name
    return f'<autoref identifier="{escape(target)}" optional><code>{escape(title)}</code></autoref>'
