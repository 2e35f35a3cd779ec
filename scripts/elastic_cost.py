#!/usr/bin/env python
"""What ``refit.on_consumer_loss=continue`` costs: a steady round with continue against one with fail, interleaved in
one run over the same processes, and the time from a consumer's SIGKILL to the survivors' next completed round.

    python scripts/elastic_cost.py --size-mib 32 --rounds 20 --repeats 3

One producer and two consumers (gloo on loopback, every consumer verifying) run ``--repeats`` pairs of sessions,
fail and continue alternately, each of ``--rounds`` rounds of the same synthetic model; a steady round is the
producer's wall time of one ``send`` (from the call to every consumer's "done"), rounds after the first. Then a
continue session with a third consumer that SIGKILLs itself mid-transfer in round 3: the figure is from the kill to
the end of the producer's ``send`` of round 3, sent again to the two survivors, with ``--timeout-s`` as
``group.timeout_s``. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from refit_app.app import rank_harness
from refit_app.app.rank_harness import free_port
from refit_app.protocol.elastic import ElasticConsumerSession, ElasticProducerSession
from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.groups import connect
from refit_app.transport.spec import GroupSpec

TOKEN = "elastic-cost-token-0123456789abcdef"
KILLED_IN = 3


def _model(size_mib: int, k: int) -> list[tuple[str, torch.Tensor]]:
    per = size_mib * (1 << 20) // 4 // 8
    return [(f"t{i}", torch.full((per,), float(k * 10 + i))) for i in range(8)]


def _spec(rank: int, world: int, port: int, timeout_s: float) -> GroupSpec:
    return GroupSpec(backend="gloo", port=port, world_size=world, rank=rank, timeout_s=timeout_s, token=TOKEN)


def _rank(
    rank: int, plan: list[tuple[str, int]], kill_port: int, args: argparse.Namespace, killed_at, steady_done
) -> object:
    torch.set_num_threads(1)
    steady: dict[str, list[float]] = {"fail": [], "continue": []}
    for mode, port in plan:
        if rank == 3:
            continue  # the third consumer only takes part in the kill
        spec = _spec(rank, 3, port, args.timeout_s)
        if rank == 0:
            times = []
            if mode == "fail":
                with connect(spec) as rg:
                    session = ProducerSession(rg)
                    for k in range(1, args.rounds + 1):
                        started = time.perf_counter()
                        session.send(_model(args.size_mib, k))
                        times.append(time.perf_counter() - started)
                    session.close()
            else:
                with ElasticProducerSession(spec) as session:
                    for k in range(1, args.rounds + 1):
                        started = time.perf_counter()
                        session.send(_model(args.size_mib, k))
                        times.append(time.perf_counter() - started)
            steady[mode].append(statistics.median(times[1:]))
        elif mode == "fail":
            with connect(spec) as rg:
                session = ConsumerSession(rg, verify=True)
                while session.receive(lambda batch: None) is not None:
                    pass
        else:
            with ElasticConsumerSession(spec, verify=True) as session:
                while session.receive(lambda batch: None) is not None:
                    pass
    spec = _spec(rank, 4, kill_port, args.timeout_s)
    if rank == 3:
        steady_done.wait(1800)  # joins when the others start the kill session (a joiner waits 2 x timeout_s)
    if rank == 0:
        steady_done.set()
        with ElasticProducerSession(spec) as session:
            for k in range(1, 6):
                session.send(_model(args.size_mib, k))
                if k == KILLED_IN:
                    recovered = time.monotonic() - killed_at.value
        return steady, recovered
    with ElasticConsumerSession(spec, verify=True) as session:

        def load(batch):
            if rank == 3 and session.session.rounds + 1 == KILLED_IN:
                killed_at.value = time.monotonic()
                os.kill(os.getpid(), signal.SIGKILL)

        while session.receive(load) is not None:
            pass
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=6.0)
    args = parser.parse_args()
    plan = [(mode, free_port()) for _ in range(args.repeats) for mode in ("fail", "continue")]
    ctx = mp.get_context(rank_harness.START_METHOD)
    killed_at, steady_done = ctx.Value("d", 0.0), ctx.Event()
    outcomes = rank_harness.run_ranks(
        _rank, 4, (plan, free_port(), args, killed_at, steady_done), timeout_s=1800, startup_s=300
    )
    producer = outcomes[0]
    if not producer.ok:
        sys.exit(f"the producer failed: {producer.error}\n{producer.traceback}")
    steady, recovered = producer.value
    fail, cont = statistics.median(steady["fail"]), statistics.median(steady["continue"])
    print(f"| {args.size_mib} MiB, 2 consumers verifying | fail | continue | continue / fail |")
    print("| --- | --- | --- | --- |")
    pairs = ", ".join(f"{f * 1e3:.1f}/{c * 1e3:.1f}" for f, c in zip(steady["fail"], steady["continue"]))
    print(
        f"| steady round (median of {args.repeats} sessions' medians; pairs {pairs} ms) "
        f"| {fail * 1e3:.1f} ms | {cont * 1e3:.1f} ms | {cont / fail:.3f} |"
    )
    print(
        f"| SIGKILL of 1 of 3 consumers in round {KILLED_IN} to the survivors' round {KILLED_IN} done "
        f"(group.timeout_s={args.timeout_s:g}) | - | {recovered:.1f} s | - |"
    )


if __name__ == "__main__":
    main()
