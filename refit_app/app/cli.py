"""Every failure of ``python -m refit_app`` ends in one line on stderr; the traceback only with HYDRA_FULL_ERROR=1.

Hydra reports a failure itself (inside ``hydra.main``: the multi-line composition error, or the stripped traceback
of the task's exception) and then exits with status 1, so the report cannot be changed before it is written. While
the app runs, ``sys.stderr`` is a gate that passes text straight through (warnings and progress appear as they
happen) except what is written while an exception is being handled and what Hydra or argparse write themselves:
that is held back, and on a failure replaced by one line made from the exception being reported. Held text that
turns out not to belong to a failure is passed on at the next write.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, TextIO

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from refit_app.common.errors import Interrupted, RefitError

FULL_ERROR_ENV = "HYDRA_FULL_ERROR"
"""Hydra's: ``1`` keeps the full traceback of a failed run (refit_app otherwise prints one line)."""
CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
"""Set to ``ERROR`` (unless the user set it) by :func:`quiet_c10d` before torch is imported: c10d's multi-line
warnings about a vanished peer would repeat the one-line error."""


def quiet_c10d() -> None:
    """Keep c10d's C++ warnings out of a run's output (``python -m refit_app`` and the benchmark call it before
    importing torch, which reads the variable once); a user's own ``TORCH_CPP_LOG_LEVEL`` wins."""
    os.environ.setdefault(CPP_LOG_LEVEL_ENV, "ERROR")


PROG = "refit_app"

_SCHEMA_PREFIX = "base_"
"""Options Hydra lists for a group include the schemas registered by refit_app.app.config; users never pick those."""

_REPORTERS = ("hydra.", "argparse")
"""Modules that report a failure by writing to stderr outside an exception handler: Hydra ("Error executing job
with overrides: ..." before it re-raises a job's exception) and argparse (usage, then "error: ...")."""

_TYPE_NAMES = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}


def run_with_one_line_errors(main_fn: Callable[[], Any]) -> None:
    """Run a ``@hydra.main`` function (run or ``-m`` multirun); on failure print one line and exit with status 1.

    With HYDRA_FULL_ERROR=1 nothing is filtered and Hydra's own report, with the full traceback, stands.
    """
    if os.environ.get(FULL_ERROR_ENV) == "1":
        main_fn()
        return
    gate = _StderrGate(sys.stderr)
    sys.stderr = gate
    status = 0
    # SIGTERM (a scheduler, `kill`) ends the run as Ctrl-C does: metrics.json says why, children are stopped.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        main_fn()
    except SystemExit as e:
        status = _exit_status(e.code)
        if isinstance(e.code, str):
            gate.reported(_ExitMessage(e.code))
    except KeyboardInterrupt as e:
        status = e.exit_status if isinstance(e, Interrupted) else 128 + signal.SIGINT
        gate.reported(e)
    except Exception as e:
        # Escaped Hydra's own report (it re-raises under a debugger): still one line.
        status = 1
        gate.reported(e)
    finally:
        sys.stderr = gate.target
        signal.signal(signal.SIGTERM, previous)
    if status == 0:
        gate.release()
        return
    line = _capped(describe_failure(gate.exception, gate.held_text(), sys.argv[1:]))
    gate.target.write(f"{PROG}: error: {line}\n")
    gate.target.flush()
    raise SystemExit(status if status > 128 else 1)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


class _ExitMessage(Exception):
    """``sys.exit("message")``: Python would print the message itself."""


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1


class _StderrGate:
    """Stands in for ``sys.stderr``: passes text through, but holds back failure reports (see the module doc)."""

    def __init__(self, target: TextIO) -> None:
        self.target = target
        self._held: list[str] = []
        self.exception: BaseException | None = None

    def write(self, text: str) -> int:
        return self._write(text, sys._getframe(1))

    def writelines(self, lines: Sequence[str]) -> None:
        self._write("".join(lines), sys._getframe(1))

    def _write(self, text: str, writer: FrameType) -> int:
        handling = sys.exc_info()[1]
        if handling is None and not writer.f_globals.get("__name__", "").startswith(_REPORTERS):
            self.release()
            return self.target.write(text)
        if handling is not None:
            self.exception = handling
        self._held.append(text)
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def reported(self, exc: BaseException) -> None:
        self.exception = exc

    def held_text(self) -> str:
        return "".join(self._held)

    def release(self) -> None:
        """Pass held text on: it was written while an exception was handled, but the program carried on."""
        if self._held:
            self.target.write(self.held_text())
            self._held.clear()
        self.exception = None

    def __getattr__(self, name: str) -> Any:
        # isatty(), fileno(), encoding, ...: progress output asks the real stream what it is.
        return getattr(self.target, name)


