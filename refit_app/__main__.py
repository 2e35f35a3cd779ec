"""``python -m refit_app``: resolve the config with Hydra and run it; every failure ends in one line."""

import os

# c10d prints multi-line C++ warnings when a peer disappears; our own one-line error already says what happened.
# Set before torch is imported, which reads it once.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from refit_app.app import run  # noqa: E402
from refit_app.cli import run_with_one_line_errors  # noqa: E402
from refit_app.schema import CONF_PATH, CONFIG_NAME  # noqa: E402


@hydra.main(version_base="1.3", config_path=CONF_PATH, config_name=CONFIG_NAME)
def _main(cfg: DictConfig) -> float | None:
    # The run's throughput is the task's value, which a sweeper (hparams_search=buffers_optuna) maximizes.
    return run(cfg).get("gb_per_s")


def main() -> None:
    """``python -m refit_app`` and the ``refit-app`` console script."""
    run_with_one_line_errors(_main)


if __name__ == "__main__":
    main()
