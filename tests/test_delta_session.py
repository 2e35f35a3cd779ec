"""Delta rounds over real gloo groups: every round's tensors on every consumer equal the producer's bytes, with
the consumer's own tensors, the session's mirror, the changes handed out, or both (the mirror patched and the
changes handed out with it); the producer's choice of dense and delta rounds; a consumer whose tensors were
written to gets a dense round."""

from __future__ import annotations

import pytest
import torch
from mp_utils import run_ranks

from refit_app.protocol.session import ConsumerSession, ProducerSession, TensorDelta
from refit_app.transport.groups import GroupSpec, connect

TIMEOUT_S = 30.0
BUFFER = 4096


def _spec(rank: int, world_size: int, port: int, topology: str = "tree", backend: str = "gloo") -> GroupSpec:
    return GroupSpec(
        backend=backend, port=port, world_size=world_size, rank=rank, timeout_s=TIMEOUT_S, topology=topology
    )


def _model(round_index: int, shares: list[float]) -> list[tuple[str, torch.Tensor]]:
    """Round 1's weights, then in each later round ``r`` a share ``shares[r - 1]`` of each tensor's elements
    changed (seeded by the round)."""
    g = torch.Generator().manual_seed(0)
    base = [
        ("embed", torch.randn(300, 64, generator=g).to(torch.bfloat16)),
        ("w", torch.randn(77, 33, generator=g)),
        ("f16", torch.randn(129, generator=g).to(torch.float16)),
        ("i8", torch.randint(-128, 127, (1001,), generator=g, dtype=torch.int8)),
        ("i64", torch.randint(-(2**62), 2**62, (50,), generator=g, dtype=torch.int64)),
        ("mask", torch.rand(333, generator=g) > 0.5),
        ("scalar", torch.tensor(1.5, dtype=torch.float64)),
        ("empty", torch.empty(0, 3)),
        ("fp8", torch.randn(257, generator=g).to(torch.float8_e4m3fn)),
    ]
    for r in range(2, round_index + 1):
        share = shares[r - 1]
        gr = torch.Generator().manual_seed(r)
        for _, t in base:
            if t.numel() == 0:
                continue
            flat = t.view(-1).view(torch.uint8)
            n = max(1, int(t.numel() * share)) if share > 0 else 0
            idx = torch.randperm(t.numel(), generator=gr)[:n]
            item = t.element_size()
            b = flat.view(-1, item) if item > 1 else flat.view(-1, 1)
            # Flip one bit of each chosen element (a bool flips between 0 and 1).
            if t.dtype == torch.bool:
                b[idx, 0] ^= 1
            else:
                b[idx, 0] ^= 0x10
    return base


