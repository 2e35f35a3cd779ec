"""``python -m refit_app``: resolve the config with Hydra and run it; every failure ends in one line."""

import logging
import os
import sys

# c10d prints multi-line C++ warnings when a peer disappears; our own one-line error already says what happened.
# Set before torch is imported, which reads it once.
from refit_app.app.cli import quiet_c10d, run_with_one_line_errors  # torch-free

quiet_c10d()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from refit_app.app.metrics import headline  # noqa: E402
from refit_app.app.reference import register_help_resolver  # noqa: E402
from refit_app.app.runner import run  # noqa: E402
from refit_app.app.schema import CONF_PATH, CONFIG_NAME  # noqa: E402


@hydra.main(version_base="1.3", config_path=CONF_PATH, config_name=CONFIG_NAME)
def _main(cfg: DictConfig) -> float | None:
    # The task's value, which a sweeper (hparams_search=buffers_optuna) maximizes: the run's headline throughput,
    # a steady round's when it had several (what an RL loop pays every step), as the sweep summary plots it.
    return headline(run(cfg)).gb_per_s


def main() -> None:
    """``python -m refit_app`` and the ``refit-app`` console script."""
    register_help_resolver()
    try:
        run_with_one_line_errors(_main)
    except SystemExit as e:
        if not e.code or "torch.distributed" not in sys.modules:
            raise
        # A failed rank can leave a transport thread blocked in a collective (a chain relay's receive from a dead
        # peer); interpreter teardown would destroy it and abort the process (SIGABRT) after the one-line error
        # was printed. Everything the run keeps (metrics.json, the run directory, the line) is written by now.
        # Not in role=local's launcher (it never imports torch): its multiprocessing clean-up must run.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)


if __name__ == "__main__":
    main()
