"""Building a source or sink from the ``_target_`` its config names: the built-in ones and a user's own alike."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from refit_app.common.errors import ConfigError, one_line


def resolve(target: str) -> Any:
    """The object that a dotted ``module.attribute`` path names."""
    module_name, _, attribute = target.rpartition(".")
    if not module_name:
        raise ConfigError(f"_target_={target!r} is not a dotted path; give module.Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"_target_={target!r}: cannot import {module_name} ({one_line(e)})") from e
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ConfigError(f"_target_={target!r}: module {module_name} has no {attribute!r}") from None


def instantiate(target: str, params: Mapping[str, Any]) -> Any:
    """``target(**params)``; a TypeError from the call (a parameter it does not take) becomes one line."""
    factory = resolve(target)
    try:
        return factory(**params)
    except TypeError as e:
        if e.__traceback__ is not None and e.__traceback__.tb_next is None:
            # Raised by the call itself (wrong or missing keyword), not from inside the constructor.
            raise ConfigError(f"_target_={target!r} does not accept {dict(params)!r}: {one_line(e)}") from e
        raise
