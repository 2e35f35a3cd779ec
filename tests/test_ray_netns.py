"""``role=ray`` on a Ray cluster of two nodes in two namespace hosts, where the refit's bytes cross the link between
them: ``ray start --head`` in host 1, ``ray start --address`` in host 2 (:func:`ray_utils.netns_cluster`), and the
driver in host 1 with ``ray.strategy=STRICT_SPREAD``, so that the producer's actor runs on one node and the
consumer's on the other. Needs network namespaces (root, as CI runs: skipped elsewhere) and Ray (failed in CI
without it). Ray's processes are stopped by the ids of the processes in the two namespaces, never by name."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from cli_utils import hermetic_env
from conditions import needs_netns, needs_ray
from netns_utils import Rank, listed_namespaces, namespace_hosts, namespace_pids, rx_bytes
from ray_utils import netns_cluster

pytestmark = [pytest.mark.netns, pytest.mark.ray, needs_netns, needs_ray]

RATE = "1gbit"
RATE_BYTES_S = 1e9 / 8
ROUNDS = 3
MODEL = ["source.preset=llama-1b", "source.size=64MiB"]
"""67 MB a round: 0.54 s at 1 Gbit/s, where tbf's 4 MB burst is 6%."""
HOST_IPS = ("10.77.0.1", "10.77.0.2")
"""The hosts' addresses (scripts/netns_hosts.sh): the head and the driver on the first."""
RUN_S = 240.0
"""Hard limit on the driver (the actors' start-up on a loaded 2-core machine included); only a hang nears it."""


def test_role_ray_across_two_nodes_verifies_every_round_over_the_link(tmp_path: Path) -> None:
    prefix = f"refit-r{os.getpid() % 10000}x"
    started = time.monotonic()
    with namespace_hosts(prefix) as make:
        host1, host2 = make(2, RATE)
        with netns_cluster(host1, host2, HOST_IPS[0], env=hermetic_env()) as cluster:
            rx_before = [rx_bytes(host1), rx_bytes(host2)]
            driver = Rank(
                host1,
                tmp_path,
                "ray",
                "role=ray",
                f"ray.address={cluster.address}",
                "ray.strategy=STRICT_SPREAD",
                "ray.start_timeout_s=120",
                "group.world_size=2",
                f"refit.rounds={ROUNDS}",
                "sink=verify",
                *MODEL,
                env=cluster.env,
            )
            try:
                code = driver.wait(RUN_S)
            finally:
                driver.kill()
            crossed = [rx_bytes(host1) - rx_before[0], rx_bytes(host2) - rx_before[1]]
        left_in = {ns: namespace_pids(ns) for ns in (host1, host2)}
    took = time.monotonic() - started
    head_s, worker_s = cluster.start_seconds
    print(f"two Ray nodes: {took:.1f}s in all; ray start {head_s:.1f}s (head), {worker_s:.1f}s (worker)")

    assert code == 0, driver.text()[-4000:]
    metrics = driver.metrics()
    assert (metrics["role"], metrics["status"], metrics["verified"], metrics["rounds_done"]) == ("ray", "ok", True, 3)
    [consumer] = metrics["consumers"]
    assert consumer["rank"] == 1 and consumer["verified"] is True
    assert all(r["verified"] for r in consumer["rounds"]) and len(consumer["rounds"]) == ROUNDS
    # Across nodes every rank is on gloo (auto takes shared memory only where all ranks share a host).
    assert metrics["backend"] == consumer["backend"] == "gloo"
    # The producer listens on its node's address; Ray marks an actor's lines with its node's address where that is
    # not the driver's (host 1): the two ranks ran on different nodes, and the bytes crossed the link between them.
    text = driver.text()
    nodes = _rank_nodes(text)
    producer_host = re.search(r"the producer at (10\.77\.0\.\d):", text)
    assert producer_host and nodes["producer"] == producer_host[1], text[-4000:]
    assert set(nodes.values()) == {HOST_IPS[0], HOST_IPS[1]}, (nodes, text[-4000:])
    # Every round's bytes came into the consumer's host over its link, at no more than the link's rate (tbf lets
    # a 4 MB burst through at once).
    model_bytes = sum(r["bytes"] for r in metrics["rounds"])
    assert model_bytes > ROUNDS * 64 * 2**20
    into_consumer = crossed[HOST_IPS.index(nodes["consumer 1"])]
    assert into_consumer >= model_bytes, (crossed, model_bytes)
    wire_s = sum(r["seconds"] for r in metrics["rounds"])
    assert wire_s >= 0.9 * model_bytes / RATE_BYTES_S, (wire_s, model_bytes / RATE_BYTES_S)
    # Nothing of the cluster is left: no process in either namespace, the namespaces gone.
    assert cluster.left == [] and left_in == {host1: [], host2: []}, (cluster.left, left_in)
    assert not [ns for ns in listed_namespaces() if ns.startswith(prefix)], listed_namespaces()


def _rank_nodes(text: str) -> dict[str, str]:
    """``{"producer": ip, "consumer 1": ip}``: the node each rank's lines came from, as Ray's prefix says
    (``(RankActor pid=N, ip=IP)``; no ``ip=`` on the driver's node)."""
    nodes = {}
    for m in re.finditer(r"\(RankActor pid=\d+(?:, ip=([\d.]+))?\)\S* \[[^]]*\]\[(producer|consumer \d+)\]", text):
        nodes.setdefault(m[2], m[1] or HOST_IPS[0])
    return nodes
