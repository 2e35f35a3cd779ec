"""Sharded refits from a real sharded trainer: K producer processes train a model under FSDP2's ``fully_shard``
(gloo on CPU, uneven shards) with AdamW steps between rounds, and send their own shards straight to M
tensor-parallel consumers (column- and row-parallel slices, whole norms), bit for bit against the trainer's full
tensors sliced. And a wrong layout on any one rank: every rank fails in one line before any data byte."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from mp_utils import init_gloo, run_ranks

from refit_app.common.errors import HandshakeError
from refit_app.protocol.sharded import (
    COLUMN,
    ROW,
    WHOLE,
    agree,
    allocate,
    expected_of,
    from_tensors,
    receive,
    send,
    tp_needs,
)

TIMEOUT_S = 30.0
ROUNDS = 3


class Block(torch.nn.Module):
    """A transformer MLP's shape: an up projection (column-parallel), a down projection (row-parallel), a norm."""

    def __init__(self, hidden: int = 8, inner: int = 33) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, inner)
        self.down = torch.nn.Linear(inner, hidden - 3)
        self.norm = torch.nn.LayerNorm(inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(torch.relu(self.up(x))))


def rule(name: str):
    return COLUMN if name.startswith("up.") else ROW if name.startswith("down.") else WHOLE


