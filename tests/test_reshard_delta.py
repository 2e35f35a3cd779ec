"""Delta rounds of a sharded refit over real gloo groups: K producers change a few elements of their own shards
between rounds and send each consumer only those, bit for bit; a consumer whose pieces were written since (through
``.data``, which torch's version counter does not see) has them sent again whole in the same round, never wrong."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mp_utils import init_gloo, run_ranks

from refit_app.core.reshard.delta import ConsumerBases, ProducerDeltas, receive_delta
from refit_app.core.reshard.plan import Layout, Need, Replicate, Shard, TensorSpec, held_boxes, plan, shard_box, whole
from refit_app.core.reshard.transfer import Held
from refit_app.protocol.sharded import ShardedPlan, receive, send
from refit_app.transport.pairs import TorchPairs

ROUNDS = 5
SHAPES = [(33, 17), (5, 40), (7,), (), (130, 3), (64, 64)]
DTYPES = [torch.bfloat16, torch.float32, torch.int8, torch.float16, torch.bfloat16, torch.float32]


def _specs(k: int) -> list[TensorSpec]:
    return [
        TensorSpec(
            f"t{i}",
            str(dt).removeprefix("torch."),
            s,
            dt.itemsize,
            Layout.one_dim(list(range(k)), Shard(0) if s else Replicate()),
        )
        for i, (s, dt) in enumerate(zip(SHAPES, DTYPES))
    ]


def _full(i: int, round_: int) -> torch.Tensor:
    """Tensor ``i`` as of ``round_``: round 1's values with a few elements changed every round since."""
    g = torch.Generator().manual_seed(i)
    t = (torch.randn(SHAPES[i], generator=g) * 50).to(DTYPES[i])
    flat = t.reshape(-1)
    for _ in range(2, round_ + 1):
        if flat.numel():
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
            flat[idx] = (torch.randn(idx.numel(), generator=g) * 50).to(DTYPES[i])
    return t


def _rank(
    rank: int,
    world_size: int,
    port: int,
    k: int,
    scribble_round: int,
    d: int = 1,
    scribbler: int = -1,
    threads: int | None = None,
):
    """Producers ``0..k-1`` and ``d`` replicas of ``m`` tensor-parallel consumers (chained where ``d`` > 1);
    consumer ``scribbler`` (default: the last rank) writes over its slice of t5 before round ``scribble_round``;
    the consumers apply and hash their pairs on ``threads`` threads (None: the default)."""
    init_gloo(rank, world_size, port, timeout_s=30)
    try:
        m = (world_size - k) // d
        specs = _specs(k)
        needs = [
            Need(k + r * m + c, s.name, shard_box(s.shape, i % 2 % len(s.shape), m, c) if s.shape else whole(s.shape))
            for r in range(d)
            for c in range(m)
            for i, s in enumerate(specs)
        ]
        chains = [[k + r * m + c for r in range(d)] for c in range(m)] if d > 1 else []
        agreed = ShardedPlan(plan(specs, needs, chains=chains), 1024, None, True, "")  # what agree() gives every rank
        options = {"num_buffers": 2}
        out = []
        if rank < k:
            state = ProducerDeltas()
            local = {}
            for round_ in range(1, ROUNDS + 1):
                for i, s in enumerate(specs):  # the trainer's step: its shards change in place
                    box = held_boxes(s)[rank]
                    fresh = Held(_full(i, round_), whole(s.shape)).region(box)
                    if s.name in local:
                        local[s.name].tensor.copy_(fresh)
                    else:
                        local[s.name] = Held(fresh.clone(), box)
                out.append(send(dist.group.WORLD, rank, agreed, local, delta=state, **options))
            return out
        bases = ConsumerBases()
        mine = [n for n in needs if n.rank == rank]
        slices = {
            n.name: Held(torch.zeros([b - a for a, b in n.box], dtype=DTYPES[int(n.name[1:])]), n.box) for n in mine
        }
        for round_ in range(1, ROUNDS + 1):
            if round_ == scribble_round and rank == (scribbler if scribbler >= 0 else world_size - 1):
                # an engine's load wrote its weights behind torch's back
                slices["t5"].tensor.data.copy_(torch.full_like(slices["t5"].tensor, 7.0))
            if threads is None:
                got = receive(dist.group.WORLD, rank, agreed, slices, bases=bases, **options)
            else:
                pairs = TorchPairs(rank, dist.group.WORLD)
                got = receive_delta(
                    pairs, agreed.transfers, slices, bases, buffer_size_bytes=1024, threads=threads, **options
                )
            exact = all(
                torch.equal(h.tensor, Held(_full(int(name[1:]), round_), whole(SHAPES[int(name[1:])])).region(h.box))
                for name, h in slices.items()
            )
            out.append((got, exact, bases.repaired))
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("k, m", [(2, 1), (3, 2), (1, 2)])
def test_delta_rounds_send_the_changes_and_every_consumer_ends_exact(k, m):
    results = run_ranks(_rank, k + m, k, 0, timeout=120)
    for consumer in results[k:]:
        assert all(exact for _, exact, _ in consumer), consumer
        first, later = consumer[0][0], [got for got, _, _ in consumer[1:]]
        assert all(got < first / 3 for got in later), consumer  # about 2% of the elements change a round
        assert [repaired for _, _, repaired in consumer[1:]] == [0] * (ROUNDS - 1), consumer


