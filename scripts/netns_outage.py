#!/usr/bin/env python
"""Which link outages a refit survives: a producer and a consumer on namespace hosts, the consumer's link cut for
a while in the middle of a multi-round refit, once per outage length.

    sudo .venv/bin/python scripts/netns_outage.py --rate 200mbit --timeout-s 10 --outages 1,2,3,4,6

For each outage length: creates two hosts with ``scripts/netns_hosts.sh`` (egress limited to ``--rate``), starts
``python -m refit_app`` as the producer on host 1 and a verifying consumer on host 2, waits until the producer has
finished round 2, takes the link down for that many seconds (``--cut host``: the consumer's own interface, as
``tests/test_netns.py`` does; ``--cut bridge``: the bridge's port to it, so that both ends see silent loss), brings
it back, and records both exit statuses and error lines. Prints one markdown table and removes the hosts after every
trial, also on failure or Ctrl-C.

Why an outage shorter than ``group.timeout_s`` can still fail a run: while the link is down, TCP retransmits what
it sent at exponentially growing intervals (RTO, 2 RTO, 4 RTO ...), so the first retransmission after the link is
back may come much later than the link did. ``--rto-max-ms`` sets ``net.ipv4.tcp_rto_max_ms`` (Linux 6.15+) in
both hosts, which caps that interval, to measure what the cap buys.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # netns_utils: the ranks of tests/test_netns.py

from netns_utils import Rank  # noqa: E402

HOSTS_SCRIPT = REPO / "scripts" / "netns_hosts.sh"
PREFIX = "refit-out"
PORT = 29690
STARTUP_LIMIT_S = 180.0
"""Most a rank may take to start and finish round 2; only a hang gets near it."""


def _hosts(*args: str) -> None:
    run = subprocess.run([str(HOSTS_SCRIPT), *args], check=False, capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise SystemExit(f"netns_outage: netns_hosts.sh {' '.join(args)} failed: {run.stderr.strip()}")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _error(rank: Rank) -> str:
    lines = rank.error_lines()
    return lines[0].removeprefix("refit_app: error: ") if lines else ""


def trial(args: argparse.Namespace, outage_s: float, work: Path) -> dict:
    """One run with one outage; returns the exit statuses, the error lines and the seconds from the link's return
    to the last exit."""
    _hosts("up", "2", args.rate, PREFIX)
    ranks: list[Rank] = []
    env = {**os.environ, "REFIT_APP_TOKEN": "netns-outage"}
    try:
        if args.rto_max_ms is not None:
            for k in (1, 2):
                _ip("netns", "exec", f"{PREFIX}{k}", "sysctl", "-qw", f"net.ipv4.tcp_rto_max_ms={args.rto_max_ms}")
        group = [f"group.port={PORT}", "group.world_size=2", f"group.timeout_s={args.timeout_s:g}"]
        run = [f"refit.rounds={args.rounds}", f"source.size={args.size}", f"refit.buffer_size_bytes={args.buffer}"]
        # Start-up is outside the deadline under test: the consumer waits for its producer as long as start-up takes.
        producer = ["role=producer", "group.host=0.0.0.0", *run, *group]
        ranks.append(Rank(f"{PREFIX}1", work, f"producer-{outage_s:g}", *producer, env=env))
        consumer = ["role=consumer", "group.host=10.77.0.1", "group.rank=1", "sink=verify", *group]
        ranks.append(Rank(f"{PREFIX}2", work, f"consumer-{outage_s:g}", *consumer, env=env))
        try:
            ranks[0].wait_for(rf"round 2/{args.rounds}", STARTUP_LIMIT_S)
        except AssertionError:
            return {
                "outage_s": outage_s,
                "codes": [r.proc.poll() for r in ranks],
                "errors": [_error(r) for r in ranks],
                "note": "never reached round 2",
            }
        cut = (
            ["-n", f"{PREFIX}0", "link", "set", "p2"]
            if args.cut == "bridge"
            else ["-n", f"{PREFIX}2", "link", "set", "eth0"]
        )
        _ip(*cut, "down")
        time.sleep(outage_s)
        _ip(*cut, "up")
        back = time.monotonic()
        limit = args.timeout_s * 3 + args.rounds * 30 + 60
        codes = []
        for r in ranks:
            try:
                codes.append(r.proc.wait(max(1.0, back + limit - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        rounds = re.findall(r"round (\d+)/", ranks[0].text())
        return {
            "outage_s": outage_s,
            "codes": codes,
            "errors": [_error(r) for r in ranks],
            "after_s": time.monotonic() - back,
            "rounds": int(rounds[-1]) if rounds else 0,
        }
    finally:
        for r in ranks:
            r.kill()
        _hosts("down", PREFIX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="200mbit", help="every host's egress limit (tc tbf), like 200mbit")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="group.timeout_s of both ranks")
    parser.add_argument("--outages", default="1,2,3,4,6", help="outage lengths in seconds, comma-separated")
    parser.add_argument("--repeats", type=int, default=1, help="trials per outage length")
    parser.add_argument("--cut", choices=("host", "bridge"), default="host", help="which end of the link goes down")
    parser.add_argument("--rto-max-ms", type=int, default=None, help="set net.ipv4.tcp_rto_max_ms in both hosts")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--size", default="32MiB")
    parser.add_argument("--buffer", default="4MiB")
    args = parser.parse_args()
    outages = [float(x) for x in args.outages.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="netns-outage-") as tmp:
        for outage in outages:
            for _ in range(args.repeats):
                r = trial(args, outage, Path(tmp))
                rows.append(r)
                print(f"outage {outage:g}s: exit {r['codes']} {r['errors']}", file=sys.stderr, flush=True)
    cap = f", net.ipv4.tcp_rto_max_ms={args.rto_max_ms}" if args.rto_max_ms is not None else ""
    print(
        f"\n{args.rate}, group.timeout_s={args.timeout_s:g}, cut at the {args.cut}{cap}, "
        f"{args.size} x {args.rounds} rounds\n"
    )
    print("| outage (s) | exit (producer, consumer) | survived | rounds | first error line |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        ok = r["codes"] == [0, 0]
        error = next((e for e in r["errors"] if e), "")
        print(
            f"| {r['outage_s']:g} | {r['codes'][0]}, {r['codes'][1]} | {'yes' if ok else 'no'} | "
            f"{r.get('rounds', '-')} | {error[:110]} |"
        )


if __name__ == "__main__":
    main()
