#!/usr/bin/env python
"""The link is the limit (issue 13): refit time against B / R over namespace hosts with rate-limited links.

    sudo .venv/bin/python scripts/netns_bench.py --rate 2gbit --size 512MiB

Creates 1 + max(--consumers) hosts with ``scripts/netns_hosts.sh`` (every host's egress limited to ``--rate`` by
tbf), runs one worker process per host for the whole run (the producer on host 1 bound to 0.0.0.0, consumers
joining at 10.77.0.1), and for each topology and consumer count refits a synthetic model (``--preset``, ``--size``)
``--rounds`` times per buffer size over one group. A refit is one :meth:`ProducerSession.send`: from the round
header to every consumer's "done", so the time is until the last consumer holds every byte (``--verify``: and has
checked every byte). After each round the transport's limit runs on the same link (``refit_app.bench``'s: the same
chunks pre-packed on both sides, all in flight, then a barrier), so noise hits both alike. The first round pays
the manifest and faults its buffers in; the table reports the median of the later ones. Prints one markdown table
and removes the hosts afterwards, also on failure or Ctrl-C.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOSTS_SCRIPT = REPO / "scripts" / "netns_hosts.sh"
PREFIX = "refit-bench"
PRODUCER_ADDRESS = "10.77.0.1"
BASE_PORT = 29700
"""Each (topology, consumers) case gets BASE_PORT + its index: a new group never meets the last one's store."""
TOKEN = "netns-bench"
"""The group's shared secret: the hosts' addresses are not loopback ones, so a group without one is refused."""
NATURAL = "natural"
"""``--size natural``: the preset's own size (the lora adapter's 93 MB)."""
DEFAULT_BUFFER = "default"
"""The library default buffer size (what ``python -m refit_app`` uses when refit.buffer_size_bytes is null)."""


def _rate_bytes_per_s(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.strip().lower())
    if not m:
        raise SystemExit(f"netns_bench: --rate {rate!r} is not like 2gbit, 500mbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return float(m.group(1)) * scale / 8


# ---------------------------------------------------------------------------------------------------------------
# One worker per host


def worker(rank: int, plan: dict) -> None:
    from refit_app.bench.cases import Case
    from refit_app.bench.modes import Limit, barrier
    from refit_app.common.sizes import parse_size
    from refit_app.models.sources import SyntheticSource
    from refit_app.packed_tensor import get_num_buffers, get_target_packed_tensor_size
    from refit_app.protocol.session import ConsumerSession, ProducerSession
    from refit_app.transport.groups import GroupSpec, connect

    size = None if plan["size"] == NATURAL else parse_size(plan["size"], key="--size")
    source = SyntheticSource(plan["preset"], size)
    metas = source.manifest_tensors()
    tensors = list(source.tensors()) if rank == 0 else None
    for index, case in enumerate(plan["cases"]):
        consumers = case["consumers"]
        if rank > consumers:
            continue
        spec = GroupSpec(
            backend="gloo",
            host="0.0.0.0" if rank == 0 else PRODUCER_ADDRESS,
            port=BASE_PORT + index,
            world_size=consumers + 1,
            rank=rank,
            timeout_s=plan["timeout_s"],
            topology=case["topology"],
            token=TOKEN,
        )
        with connect(spec) as rg:
            for buffer in plan["buffers"]:
                target = (
                    get_target_packed_tensor_size() if buffer == DEFAULT_BUFFER else parse_size(buffer, key="--buffers")
                )
                # The transport's limit on this link: the same chunks pre-packed on both sides, all in flight, until
                # every consumer holds them (a barrier), alternating with the refit rounds.
                limit = Limit(
                    rank,
                    source,
                    metas,
                    Case(
                        plan["preset"],
                        size,
                        target,
                        get_num_buffers(),
                        consumers,
                        "none",
                        plan["rounds"],
                        ("limit",),
                        0,
                    ),
                )
                seconds, limit_seconds = [], []
                if rank == 0:
                    session = ProducerSession(rg, buffer_size_bytes=target)
                else:
                    session = ConsumerSession(rg, verify=plan["verify"])
                for _ in range(plan["rounds"]):
                    started = time.perf_counter()
                    if rank == 0:
                        sent = session.send(tensors)
                    else:
                        got = session.receive(lambda batch: None)
                        if plan["verify"] and not got.verified:
                            raise SystemExit(f"rank {rank}: round {got.round} was not verified")
                    seconds.append(time.perf_counter() - started)
                    barrier(rg)
                    started = time.perf_counter()
                    limit.run(rg)
                    barrier(rg)
                    limit_seconds.append(time.perf_counter() - started)
                if rank == 0:
                    session.close()
                    print(
                        json.dumps(
                            {
                                **case,
                                "buffer": buffer,
                                "target": target,
                                "bytes": sent.bytes,
                                "chunks": sent.num_chunks,
                                "seconds": seconds,
                                "limit_seconds": limit_seconds,
                            }
                        ),
                        flush=True,
                    )
                else:
                    if session.receive(lambda batch: None) is not None:
                        raise SystemExit(f"rank {rank}: the producer's session did not end")
                del limit


# ---------------------------------------------------------------------------------------------------------------
# The driver


def _hosts(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(HOSTS_SCRIPT), *args], check=False, capture_output=True, text=True, timeout=120)


