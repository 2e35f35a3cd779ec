"""Running one rank of a sharded refit (:mod:`refit_app.app.sharded`): its group, the settings every rank agrees on,
then the rounds: the application's own (verify, save, model sinks) or, where the consumers are an engine's workers
(sink=vllm), :mod:`refit_app.app.sharded_engine`'s. Apart from both so that neither imports the other's runner."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

from refit_app.app.config import ENGINE_SINKS, RunSettings
from refit_app.app.sharded import RoundView, agree_settings, run_rounds
from refit_app.common.errors import PeerError, VerificationError
from refit_app.core.reshard.transfer import RegionMismatch
from refit_app.models.sources import make_source
from refit_app.transport.backends import masked_gloo_error
from refit_app.transport.groups import connect


def run_sharded(s: RunSettings, *, after_round: Callable[[RoundView], None] | None = None) -> dict[str, Any]:
    """This rank's part of a sharded refit, ``refit.rounds`` rounds; its metrics. ``after_round``: called on every
    rank after each round's transfer, before a consumer checks it (a test reads the trainer's and the slices'
    values there)."""
    layout = s.sharded
    assert layout is not None, "run_sharded needs a sharded layout (group.producers, tp_size, replicas)"
    if s.refit.elastic:  # refit.on_consumer_loss=continue: a group per generation of the ranks there
        from refit_app.app.sharded_elastic import run_elastic

        return run_elastic(s)
    producer = s.rank < layout.producers
    source = make_source(s.source.target, s.source.params) if producer else None
    engine = None
    if not producer and s.sink_name in ENGINE_SINKS:
        from refit_app.app.sharded_engine import engine_sink

        engine = engine_sink(s)  # its imports (tens of seconds) before the rendezvous: in no peer's deadline
    started = time.perf_counter()
    with connect(replace(s.group, backend="gloo")) as rg:
        pg = rg.group.process_group()
        try:
            with ExitStack() as stack:
                agreed = agree_settings(pg, s, layout, source)
                if agreed.engines:  # the consumers are an engine's workers, which join the refit themselves
                    from refit_app.app.sharded_engine import engine_rounds

                    return engine_rounds(s, layout, agreed, rg, pg, source or engine, started, stack)
                return run_rounds(s, layout, agreed, rg, pg, source, started, stack, after_round)
        except RegionMismatch as e:  # bytes that arrived other than their source hashed them (it names the rank)
            raise VerificationError(str(e)) from e
        except RuntimeError as e:  # gloo's own error: a peer lost; say whose and why, where it said
            raise PeerError(rg.control.explain(e)) from e
        except ValueError as e:
            lost = masked_gloo_error(e)
            if lost is None:
                raise
            raise PeerError(rg.control.explain(lost)) from lost
        finally:
            del pg