def _rank(rank: int, world_size: int, port: int, k: int, wrong: int | None):
    init_gloo(rank, world_size, port, timeout_s=TIMEOUT_S)
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh("cpu", list(range(k)))  # every rank takes part in making the trainer's group
        torch.manual_seed(0)
        model = Block(inner=34 if rank == wrong else 33)  # the wrong rank's engine (or trainer) is another shape
        m = world_size - k
        if rank < k:
            fully_shard(model, mesh=mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            specs, shards = from_tensors(model.named_parameters(), rank=rank)
            start = time.monotonic()
            try:
                plan = agree(dist.group.WORLD, rank, specs=specs, buffer_size_bytes=256)
            except HandshakeError as e:
                return ("refused", str(e), start, time.monotonic())
            fulls = []
            for _ in range(ROUNDS):
                send(dist.group.WORLD, rank, plan, shards)
                fulls.append(
                    {n: p.full_tensor().detach().numpy().copy() for n, p in model.named_parameters()}
                )  # pickles
                loss = model(torch.randn(4, 8)).square().sum()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            return ("trained", fulls)
        expects = expected_of(model.named_parameters())
        needs = tp_needs(expects, rank, rank - k, m, rule)
        start = time.monotonic()
        try:
            plan = agree(dist.group.WORLD, rank, needs=needs, expects=expects, buffer_size_bytes=256)
        except HandshakeError as e:
            return ("refused", str(e), start, time.monotonic())
        rounds = []
        for _ in range(ROUNDS):
            slices = allocate(expects, needs)
            receive(dist.group.WORLD, rank, plan, slices)
            rounds.append({n: (h.tensor.numpy().copy(), h.box) for n, h in slices.items()})
        return ("received", rounds)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("k, m", [(3, 2), (2, 3)])
def test_an_fsdp2_trainer_sends_each_tensor_parallel_rank_its_slices_every_round(k, m):
    results = run_ranks(_rank, k + m, k, None, timeout=180)
    assert [r[0] for r in results] == ["trained"] * k + ["received"] * m, [r[0] for r in results]
    fulls = results[0][1]
    for r in range(1, k):
        for a, b in zip(fulls, results[r][1]):
            assert all((a[n] == b[n]).all() for n in a)
    for round_, full in enumerate(fulls):
        if round_:
            assert not (full["up.weight"] == fulls[round_ - 1]["up.weight"]).all(), "the trainer did not train"
        for c in range(m):
            got = results[k + c][1][round_]
            assert set(got) == set(full)
            for name, (array, box) in got.items():
                want = full[name][tuple(slice(a, b) for a, b in box)]
                assert array.shape == want.shape and array.tobytes() == want.tobytes(), (round_, c, name)
            # column-parallel: its rows; row-parallel: its columns; the rest whole
            step = -(-33 // m)
            assert got["up.weight"][1] == ((min(c * step, 33), min((c + 1) * step, 33)), (0, 8))
            assert got["down.weight"][1] == ((0, 5), (min(c * step, 33), min((c + 1) * step, 33)))
            assert got["norm.weight"][1] == ((0, 33),) and got["down.bias"][1] == ((0, 5),)


@pytest.mark.parametrize("wrong", [1, 3])  # a producer, a consumer
def test_a_wrong_layout_on_one_rank_stops_every_rank_in_one_line_before_any_data(wrong):
    results = run_ranks(_rank, 4, 2, wrong, timeout=60)
    assert [r[0] for r in results] == ["refused"] * 4, results
    lines = {r[1] for r in results}
    assert len(lines) == 1, lines  # the same words everywhere
    (line,) = lines
    assert "\n" not in line and "34" in line and "33" in line, line
    # From the moment the last rank offered its layout (one clock: CLOCK_MONOTONIC is the machine's) to the last
    # refusal; before it, the ranks wait for each other (a trainer's start-up on a loaded machine is seconds).
    last_offer = max(r[2] for r in results)
    assert max(r[3] for r in results) - last_offer < 5.0, [r[3] - last_offer for r in results]


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sharded_fsdp.py"


def test_the_sharded_example_runs_and_the_docs_show_the_file_itself(cli):
    page = EXAMPLE.parent.parent / "docs" / "sharded.md"
    assert EXAMPLE.read_text().strip() in page.read_text()
    result = cli.script(EXAMPLE)
    assert result.returncode == 0, result.describe()
    assert "every engine rank holds exactly its slices of the trainer's last weights: True" in result.stdout
    assert result.stdout.count("received") == 6, result.describe()


def _mistake_rank(rank: int, world_size: int, port: int, mistake: str):
    """Two producers with declared row shards, two tensor-parallel consumers; ``mistake`` is one user's error."""
    from refit_app.common.errors import PeerError
    from refit_app.core.reshard.plan import Layout, LayoutError, Shard
    from refit_app.protocol.sharded import Declared, Expected

    init_gloo(rank, world_size, port, timeout_s=20)
    try:
        full = torch.arange(11 * 6, dtype=torch.float32).reshape(11, 6)
        layout = Layout.one_dim([0, 1], Shard(0))
        start = time.monotonic()
        try:
            if rank < 2:
                rows = (0, 6) if rank == 0 else (6, 11)
                specs, shards = from_tensors(
                    [("w", Declared(full[rows[0] : rows[1]].clone(), (11, 6), layout))], rank=rank
                )
                plan = agree(dist.group.WORLD, rank, specs=specs, delta=mistake == "modes" and rank == 0)
                return ("sent", send(dist.group.WORLD, rank, plan, shards))
            expects = [Expected("w", "float32", (11, 6))]
            needs = tp_needs(expects, 5 - rank if mistake == "rank" and rank == 2 else rank, rank - 2, 2, rule)
            plan = agree(dist.group.WORLD, rank, needs=needs, expects=expects)
            slices = allocate(expects, needs)
            if mistake == "dtype" and rank == 2:
                slices["w"] = type(slices["w"])(slices["w"].tensor.to(torch.bfloat16), slices["w"].box)
            return ("received", receive(dist.group.WORLD, rank, plan, slices))
        except (HandshakeError, LayoutError, PeerError) as e:
            return (type(e).__name__, str(e), time.monotonic() - start)
    finally:
        dist.destroy_process_group()


def test_a_consumer_giving_another_ranks_needs_or_ranks_in_other_modes_stop_every_rank_in_one_line():
    for mistake, words in [
        ("rank", "rank 2 gave needs for rank 3"),
        ("modes", "ranks 0 and 1 disagree on delta: True and False"),
    ]:
        results = run_ranks(_mistake_rank, 4, mistake, timeout=60)
        assert [r[0] for r in results] == ["HandshakeError"] * 4, results
        assert all(words in r[1] and "\n" not in r[1] for r in results), results


def test_a_slice_of_another_dtype_is_refused_before_any_byte_moves():
    results = run_ranks(_mistake_rank, 4, "dtype", timeout=60)
    assert results[2][:2] == ("LayoutError", "rank 2: tensor 'w' is bfloat16 here, the plan moves it as float32")
    # its producers lose it and say so in one line, within the group's timeout
    assert all(r[0] in ("PeerError", "sent") for r in results[:2]), results
    assert any(r[0] == "PeerError" and "lost rank 2" in r[1] for r in results[:2]), results


def test_a_slice_that_cannot_hold_its_box_is_refused():
    from refit_app.core.reshard.plan import LayoutError
    from refit_app.core.reshard.transfer import Held

    with pytest.raises(LayoutError, match=r"a tensor of shape \[3, 6\] cannot hold the box \[\(0, 6\), \(0, 6\)\]"):
        Held(torch.zeros(3, 6), ((0, 6), (0, 6)))


def _swapped_ranks(rank: int, world_size: int, port: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from refit_app.core.reshard.plan import LayoutError

    init_gloo(rank, world_size, port, timeout_s=20)
    try:
        model = torch.nn.Linear(8, 8)  # even shards: a swap would not show in their shapes
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        try:
            from_tensors(model.named_parameters(), rank=rank, ranks=lambda r: 1 - r)
        except LayoutError as e:
            return str(e)
        return "accepted"
    finally:
        dist.destroy_process_group()


def test_a_dtensor_read_as_another_ranks_shard_is_refused():
    results = run_ranks(_swapped_ranks, 2, timeout=60)
    assert all("which the layout gives to rank" in r and "check rank= and ranks=" in r for r in results), results
