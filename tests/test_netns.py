"""Across hosts for real: the producer and its consumers in separate network namespaces (``scripts/netns_hosts.sh``)
joined by a bridge, with rate-limited links, a partition and an unreachable host. Each host's name resolves to
127.0.0.1 inside its namespace, as in many containers and VMs; the across-hosts recipe of README.md and
docs/multi-host.md must work as written. Needs the rights to make network namespaces (``needs_netns``: root, as CI
runs); skipped with the reason elsewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conditions import NETNS_SCRIPT, needs_netns
from mp_utils import STARTUP_LIMIT_S
from netns_utils import Rank, hosts_sh, listed_namespaces, namespace_hosts

pytestmark = [pytest.mark.netns, needs_netns]

FAIL_TIMEOUT_S = 10.0
"""group.timeout_s where a failure is under test."""
EXIT_BUDGET_S = FAIL_TIMEOUT_S + 30.0
"""The issue's promise: survivors exit within group.timeout_s + 30 s of the partition."""
PORT = 29611
"""Fixed on purpose: every test makes its own namespaces, each with a network stack of its own, so nothing else can
hold this port there (and the machine's own ports are untouched)."""


@pytest.fixture(autouse=True)
def _token(monkeypatch) -> None:
    """The recipe's hosts talk over non-loopback addresses, where a group needs a token (docs/security.md)."""
    monkeypatch.setenv("REFIT_APP_TOKEN", "netns-test-token")


@pytest.fixture
def hosts() -> Iterator:
    """``hosts(n, rate)`` creates n namespace hosts (10.77.0.1..n) and returns their names; all go at the end."""
    prefix = f"rt{os.getpid() % 10000}x"
    with namespace_hosts(prefix) as make:
        yield make
    assert not [ns for ns in listed_namespaces() if ns.startswith(prefix)], listed_namespaces()


def _group(world_size: int, timeout_s: float, rank: int | None = None) -> list[str]:
    rank_args = [] if rank is None else [f"group.rank={rank}"]
    return [f"group.port={PORT}", f"group.world_size={world_size}", f"group.timeout_s={timeout_s:g}", *rank_args]


def _verified_refit(hosts, tmp_path: Path, consumers: int, *extra: str) -> list[Rank]:
    """A producer host and ``consumers`` consumer hosts on 2 Gbit/s links refit 192 MiB; every consumer verifies.
    Returns the finished ranks, producer first."""
    names = hosts(consumers + 1, "2gbit")
    world = consumers + 1
    model = ["source.preset=llama-1b", "source.size=192MiB", "refit.buffer_size_bytes=16MiB"]
    ranks = [
        Rank(
            names[0],
            tmp_path,
            "producer",
            "role=producer",
            "group.host=0.0.0.0",
            *model,
            *extra,
            *_group(world, STARTUP_LIMIT_S),
        )
    ]
    ranks += [
        Rank(
            names[k],
            tmp_path,
            f"consumer{k}",
            "role=consumer",
            "group.host=10.77.0.1",
            "sink=verify",
            *extra,
            *_group(world, STARTUP_LIMIT_S, k),
        )
        for k in range(1, world)
    ]
    try:
        codes = [r.wait(STARTUP_LIMIT_S * 2) for r in ranks]
    finally:
        for r in ranks:
            r.kill()
    for r, code in zip(ranks, codes):
        assert code == 0, f"{r.name}:\n{r.text()[-3000:]}"
    for r in ranks[1:]:
        assert r.metrics()["verified"] is True
    assert ranks[0].metrics()["bytes"] > 190 * 2**20
    return ranks


@pytest.mark.parametrize("consumers", [1, 2, 3])
def test_verified_refit_across_hosts(hosts, tmp_path: Path, consumers: int) -> None:
    _verified_refit(hosts, tmp_path, consumers)


def test_a_partition_mid_transfer_fails_every_rank_within_the_deadline(hosts, tmp_path: Path) -> None:
    names = hosts(2, "1gbit")
    run = ["refit.rounds=1000", "source.size=32MiB", "refit.buffer_size_bytes=4MiB"]
    producer = Rank(
        names[0], tmp_path, "producer", "role=producer", "group.host=0.0.0.0", *run, *_group(2, FAIL_TIMEOUT_S)
    )
    consumer = Rank(
        names[1], tmp_path, "consumer1", "role=consumer", "group.host=10.77.0.1", *_group(2, FAIL_TIMEOUT_S, 1)
    )
    try:
        # Both sides are past their start-up once the second round is done: cut the consumer's link then.
        producer.wait_for(r"round 2/1000", STARTUP_LIMIT_S)
        assert hosts_sh("link", names[1], "down").returncode == 0
        cut = time.monotonic()
        codes = {r.name: r.wait(EXIT_BUDGET_S + 10) for r in (producer, consumer)}
        took = time.monotonic() - cut
    finally:
        producer.kill()
        consumer.kill()
    assert codes == {"producer": 1, "consumer1": 1}, producer.text()[-2000:] + consumer.text()[-2000:]
    assert took <= EXIT_BUDGET_S, f"{took:.1f}s after the partition; budget {EXIT_BUDGET_S:g}s"
    print(f"partition: both ranks exited 1 within {took:.1f}s of the cut (group.timeout_s={FAIL_TIMEOUT_S:g})")
    for r in (producer, consumer):
        lines = r.error_lines()
        print(f"  {r.name}: {lines}")
        assert len(lines) == 1, r.text()[-3000:]
        assert re.search(r"round \d+|lost|no progress|did not report", lines[0]), lines
    assert producer.metrics()["status"] == "failed"


