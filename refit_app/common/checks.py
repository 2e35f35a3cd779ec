"""Checking settings: every invalid value of one settings object collected and reported in one line, each
named as the user would type it back."""

from __future__ import annotations

from typing import Any

from refit_app.common.errors import ConfigError


def show(value: Any) -> str:
    """A value as the user would type it back: strings quoted, None as null."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value)
    return str(value)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Problems:
    """Collects every invalid value of one settings object, so that the user fixes them all in one go."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def fail(self, key: str, value: Any, allowed: str) -> None:
        self.errors.append(f"{key}={show(value)} is invalid: {allowed}")

    def raise_any(self) -> None:
        if self.errors:
            raise ConfigError("; ".join(self.errors))
