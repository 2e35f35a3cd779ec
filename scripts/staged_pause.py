"""How long an engine stops per refit: a staged round's pause (:meth:`StagedRound.apply`) against a plain ``receive``
into the same tensors (which an engine has to stop for from start to end), in one run over loopback gloo.

Two ranks, one group; four sessions in turn: dense rounds (``delta="off"``) received plainly, then staged and
applied; delta rounds (``delta="on"``, 1% of the elements changed by one bit before each round, outside the timing)
received plainly, then staged and applied (each delta session's first, dense, round left out). The consumer
verifies every round (``--no-verify``: not). The producer changes its model only once the consumer is done with the
last round, and the consumer starts the clock once the producer is ready to send, so neither side's work between
rounds lands in the other's figures. Prints medians and the pause / receive ratio.

    python scripts/staged_pause.py                       # a 200 MB model (25 x 8 MiB bf16), 6 rounds a session
    python scripts/staged_pause.py --model-size 32MiB --rounds 3     # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from refit_app.app import rank_harness
from refit_app.app.rank_harness import free_port
from refit_app.common.sizes import parse_size
from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.groups import connect
from refit_app.transport.spec import GroupSpec

TENSOR_BYTES = 8 << 20
SESSIONS = (("off", False), ("off", True), ("on", False), ("on", True))
"""(the producer's ``delta``, whether the consumer stages), in the order they run."""


def _model(nbytes: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    count = max(1, nbytes // TENSOR_BYTES)
    return [(f"layer{i}.weight", torch.randn(TENSOR_BYTES // 2, generator=g).to(torch.bfloat16)) for i in range(count)]


def _change(model: list[tuple[str, torch.Tensor]], g: torch.Generator) -> None:
    for _, t in model:
        flat = t.view(torch.int16)
        flat[torch.randint(0, flat.numel(), (flat.numel() // 100,), generator=g)] ^= 1


def _rank(rank: int, world_size: int, port: int, model_bytes: int, rounds: int, verify: bool) -> dict:
    spec = GroupSpec(backend="gloo", port=port, world_size=world_size, rank=rank, timeout_s=120)
    out: dict[str, list] = {}
    with connect(spec) as rg:
        model = _model(model_bytes)
        g = torch.Generator().manual_seed(1)
        targets = {n: torch.empty_like(t) for n, t in model}
        for delta, staged in SESSIONS:
            key = f"{'delta' if delta == 'on' else 'dense'} {'staged' if staged else 'receive'}"
            rows = out.setdefault(key, [])
            if rank == 0:
                with ProducerSession(rg, delta=delta) as session:
                    for _ in range(rounds):
                        rg.group.broadcast(torch.ones(1), 1)  # the consumer is done with the last round
                        _change(model, g)
                        rg.group.broadcast(torch.ones(1), 0)  # go: the consumer's wait is no round's time
                        session.send(model)
                continue
            session = ConsumerSession(rg, verify=verify)
            for k in range(1, rounds + 1):
                rg.group.broadcast(torch.zeros(1), 1)
                rg.group.broadcast(torch.zeros(1), 0)
                started = time.perf_counter()
                if staged:
                    metrics = session.stage(targets).apply()
                    row = (metrics["base_round"], metrics["pause_seconds"], metrics["stage_seconds"])
                else:
                    r = session.receive(targets=targets)
                    row = (r.base_round, time.perf_counter() - started, 0.0)
                if delta == "off" or k > 1:
                    rows.append(row)
            assert session.receive(targets=targets) is None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="200MB")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per session")
    parser.add_argument("--no-verify", dest="verify", action="store_false")
    args = parser.parse_args()
    model_bytes = parse_size(args.model_size)
    outcomes = rank_harness.run_ranks(
        _rank, 2, (2, free_port(), model_bytes, args.rounds, args.verify), timeout_s=600, startup_s=180
    )
    for o in outcomes:
        if not o.ok:
            raise SystemExit(f"rank {o.rank} failed: {o.exc or o.error}\n{o.traceback}")
    rows = outcomes[1].value
    size = max(1, model_bytes // TENSOR_BYTES) * TENSOR_BYTES
    print(f"model {size / 1e6:.0f} MB ({size // TENSOR_BYTES} x 8 MiB bf16), verify={args.verify}, loopback gloo")
    for kind in ("dense", "delta"):
        plain = statistics.median(s for _, s, _ in rows[f"{kind} receive"])
        staged = rows[f"{kind} staged"]
        pause = statistics.median(s for _, s, _ in staged)
        stage = statistics.median(s for _, _, s in staged)
        assert all(bool(b) == (kind == "delta") for b, _, _ in rows[f"{kind} receive"] + staged), rows
        print(
            f"{kind} rounds: plain receive {plain:.3f} s (the engine stopped throughout); staged: stage {stage:.3f} s "
            f"beside the engine, pause {pause:.4f} s; pause / receive {pause / plain:.3f} ({len(staged)} rounds)"
        )


if __name__ == "__main__":
    main()
