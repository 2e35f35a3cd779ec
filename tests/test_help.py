"""``--help`` lists every key of the schema with its default and its meaning on one line, and the values of every
choice, from the homes of those facts (the schema, PRESETS, BACKENDS, the files in conf/)."""

from __future__ import annotations

import dataclasses
from importlib import resources

import pytest

from refit_app.app import schema
from refit_app.app.reference import group_options, help_reference
from refit_app.models.defaults import FLOAT_DTYPES, SYNTHETIC_UPDATES
from refit_app.models.presets import PRESETS
from refit_app.transport.spec import BACKENDS


@pytest.fixture(scope="module")
def lines() -> list[str]:
    # As printed: Hydra's template turns each $$ back into $.
    return [line.strip() for line in help_reference().replace("$$", "$").splitlines()]


def line_of(lines: list[str], start: str) -> str:
    found = [line for line in lines if line.startswith(start)]
    assert len(found) == 1, f"{start!r}: {found}"
    return found[0]


def test_every_key_is_listed_with_its_default(lines: list[str]) -> None:
    for section in ("refit", "group"):
        node = getattr(schema.Config(), section)
        expected = {
            f"{section}.{f.name}": getattr(node, f.name)
            for f in dataclasses.fields(node)
            if not dataclasses.is_dataclass(getattr(node, f.name))
        }
        for key, default in expected.items():
            if isinstance(default, str) and default.startswith("${"):
                continue  # an environment default, below
            shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
            line_of(lines, f"{key}={shown} ")
    line_of(lines, "refit.debug.corrupt_chunk=null ")
    line_of(lines, "refit.num_buffers=2 (or $NRL_REFIT_NUM_BUFFERS) ")
    for group, options in schema.GROUP_SCHEMAS.items():
        for cls in options.values():
            base = {f.name for f in dataclasses.fields(cls.__mro__[1])}
            for f in dataclasses.fields(cls):
                key = f"{group}.{f.name}"
                if f.name in base:
                    line_of(lines, f"{key} (set by the option)")
                elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    continue
                else:
                    assert any(line.startswith((f"{key}=", f"{key} (required)")) for line in lines), key


def test_each_key_has_its_field_docstring_on_its_line(lines: list[str]) -> None:
    assert line_of(lines, "group.port=null").endswith(
        "Rendezvous port. null: a free port for role=local, 29500 for a producer and its consumers."
    )
    # A docstring that spans lines in the source is one line here.
    assert line_of(lines, "refit.buffer_size_bytes=null").endswith(
        "null: the library default on a producer; the producer's value on a consumer."
    )
    # A key that two options share is listed under each, with each option's meaning.
    paths = [line for line in lines if line.startswith("source.path (required)")]
    assert [p.endswith("(sharded or not).") for p in paths] == [True, False], paths


@pytest.mark.parametrize(
    ("key", "choices"),
    [
        ("group.backend=auto", BACKENDS),
        ("source.preset=tiny", tuple(PRESETS)),
        ("source.dtype=bfloat16", FLOAT_DTYPES),
        ("source.update=shuffle", SYNTHETIC_UPDATES),
    ],
)
def test_the_values_of_a_choice_come_from_their_home(lines: list[str], key: str, choices: tuple[str, ...]) -> None:
    assert line_of(lines, key).endswith(f"[{', '.join(choices)}]")


def test_every_group_lists_the_options_that_conf_holds(lines: list[str]) -> None:
    root = resources.files(schema.CONF_MODULE)
    for group in ("role", "source", "sink", "hparams_search"):
        on_disk = sorted(
            p.name.removesuffix(".yaml") for p in root.joinpath(group).iterdir() if p.name.endswith(".yaml")
        )
        assert sorted(group_options(group)) == on_disk
        for option in on_disk:
            line_of(lines, f"{group}={option}: ")
    assert line_of(lines, "role=consumer:")
    assert "also sets: group.rank=1 group.world_size=2 refit.use_legacy_packing=null" in lines


def test_help_prints_the_reference_and_the_config(cli) -> None:
    result = cli("--help")
    assert result.returncode == 0, result.describe()
    out = result.stdout
    for text in (
        "Usage: python -m refit_app",
        "group.backend=auto",
        "[auto, gloo, nccl, pynccl, shm]",
        "refit.num_buffers=2 (or $NRL_REFIT_NUM_BUFFERS)",
        "hparams_search=buffers_optuna: ",
        # $CONFIG: the composed config with this command line's choices
        "  num_consumers: 1\n",
    ):
        assert text in out, f"{text!r} missing\n{result.describe()}"
    assert "base_" not in out, "the typed schemas are not options users choose"
