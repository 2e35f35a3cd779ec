"""``python -m refit_app.bench``."""

import sys

# As in ``python -m refit_app``: c10d's multi-line C++ warnings about a lost peer would bury the one-line error.
from refit_app.app.cli import quiet_c10d

quiet_c10d()

from refit_app.bench.cli import main  # noqa: E402 - after quiet_c10d, which must precede torch

sys.exit(main())
