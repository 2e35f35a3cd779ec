"""``role=local``: one producer and ``role.num_consumers`` consumers as processes on this machine.

The ranks are started and supervised by :mod:`refit_app.app.rank_harness`; each runs
:func:`refit_app.app.roles.run_producer` or :func:`~refit_app.app.roles.run_consumer` exactly as a separate launch
would, and logs into this job's log too.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from refit_app.app.config import RunSettings
from refit_app.app.metrics import round_times
from refit_app.app.rank_harness import ActivityHandler, RankOutcome, prestart, root_cause, run_ranks
from refit_app.common.errors import PeerError, RefitError, SinkError
from refit_app.common.sizes import gb_per_s
from refit_app.transport.auth import new_run_id, new_secret

logger = logging.getLogger(__name__)

RANK_MODULES = ("refit_app.app.roles",)
"""What every rank imports (torch with it): once, in the fork server, not once per rank. This process never
imports them: it only supervises."""

STARTUP_LIMIT_S = 300.0
"""How long the ranks of role=local may take to start (fork, imports) before the run fails; only a hang nears it."""
LOCAL_EXIT_GRACE_S = 5.0
"""How long ``role=local`` waits, after one rank failed, for the others to exit with their own errors before it
stops them. Not the group deadline: a rank that fails before the rendezvous (a bad source, say) would leave its
peers waiting out their whole ``group.timeout_s`` for a root cause that is already known."""


class LocalRunError(RefitError):
    """A rank of ``role=local`` (or ``role=ray``) failed; carries the metrics gathered from every rank."""

    def __init__(self, message: str, metrics: dict[str, Any]) -> None:
        super().__init__(message)
        self.metrics = metrics

    def __reduce__(self) -> tuple[Any, ...]:
        # A launcher that runs jobs in other processes (hydra/launcher=submitit_local) pickles a job's exception;
        # the default rebuilds it from args alone and fails on the missing metrics, replacing the real error.
        return (type(self), (str(self), self.metrics))


def _rank_main(rank: int, s: RunSettings, log_files: list[str]) -> dict[str, Any]:
    """One spawned rank: the producer (rank 0) or a consumer, with this run's settings; in a sharded refit, one of
    its producers or consumers."""
    from refit_app.app.roles import run_consumer, run_producer

    # Its last line says what it was doing, should it be stopped.
    rank_logging(rank, log_files, ActivityHandler(), producers=num_producers(s))
    # Every rank is on this host, so its rank is its index here: the producer takes cuda:0, consumer k cuda:k.
    ranked = rank_settings(s, rank, local_rank=rank)
    if s.sharded is not None:
        from refit_app.app.sharded_run import run_sharded

        return run_sharded(ranked)
    # Only the producer draws a live progress line: several ranks rewriting one terminal line is noise.
    return (run_producer if rank == 0 else run_consumer)(ranked, show_progress=rank == 0)


def num_producers(s: RunSettings) -> int:
    """1, or a sharded refit's ``group.producers``."""
    return 1 if s.sharded is None else s.sharded.producers


def rank_label(rank: int, producers: int = 1) -> str:
    """``producer`` (of one), ``producer 1`` (of a sharded refit's several), ``consumer 3``."""
    if rank < producers:
        return "producer" if producers == 1 else f"producer {rank}"
    return f"consumer {rank}"


