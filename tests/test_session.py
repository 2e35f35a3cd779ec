"""Refit sessions over real gloo groups: many rounds, the manifest once, a changed tensor list, a shape change, a
consumer that fails in round 3, the iterator form, and a session over a process group the caller made."""

from __future__ import annotations

import pytest
import torch
from mp_utils import RankFailure, gloo_spec, run_ranks
from tensor_utils import raw_bytes

from refit_app.common.errors import HandshakeError, PeerError, RefitError, SourceError, VerificationError
from refit_app.protocol.session import ConsumerSession, ConsumerSessionLike, ProducerSession, ProducerSessionLike
from refit_app.transport.groups import connect

TIMEOUT_S = 30.0
"""group.timeout_s of these sessions; nothing here waits for it unless a test is about a failure."""
BUFFER = 4096
"""Small buffers: several chunks per round, so buffer reuse across chunks and rounds is exercised."""
BACKENDS = ["gloo", "shm"]
"""The backends the round tests run over: sockets, and shared memory (views of the producer's segments kept)."""


def _weights(round_index: int, *, extra: bool = False, wide: bool = False) -> list[tuple[str, torch.Tensor]]:
    """A trainer's state in ``round_index``: every value depends on the round, as after an optimizer step."""
    g = torch.Generator().manual_seed(round_index)
    named = [
        ("embed", torch.randn(64, 32 if not wide else 48, generator=g)),
        ("norm", torch.randn(32, generator=g).to(torch.bfloat16)),
        ("scale", torch.tensor(float(round_index))),
        ("proj", torch.randn(40, 40, generator=g).t()),  # a strided view, as a transposed weight
        ("empty", torch.empty(0, 3)),
    ]
    if extra:
        named.append(("lora_A", torch.randn(8, 32, generator=g)))
    return named


