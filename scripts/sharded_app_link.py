#!/usr/bin/env python
"""The application's sharded delta rounds against its one-producer dense rounds over rate-limited links (issue 33's
delta goal), both runs through ``python -m refit_app`` on namespace hosts, in one run of this script.

    sudo .venv/bin/python scripts/sharded_app_link.py --rate 2gbit --size 256MiB --k 4 --rounds 5

Creates ``--k`` + 1 hosts with ``scripts/netns_hosts.sh`` (each host's egress shaped to ``--rate`` by tbf, MTU 9000),
then runs, with the same synthetic model (``--preset`` at ``--size``, ``source.update=training`` at ``--lr``, so the
changed share comes out of bf16 rounding) and ``--rounds`` verified rounds each:

- ``one producer, dense``: ``role=producer`` on host 1 and ``role=consumer`` on host 2 (``refit.delta=off``);
- ``K producers, delta``: ``role=producer`` ranks 0..K-1 on hosts 1..K (``group.producers=K``, ``refit.delta=on``),
  each sending its own rows, and one ``role=consumer`` that needs every tensor whole on host K+1.

Every rank runs with ``OMP_NUM_THREADS=--threads`` (1: the ranks' hosts share this machine's cores, and torch's
intra-op threads would contend for them). Each rank's metrics.json gives its rounds; a round's time is its slowest
rank's (the ranks start it together), the steady round the median of rounds 2..N. Prints one markdown table and
where a delta round's time goes (the slowest producer's comparing and encoding, the consumer's applying and
hashing); removes the hosts afterwards, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOSTS_SCRIPT = REPO / "scripts" / "netns_hosts.sh"
PREFIX = "refit-sapp"
FIRST_ADDRESS = "10.77.0.1"
PORT = 29890
TOKEN = "sharded-app-link"
RUN_TIMEOUT_S = 1800


def _run(args: argparse.Namespace, name: str, ranks: list[list[str]], out: Path) -> list[dict]:
    """Start every rank (rank r on host r + 1), wait for all; each rank's metrics.json."""
    common = [
        f"source.preset={args.preset}",
        f"source.size={args.size}",
        "source.update=training",
        f"source.lr={args.lr}",
        f"refit.rounds={args.rounds}",
        f"refit.buffer_size_bytes={args.buffer}",
        f"group.host={FIRST_ADDRESS}",
        f"group.port={PORT}",
        "group.timeout_s=600",
    ]
    env = {**os.environ, "REFIT_APP_TOKEN": TOKEN, "GLOO_SOCKET_IFNAME": "eth0"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    procs = []
    try:
        for rank, settings in enumerate(ranks):
            command = ["ip", "netns", "exec", f"{args.hosts}{rank + 1}", sys.executable, "-m", "refit_app"]
            command += [*settings, *common, f"hydra.run.dir={out}/{name}/{rank}"]
            log = open(out / f"{name}.{rank}.log", "w")  # noqa: SIM115 (closed with the process below)
            procs.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        codes = [p.wait(timeout=RUN_TIMEOUT_S) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    if any(codes):
        raise SystemExit(f"sharded_app_link: {name}: exit codes {codes}; see the logs in {out}")
    return [json.loads((out / name / str(rank) / "metrics.json").read_text()) for rank in range(len(ranks))]


def _rounds(metrics: list[dict], key: str, combine=max) -> list[float]:
    """Per round, ``key`` combined over the ranks that report it."""
    per_round = zip(*(m["rounds"] for m in metrics))
    return [combine([r[key] for r in entries if r.get(key) is not None] or [0]) for entries in per_round]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/sharded_app_link.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="2gbit")
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--lr", default="1e-6", help="source.lr (it sets the changed share)")
    parser.add_argument("--k", type=int, default=4, help="producers of the sharded run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--buffer", default="8MiB", help="refit.buffer_size_bytes")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of every rank (0: torch's default); the ranks' hosts share this machine's cores",
    )
    parser.add_argument("--out", default=None, help="where the runs' directories go (default: a temporary one)")
    parser.add_argument(
        "--hosts", default=PREFIX, help="the hosts' namespace prefix (another one lets two runs share a machine)"
    )
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("sharded_app_link: needs root (network namespaces)")
    out = Path(args.out or tempfile.mkdtemp(prefix="sharded-app-link-"))
    out.mkdir(parents=True, exist_ok=True)
    k = args.k
    env = {**os.environ, "NETNS_MTU": "9000"}
    subprocess.run(["bash", str(HOSTS_SCRIPT), "up", str(k + 1), args.rate, args.hosts], check=True, env=env)
    try:
        dense = _run(
            args,
            "one-producer",
            [["role=producer", "refit.delta=off"], ["role=consumer", "group.rank=1", "sink=verify"]],
            out,
        )
        layout = [f"group.producers={k}", f"group.world_size={k + 1}"]
        delta = _run(
            args,
            "sharded-delta",
            [["role=producer", f"group.rank={r}", "refit.delta=on", *layout] for r in range(k)]
            + [["role=consumer", f"group.rank={k}", "sink=verify", *layout]],
            out,
        )
    finally:
        subprocess.run(["bash", str(HOSTS_SCRIPT), "down", args.hosts], check=False)
    dense_rounds, delta_rounds = _rounds(dense, "seconds"), _rounds(delta, "seconds")
    dense_steady, delta_steady = statistics.median(dense_rounds[1:]), statistics.median(delta_rounds[1:])
    model = sum(m["rounds"][0]["bytes"] for m in delta[:k])
    wire = _rounds(delta[k:], "wire_bytes", sum)
    changed = _rounds(delta[:k], "changed_elements", sum)
    diff = _rounds(delta[:k], "diff_seconds")
    apply = _rounds(delta[k:], "apply_seconds")
    verified = all(m.get("verified") for m in (dense[1], delta[k]))
    print(f"\n{args.preset} at {args.size} ({model / 1e9:.3f} GB, S), every link {args.rate}, {args.rounds} rounds")
    threads = args.threads or "torch's default"
    print(f"source.update=training at lr {args.lr}, buffers {args.buffer}, OMP_NUM_THREADS {threads}; runs in {out}")
    print(f"every round verified: {verified}\n")
    print("| run | steady round | rounds (s) | wire bytes / steady round | one-producer dense / this |")
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| one producer, dense | {dense_steady:.3f} s | {', '.join(f'{t:.2f}' for t in dense_rounds)} "
        f"| {statistics.median(_rounds(dense[1:], 'wire_bytes', sum)[1:]) / model:.3f} S | 1.0x |"
    )
    print(
        f"| {k} producers, delta | {delta_steady:.3f} s | {', '.join(f'{t:.2f}' for t in delta_rounds)} "
        f"| {statistics.median(wire[1:]) / model:.4f} S | {dense_steady / delta_steady:.1f}x |"
    )
    first = changed[0] or 1
    print(
        f"\nsteady delta round: changed {statistics.median(changed[1:]) / first:.2%} of the elements, the slowest "
        f"producer compared and encoded for {statistics.median(diff[1:]):.3f} s, the consumer applied and hashed "
        f"for {statistics.median(apply[1:]):.3f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