def test_a_link_down_for_3s_of_a_10s_deadline_does_not_fail_the_run(hosts, tmp_path: Path) -> None:
    """An outage survives when TCP's next retransmission after the link is back still falls inside the deadline.
    Retransmissions back off (about 0.2, 0.6, 1.4, 3, 6.2, 12.6 s after the loss), so with group.timeout_s=10 the
    last one inside it comes about 6 s in: 3 s is well within that, and docs/failures.md has the measured limit
    (scripts/netns_outage.py)."""
    names = hosts(2, "1gbit")
    run = ["refit.rounds=20", "source.size=32MiB", "refit.buffer_size_bytes=4MiB"]
    producer = Rank(
        names[0], tmp_path, "producer", "role=producer", "group.host=0.0.0.0", *run, *_group(2, FAIL_TIMEOUT_S)
    )
    consumer = Rank(
        names[1], tmp_path, "consumer1", "role=consumer", "group.host=10.77.0.1", *_group(2, FAIL_TIMEOUT_S, 1)
    )
    try:
        producer.wait_for(r"round 2/20", STARTUP_LIMIT_S)
        assert hosts_sh("link", names[1], "down").returncode == 0
        # The outage itself is the event under test: 3 s of the group.timeout_s of 10 s.
        timer = threading.Timer(3.0, hosts_sh, ("link", names[1], "up"))
        timer.start()
        codes = [r.wait(STARTUP_LIMIT_S) for r in (producer, consumer)]
        timer.join()
    finally:
        producer.kill()
        consumer.kill()
    assert codes == [0, 0], producer.text()[-2000:] + consumer.text()[-2000:]
    assert consumer.metrics()["rounds_done"] == 20 and consumer.metrics()["verified"] is True


def test_a_consumer_that_cannot_reach_the_producer_says_so(hosts, tmp_path: Path) -> None:
    names = hosts(2)
    assert hosts_sh("link", names[1], "down").returncode == 0
    consumer = Rank(
        names[1], tmp_path, "consumer1", "role=consumer", "group.host=10.77.0.1", *_group(2, FAIL_TIMEOUT_S, 1)
    )
    started = time.monotonic()
    try:
        assert consumer.wait(STARTUP_LIMIT_S + EXIT_BUDGET_S) == 1
    finally:
        consumer.kill()
    print(f"unreachable producer: the consumer exited 1 after {time.monotonic() - started:.1f}s")
    assert consumer.error_lines() == [
        f"refit_app: error: could not reach the producer at 10.77.0.1:{PORT} within {FAIL_TIMEOUT_S:g}s; start "
        "the producer (group.rank=0) or check group.host and group.port"
    ], consumer.text()[-2000:]


def test_a_chain_over_three_consumer_hosts_is_verified(hosts, tmp_path: Path) -> None:
    """``group.topology=chain`` (issue 13): each consumer host relays every chunk to the next one over its own
    rate-limited link; every consumer checks every byte."""
    ranks = _verified_refit(hosts, tmp_path, 3, "group.topology=chain", "group.backend=gloo")
    for k, r in enumerate(ranks[1:], start=1):
        relays = f"forwards to rank {k + 1}" if k < 3 else "forwards to nobody"
        assert f"rank {k}: chain topology: receives from rank {k - 1}, {relays}" in r.text(), r.text()[-3000:]


def test_the_link_benchmark_times_verified_rounds_against_the_limit_on_the_same_link() -> None:
    """``scripts/netns_bench.py --verify``: every round of the refit is verified by the consumer, the limit runs on
    the same link between them, and the table names both as multiples of B / R; the hosts are gone afterwards."""
    script = NETNS_SCRIPT.parent / "netns_bench.py"
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            "--rate",
            "2gbit",
            "--preset",
            "llama-1b",
            "--size",
            "64MiB",
            "--consumers",
            "1",
            "--topologies",
            "tree",
            "--buffers",
            "default",
            "--rounds",
            "3",
            "--verify",
            "--timeout-s",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=STARTUP_LIMIT_S * 2,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "consumers verify every round" in run.stdout, run.stdout
    row = next(line for line in run.stdout.splitlines() if line.startswith("| tree | 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    refit_s, refit_x, limit_s, limit_x, ratio = cells[2:7]
    # 67 MB at 250 MB/s: B / R = 0.27 s. Neither side beats the link by more than tbf's 4 MB burst (6%).
    assert float(refit_x.split("x")[0]) >= 0.9 and float(limit_x.rstrip("x")) >= 0.9, row
    assert float(ratio) == pytest.approx(float(limit_s) / float(refit_s), abs=0.06), row
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert "refit-bench" not in listed
