"""Ray clusters for the tests. Local ones (tests/test_ray.py, tests/test_ray_elastic.py): started with ``ray.init``
in a temp directory of their own, stopped with ``ray.shutdown``; and the check that a run left nothing on one. And
a cluster of two nodes in two namespace hosts (tests/test_ray_netns.py, scripts/ray_link.py): ``ray start`` in each,
stopped by the process ids in those namespaces, never with ``ray stop`` (which finds Ray's processes by name across
the whole machine). Imports neither pytest nor Ray.
"""

from __future__ import annotations

import importlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netns_utils import stop_namespace_processes

from refit_app.app.ray_role import RAY_WORKER_NICENESS_ENV

HEAD_PORT = 6390
"""The head's GCS port inside its namespace host (a network stack of its own: nothing else holds it there)."""
OBJECT_STORE_BYTES = 100 * 10**6
"""Each node's object store (Ray's minimum is 75 MiB): the refit's bytes never go through it."""


@contextmanager
def local_cluster(cpus: int, pythonpath: str | None = None) -> Iterator[Any]:
    """A local cluster of ``cpus`` logical CPUs, as the ``ray`` module; ``pythonpath``: a folder the workers import
    from too (actor classes defined in a test module)."""
    ray = importlib.import_module("ray")
    # Workers at the tests' own priority, not Ray's default niceness 15: under two busy loops a niced actor gets a
    # few percent of a core and every Ray test took minutes (the application does the same for its own clusters).
    os.environ.setdefault(RAY_WORKER_NICENESS_ENV, "0")
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    runtime_env = None
    if pythonpath is not None:
        path = os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")]))
        runtime_env = {"env_vars": {"PYTHONPATH": path}}
    ray.init(
        address="local",
        num_cpus=cpus,
        include_dashboard=False,
        _temp_dir=temp,
        log_to_driver=False,
        runtime_env=runtime_env,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def assert_all_cpus_back(ray: Any, cpus: int) -> None:
    """Every CPU of the cluster is free again and every placement group removed: no actor or bundle of a run is
    left (Ray frees an actor's resources shortly after it ends: up to 30 s here)."""
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == cpus, ray.available_resources()
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@dataclass(frozen=True)
class NetnsCluster:
    address: str
    """``HOST:PORT`` of the head, for ``ray.address``."""
    env: dict[str, str]
    """The environment of the nodes, for a driver too: the cluster's own token (``RAY_AUTH_TOKEN``)."""
    namespaces: tuple[str, str]
    """The head's namespace host and the worker's."""
    start_seconds: tuple[float, float]
    """How long ``ray start`` took on the head and on the worker."""
    left: list[str]
    """After the ``with`` block: the command lines of processes that outlived SIGKILL (none, normally)."""


def _ray_start(ns: str, args: list[str], env: dict[str, str], timeout_s: float) -> float:
    """``ray start *args`` inside ``ns``; its output in a log under the node's temp dir; the seconds it took."""
    log = Path(next(a for a in args if a.startswith("--temp-dir=")).split("=", 1)[1]) / "ray_start.log"
    started = time.monotonic()
    with open(log, "w") as out:
        # ray start returns once its daemons run; they write to files of their own, never to this log.
        result = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "ray.scripts.scripts", "start", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=timeout_s,
            check=False,
        )
    if result.returncode != 0:
        raise RuntimeError(f"ray start in {ns} exited {result.returncode}:\n{log.read_text()[-3000:]}")
    return time.monotonic() - started


@contextmanager
def netns_cluster(
    head: str,
    worker: str,
    head_ip: str,
    *,
    cpus: int = 1,
    start_timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> Iterator[NetnsCluster]:
    """A Ray cluster of two nodes: ``ray start --head`` in namespace host ``head`` (at ``head_ip``), ``ray start
    --address`` in ``worker``, each with ``cpus`` CPUs, a small object store, no dashboard and a short temp dir of
    its own (Ray's socket paths must fit in 107 bytes). Token authentication with a token of the cluster's own,
    in the environment of the nodes (``env``, default this process's, without its ``RAY_*``; nothing is written
    to ``~/.ray``). At the end every process in both namespaces gets SIGTERM, then SIGKILL
    (:func:`netns_utils.stop_namespace_processes`), and the temp dirs go."""
    address = f"{head_ip}:{HEAD_PORT}"
    env = {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), **{RAY_WORKER_NICENESS_ENV: "0"})
    node = [f"--num-cpus={cpus}", f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats"]
    temps = [tempfile.mkdtemp(prefix="rn", dir="/tmp") for _ in range(2)]
    left: list[str] = []
    try:
        head_s = _ray_start(
            head,
            ["--head", f"--node-ip-address={head_ip}", f"--port={HEAD_PORT}", "--include-dashboard=false", *node,
             f"--temp-dir={temps[0]}"],
            env,
            start_timeout_s,
        )  # fmt: skip
        worker_s = _ray_start(worker, [f"--address={address}", *node, f"--temp-dir={temps[1]}"], env, start_timeout_s)
        yield NetnsCluster(address, env, (head, worker), (head_s, worker_s), left)
    finally:
        # As Ray itself stops (its GCS last): the worker node, then the head's processes, its GCS once they are gone.
        # Signalled all at once, the GCS and the head's raylet did not end within 10 s of SIGTERM.
        left += stop_namespace_processes([worker, head], last="gcs_server")
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)
