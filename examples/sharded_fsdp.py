"""A sharded trainer refits a tensor-parallel engine: two FSDP2 trainer ranks each send their own shards straight to
the two engine ranks that need them, after every optimizer step; no rank ever holds a whole tensor it does not need.

    python examples/sharded_fsdp.py

All four ranks run here as processes of one gloo group: ranks 0-1 train, ranks 2-3 are the engine's tensor-parallel
ranks (column-parallel up projection, row-parallel down projection, the norm whole on both).
"""

import socket
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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

TRAINERS, ENGINE_TP, STEPS = 2, 2, 3


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 257)  # 257 rows: the trainer's shards are uneven (129 + 128)
        self.norm = torch.nn.LayerNorm(257)
        self.down = torch.nn.Linear(257, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(torch.relu(self.up(x))))


def engine_rule(name: str):
    """How the engine's tensor-parallel ranks split each weight (vLLM's column- and row-parallel layers)."""
    return COLUMN if name.startswith("up.") else ROW if name.startswith("down.") else WHOLE


def rank_main(rank: int, port: int, out: Path) -> None:
    world = TRAINERS + ENGINE_TP
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh("cpu", list(range(TRAINERS)))  # the trainer's mesh (every rank takes part in making it)
    torch.manual_seed(0)
    model = MLP()
    if rank < TRAINERS:
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        specs, shards = from_tensors(model.named_parameters(), rank=rank)  # this rank's shards, as they are
        plan = agree(dist.group.WORLD, rank, specs=specs)  # the same plan on every rank; verified rounds by default
        for step in range(STEPS):
            model(torch.randn(32, 64)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            sent = send(dist.group.WORLD, rank, plan, shards)
            print(f"trainer rank {rank}: step {step}, sent {sent} bytes")
        full = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save(full, out / "trainer.pt")
    else:
        tp_rank = rank - TRAINERS
        expects = expected_of(model.named_parameters())  # the engine's own model says dtypes and shapes
        needs = tp_needs(expects, rank, tp_rank, ENGINE_TP, engine_rule)
        plan = agree(dist.group.WORLD, rank, needs=needs, expects=expects)
        slices = allocate(expects, needs)
        for step in range(STEPS):
            received = receive(dist.group.WORLD, rank, plan, slices)  # every region checked where it lands
            print(f"engine rank {tp_rank}: step {step}, received {received} bytes")
        torch.save({name: (h.tensor, h.box) for name, h in slices.items()}, out / f"engine{tp_rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        mp.spawn(rank_main, args=(port, out), nprocs=TRAINERS + ENGINE_TP)
        full = torch.load(out / "trainer.pt")
        exact = all(
            torch.equal(tensor, full[name][tuple(slice(a, b) for a, b in box)])
            for tp_rank in range(ENGINE_TP)
            for name, (tensor, box) in torch.load(out / f"engine{tp_rank}.pt").items()
        )
        print(f"every engine rank holds exactly its slices of the trainer's last weights: {exact}")


if __name__ == "__main__":
    main()
