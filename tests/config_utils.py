"""The real ``conf/`` composed in this process, as Hydra composes it for ``python -m refit_app``, and the settings
``validate()`` makes of it (or the one-line message it refuses them with)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from refit_app.app.config import RunSettings, validate
from refit_app.app.schema import CONF_MODULE, CONFIG_NAME
from refit_app.common.errors import ConfigError


def compose_config(overrides: list[str], *, return_hydra_config: bool = False) -> DictConfig:
    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        return compose(config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=return_hydra_config)


def settings(*overrides: str) -> RunSettings:
    return validate(compose_config(list(overrides)))


def refused(*overrides: str) -> str:
    """The message validate() refuses ``overrides`` with; it must be one line."""
    with pytest.raises(ConfigError) as info:
        settings(*overrides)
    message = str(info.value)
    assert "\n" not in message
    return message
