"""The application's round is the library's round: in steady rounds, ``python -m refit_app``'s own loop
(:class:`~refit_app.app.roles.ProducerRounds` / :class:`~refit_app.app.roles.ConsumerRounds`, with the settings the
command line composes) makes exactly the group calls a bare session pair makes for the same model, on every rank:
no extra barrier, handshake, store round trip or manifest per round. Issue 23 measured the app's round as slower
than the session's; ``python -m refit_app.bench --app`` times the two, this test pins down that nothing is added by
structure (timing is never asserted)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from config_utils import settings
from mp_utils import free_port, gloo_spec, run_ranks

from refit_app.app.config import RunSettings
from refit_app.app.roles import ConsumerRounds, ProducerRounds
from refit_app.models.sinks import make_sink
from refit_app.models.sources import make_source
from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.groups import connect

TIMEOUT_S = 60.0
ROUNDS = 4
"""Round 1 carries the manifest; rounds 2..4 are the steady ones compared."""


def _shape(value: Any) -> Any:
    """What a call is about, comparable across two groups: a tensor's dtype and size (never its address), anything
    else as it is."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.numel())
    return value


class _Recording:
    """Stands in for a RefitGroup's broadcast group or control channel and logs every method called on it (the
    name and the arguments' :func:`_shape`) into ``log`` before passing the call on."""

    def __init__(self, inner: Any, label: str, log: list) -> None:
        self._inner, self._label, self._log = inner, label, log

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self._log.append((self._label, name, [_shape(a) for a in args], {k: _shape(v) for k, v in kwargs.items()}))
            return value(*args, **kwargs)

        return call


def _record(rg: Any, log: list) -> None:
    rg.group = _Recording(rg.group, "group", log)
    rg.control = _Recording(rg.control, "control", log)


def _steady_calls(rank: int, world_size: int, port: int, s: RunSettings, session_port: int) -> dict[str, list]:
    """The group calls of rounds 2..ROUNDS, on this rank: of the application's loop on one group, and of a bare
    session pair on another, sending the same source to a consumer that keeps nothing."""
    calls: dict[str, list] = {}
    with connect(gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S)) as rg:
        log: list = []
        _record(rg, log)
        if rank == 0:
            app = ProducerRounds(s, rg, make_source(s.source.target, s.source.params), show_progress=True)
            for k in range(1, ROUNDS + 1):
                if k == 2:
                    log.clear()
                app.send(k)
            calls["app"] = list(log)
            app.finish()
        else:
            consumer = ConsumerRounds(s, rg, make_sink(s.sink.target, s.sink.params), show_progress=False)
            for k in range(1, ROUNDS + 1):
                if k == 2:
                    log.clear()
                assert consumer.receive() is not None
            calls["app"] = list(log)
            assert consumer.receive() is None
            consumer.finish()
    with connect(gloo_spec(rank, world_size, session_port, timeout_s=TIMEOUT_S)) as rg:
        log = []
        _record(rg, log)
        if rank == 0:
            source = make_source(s.source.target, s.source.params)
            session = ProducerSession(
                rg, buffer_size_bytes=s.refit.buffer_size_bytes, num_buffers=s.refit.num_buffers, rounds=ROUNDS
            )
            for k in range(1, ROUNDS + 1):
                if k == 2:
                    log.clear()
                if k > 1:
                    source.advance(k)
                session.send(source.tensors(), metas=source.manifest_tensors())
            calls["session"] = list(log)
            session.close()
        else:
            session = ConsumerSession(rg, num_buffers=s.refit.num_buffers, rounds=ROUNDS)
            for k in range(1, ROUNDS + 1):
                if k == 2:
                    log.clear()
                assert session.receive(lambda batch: None) is not None
            calls["session"] = list(log)
            assert session.receive(lambda batch: None) is None
    return calls


def _is_tensor(arg: Any) -> bool:
    return isinstance(arg, tuple) and arg[0] == "tensor"


@pytest.mark.parametrize("consumers", [1, 2])
def test_a_steady_app_round_makes_the_group_calls_of_a_bare_session_round(consumers):
    s = settings(
        "sink=discard",
        "source.preset=llama-1b",
        "source.size=3MB",
        "refit.buffer_size_bytes=256KiB",
        f"refit.rounds={ROUNDS}",
        f"role.num_consumers={consumers}",
    )
    per_rank = run_ranks(_steady_calls, consumers + 1, s, free_port(), timeout=120)
    model_bytes = make_source(s.source.target, s.source.params).total_bytes
    for rank, calls in enumerate(per_rank):
        # The calls compared carry the model, every steady round (3 MB in 256 KiB buffers), not only small messages.
        sent = sum(c[2][0][2] for c in calls["session"] if c[0] == "group" and c[2] and _is_tensor(c[2][0]))
        assert sent >= (ROUNDS - 1) * model_bytes, (rank, calls["session"])
        assert calls["app"] == calls["session"], rank