def describe_failure(exc: BaseException | None, report: str, argv: Sequence[str]) -> str:
    """One line that says what is wrong and how to fix it, from the exception Hydra reported (or its text)."""
    if isinstance(exc, (RefitError, _ExitMessage)):
        return _squeeze(str(exc))
    if isinstance(exc, KeyboardInterrupt):
        return str(exc) if isinstance(exc, Interrupted) else "interrupted by SIGINT"
    if isinstance(exc, MissingConfigException):
        return _missing_option(exc)
    if isinstance(exc, OverrideParseException):
        return f"cannot parse the command line: {_squeeze(_first_line(str(exc)))}"
    cause = exc.__cause__ if exc is not None and isinstance(exc.__cause__, OmegaConfBaseException) else exc
    if isinstance(cause, OmegaConfBaseException):
        return _omegaconf_error(cause, argv)
    if isinstance(exc, HydraException):
        # Hydra's own messages are written for users; the class name would add nothing.
        return _squeeze(str(exc))
    if exc is not None:
        return f"{type(exc).__name__}: {_squeeze(str(exc))}" if str(exc) else type(exc).__name__
    return _from_text(report)


def _missing_option(exc: MissingConfigException) -> str:
    missing = exc.missing_cfg_file or ""
    group, _, option = missing.rpartition("/")
    options = [o for o in (exc.options or []) if not o.startswith(_SCHEMA_PREFIX)]
    if group and options:
        return f"{group}={option} is not an option; choose one of {', '.join(options)}"
    return _squeeze(_first_line(str(exc)))


def _omegaconf_error(exc: OmegaConfBaseException, argv: Sequence[str]) -> str:
    full_key = getattr(exc, "full_key", None) or ""
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)) and full_key:
        return _unknown_key(exc, full_key, argv)
    if isinstance(exc, MissingMandatoryValue) and full_key:
        return f"{full_key} is required: add {full_key}=<value> to the command line"
    reason = _first_line(getattr(exc, "msg", None) or str(exc))
    if isinstance(exc, ValidationError) and full_key:
        # The rejected value itself: in a sweep (-m key=abc,2) the command line holds several.
        value = getattr(exc, "value", None)
        if value is None:
            value = _override_value(argv, full_key)
        shown = f"={value}" if value is not None else ""
        return f"{full_key}{shown} is invalid: {_expected(reason)}"
    return _squeeze(reason)


def _unknown_key(exc: OmegaConfBaseException, full_key: str, argv: Sequence[str]) -> str:
    """Name the key the user typed, with its value, and the keys that do exist at that level."""
    typed = next((key for key, _ in _overrides(argv) if key == full_key or key.startswith(full_key + ".")), full_key)
    value = _override_value(argv, typed)
    shown = f" (value {value!r})" if value is not None else ""
    parent_key = full_key.rpartition(".")[0]
    keys = _keys_of(getattr(exc, "parent_node", None), getattr(exc, "object_type", None))
    where = f"keys under {parent_key}" if parent_key else "top-level keys"
    listing = f"; {where}: {', '.join(keys)}" if keys else ""
    return f"unknown key {typed!r}{shown}{listing}"


def _keys_of(node: Any, object_type: Any) -> list[str]:
    if dataclasses.is_dataclass(object_type):
        return [f.name for f in dataclasses.fields(object_type)]
    if isinstance(node, DictConfig):
        return [str(k) for k in node if k != "hydra"]
    return []


def _expected(reason: str) -> str:
    """OmegaConf's type error as what the user may type instead."""
    converted = re.search(r"could not be converted to (\w+)", reason)
    if converted:
        return "must be " + _TYPE_NAMES.get(converted.group(1), converted.group(1).lower())
    if "is not a valid bool" in reason:
        return "must be true or false"
    if "is not Optional" in reason:
        return "must not be null"
    return reason


def _overrides(argv: Sequence[str]) -> list[tuple[str, str]]:
    """``key=value`` pairs from the command line, with Hydra's ``+``/``++``/``~`` prefixes removed."""
    pairs = []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.partition("=")
        pairs.append((key.lstrip("+~"), value))
    return pairs


def _override_value(argv: Sequence[str], key: str) -> str | None:
    return next((value for k, value in _overrides(argv) if k == key), None)


_ARGPARSE_ERROR = re.compile(r": error: (?P<message>.+)$")
_EXCEPTION_LINE = re.compile(r"^(?P<message>[\w.]+(?:Error|Exception): .+)$")


def _from_text(report: str) -> str:
    """The last ``prog: error: message`` or ``SomeError: message`` line of a report no exception explains."""
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    for line in reversed(lines):
        match = _ARGPARSE_ERROR.search(line) or _EXCEPTION_LINE.match(line)
        if match:
            return match.group("message")
    return lines[-1] if lines else "failed without an error message"


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip()), text)


MAX_LINE_CHARS = 2000
"""The longest error line the application prints. Lists in messages are capped where they are made (``some_of``);
this is the net under a message that still grew with its input, so a terminal or a log never gets a line of
megabytes."""


def _capped(line: str) -> str:
    if len(line) <= MAX_LINE_CHARS:
        return line
    return f"{line[: MAX_LINE_CHARS - 40]}... ({len(line) - MAX_LINE_CHARS + 40} more characters)"


def _squeeze(text: str) -> str:
    """One line even when a message spans several."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())