def _plain(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    return str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _delta_rounds(
    rank: int,
    world_size: int,
    port: int,
    mode: str,
    shares: list[float],
    kind: str,
    topology: str = "tree",
    backend: str = "gloo",
) -> list:
    with connect(_spec(rank, world_size, port, topology, backend)) as rg:
        if rank == 0:
            out = []
            with ProducerSession(rg, buffer_size_bytes=BUFFER, delta=mode) as session:
                for k in range(1, len(shares) + 1):
                    r = session.send(_model(k, shares))
                    out.append((r.round, r.base_round, r.wire_bytes, r.changed_elements, dict(r.encodings)))
            return out
        session = ConsumerSession(
            rg,
            verify=kind != "deltas",
            mirror=kind in ("mirror", "mirror+deltas"),
            accept_deltas=kind in ("deltas", "mirror+deltas"),
        )
        held: dict[str, torch.Tensor] = {}
        handed: list[str] = []
        targets = None
        if kind == "targets":
            targets = {n: torch.zeros_like(t) for n, t in _model(1, shares)}
        out = []
        while True:

            def take(batch):
                for name, t in batch:
                    handed.append(name)
                    if isinstance(t, TensorDelta):
                        t.apply_to(held[name])
                        if kind == "mirror+deltas":
                            # The copy it carries is patched already: the change is in it.
                            assert _plain(t.mirror[name]) == _plain(held[name]), name
                    elif kind in ("deltas", "mirror+deltas"):
                        held[name] = t.clone()

            handed.clear()
            r = session.receive(take, targets=targets)
            if r is None:
                return out
            if kind == "mirror+deltas" and r.base_round:
                # Only the changed tensors are handed out, and the copy holds the whole model.
                assert len(handed) == sum(r.encodings.values()), (handed, r.encodings)
                mirror = session._delta.views
                assert {n: _plain(mirror[n]) for n in mirror} == {n: _plain(t) for n, t in held.items()}
            if kind == "mirror":
                state = {m.name: session._delta.image.view(i) for i, m in enumerate(session.manifest.tensors)}
            else:
                state = targets if kind == "targets" else held
            out.append((r.round, r.base_round, r.verified, {n: _plain(t) for n, t in state.items()}))


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@pytest.mark.parametrize("kind", ["targets", "mirror", "deltas", "mirror+deltas"])
def test_every_round_equals_the_producers_bytes(kind, backend):
    shares = [0, 0.01, 0.0, 0.3, 1.0, 0.001]
    results = run_ranks(_delta_rounds, 2, "on", shares, kind, "tree", backend, timeout=240)
    producer, consumer = results
    for (k, base, _wire, _changed, _enc), (k2, base2, verified, state) in zip(producer, consumer):
        assert k == k2 and base == base2
        expect = {n: _plain(t) for n, t in _model(k, shares)}
        assert state == expect, f"round {k}"
        if kind != "deltas":
            assert verified is True
        assert base == (0 if k == 1 else k - 1)
    # Round 3 changed nothing: only the stream's end went over the wire.
    assert producer[2][3] == 0 and producer[2][2] < 200


def test_chain_and_three_consumers():
    shares = [0, 0.01, 0.05]
    results = run_ranks(_delta_rounds, 4, "on", shares, "mirror", "chain", timeout=240)
    for consumer in results[1:]:
        for k, _base, verified, state in consumer:
            assert state == {n: _plain(t) for n, t in _model(k, shares)}
            assert verified is True


def _fallbacks(rank: int, world_size: int, port: int, shares: list[float]) -> list:
    """Round 3: consumer 1 writes into its targets first; consumer 2 keeps nothing and accepts no deltas."""
    with connect(_spec(rank, world_size, port)) as rg:
        if rank == 0:
            out = []
            with ProducerSession(rg, buffer_size_bytes=BUFFER, delta="on") as session:
                for k in range(1, len(shares) + 1):
                    r = session.send(_model(k, shares))
                    out.append((r.round, r.base_round))
            return out
        if rank == 2:
            session = ConsumerSession(rg, verify=True)
            out = []
            while (r := session.receive(lambda b: None)) is not None:
                out.append((r.round, r.base_round, r.verified))
            return out
        session = ConsumerSession(rg, verify=True)
        targets = {n: torch.zeros_like(t) for n, t in _model(1, shares)}
        out = []
        while True:
            if session.rounds == 2:
                targets["w"].add_(1.0)  # in place: the next round cannot be a delta against these bytes
            r = session.receive(targets=targets)
            if r is None:
                return out
            out.append((r.round, r.base_round, r.verified, {n: _plain(t) for n, t in targets.items()}))


def test_a_consumer_that_cannot_vouch_for_its_tensors_gets_a_dense_round():
    shares = [0, 0.01, 0.01, 0.01]
    producer, changed, keeper = run_ranks(_fallbacks, 3, shares, timeout=240)
    # Round 2: consumer 2 keeps nothing, so every round is dense for everyone.
    assert [b for _, b in producer] == [0, 0, 0, 0]
    assert [v for _, _, v in keeper] == [True] * 4
    for k, _base, verified, state in changed:
        assert verified is True and state == {n: _plain(t) for n, t in _model(k, shares)}


def _two_consumers_one_writes(rank: int, world_size: int, port: int, shares: list[float]) -> list:
    with connect(_spec(rank, world_size, port)) as rg:
        if rank == 0:
            with ProducerSession(rg, buffer_size_bytes=BUFFER, delta="on") as session:
                return [session.send(_model(k, shares)).base_round for k in range(1, len(shares) + 1)]
        session = ConsumerSession(rg, verify=True)
        targets = {n: torch.zeros_like(t) for n, t in _model(1, shares)}
        bases = []
        while True:
            if rank == 1 and session.rounds == 2:
                targets["w"].add_(1.0)
            r = session.receive(targets=targets)
            if r is None:
                return bases
            assert {n: _plain(t) for n, t in targets.items()} == {n: _plain(t) for n, t in _model(r.round, shares)}
            bases.append(r.base_round)


def test_written_targets_turn_the_next_round_dense_and_then_deltas_resume():
    shares = [0, 0.01, 0.01, 0.01]
    producer, *consumers = run_ranks(_two_consumers_one_writes, 3, shares, timeout=240)
    assert producer == [0, 1, 0, 3]
    assert consumers == [producer, producer]


def _mismatched_base(rank: int, world_size: int, port: int) -> str:
    shares = [0, 0.01, 0.01]
    with connect(_spec(rank, world_size, port)) as rg:
        if rank == 0:
            with ProducerSession(rg, buffer_size_bytes=BUFFER, delta="on") as session:
                for k in range(1, 4):
                    session.send(_model(k, shares))
            return "done"
        session = ConsumerSession(rg, mirror=True)
        session.receive()
        session.receive()
        # This consumer's copy goes stale without its knowing (as if it missed round 2) but it claims round 2.
        session._delta.held_round = 1
        session._held = lambda given: 2  # type: ignore[method-assign]
        session.receive()
        return "applied"


def test_a_consumer_whose_base_differs_never_applies_a_delta():
    from mp_utils import RankFailure

    results = run_ranks(_mismatched_base, 2, timeout=120, return_exceptions=True)
    failure = results[1]
    assert isinstance(failure, RankFailure)
    assert "round 3 as changes to round 2, but this consumer holds round 1" in failure.message
    assert isinstance(results[0], RankFailure) and "round 3" in results[0].message


def _auto_rounds(rank: int, world_size: int, port: int, shares: list[float]) -> list:
    """``auto`` over rounds whose changes thin out: the producer's round kinds; each consumer's tensors (rank 1:
    its mirror, taken from the batches, which a plain round hands out from the receive buffers; rank 2: targets)."""
    with connect(_spec(rank, world_size, port)) as rg:
        if rank == 0:
            with ProducerSession(rg, buffer_size_bytes=BUFFER, delta="auto") as session:
                return [session.send(_model(k, shares)) for k in range(1, len(shares) + 1)]
        targets = {n: torch.zeros_like(t) for n, t in _model(1, shares)} if rank == 2 else None
        session = ConsumerSession(rg, verify=True, mirror=rank == 1)
        out = []
        while True:
            seen: dict[str, tuple] = {}

            def take(batch, seen=seen):
                seen.update((name, _plain(t)) for name, t in batch)

            r = session.receive(take, targets=targets)
            if r is None:
                return out
            state = {n: _plain(t) for n, t in targets.items()} if targets is not None else seen
            out.append((r.round, r.base_round, r.plain, r.verified, state, session._held(targets)))


def test_auto_sends_plain_rounds_while_changes_are_many_and_deltas_once_they_thin_out():
    # Round 2: a delta round (nothing measured yet) whose changes take over half the dense bytes; rounds 3-5 plain
    # (the sample still sees 60% changed, then round 5's 0.1% is half as many as when deltas stopped paying);
    # round 6 dense into the snapshot and the mirror; round 7 a delta round again.
    shares = [0, 0.6, 0.6, 0.6, 0.001, 0.001, 0.001]
    producer, *consumers = run_ranks(_auto_rounds, 3, shares, timeout=240)
    kinds = ["delta" if r.base_round else "plain" if r.plain else "keep" for r in producer]
    assert kinds == ["keep", "delta", "plain", "plain", "plain", "keep", "delta"]
    assert producer[6].base_round == 6
    assert [r.changed_elements is not None for r in producer[2:]] == [True] * 5  # estimated from the sample
    for consumer in consumers:
        for (k, base, plain, verified, state, _held), r in zip(consumer, producer):
            assert (base, plain) == (r.base_round, r.plain), f"round {k}"
            assert verified is True
            assert state == {n: _plain(t) for n, t in _model(k, shares)}, f"round {k}"
    mirror, targets = consumers
    # After a plain round the mirror holds no round the producer could send changes against; targets do.
    assert [h for *_, h in mirror[2:5]] == [0, 0, 0]
    assert [h for *_, h in targets[2:5]] == [3, 4, 5]
