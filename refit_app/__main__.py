"""``python -m refit_app``: resolve the config with Hydra and run it; every failure ends in one line."""

import hydra
from omegaconf import DictConfig

from refit_app.app import run
from refit_app.cli import run_with_one_line_errors
from refit_app.config import CONF_DIR, CONFIG_NAME


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name=CONFIG_NAME)
def _main(cfg: DictConfig) -> None:
    run(cfg)


def main() -> None:
    run_with_one_line_errors(_main)


if __name__ == "__main__":
    main()
