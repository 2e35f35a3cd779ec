"""Local Ray clusters for the tests (tests/test_ray.py, tests/test_ray_elastic.py): started with ``ray.init`` in a
temp directory of their own, stopped with ``ray.shutdown``; and the check that a run left nothing on one."""

from __future__ import annotations

import importlib
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def local_cluster(cpus: int, pythonpath: str | None = None) -> Iterator[Any]:
    """A local cluster of ``cpus`` logical CPUs, as the ``ray`` module; ``pythonpath``: a folder the workers import
    from too (actor classes defined in a test module)."""
    ray = importlib.import_module("ray")
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