def test_a_consumer_whose_pieces_were_written_since_has_them_sent_whole_not_wrong():
    results = run_ranks(_rank, 3, 2, 3, timeout=120)
    consumer = results[2]
    assert all(exact for _, exact, _ in consumer), consumer
    sizes = [got for got, _, _ in consumer]
    assert sizes[2] > 3 * max(sizes[1], sizes[3]), sizes  # round 3: t5's pieces went again, whole
    # round 3: every piece of t5 (64 x 64 float32 in 1 KiB pieces: 16), from both producers
    assert [repaired for _, _, repaired in consumer[1:]] == [0, 16, 0, 0], consumer


@pytest.mark.parametrize("scribbler", [3, 4])
def test_replica_chains_relay_delta_rounds_and_a_replica_written_since_is_repaired_by_the_one_before(scribbler):
    k, m, d = 2, 1, 3  # one chain: consumer 2 gets its pieces from the producers, 3 from 2, 4 from 3
    world = k + m * d
    results = run_ranks(_rank, world, k, 3, d, scribbler, timeout=120)
    for rank in range(k, world):
        consumer = results[rank]
        assert all(exact for _, exact, _ in consumer), (rank, consumer)
        first, later = consumer[0][0], [got for got, _, _ in consumer[1:]]
        repaired = [n for _, _, n in consumer[1:]]
        if rank == scribbler:  # round 3: every piece of t5 again, whole, from the replica before it
            assert repaired == [0, 16, 0, 0] and later[1] > 3 * max(later[0], later[2]), (rank, consumer)
        else:
            assert repaired == [0] * (ROUNDS - 1) and all(got < first / 3 for got in later), (rank, consumer)


def test_the_consumers_threads_change_nothing_it_receives_or_repairs():
    # Three producers: the consumer applies and hashes three pairs at once on three threads, or one after the other
    # on one; a base written since (t5, round 3) is caught either way. The same bytes arrive, the same pieces go again.
    k = 3
    one, three = (run_ranks(_rank, k + 1, k, 3, 1, -1, threads, timeout=120)[k] for threads in (1, 3))
    assert all(exact for _, exact, _ in one) and all(exact for _, exact, _ in three), (one, three)
    assert one == three, (one, three)
    repaired = [n for _, _, n in three[1:]]
    assert repaired[1] > 0 and repaired[:1] + repaired[2:] == [0, 0, 0], (
        three
    )  # round 3: t5's pieces, from all three producers