def _run_workers(plan: dict, hosts: int, out_dir: Path, limit_s: float) -> list[dict]:
    procs = []
    try:
        for rank in range(hosts):
            with open(out_dir / f"rank{rank}.out", "w") as out, open(out_dir / f"rank{rank}.err", "w") as err:
                procs.append(
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            f"{PREFIX}{rank + 1}",
                            sys.executable,
                            __file__,
                            "--worker",
                            str(rank),
                            "--plan",
                            json.dumps(plan),
                        ],
                        stdout=out,
                        stderr=err,
                        cwd=REPO,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + limit_s
        for proc in procs:
            proc.wait(max(deadline - time.monotonic(), 1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(10)
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "\n".join(
            f"--- rank {r} (exit {rc}) ---\n{(out_dir / f'rank{r}.err').read_text()[-2000:]}" for r, rc in failed
        )
        raise SystemExit(f"netns_bench: workers failed:\n{tails}")
    return [json.loads(line) for line in (out_dir / "rank0.out").read_text().splitlines() if line.startswith("{")]


def _table(results: list[dict], rate: float, rate_text: str, verify: bool) -> str:
    def steady(r: dict, key: str = "seconds") -> float:
        later = r[key][1:] or r[key]
        return statistics.median(later)

    bytes_ = results[0]["bytes"]
    limit = bytes_ / rate
    mib = 2**20
    lines = [
        (
            f"B = {bytes_ / 1e6:.0f} MB, R = {rate_text} ({rate / 1e6:.0f} MB/s), B / R = {limit:.2f} s; times are "
            "medians of the rounds after the first; consumers "
            + ("verify every round" if verify else "discard")
            + "; the limit moves the same chunks, pre-packed, all in flight, alternating with the refit's rounds."
        ),
        "",
        (
            "| topology | consumers | default buffer: refit (s) | x B/R | limit (s) | x B/R | limit / refit |"
            " best buffer | refit (s) | x B/R | sweep (buffer: refit x B/R) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cases = sorted({(r["topology"], r["consumers"]) for r in results}, key=lambda c: (c[0] != "tree", c[1]))
    for topology, consumers in cases:
        rows = [r for r in results if (r["topology"], r["consumers"]) == (topology, consumers)]
        default = next((r for r in rows if r["buffer"] == DEFAULT_BUFFER), None)
        best = min(rows, key=steady)
        sweep = ", ".join(f"{r['target'] // mib} MiB: {steady(r) / limit:.2f}" for r in rows)
        if default:
            refit_s, limit_s = steady(default), steady(default, "limit_seconds")
            default_cells = (
                f"{refit_s:.2f} | {refit_s / limit:.2f}x ({default['target'] // mib} MiB) | "
                f"{limit_s:.2f} | {limit_s / limit:.2f}x | {limit_s / refit_s:.2f}"
            )
        else:
            default_cells = "- | - | - | - | -"
        lines.append(
            f"| {topology} | {consumers} | {default_cells} | {best['target'] // mib} MiB | "
            f"{steady(best):.2f} | {steady(best) / limit:.2f}x | {sweep} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="2gbit", help="egress rate of every host (tc tbf), e.g. 2gbit")
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--size", default="512MiB", help=f"model size B, or {NATURAL!r} for the preset's own")
    parser.add_argument("--consumers", default="1,2,3")
    parser.add_argument("--topologies", default="tree,chain")
    parser.add_argument(
        "--buffers",
        default=f"{DEFAULT_BUFFER},4MiB,64MiB,256MiB",
        help=f"buffer sizes to sweep; {DEFAULT_BUFFER!r} is the library default",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--verify",
        action="store_true",
        help="consumers verify every round (sink=verify): the producer checksums, they check",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="group.timeout_s of every group")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, json.loads(args.plan))
        return
    rate = _rate_bytes_per_s(args.rate)
    from refit_app.common.errors import ConfigError
    from refit_app.common.sizes import parse_size

    try:  # refuse a bad size here, in one line, rather than in every worker
        if args.size != NATURAL:
            parse_size(args.size, key="--size")
        [parse_size(b, key="--buffers") for b in args.buffers.split(",") if b != DEFAULT_BUFFER]
    except ConfigError as e:
        raise SystemExit(f"netns_bench: error: {e}") from None
    counts = [int(c) for c in args.consumers.split(",")]
    plan = {
        "preset": args.preset,
        "size": args.size,
        "rounds": args.rounds,
        "timeout_s": args.timeout_s,
        "verify": args.verify,
        "buffers": args.buffers.split(","),
        "cases": [{"topology": t, "consumers": c} for t in args.topologies.split(",") for c in counts],
    }
    hosts = 1 + max(counts)
    up = _hosts("up", str(hosts), args.rate, PREFIX)
    if up.returncode != 0:
        raise SystemExit(up.stderr.strip() or f"netns_bench: netns_hosts.sh up failed ({up.returncode})")
    try:
        with tempfile.TemporaryDirectory(prefix="netns-bench-") as tmp:
            limit_s = len(plan["cases"]) * len(plan["buffers"]) * (args.rounds * 60 + 60) + 300
            results = _run_workers(plan, hosts, Path(tmp), limit_s)
    finally:
        _hosts("down", PREFIX)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(_table(results, rate, args.rate, args.verify))


if __name__ == "__main__":
    main()
