#!/usr/bin/env python
"""Sharded refits over rate-limited links: K producers, each on a namespace host of its own, send their shards
straight to M tensor-parallel consumers (D replicas), each on its own host; every host's link is shaped to
``--rate`` (tc tbf on its egress). Compared in the same run, on the same hosts and model, with one producer that
holds the whole model and sends it whole to every consumer along a chain (what a one-producer refit does), and with
gathering the shards onto producer 0 first and then doing that. ``--modes sharded-delta`` adds delta rounds: between
rounds every producer changes about ``--change`` of its shards' elements in place (scattered, as an optimizer step
leaves them), and each round sends only those, every piece verified.

    sudo .venv/bin/python scripts/sharded_link.py --rate 400mbit --size 512MiB --k 4 --m 4 --rounds 4

The model is ``source.preset``'s shapes (llama-1b by default) scaled to ``--size``, bf16, sharded over the
producers by rows (FSDP2's ``Shard(0)``, uneven where the rows do not divide); the consumers take vLLM's
tensor-parallel slices (q/k/v/gate/up, the embedding and the head by rows, o/down by columns, norms whole). Every
round is verified (each region hashed by its source and checked where it lands). Prints, per mode, the steady round
(median of rounds 2..N), the bytes all links transmitted in one round against the model's bytes S, and the round
against S/R (the link's time for the model) and (S/K)/R (each producer's share), and for delta rounds where each
rank's time went (until its call returned, its CPU seconds, its comparing or applying) with the load average; then
removes the hosts, also on failure or Ctrl-C. Links use a 9000-byte MTU, so TCP/IP headers cost under 1% of the bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOSTS_SCRIPT = REPO / "scripts" / "netns_hosts.sh"
PREFIX = "refit-shard"
PORT = 29870
RUN_TIMEOUT_S = 1800
MODES = ("sharded", "one-producer", "gather-broadcast", "sharded-delta")


def _parse_rate(text: str) -> float:
    """tc's rate (``400mbit``, ``2gbit``) in bytes per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale / 8
    raise SystemExit(f"--rate {text!r}: give it as tc does, like 400mbit or 2gbit")


# -- one rank, inside its host ----------------------------------------------------------------------------------


def _model(preset: str, size: int) -> list[tuple[str, tuple[int, ...]]]:
    from refit_app.models.presets import PRESETS, fit_arch

    arch = fit_arch(PRESETS[preset], size, 2)
    return [(name, shape) for name, shape, _ in arch.specs()]


def _rule(name: str):
    from refit_app.protocol.sharded import COLUMN, ROW, WHOLE

    if "norm" in name:
        return WHOLE
    return ROW if ("o_proj" in name or "down_proj" in name) else COLUMN