def _as_bytes(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """A tensor as plain values: tensors sent back through a queue would share memory with an exiting rank."""
    return str(t.dtype), tuple(t.shape), raw_bytes(t)


def _keep(store: dict[str, tuple]):
    def consume(batch: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in batch:
            store[name] = _as_bytes(t)

    return consume


def _plain_rounds(rank: int, world_size: int, port: int, plans: list[dict], backend: str = "gloo") -> list:
    """Round ``i`` sends ``_weights(i + 1, **plans[i])``; consumers verify and return what they received."""
    with connect(gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S, backend=backend)) as rg:
        if rank == 0:
            out = []
            with ProducerSession(rg, buffer_size_bytes=BUFFER) as session:
                assert isinstance(session, ProducerSessionLike)
                for i, plan in enumerate(plans):
                    r = session.send(_weights(i + 1, **plan))
                    out.append((r.round, r.manifest_sent, r.bytes, r.checksums is not None))
            return out
        session = ConsumerSession(rg, verify=True)
        assert isinstance(session, ConsumerSessionLike)
        out = []
        while True:
            received: dict[str, tuple] = {}
            r = session.receive(_keep(received))
            if r is None:
                return out
            out.append((r.round, r.manifest_sent, r.verified, received))


def _expect_same(received: dict[str, tuple], sent: list[tuple[str, torch.Tensor]]) -> None:
    assert list(received) == [name for name, _ in sent]
    for name, t in sent:
        assert received[name] == _as_bytes(t), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_rounds_send_the_manifest_once_and_every_round_verifies(backend):
    plans = [{}, {}, {}, {}]
    producer, *consumers = run_ranks(_plain_rounds, 3, plans, backend, timeout=120)
    assert [(r, fresh) for r, fresh, _, _ in producer] == [(1, True), (2, False), (3, False), (4, False)]
    assert all(checked for *_, checked in producer)  # a consumer verifies, so checksums travel every round
    for rounds in consumers:
        assert [(r, fresh, ok) for r, fresh, ok, _ in rounds] == [
            (1, True, True),
            (2, False, True),
            (3, False, True),
            (4, False, True),
        ]
        for i, (*_, received) in enumerate(rounds):
            _expect_same(received, _weights(i + 1))


def test_a_changed_tensor_list_brings_a_fresh_manifest():
    plans = [{}, {"extra": True}, {"extra": True}, {"extra": True, "wide": True}]
    producer, consumer = run_ranks(_plain_rounds, 2, plans, timeout=120)
    assert [fresh for _, fresh, _, _ in producer] == [True, True, False, True]
    assert [fresh for _, fresh, _, _ in consumer] == [True, True, False, True]
    for i, (*_, received) in enumerate(consumer):
        _expect_same(received, _weights(i + 1, **plans[i]))


def _model_consumer_refuses_reshape(rank: int, world_size: int, port: int) -> list:
    """A consumer whose model has fixed shapes: a reshaped tensor is refused at the fresh manifest."""
    with connect(gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            with ProducerSession(rg, buffer_size_bytes=BUFFER) as session:
                session.send(_weights(1))
                session.send(_weights(2, wide=True))
            return []
        shapes: dict[str, tuple[int, ...]] = {}

        def on_manifest(manifest) -> None:
            for t in manifest.tensors:
                if shapes.setdefault(t.name, t.shape) != t.shape:
                    raise HandshakeError(f"{t.name} changed shape {list(shapes[t.name])} -> {list(t.shape)}")

        session = ConsumerSession(rg)
        while session.receive(lambda batch: None, on_manifest=on_manifest) is not None:
            pass
        return []


def test_a_shape_change_is_caught_and_stops_every_rank_naming_the_round_and_tensor():
    outcomes = run_ranks(_model_consumer_refuses_reshape, 2, timeout=120, return_exceptions=True)
    for outcome in outcomes:
        assert isinstance(outcome, RankFailure), outcome
        assert "round 2: embed changed shape [64, 32] -> [64, 48]" in outcome.message, outcome


def _fails_in_round_3(rank: int, world_size: int, port: int) -> int:
    with connect(gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            with ProducerSession(rg, buffer_size_bytes=BUFFER) as session:
                for i in range(5):
                    session.send(_weights(i + 1))
            return session.rounds

        def check(r) -> dict:
            if rank == 2 and r.round == 3:
                raise VerificationError("the model check failed")
            return {"checked": True}

        session = ConsumerSession(rg)
        while session.receive(lambda batch: None, on_round_end=check) is not None:
            pass
        return session.rounds


def test_a_consumer_failing_in_round_3_fails_every_rank_with_its_reason():
    outcomes = run_ranks(_fails_in_round_3, 3, timeout=120, return_exceptions=True)
    for outcome in outcomes:
        assert isinstance(outcome, RankFailure), outcome
        assert "round 3: the model check failed" in outcome.message, outcome
    assert outcomes[2].exc_type == "VerificationError"
    assert outcomes[0].exc_type == outcomes[1].exc_type == "PeerError"
    assert "rank 2 failed" in outcomes[0].message


def _iterator_rounds(rank: int, world_size: int, port: int, backend: str) -> list:
    with connect(gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S, backend=backend)) as rg:
        if rank == 0:
            with ProducerSession(rg, buffer_size_bytes=BUFFER, num_buffers=3) as session:
                for i in range(3):
                    session.send(_weights(i + 1), extra=f"probe {i + 1}".encode())
            return []
        session = ConsumerSession(rg, verify=True, num_buffers=1)
        out = []
        while (tensors := session.receive(return_iterator=True)) is not None:
            # Keep every tensor (no clone) until the round ends, as vLLM's layerwise reload does.
            received = dict(tensors)
            r = session.last_round
            out.append((r.round, r.verified, r.extra, {n: _as_bytes(t) for n, t in received.items()}))
        return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_iterator_form_keeps_references_safely_and_carries_the_extra_payload(backend):
    _, consumer = run_ranks(_iterator_rounds, 2, backend, timeout=120)
    assert [(r, ok, extra) for r, ok, extra, _ in consumer] == [
        (1, True, b"probe 1"),
        (2, True, b"probe 2"),
        (3, True, b"probe 3"),
    ]
    for i, (*_, received) in enumerate(consumer):
        _expect_same(received, _weights(i + 1))


def _list_mismatch(rank: int, world_size: int, port: int) -> None:
    with connect(gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            session = ProducerSession(rg, buffer_size_bytes=BUFFER)
            named = _weights(1)
            from refit_app.core.meta import TensorMeta

            metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named]
            metas[1] = TensorMeta("norm", (31,), torch.bfloat16)
            session.send(iter(named), metas=metas)
            return
        ConsumerSession(rg).receive(lambda batch: None)


def test_tensors_that_contradict_their_list_fail_the_round_before_corrupting_it():
    producer, consumer = run_ranks(_list_mismatch, 2, timeout=120, return_exceptions=True)
    assert producer.exc_type == SourceError.__name__
    assert "round 1: tensor #1 is 'norm' [32]" in producer.message and "says 'norm' [31]" in producer.message
    assert isinstance(consumer, RankFailure) and "round 1" in consumer.message


def _over_process_group(
    rank: int, world_size: int, port: int, topologies: tuple[str, ...] | None = None, rounds: int = 2
) -> list:
    """``rounds`` verified rounds over the caller's own gloo group; with ``topologies`` (one per rank), each rank's
    result starts with the class of group it got."""
    import torch.distributed as dist

    from refit_app.transport.process_group import from_process_group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        options = {} if topologies is None else {"topology": topologies[rank]}
        with from_process_group(timeout_s=TIMEOUT_S, **options) as rg:
            out = [] if topologies is None else [type(rg.group).__name__]
            if rank == 0:
                with ProducerSession(rg, buffer_size_bytes=BUFFER) as session:
                    for i in range(rounds):
                        session.send(_weights(i + 1))
                return out
            session = ConsumerSession(rg, verify=True)
            while (r := session.receive(lambda batch: None)) is not None:
                out.append((r.round, r.verified))
            return out
    finally:
        dist.destroy_process_group()


def test_a_session_runs_over_the_callers_own_process_group():
    _, first, second = run_ranks(_over_process_group, 3, timeout=120)
    assert first == second == [(1, True), (2, True)]


def test_sessions_refuse_the_wrong_rank():
    class Fake:
        rank = 1
        world_size = 2

        class group:
            device = torch.device("cpu")

    with pytest.raises(ValueError, match="a ProducerSession runs on rank 0"):
        ProducerSession(Fake())  # type: ignore[arg-type]


def test_errors_keep_their_type_and_gain_the_round():
    from refit_app.protocol.rounds import with_round as _with_round

    assert str(_with_round(3, SourceError("bad"))) == "round 3: bad"
    assert isinstance(_with_round(3, SourceError("bad")), SourceError)
    peer = PeerError("rank 2 failed: round 3: x")
    assert _with_round(3, peer) is peer
    assert isinstance(_with_round(1, RefitError("round 1: y")), RefitError)


def _over_a_subgroup(rank: int, world_size: int, port: int) -> list:
    """Ranks 0, 2 and 3 of a world of 4 refit over a subgroup of theirs; rank 1 is busy with something else."""
    import torch.distributed as dist

    from refit_app.transport.process_group import from_process_group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        sub = dist.new_group([0, 2, 3])  # every rank takes part in creating it
        if rank == 1:
            return []
        with from_process_group(sub, timeout_s=TIMEOUT_S) as rg:
            if dist.get_rank(sub) == 0:
                with ProducerSession(rg, buffer_size_bytes=BUFFER) as session:
                    session.send(_weights(1))
                    session.send(_weights(2))
                return [rg.rank]
            session = ConsumerSession(rg, verify=True)
            received: dict[str, tuple] = {}
            rounds = []
            while (r := session.receive(_keep(received))) is not None:
                rounds.append(r.round)
            _expect_same(received, _weights(2))
            return [rg.rank, *rounds]
    finally:
        dist.destroy_process_group()


def test_a_session_runs_over_a_subgroup_with_group_ranks():
    assert run_ranks(_over_a_subgroup, 4, timeout=120) == [[0], [], [1, 1, 2], [2, 1, 2]]


def test_the_callers_process_group_relays_along_a_chain():
    """topology='chain' over the caller's gloo group: each consumer forwards to the next, every round verified."""
    got = run_ranks(_over_process_group, 4, ("chain",) * 4, 3, timeout=120)
    assert got[0] == ["ChainBroadcastGroup"]
    assert got[1:] == [["ChainBroadcastGroup", (1, True), (2, True), (3, True)]] * 3


def test_ranks_that_disagree_on_the_topology_all_refuse():
    # Refused as soon as the ranks compare topologies, never at a deadline: the limit, which counts from the moment
    # every rank has started up, is the ranks' own TIMEOUT_S, so a rank that waited out its deadline (or hung)
    # shows up as a "Timeout" failure instead of the ConfigError.
    results = run_ranks(_over_process_group, 3, ("chain", "chain", "tree"), timeout=TIMEOUT_S, return_exceptions=True)
    for r in results:
        assert isinstance(r, RankFailure) and r.exc_type == "ConfigError", r
        assert "topology differs between ranks (rank 0 'chain', rank 1 'chain', rank 2 'tree')" in r.message


def test_an_unknown_topology_is_refused_before_anything_else():
    from refit_app.transport.process_group import from_process_group

    with pytest.raises(ValueError, match="topology='nope' is invalid: choose one of tree, chain"):
        from_process_group(topology="nope")