def rank_logging(rank: int, log_files: list[str], *extra: logging.Handler, producers: int = 1) -> None:
    """A rank's log: its lines on stdout and in the launching job's log files, each labelled with the rank."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    # The parent's log files (Hydra's job log) get the ranks' lines too; appends of whole lines interleave cleanly.
    handlers += [logging.FileHandler(path, mode="a") for path in log_files]
    handlers += extra
    logging.basicConfig(
        level=logging.INFO,
        handlers=handlers,
        format=f"[%(asctime)s][{rank_label(rank, producers)}] %(message)s",
        force=True,
    )


def rank_settings(s: RunSettings, rank: int, *, local_rank: int | None) -> RunSettings:
    """The settings of one rank of a run that starts every rank itself (role=local, role=ray)."""
    group = replace(s.group, rank=rank, local_rank=local_rank)
    return replace(s, role="producer" if rank < num_producers(s) else "consumer", group=group)


def with_run_secret(s: RunSettings) -> RunSettings:
    """Its own secret and id per run: no other process can join these ranks, and no rank joins another run's.
    They reach the ranks as arguments, never through the environment or a file."""
    group = replace(s.group, token=s.group.token or new_secret(), run_id=s.group.run_id or new_run_id())
    return replace(s, group=group)


def check_source_early(s: RunSettings) -> None:
    """Reading a checkpoint's headers is cheap: a bad checkpoint fails here in a second, not after the ranks'
    start-up."""
    if s.source is not None and s.source.target.endswith("SafetensorsSource"):
        from refit_app.models.sources import make_source

        make_source(s.source.target, s.source.params)


def run_local(s: RunSettings) -> dict[str, Any]:
    """Run the producer and every consumer as processes here; the producer's figures at the top level."""
    prestart(RANK_MODULES)  # torch loads in the fork server while this process checks the source
    check_source_early(s)
    s = with_run_secret(s)
    log_files = [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    # Started together: the rendezvous deadline (group.timeout_s) never includes a rank's start-up.
    outcomes = run_ranks(
        _rank_main,
        s.group.world_size,
        (s, log_files),
        # With continue a lost consumer is no reason to stop the others; every rank's own deadlines bound them.
        grace_s=None if s.refit.elastic else LOCAL_EXIT_GRACE_S,
        name="refit-rank",
        preload=RANK_MODULES,
        startup_s=STARTUP_LIMIT_S,
    )
    return combine_outcomes(outcomes, s, "local")


NO_ROUND = "received no round: it joined after the producer's last round"
"""An elastic consumer's entry in a combined run that ended without a round (restarted too late, say)."""


def _no_round_is_lost(o: RankOutcome) -> RankOutcome:
    """An elastic consumer that received no round delivered nothing: it counts as lost, not as a verified rank."""
    if o.rank == 0 or not o.ok or o.value.get("rounds"):
        return o
    return RankOutcome(o.rank, False, error=NO_ROUND, exc_type="NoRound")


def combine_outcomes(
    outcomes: list[RankOutcome], s: RunSettings, role: str, per_rank: Mapping[int, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """One run's metrics from its ranks' outcomes: the producer's figures at the top level, each consumer's under
    ``consumers`` (with ``per_rank``'s entries added); raises :class:`LocalRunError` with them, naming the root
    cause, if any rank failed. A sharded refit's: :func:`combine_sharded`."""
    if s.sharded is not None:
        return combine_sharded(outcomes, s, role, per_rank)
    role_of = ["producer"] + ["consumer"] * (len(outcomes) - 1)
    if s.refit.elastic and outcomes[0].ok:
        outcomes = [_no_round_is_lost(o) for o in outcomes]
    metrics = [
        o.value if o.ok else {"role": role_of[o.rank], "rank": o.rank, "status": "failed", "error": o.error}
        for o in outcomes
    ]
    for rank, extra in (per_rank or {}).items():
        metrics[rank].update(extra)
    combined = {**metrics[0], "role": role, "consumers": metrics[1:]}
    failures = [o for o in outcomes if not o.ok]
    if failures and s.refit.elastic and outcomes[0].ok:
        # The producer completed every round with the consumers it had: the lost ones' entries say what became of
        # them, and each round's members who took part.
        failures = _lost_or_failed(failures, 1)
    _raise_if_failed(failures, outcomes, s, combined)
    verified = [c.get("verified") for c in combined["consumers"] if c.get("status") == "ok"]
    combined["verified"] = None if all(v is None for v in verified) else all(v is True for v in verified)
    return combined


OWN_PRODUCT_ERRORS = (SinkError.__name__,)
"""A consumer's failures that the run fails with even under refit.on_consumer_loss=continue: its sink could not keep
what it received (sink=save wrote nothing), so the run did not deliver what it was asked for; any other failure of
a consumer (it died, stalled, or took bytes that did not check) left the others' weights whole."""


def _lost_or_failed(failures: list[RankOutcome], k: int) -> list[RankOutcome]:
    """Under refit.on_consumer_loss=continue, with every producer done: the consumers that were lost, logged as such,
    and the failures the run still fails with (:data:`OWN_PRODUCT_ERRORS`)."""
    kept = [o for o in failures if o.exc_type in OWN_PRODUCT_ERRORS]
    for o in failures:
        if o not in kept:
            logger.warning("%s lost during the run: %s", rank_label(o.rank, k), o.error)
    return kept


def _raise_if_unsaved(s: RunSettings, consumers: Sequence[Mapping[str, Any]], combined: dict[str, Any]) -> None:
    """sink=save in a sharded refit: every tensor-parallel rank's directory must hold this run's slices. Under
    refit.on_consumer_loss=continue a consumer lost after the last round, before it published, saved nothing while
    the others published theirs (the directories then hold different runs)."""
    if s.sink_name != "save" or s.sink is None or s.sharded is None:
        return
    where = Path(s.sink.params["path"])
    saved = {c.get("saved_to") for c in consumers}
    missing = [f"tp{t}" for t in range(s.sharded.tp_size) if str(where / f"tp{t}") not in saved]
    if missing:
        error = (
            f"no consumer saved {', '.join(missing)} to {where} in this run (its saver was lost after the last "
            "round); the directories there hold different runs now, which assemble_slices refuses"
        )
        combined.update(status="failed", error=error)
        raise LocalRunError(error, combined)


def _raise_if_failed(
    failures: list[RankOutcome], outcomes: list[RankOutcome], s: RunSettings, combined: dict[str, Any]
) -> None:
    """Where a rank failed: :class:`LocalRunError` with ``combined``, naming the root cause, the failure that is not
    just "a peer failed", if there is one, with what a rank stopped meanwhile was doing (a producer still reading
    its source when a consumer gave up waiting)."""
    if not failures:
        return
    error = root_cause(
        [o for o in outcomes if o.ok or o in failures],  # under continue, not the consumers merely lost
        [rank_label(r, num_producers(s)) for r in range(len(outcomes))],
        secondary=(PeerError.__name__,),
        stopped_hint=f"if it was only slow, raise group.timeout_s (now {s.group.timeout_s:g}s)",
    )
    combined.update(status="failed", error=error)
    raise LocalRunError(error, combined)


def _sharded_delta_figures(
    producers: Sequence[Mapping[str, Any]], consumers: Sequence[Mapping[str, Any]], first: Mapping[str, Any] | None
) -> dict[str, Any]:
    """A sharded refit's round of delta rounds (producers that counted changes), over all its ranks: the elements
    every producer found changed, their share of the model (the first round counts every element: each producer's
    distinct pieces are its share), and the slowest producer's comparison and consumer's applying (each runs in
    parallel with the others)."""
    counted = [p["changed_elements"] for p in producers if p.get("changed_elements") is not None]
    if len(counted) != len(producers):
        return {}
    changed = sum(counted)
    total = changed if first is None else first["changed_elements"]
    applied = [c["apply_seconds"] for c in consumers if c.get("apply_seconds") is not None]
    return {
        "changed_elements": changed,
        "changed_fraction": changed / total if total else None,
        "diff_seconds": max(p["diff_seconds"] for p in producers),
        "apply_seconds": max(applied, default=None),
    }


def _rounds_by_number(
    producers: Sequence[Mapping[str, Any]], consumers: Sequence[Mapping[str, Any]]
) -> list[list[Mapping[str, Any]]]:
    """Each of the producers' rounds with every producer's and consumer's entry of that round: a consumer that
    joined later, or was lost, has no entry for some (with refit.on_consumer_loss=continue), and each consumer has
    at most one per round (a round cut by a lost peer returns once, when it completed)."""
    by_round = [{r["round"]: r for r in c["rounds"]} for c in consumers]
    return [
        [*entries, *(b[entries[0]["round"]] for b in by_round if entries[0]["round"] in b)]
        for entries in zip(*(p["rounds"] for p in producers))
    ]


def combine_sharded(
    outcomes: list[RankOutcome], s: RunSettings, role: str, per_rank: Mapping[int, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """A sharded refit's metrics from its ranks': each producer's under ``producers``, each consumer's under
    ``consumers`` (with ``per_rank``'s entries added), and the run's at the top level. A round's ``seconds`` is its
    slowest rank's (every rank starts it together), its ``bytes`` what the producers sent, its ``wire_bytes`` what
    every consumer received (with replicas, the relayed bytes too)."""
    k = num_producers(s)
    metrics = [
        o.value
        if o.ok
        else {"role": "producer" if o.rank < k else "consumer", "rank": o.rank, "status": "failed", "error": o.error}
        for o in outcomes
    ]
    for rank, extra in (per_rank or {}).items():
        metrics[rank].update(extra)
    producers, consumers = metrics[:k], metrics[k:]
    combined: dict[str, Any] = {"role": role, "rank": 0, "producers": producers, "consumers": consumers}
    failures = [o for o in outcomes if not o.ok]
    if failures and s.refit.elastic and all(o.ok for o in outcomes[:k]):
        # The producers completed every round with the consumers there: the lost ones' entries say what became of
        # them, and each round's members who took part (the others' rounds are counted below).
        failures = _lost_or_failed(failures, k)
    _raise_if_failed(failures, outcomes, s, combined)
    consumers = [c for c in consumers if c.get("status") != "failed"]
    _raise_if_unsaved(s, consumers, combined)
    verifies = any(c["verified"] is not None for c in consumers)  # sink=verify, or sink=model's sink.verify
    rounds = []
    for entries in _rounds_by_number(producers, consumers):
        seconds = max(e["seconds"] for e in entries)
        sent = sum(e["bytes"] for e in entries[:k])
        received = sum(e["wire_bytes"] for e in entries[k:])
        peak = [e["peak_rss_bytes"] for e in entries if e["peak_rss_bytes"] is not None]
        rounds.append(
            {
                **entries[0],
                "seconds": seconds,
                "bytes": sent,
                "gb_per_s": gb_per_s(sent, seconds),
                "wire_bytes": received,
                "verified": all(e["verified"] for e in entries[k:]) if verifies else None,
                "peak_rss_bytes": max(peak, default=None),
                **_sharded_delta_figures(entries[:k], entries[k:], rounds[0] if rounds else None),
            }
        )
    total, times = sum(r["bytes"] for r in rounds), round_times([r["seconds"] for r in rounds])
    combined.update(
        {key: value for key, value in producers[0].items() if key not in ("producers", "consumers")},
        **times,
        role=role,
        bytes=total,
        wire_bytes=sum(r["wire_bytes"] for r in rounds),
        gb_per_s=gb_per_s(total, times["seconds"]),
        peak_rss_bytes=max((m["peak_rss_bytes"] or 0 for m in [*producers, *consumers]), default=None),
        peak_extra_bytes=max((m["peak_extra_bytes"] or 0 for m in [*producers, *consumers]), default=None),
        verified=all(c["verified"] for c in consumers) if verifies else None,
        verified_tensors=None,
        sink=s.sink_name,
        rounds=rounds,
    )
    return combined