def _tx_bytes() -> int:
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from refit_app.core.reshard.delta import ConsumerBases, ProducerDeltas
    from refit_app.core.reshard.plan import Layout, Need, Replicate, Shard, TensorSpec, held_boxes, plan, whole
    from refit_app.core.reshard.transfer import Held
    from refit_app.protocol.sharded import (
        DEFAULT_CHECKSUM,
        Declared,
        ShardedPlan,
        allocate,
        from_tensors,
        receive,
        send,
        tp_needs,
    )

    rank, k, m, d = args.rank, args.k, args.m, args.d
    world = k + m * d
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://10.77.0.1:{PORT}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=RUN_TIMEOUT_S),
    )
    shapes = _model(args.preset, args.size)
    options = {"num_buffers": 2}

    def agreed(transfers: list, delta: bool = False) -> ShardedPlan:
        """What agree() gives every rank (each computes the same plan here), verified with xxh3 per region."""
        return ShardedPlan(transfers, args.buffer, DEFAULT_CHECKSUM, delta, "")

    consumers = list(range(k, world))
    chains = [[k + r * m + c for r in range(d)] for c in range(m)] if d > 1 else []

    def sharded_specs(ranks: list[int]) -> list[TensorSpec]:
        return [
            TensorSpec(n, "bfloat16", s, 2, Layout.one_dim(ranks, Shard(0) if s else Replicate())) for n, s in shapes
        ]

    specs = sharded_specs(list(range(k)))
    needs = [n for c in consumers for n in tp_needs(specs, c, (c - k) % m, m, _rule)]
    # each producer's shard, the same bytes whatever the mode (seeded by name): made once, kept
    shards: dict[str, Held] = {}
    if rank < k:
        g = torch.Generator()
        declared = []
        for spec in specs:
            box = held_boxes(spec)[rank]
            g.manual_seed(zlib.crc32(spec.name.encode()) + rank)
            local = torch.randn([b - a for a, b in box], generator=g).to(torch.bfloat16)
            declared.append((spec.name, Declared(local, spec.shape, spec.layout)))
        _, shards = from_tensors(declared, rank=rank)

    def one_producer_round(whole_model: dict[str, Held] | None) -> None:
        """Producer 0 holds the model whole and sends it whole to every consumer, along a chain."""
        one = sharded_specs([0])
        wanted = [Need(c, s.name, whole(s.shape)) for c in consumers for s in one]
        transfers = agreed(plan(one, wanted, chains=[consumers]))
        if rank == 0:
            assert whole_model is not None
            send(dist.group.WORLD, rank, transfers, whole_model, **options)
        elif rank >= k:
            receive(dist.group.WORLD, rank, transfers, allocate(one, [n for n in wanted if n.rank == rank]), **options)

    def gather_to_0() -> dict[str, Held] | None:
        """The shards gathered whole onto producer 0 (what a trainer does before a one-producer refit)."""
        if rank >= k:
            return None
        out = {}
        for spec in specs:
            local = shards[spec.name].tensor
            boxes = held_boxes(spec)
            if rank:
                dist.send(local, 0)  # shards differ in size (uneven rows): point to point, not gloo's gather
                continue
            parts = [local] + [torch.empty([b - a for a, b in boxes[r]], dtype=torch.bfloat16) for r in range(1, k)]
            for work in [dist.irecv(parts[r], r) for r in range(1, k)]:
                work.wait()
            out[spec.name] = Held(torch.cat(parts) if spec.shape else local, whole(spec.shape))
        return out if rank == 0 else None

    def train_step(step: int) -> None:
        """About ``--change`` of every shard's elements take new values, in place (outside the timed round)."""
        g = torch.Generator().manual_seed(1000 * step + rank)
        for held in shards.values():
            flat = held.tensor.reshape(-1)
            n = int(flat.numel() * args.change)
            if n:
                idx = torch.randint(0, flat.numel(), (n,), generator=g)
                flat[idx] = torch.randn(n, generator=g).to(flat.dtype)

    transfers = delta_plan = None
    whole_model = None
    results = {}
    deltas, bases = ProducerDeltas(), ConsumerBases()
    delta_slices = None
    for mode in args.modes:
        if mode in ("sharded", "sharded-delta"):
            transfers = agreed(plan(specs, needs, chains=chains))
            delta_plan = agreed(transfers.transfers, delta=True)
        if mode == "one-producer" and whole_model is None:
            whole_model = gather_to_0()  # made once, outside the timed rounds
        times, wire, ranks = [], [], []  # ranks: per round, each rank's (own seconds, CPU seconds, work seconds)
        for step in range(args.rounds):
            if mode == "sharded-delta" and rank < k and step:
                train_step(step)
            dist.barrier()
            tx0, t0, cpu0 = _tx_bytes(), time.perf_counter(), time.process_time()
            if mode == "sharded-delta":
                if rank < k:
                    send(dist.group.WORLD, rank, delta_plan, shards, delta=deltas, **options)
                else:
                    if delta_slices is None:
                        delta_slices = allocate(specs, [n for n in needs if n.rank == rank])
                    receive(dist.group.WORLD, rank, delta_plan, delta_slices, bases=bases, **options)
            elif mode == "sharded":
                if rank < k:
                    send(dist.group.WORLD, rank, transfers, shards, **options)
                else:
                    mine = [n for n in needs if n.rank == rank]
                    receive(dist.group.WORLD, rank, transfers, allocate(specs, mine), **options)
            elif mode == "one-producer":
                one_producer_round(whole_model)
            else:
                one_producer_round(gather_to_0())
            own, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            dist.barrier()
            elapsed, sent = time.perf_counter() - t0, _tx_bytes() - tx0
            work = (deltas.compare_seconds if rank < k else bases.apply_seconds) if mode == "sharded-delta" else 0.0
            totals: list = [None] * world
            dist.all_gather_object(totals, (elapsed, sent, own, cpu, work))
            times.append(max(t[0] for t in totals))
            wire.append(sum(t[1] for t in totals))
            ranks.append([[round(x, 4) for x in t[2:]] for t in totals])
        results[mode] = {"times": times, "wire": wire, "ranks": ranks}
    if rank == 0:
        print("RESULT " + json.dumps({"results": results, "model_bytes": sum(2 * _numel(s) for _, s in shapes)}))
    dist.destroy_process_group()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


# -- the driver -------------------------------------------------------------------------------------------------


