"""Ray facts that the config needs without importing Ray (the application's schema and ``--help`` import this)."""

PLACEMENT_STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK")
"""Ray's placement-group strategies for the ranks' bundles: SPREAD, across nodes where it can; STRICT_SPREAD, every
rank on a node of its own (or nothing starts); PACK, as few nodes as possible."""
DEFAULT_STRATEGY = "SPREAD"
"""A trainer and its engines on different nodes where the cluster has them, all on one node where it has one."""
DEFAULT_CPUS_PER_RANK = 1.0
DEFAULT_START_TIMEOUT_S = 300.0
"""How long connecting, placing the bundles and starting every rank's actor (which imports torch) may take."""
DEFAULT_ELASTIC_RESTARTS = 3
"""``ray.max_restarts`` under ``refit.on_consumer_loss=continue``: a consumer's actor that died is restarted (and
rejoins) up to this many times."""
RAY_EXTRA = "pip install 'refit_app[ray]'"
"""How to install Ray the way refit_app is tested with it (pyproject.toml's ``ray`` extra)."""
