#!/usr/bin/env python
"""Delta refits against dense ones over a rate-limited link between two namespace hosts (issue 21's goal).

    sudo .venv/bin/python scripts/delta_link.py --rate 2gbit --size 1GB --lr 1e-6 --rounds 20

Creates two hosts with ``scripts/netns_hosts.sh`` (egress limited to ``--rate`` by tbf), then for each ``--lr``
runs the application itself, a producer on host 1 and a verifying consumer on host 2, once per ``--modes`` value
(``refit.delta=off``, ``on``, ``auto``) in that order, ``--repeat`` times: the same synthetic llama-1b with
``source.update=training`` (so the share of changed elements comes out of bf16 rounding), ``--rounds`` verified
rounds each. Prints one markdown table of each run's steady round (median of rounds 2..N, from metrics.json),
the wire bytes of a steady round, the share of changed elements, and the speed-up of each mode against dense in
the same repetition; removes the hosts afterwards, also on failure or Ctrl-C.
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
PREFIX = "refit-delta"
PRODUCER_ADDRESS = "10.77.0.1"
BASE_PORT = 29800
TOKEN = "delta-link"
RUN_TIMEOUT_S = 1800


def _run_pair(args: argparse.Namespace, lr: str, mode: str, port: int, out: Path) -> tuple[dict, dict]:
    common = [
        f"source.preset={args.preset}",
        f"source.size={args.size}",
        "source.update=training",
        f"source.lr={lr}",
        f"refit.rounds={args.rounds}",
        f"group.port={port}",
        "group.timeout_s=300",
    ]
    env = {**os.environ, "REFIT_APP_TOKEN": TOKEN}
    producer = [
        "ip",
        "netns",
        "exec",
        f"{PREFIX}1",
        sys.executable,
        "-m",
        "refit_app",
        "role=producer",
        "group.host=0.0.0.0",
        f"refit.delta={mode}",
        f"hydra.run.dir={out}/producer",
        *common,
    ]
    consumer = [
        "ip",
        "netns",
        "exec",
        f"{PREFIX}2",
        sys.executable,
        "-m",
        "refit_app",
        "role=consumer",
        f"group.host={PRODUCER_ADDRESS}",
        "group.rank=1",
        "sink=verify",
        f"hydra.run.dir={out}/consumer",
        *common,
    ]
    with (
        open(out.parent / f"{out.name}.producer.log", "w") as plog,
        open(out.parent / f"{out.name}.consumer.log", "w") as clog,
    ):
        p = subprocess.Popen(producer, env=env, stdout=plog, stderr=subprocess.STDOUT)
        c = subprocess.Popen(consumer, env=env, stdout=clog, stderr=subprocess.STDOUT)
        codes = (p.wait(timeout=RUN_TIMEOUT_S), c.wait(timeout=RUN_TIMEOUT_S))
    if codes != (0, 0):
        raise SystemExit(f"delta_link: lr={lr} delta={mode}: exit codes {codes}; see {out.parent}")
    return tuple(json.loads((out / side / "metrics.json").read_text()) for side in ("producer", "consumer"))


def _steady(metrics: dict, key: str) -> float | None:
    values = [r.get(key) for r in metrics["rounds"][1:] if r.get(key) is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/delta_link.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="2gbit")
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--size", default="1GB")
    parser.add_argument("--lr", nargs="+", default=["1e-6"], help="source.lr values (they set the changed share)")
    parser.add_argument("--modes", nargs="+", default=["off", "on", "auto"], choices=["off", "on", "auto"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", default=None, help="where the runs' directories go (default: a temporary one)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("delta_link: needs root (network namespaces)")
    out_root = Path(args.out or tempfile.mkdtemp(prefix="delta-link-"))
    out_root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["bash", str(HOSTS_SCRIPT), "up", "2", args.rate, PREFIX], check=True)
    rows = []
    try:
        port = BASE_PORT
        for rep in range(args.repeat):
            for lr in args.lr:
                dense = None
                for mode in args.modes:
                    port += 1
                    producer, consumer = _run_pair(args, lr, mode, port, out_root / f"lr{lr}-{mode}-{rep}")
                    steady = consumer["steady_round_seconds"]
                    if mode == "off":
                        dense = steady
                    fraction = _steady(producer, "changed_fraction")
                    rows.append(
                        (
                            lr,
                            mode,
                            rep,
                            steady,
                            producer["steady_round_seconds"],
                            _steady(producer, "wire_bytes"),
                            fraction,
                            consumer.get("verified"),
                            dense / steady if dense and steady else None,
                        )
                    )
                    print(f"lr={lr} delta={mode}: steady {steady:.3f} s", flush=True)
    finally:
        subprocess.run(["bash", str(HOSTS_SCRIPT), "down", PREFIX], check=False)
    print(f"\n{args.preset} {args.size}, {args.rate} link, {args.rounds} verified rounds per run; runs in {out_root}\n")
    print(
        "| source.lr | refit.delta | rep | steady round (consumer) | steady round (producer) | wire bytes / round "
        "| changed elements | verified | dense / this |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for lr, mode, rep, steady, psteady, wire, fraction, verified, speedup in rows:
        share = "-" if fraction is None else f"{fraction:.3%}"
        wire_s = "-" if wire is None else f"{wire / 1e6:.1f} MB"
        sp = "-" if speedup is None else f"{speedup:.1f}x"
        print(f"| {lr} | {mode} | {rep} | {steady:.3f} s | {psteady:.3f} s | {wire_s} | {share} | {verified} | {sp} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