def _report(args: argparse.Namespace, result: dict) -> None:
    s = result["model_bytes"]
    rate = _parse_rate(args.rate)
    link_s = s / rate
    print(
        f"\nmodel {args.preset} {s / 1e9:.3f} GB (S), K={args.k} producers, M={args.m} x D={args.d} consumers, "
        f"every link {args.rate} (S/R = {link_s:.2f} s, (S/K)/R = {link_s / args.k:.2f} s), "
        f"buffers {args.buffer} B x 2 per pair, verified\n"
    )
    print("| mode | steady round s | x (S/K)/R | x S/R | links' bytes / S | sharded is faster by |")
    print("| --- | --- | --- | --- | --- | --- |")
    steady = {mode: statistics.median(r["times"][1:] or r["times"]) for mode, r in result["results"].items()}
    for mode, r in result["results"].items():
        t = steady[mode]
        wire = statistics.median(r["wire"][1:] or r["wire"]) / s
        faster = f"{t / steady['sharded']:.2f}x" if "sharded" in steady and mode != "sharded" else ""
        print(f"| {mode} | {t:.2f} | {t / (link_s / args.k):.2f} | {t / link_s:.2f} | {wire:.3f} | {faster} |")
    print(f"\nrounds (s): {json.dumps({m: [round(t, 2) for t in r['times']] for m, r in result['results'].items()})}")
    delta = result["results"].get("sharded-delta")
    if delta is not None and len(delta["ranks"]) > 1:
        k, steady = args.k, delta["ranks"][1:]

        def median(rank: int, field: int) -> float:
            return statistics.median(r[rank][field] for r in steady)

        print(
            "steady delta round, per rank (median of rounds 2..N): until its send or receive returned / CPU in it / "
            "comparing and encoding (a producer) or applying and hashing (a consumer), seconds"
        )
        for rank in range(len(steady[0])):
            role = f"producer {rank}" if rank < k else f"consumer {rank}"
            print(f"  {role}: {median(rank, 0):.3f} / {median(rank, 1):.3f} / {median(rank, 2):.3f}")
        load = os.getloadavg()[0]
        cpu = sum(median(rank, 1) for rank in range(len(steady[0])))
        print(f"  all ranks' CPU in a round: {cpu:.3f} s on {os.cpu_count()} cores; load average (1 min) {load:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="400mbit", help="every host's egress rate, as tc says it")
    parser.add_argument("--size", default="512MiB", help="the model's size (source.size)")
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--k", type=int, default=4, help="producers")
    parser.add_argument("--m", type=int, default=4, help="tensor-parallel consumers of one replica")
    parser.add_argument("--d", type=int, default=1, help="replicas of the consumers' layout")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--buffer", type=int, default=32 << 20, help="bytes of one buffer")
    parser.add_argument("--modes", nargs="+", default=list(MODES[:3]), choices=MODES)
    parser.add_argument("--change", type=float, default=0.01, help="sharded-delta: share of elements changed a round")
    parser.add_argument(
        "--hosts", default=PREFIX, help="the hosts' namespace prefix (another one lets two runs share a machine)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if isinstance(args.size, str):
        sys.path.insert(0, str(REPO))
        from refit_app.common.sizes import parse_size

        args.size = parse_size(args.size, "--size")
    if args.worker:
        _worker(args)
        return 0
    world = args.k + args.m * args.d
    _parse_rate(args.rate)
    env = {**os.environ, "NETNS_MTU": "9000"}
    subprocess.run(["bash", str(HOSTS_SCRIPT), "up", str(world), args.rate, args.hosts], check=True, env=env)
    procs = []
    try:
        base = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rate", args.rate]
        base += ["--size", str(args.size), "--preset", args.preset, "--k", str(args.k), "--m", str(args.m)]
        base += ["--d", str(args.d), "--rounds", str(args.rounds), "--buffer", str(args.buffer), "--modes", *args.modes]
        base += ["--change", str(args.change)]
        worker_env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        for rank in range(world):
            cmd = ["ip", "netns", "exec", f"{args.hosts}{rank + 1}", *base, "--rank", str(rank)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=worker_env))
        deadline = time.monotonic() + RUN_TIMEOUT_S
        outputs = []
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
        if any(p.returncode for p in procs):
            print(f"ranks failed: {[r for r, p in enumerate(procs) if p.returncode]}", file=sys.stderr)
            return 1
        line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
        _report(args, json.loads(line.removeprefix("RESULT ")))
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        subprocess.run(["bash", str(HOSTS_SCRIPT), "down", args.hosts], check=False)


if __name__ == "__main__":
    sys.exit(main())
