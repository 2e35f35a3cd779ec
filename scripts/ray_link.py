#!/usr/bin/env python
"""``role=ray`` across two Ray nodes (issue 22): a verified refit's steady round against the link's B / R and against
the transport's limit on the same link, and the whole command's time with its start-to-first-byte.

    sudo .venv/bin/python scripts/ray_link.py --rate 2gbit --size 256MiB --rounds 10

Creates two hosts with ``scripts/netns_hosts.sh`` (egress limited to ``--rate`` by tbf) and a Ray cluster of two
nodes on them (``tests/ray_utils.py``: ``ray start --head`` in host 1, ``ray start --address`` in host 2). Then, in
one run: the transport's limit on the link (``python -m refit_app.bench --rank 0`` in host 1 and ``--rank 1`` in
host 2, ``--modes limit``), the application's ``role=ray`` as a user runs it (the driver in host 1,
``ray.strategy=STRICT_SPREAD``: the producer's actor on one node, the consumer's on the other, which verifies every
round), and the limit again. The limit moves the same chunks, pre-packed on both sides, all in flight; its figure
is the median of both runs' repetitions. While ``role=ray`` runs, both hosts' receive counters are read every 10 ms:
the first byte is when one of them has grown by 1 MiB since the command started (Ray's own traffic is far less).
Prints one markdown table and removes the cluster and the hosts afterwards, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # netns_utils, ray_utils: the hosts and the cluster of the tests

from netns_bench import _rate_bytes_per_s  # noqa: E402 (scripts/ is this script's own directory)
from netns_utils import Rank, namespace_hosts, namespace_pids  # noqa: E402
from ray_utils import netns_cluster  # noqa: E402

PREFIX = "refit-rlink"
HOST_IPS = ("10.77.0.1", "10.77.0.2")
BENCH_PORT = 29660
"""The limit's runs take BENCH_PORT and BENCH_PORT + 1 on host 1 (a network stack of its own)."""
TOKEN = "ray-link"
"""The bench's group token: the hosts' addresses are not loopback ones."""
FIRST_BYTES = 2**20
"""Received bytes that mark the refit's start: Ray's own traffic before it is tens of KB."""
POLL_S = 0.01


# ---------------------------------------------------------------------------------------------------------------
# The transport's limit on the link


