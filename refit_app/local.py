"""``role=local``: one producer and ``role.num_consumers`` consumers as processes on this machine.

The ranks are started and supervised by :mod:`refit_app.launch`; each runs :func:`refit_app.roles.run_producer` or
:func:`~refit_app.roles.run_consumer` exactly as a separate launch would, and logs into this job's log too.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from typing import Any

from refit_app.config import RunSettings
from refit_app.errors import PeerError, RefitError
from refit_app.launch import free_port, prestart, run_ranks

logger = logging.getLogger(__name__)

RANK_MODULES = ("refit_app.roles",)
"""What every rank imports (torch with it): once, in the fork server, not once per rank. This process never
imports them: it only supervises."""

STARTUP_LIMIT_S = 300.0
"""How long the ranks of role=local may take to start (fork, imports) before the run fails; only a hang nears it."""
LOCAL_EXIT_GRACE_S = 5.0
"""How long ``role=local`` waits, after one rank failed, for the others to exit with their own errors before it
stops them. Not the group deadline: a rank that fails before the rendezvous (a bad source, say) would leave its
peers waiting out their whole ``group.timeout_s`` for a root cause that is already known."""


class LocalRunError(RefitError):
    """A rank of ``role=local`` failed; carries the metrics gathered from every rank."""

    def __init__(self, message: str, metrics: dict[str, Any]) -> None:
        super().__init__(message)
        self.metrics = metrics


def _rank_main(rank: int, s: RunSettings, log_files: list[str]) -> dict[str, Any]:
    """One spawned rank: the producer (rank 0) or a consumer, with this run's settings."""
    from refit_app.roles import run_consumer, run_producer

    label = "producer" if rank == 0 else f"consumer {rank}"
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    # The parent's log files (Hydra's job log) get the ranks' lines too; appends of whole lines interleave cleanly.
    handlers += [logging.FileHandler(path, mode="a") for path in log_files]
    logging.basicConfig(level=logging.INFO, handlers=handlers, format=f"[%(asctime)s][{label}] %(message)s")
    ranked = replace(s, role="producer" if rank == 0 else "consumer", group=replace(s.group, rank=rank))
    # Only the producer draws a live progress line: several ranks rewriting one terminal line is noise.
    return (run_producer if rank == 0 else run_consumer)(ranked, show_progress=rank == 0)


def run_local(s: RunSettings) -> dict[str, Any]:
    """Run the producer and every consumer as processes here; the producer's figures at the top level."""
    prestart(RANK_MODULES)  # torch loads in the fork server while this process checks the source
    if s.source is not None and s.source.target.endswith("SafetensorsSource"):
        # Reading the headers is cheap: a bad checkpoint fails here in a second, not after the ranks' start-up.
        from refit_app.sources import make_source

        make_source(s.source.target, s.source.params)
    if s.group.port is None:
        s = replace(s, group=replace(s.group, port=free_port()))
    log_files = [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    # Started together: the rendezvous deadline (group.timeout_s) never includes a rank's start-up.
    outcomes = run_ranks(_rank_main, s.group.world_size, (s, log_files), grace_s=LOCAL_EXIT_GRACE_S,
                         name="refit-rank", preload=RANK_MODULES, startup_s=STARTUP_LIMIT_S)
    role_of = ["producer"] + ["consumer"] * (len(outcomes) - 1)
    metrics = [
        o.value if o.ok else {"role": role_of[o.rank], "rank": o.rank, "status": "failed", "error": o.error}
        for o in outcomes
    ]
    combined = {**metrics[0], "role": "local", "consumers": metrics[1:]}
    failures = [o for o in outcomes if not o.ok]
    if failures:
        # The root cause is the failure that is not just "a peer failed", if there is one.
        root = next((f for f in failures if f.exc_type not in (PeerError.__name__, "Timeout")), failures[0])
        combined.update(status="failed", error=root.error)
        raise LocalRunError(root.error, combined)
    verified = [c.get("verified") for c in combined["consumers"]]
    combined["verified"] = None if all(v is None for v in verified) else all(v is True for v in verified)
    return combined
