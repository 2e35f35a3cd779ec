"""A sharded refit's bytes over real gloo groups: K producers that hold only their shards, M consumers (and replica
chains) that each end with exactly their box of every tensor, bit for bit, against the full tensor sliced."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist
from mp_utils import deadline_budget, init_gloo, run_ranks, wait_all_past_init

from refit_app.common.errors import PeerError
from refit_app.core.reshard.plan import Layout, Need, Replicate, Shard, TensorSpec, held_boxes, plan, shard_box, whole
from refit_app.core.reshard.transfer import Held, receive_regions, send_regions
from refit_app.protocol.checksum import checksum_function, default_algorithm
from refit_app.transport.pairs import TorchPairs

TIMEOUT_S = 30.0


def _checksum(verify: bool):
    return checksum_function(default_algorithm()) if verify else None


DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.float16, torch.uint8]


def _full(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor, the same on every rank (the oracle)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return (
        torch.randint(0, 255, shape, generator=g, dtype=torch.uint8).to(dtype)
        if not dtype.is_floating_point
        else (torch.randn(shape, generator=g).to(dtype))
    )


def model(k: int, two_d: bool) -> list[tuple[TensorSpec, torch.dtype]]:
    """Uneven shapes, empty shards, a scalar, replicated tensors; with ``two_d``, a 2 x (k/2) mesh sharding dim 0
    on both axes."""
    ranks = list(range(k))
    shapes = [(33, 17), (5, 40), (7,), (), (3, 2, 9), (1, 64), (130, 3)]
    out = []
    for i, shape in enumerate(shapes):
        dtype = DTYPES[i % len(DTYPES)]
        if not shape:
            layout = Layout.one_dim(ranks, Replicate())
        elif two_d and i % 2 == 0:
            layout = Layout((2, k // 2), tuple(ranks), (Shard(0), Shard(0)))
        elif i % 3 == 2:
            layout = Layout.one_dim(ranks, Replicate())
        else:
            layout = Layout.one_dim(ranks, Shard(i % len(shape)))
        spec = TensorSpec(f"t{i}", str(dtype), shape, dtype.itemsize, layout)
        out.append((spec, dtype))
    return out


def needs_of(specs, k: int, m: int, d: int) -> tuple[list[Need], list[list[int]]]:
    """M tensor-parallel consumers (alternately column- and row-parallel, scalars whole), in D replicas."""
    needs = []
    for r in range(d):
        for c in range(m):
            rank = k + r * m + c
            for i, spec in enumerate(specs):
                box = whole(spec.shape) if not spec.shape else shard_box(spec.shape, i % 2 % len(spec.shape), m, c)
                needs.append(Need(rank, spec.name, box))
    chains = [[k + r * m + c for r in range(d)] for c in range(m)] if d > 1 else []
    return needs, chains


def _rank(
    rank: int, world_size: int, port: int, k: int, m: int, d: int, two_d: bool, buffer: int, nb: int, verify: bool
):
    init_gloo(rank, world_size, port, timeout_s=TIMEOUT_S)
    try:
        typed = model(k, two_d)
        specs = [s for s, _ in typed]
        needs, chains = needs_of(specs, k, m, d)
        transfers = plan(specs, needs, chains=chains)
        group = TorchPairs(rank)
        if rank < k:
            shards = {}
            for spec, dtype in typed:
                box = held_boxes(spec)[rank]
                shards[spec.name] = Held(
                    Held(_full(spec.name, spec.shape, dtype), whole(spec.shape)).region(box).clone(), box
                )
            return (
                "sent",
                send_regions(
                    group, transfers, shards, buffer_size_bytes=buffer, num_buffers=nb, checksum=_checksum(verify)
                ),
            )
        mine = [n for n in needs if n.rank == rank]
        dtypes = dict((s.name, dt) for s, dt in typed)
        slices = {n.name: Held(torch.full([b1 - b0 for b0, b1 in n.box], 7, dtype=dtypes[n.name]), n.box) for n in mine}
        received = receive_regions(
            group, transfers, slices, buffer_size_bytes=buffer, num_buffers=nb, checksum=_checksum(verify)
        )
        bad = []
        for n in mine:
            spec = next(s for s in specs if s.name == n.name)
            want = Held(_full(n.name, spec.shape, dtypes[n.name]), whole(spec.shape)).region(n.box)
            got = slices[n.name].tensor
            if got.shape != want.shape or not torch.equal(
                got.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)
            ):
                bad.append(n.name)
        return ("received", received, bad)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "k, m, d, two_d, buffer, nb, verify",
    [
        (1, 1, 1, False, 64, 2, True),  # today's refit: one producer, one consumer wanting every tensor whole
        (2, 3, 1, False, 256, 2, False),
        (3, 2, 1, False, 100, 1, True),
        (4, 4, 1, True, 512, 3, True),
        (2, 2, 2, False, 128, 2, True),  # replicas: the second gets its regions along the chain
        (5, 1, 3, False, 1 << 20, 2, False),
    ],
)
def test_every_consumer_ends_with_its_box_of_every_tensor_bit_exact(k, m, d, two_d, buffer, nb, verify):
    world = k + m * d
    results = run_ranks(_rank, world, k, m, d, two_d, buffer, nb, verify, timeout=120)
    assert all(r[0] == "sent" for r in results[:k]), results
    assert [r[2] for r in results[k:]] == [[] for _ in range(m * d)], results
    specs = [s for s, _ in model(k, two_d)]
    needs, _chains = needs_of(specs, k, m, d)
    # each producer sent exactly its part of the plan, and nothing twice: the producers together sent what the
    # first replica needs
    first = [n for n in needs if n.rank < k + m]
    need_bytes = sum(
        torch.Size([b1 - b0 for b0, b1 in n.box]).numel() * next(s.itemsize for s in specs if s.name == n.name)
        for n in first
    )
    assert sum(r[1] for r in results[:k]) == need_bytes


class _FlipsOneByte:
    """The producer's real gloo pairs, with one byte of its second data chunk flipped on the way out (after the
    producer hashed it): what a corrupting link or NIC would do."""

    def __init__(self, pairs: TorchPairs) -> None:
        self.rank = pairs.rank
        self._pairs = pairs
        self._data_sends = 0

    def isend(self, tensor: torch.Tensor, dst: int):
        if tensor.dtype == torch.uint8:
            self._data_sends += 1
            if self._data_sends == 2:
                tensor[0] ^= 0xFF
        return self._pairs.isend(tensor, dst)

    def irecv(self, tensor: torch.Tensor, src: int):
        return self._pairs.irecv(tensor, src)


def _corrupted_rank(rank: int, world_size: int, port: int):
    init_gloo(rank, world_size, port, timeout_s=30)
    try:
        specs = [TensorSpec(f"w{i}", "float32", (8, 8), 4, Layout.one_dim([0], Shard(0))) for i in range(8)]
        transfers = plan(specs, [Need(1, s.name, whole(s.shape)) for s in specs])
        options = {"buffer_size_bytes": 512, "num_buffers": 2, "checksum": _checksum(True)}  # two tensors a chunk
        if rank == 0:
            shards = {s.name: Held(_full(s.name, s.shape, torch.float32), whole(s.shape)) for s in specs}
            return send_regions(_FlipsOneByte(TorchPairs(0)), transfers, shards, **options)
        slices = {s.name: Held(torch.empty(8, 8), whole(s.shape)) for s in specs}
        return receive_regions(TorchPairs(1), transfers, slices, **options)
    finally:
        dist.destroy_process_group()


def test_a_region_that_arrives_other_than_it_was_sent_is_named():
    producer, consumer = run_ranks(_corrupted_rank, 2, timeout=60, return_exceptions=True)
    assert producer == 8 * 8 * 8 * 4
    assert consumer.exc_type == "RegionMismatch", consumer
    assert "region [(0, 8), (0, 8)] of tensor 'w2' from rank 0" in consumer.message, consumer.message


def _killed_rank(rank: int, world_size: int, port: int, victim: int, timeout_s: float):
    import os
    import signal

    init_gloo(rank, world_size, port, timeout_s=timeout_s)
    wait_all_past_init(rank, world_size, waiter=victim, timeout_s=timeout_s)
    specs = [TensorSpec(f"w{i}", "float32", (64, 64), 4, Layout.one_dim([0, 1], Shard(0))) for i in range(16)]
    needs = [Need(2 + c, s.name, shard_box(s.shape, 1, 2, c)) for c in range(2) for s in specs]
    transfers = plan(specs, needs)
    options = {"buffer_size_bytes": 4096, "num_buffers": 2}
    pairs = TorchPairs(rank)
    if rank == victim:

        class _DiesAtItsThirdMessage:
            rank = pairs.rank
            calls = 0

            def _maybe_die(self):
                self.calls += 1
                if self.calls == 3:
                    os.kill(os.getpid(), signal.SIGKILL)

            def isend(self, tensor, dst):
                self._maybe_die()
                return pairs.isend(tensor, dst)

            def irecv(self, tensor, src):
                self._maybe_die()
                return pairs.irecv(tensor, src)

        pairs = _DiesAtItsThirdMessage()
    start = time.monotonic()
    try:
        if rank < 2:
            shards = {
                s.name: Held(torch.ones([b - a for a, b in held_boxes(s)[rank]]), held_boxes(s)[rank]) for s in specs
            }
            send_regions(pairs, transfers, shards, **options)
        else:
            slices = {n.name: Held(torch.empty([b - a for a, b in n.box]), n.box) for n in needs if n.rank == rank}
            receive_regions(pairs, transfers, slices, **options)
    except PeerError as e:
        return ("failed", time.monotonic() - start, str(e))
    return ("done", time.monotonic() - start, "")


@pytest.mark.parametrize("victim", [0, 3])  # a producer, a consumer
def test_a_rank_killed_mid_transfer_makes_its_peers_fail_within_the_deadline(victim):
    timeout_s = 6.0
    results = run_ranks(_killed_rank, 4, victim, timeout_s, timeout=60, return_exceptions=True)
    assert results[victim].exc_type == "Died", results[victim]
    peers = [r for rank, r in enumerate(results) if rank != victim]
    # Whoever exchanged bytes with the dead rank fails (a peer that had finished its part before may be done), and
    # nobody waits much past one deadline for it.
    assert any(r[0] == "failed" for r in peers), peers
    assert all(r[1] < deadline_budget(timeout_s) for r in peers), peers
    # Each names the rank it lost: the dead one, or a peer that gave up on it and exited first.
    for r in peers:
        assert r[0] == "done" or (re.search(r"lost rank \d while", r[2]) and "\n" not in r[2]), r
    assert any(f"lost rank {victim} while" in r[2] for r in peers), peers