def _limit(hosts: list[str], args: argparse.Namespace, out: Path, port: int) -> dict:
    """``python -m refit_app.bench --rank`` on both hosts, ``--modes limit``; rank 0's case from bench.json."""
    env = {**os.environ, "REFIT_APP_TOKEN": TOKEN}
    group = ["--port", str(port), "--world-size", "2"]
    cases = ["--preset", args.preset, "--size", args.size, "--modes", "limit", "--reps", str(args.reps)]
    ranks = [
        ["--rank", "0", "--host", "0.0.0.0", *group, *cases, "--flat-refits", "0", "--out", str(out / f"bench{port}")],
        ["--rank", "1", "--host", HOST_IPS[0], *group],
    ]
    procs = []
    try:
        for rank, (ns, rank_args) in enumerate(zip(hosts, ranks)):
            with open(out / f"bench{port}-rank{rank}.log", "w") as log:
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", ns, sys.executable, "-m", "refit_app.bench", *rank_args],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=out,
                        start_new_session=True,
                    )
                )
        codes = [p.wait(args.timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(10)
    if codes != [0, 0]:
        raise SystemExit(f"ray_link: the limit's ranks exited {codes}; see {out}/bench{port}-rank*.log")
    [case] = json.loads((out / f"bench{port}" / "bench.json").read_text())["cases"]
    return case


# ---------------------------------------------------------------------------------------------------------------
# role=ray, with the hosts' receive counters read meanwhile


def _rx(ns: str) -> int | None:
    """Host ``ns``'s received bytes on eth0, from /proc/PID/net/dev of a process in it (a file read: cheap enough
    to poll); None where no process is there to read it through."""
    for pid in namespace_pids(ns):
        try:
            text = Path(f"/proc/{pid}/net/dev").read_text()
        except OSError:
            continue
        m = re.search(r"^\s*eth0:\s*(\d+)", text, re.MULTILINE)
        if m:
            return int(m[1])
    return None


class FirstBytes(threading.Thread):
    """Reads both hosts' counters every POLL_S from now until :meth:`stop`; ``at``: the seconds from the start to
    the first read where one host had received FIRST_BYTES more."""

    def __init__(self, hosts: list[str]) -> None:
        super().__init__(daemon=True)
        self.hosts = hosts
        self.base = [_rx(ns) or 0 for ns in hosts]
        self.started = time.monotonic()
        self.at: float | None = None
        self._done = threading.Event()
        self.start()

    def run(self) -> None:
        while self.at is None and not self._done.wait(POLL_S):
            now = [_rx(ns) for ns in self.hosts]
            if any(n is not None and n - b >= FIRST_BYTES for n, b in zip(now, self.base)):
                self.at = time.monotonic() - self.started

    def stop(self) -> None:
        self._done.set()
        self.join(5)


def _role_ray(hosts: list[str], cluster, args: argparse.Namespace, out: Path) -> tuple[list[str], dict, float, float]:
    overrides = [
        "role=ray",
        f"ray.address={cluster.address}",
        "ray.strategy=STRICT_SPREAD",
        "group.world_size=2",
        f"refit.rounds={args.rounds}",
        "sink=verify",
        f"source.preset={args.preset}",
        f"source.size={args.size}",
    ]
    watch = FirstBytes(hosts)
    driver = Rank(hosts[0], out, "ray", *overrides, env=cluster.env)
    try:
        code = driver.wait(args.timeout_s)
    finally:
        driver.kill()
        watch.stop()
    took = time.monotonic() - driver.started
    if code != 0:
        raise SystemExit(f"ray_link: role=ray exited {code}:\n{driver.text()[-3000:]}")
    if watch.at is None:
        raise SystemExit("ray_link: neither host's counter grew by 1 MiB while role=ray ran")
    return overrides, driver.metrics(), took, watch.at


# ---------------------------------------------------------------------------------------------------------------


def _table(args, rate: float, metrics: dict, limits: list[dict], took: float, first: float, cluster) -> str:
    consumer = metrics["consumers"][0]
    nbytes = metrics["rounds"][-1]["bytes"]
    ideal = nbytes / rate
    steady = metrics["steady_round_seconds"]
    limit_reps = [s for case in limits for s in case["modes"]["limit"]["per_rep_seconds"]]
    limit = statistics.median(limit_reps)
    if any(case["bytes"] != nbytes for case in limits):
        raise SystemExit(f"ray_link: the limit moved {limits[0]['bytes']} bytes a round, role=ray {nbytes}")
    refit_s = sum(r["seconds"] for r in metrics["rounds"])
    load = os.getloadavg()
    return "\n".join(
        [
            f"{metrics['source']}: B = {nbytes / 1e6:.0f} MB a round, R = {args.rate} ({rate / 1e6:.0f} MB/s), "
            f"B / R = {ideal:.3f} s; role=ray, {args.rounds} rounds verified: {consumer['verified']}, backend "
            f"{metrics['backend']}, buffer {metrics['buffer_size_bytes'] // 2**20} MiB x {metrics['num_buffers']}",
            "",
            "| | seconds | x B/R |",
            "|---|---|---|",
            f"| role=ray steady round (producer's, median of rounds 2..{args.rounds}) | {steady:.3f} | "
            f"{steady / ideal:.3f}x |",
            f"| the limit on the same link (median of {len(limit_reps)}) | {limit:.3f} | {limit / ideal:.3f}x |",
            f"| limit / role=ray round | {limit / steady:.3f} | |",
            "",
            f"role=ray's command: {took:.1f} s in all; the first MiB crossed the link {first:.1f} s after it started; "
            f"the {args.rounds} rounds took {refit_s:.2f} s (first {metrics['first_round_seconds']:.3f} s). "
            f"ray start took {cluster.start_seconds[0]:.1f} s (head) and {cluster.start_seconds[1]:.1f} s (worker). "
            f"Load average at the end: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}.",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="2gbit", help="egress rate of both hosts (tc tbf), e.g. 1gbit")
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--size", default="256MiB", help="source.size, the model's bytes B")
    parser.add_argument("--rounds", type=int, default=10, help="role=ray's rounds")
    parser.add_argument("--reps", type=int, default=5, help="the limit's repetitions in each of its two runs")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="hard limit on each command")
    parser.add_argument("--out", type=Path, help="where the runs' files go (default: a temporary directory)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("ray_link: needs root (network namespaces)")
    rate = _rate_bytes_per_s(args.rate)
    out = args.out or Path(tempfile.mkdtemp(prefix="ray-link-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"ray_link: load average before {os.getloadavg()[0]:.2f}; files in {out}", flush=True)
    with namespace_hosts(PREFIX) as make:
        hosts = make(2, args.rate)
        with netns_cluster(hosts[0], hosts[1], HOST_IPS[0]) as cluster:
            limits = [_limit(hosts, args, out, BENCH_PORT)]
            overrides, metrics, took, first = _role_ray(hosts, cluster, args, out)
            limits.append(_limit(hosts, args, out, BENCH_PORT + 1))
    if cluster.left:
        raise SystemExit(f"ray_link: processes outlived SIGKILL: {cluster.left}")
    print(f"ray_link: python -m refit_app {' '.join(overrides)}\n")
    print(_table(args, rate, metrics, limits, took, first, cluster))
    return 0


if __name__ == "__main__":
    sys.exit(main())
