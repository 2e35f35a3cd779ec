"""What a consumer pays to vouch for its delta base by its bytes (``ConsumerSession(check_base=True)``, issue 31).

Two figures, in one run: the time to checksum a model's held tensors (``xxh3_64_16mib`` over :func:`checksum_all`'s
two threads, and over one thread tensor by tensor for comparison), and the steady delta round's time on loopback
gloo with the check on and off, as the producer's ``send()`` sees it (the consumer hashes its tensors before
claiming them and, without the producer's checksums, again as the round's data is in; the producer starts each
round once the consumer is waiting for it, so the check is not hidden behind the producer's work between rounds).
Sessions with the check on and off alternate over one group; each session's first two rounds (dense, then the
first delta) are left out.

    python scripts/delta_base_cost.py                          # 256 MiB and 1 GiB hashed; a 128 MiB model's rounds
    python scripts/delta_base_cost.py --hash-sizes 64MiB --model-size 32MiB --rounds 4   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from refit_app.app import rank_harness
from refit_app.app.rank_harness import free_port
from refit_app.common.sizes import parse_size
from refit_app.protocol.checksum import PIECED, checksum_all, checksum_function
from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.groups import connect
from refit_app.transport.spec import GroupSpec

TENSOR_BYTES = 8 << 20
"""Each model tensor's size: an 8 MiB bf16 matrix, under one hash piece (the case two threads help most)."""


def _model(nbytes: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    count = max(1, nbytes // TENSOR_BYTES)
    return [(f"layer{i}.weight", torch.randn(TENSOR_BYTES // 2, generator=g).to(torch.bfloat16)) for i in range(count)]


def hash_times(sizes: list[int], reps: int) -> list[tuple[int, float, float]]:
    """(bytes, two-thread seconds, one-thread seconds), medians of ``reps``, over views of one buffer."""
    buffer = torch.empty(max(sizes), dtype=torch.uint8).random_().view(torch.bfloat16)  # real pages, not zero ones
    views = [buffer[i : i + TENSOR_BYTES // 2] for i in range(0, buffer.numel(), TENSOR_BYTES // 2)]
    one = checksum_function(PIECED)
    out = []
    for size in sizes:
        held = [v.view(torch.uint8).numpy() for v in views[: size // TENSOR_BYTES]]
        both, single = [], []
        for _ in range(reps):
            started = time.perf_counter()
            checksum_all(PIECED, held)
            both.append(time.perf_counter() - started)
            started = time.perf_counter()
            [one(b) for b in held]
            single.append(time.perf_counter() - started)
        out.append((size, statistics.median(both), statistics.median(single)))
    return out


def _rounds(rank: int, world_size: int, port: int, model_bytes: int, rounds: int, blocks: int, verify: bool):
    spec = GroupSpec(backend="gloo", port=port, world_size=world_size, rank=rank, timeout_s=120)
    times: dict[bool, list[float]] = {True: [], False: []}
    with connect(spec) as rg:
        model = _model(model_bytes)
        g = torch.Generator().manual_seed(1)
        for block in range(blocks):
            check = block % 2 == 0
            if rank == 0:
                with ProducerSession(rg, delta="on") as session:
                    for k in range(1, rounds + 1):
                        for _, t in model:  # 1% of the elements change by one bit, outside the timing
                            flat = t.view(torch.int16)
                            idx = torch.randint(0, flat.numel(), (flat.numel() // 100,), generator=g)
                            flat[idx] ^= 1
                        rg.group.broadcast(torch.ones(1), 0)  # ready: the consumer's check is then inside the time
                        started = time.perf_counter()
                        r = session.send(model)
                        if k > 2:
                            assert r.base_round == k - 1, (k, r.base_round)
                            times[check].append(time.perf_counter() - started)
            else:
                targets = {n: torch.empty_like(t) for n, t in model}
                session = ConsumerSession(rg, verify=verify, check_base=check)
                for _ in range(rounds):
                    rg.group.broadcast(torch.zeros(1), 0)
                    session.receive(targets=targets)
                assert session.receive(targets=targets) is None
    return times


def round_times(model_bytes: int, rounds: int, blocks: int, verify: bool) -> dict[bool, list[float]]:
    outcomes = rank_harness.run_ranks(
        _rounds, 2, (2, free_port(), model_bytes, rounds, blocks, verify), timeout_s=600, startup_s=180
    )
    for o in outcomes:
        if not o.ok:
            raise SystemExit(f"rank {o.rank} failed: {o.exc or o.error}\n{o.traceback}")
    return outcomes[0].value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hash-sizes", nargs="+", default=["256MiB", "1GiB"])
    parser.add_argument("--model-size", default="128MiB")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per session (the first two left out)")
    parser.add_argument("--blocks", type=int, default=4, help="sessions, alternating check on and off")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--verify", action="store_true", help="consumer verifies (the check reuses its checksums)")
    args = parser.parse_args()
    for size, both, single in hash_times([parse_size(s) for s in args.hash_sizes], args.reps):
        print(
            f"checksum {size / 2**20:.0f} MiB of bf16 ({size // TENSOR_BYTES} x 8 MiB): {both:.3f} s on two threads "
            f"({size / both / 1e9:.1f} GB/s), {single:.3f} s on one"
        )
    times = round_times(parse_size(args.model_size), args.rounds, args.blocks, args.verify)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"steady delta round, {args.model_size} model, 1% changed, verify={args.verify}: check on {on:.3f} s, "
        f"off {off:.3f} s, on/off {on / off:.2f} ({len(times[True])} and {len(times[False])} rounds)"
    )


if __name__ == "__main__":
    main()
