"""Ray: the library's actors-as-a-group (``examples/ray_refit.py``) and ``role=ray``, on real local Ray clusters.

One cluster per module (started here with ``ray.init``, joined by the runs through ``ray.address`` / ``RAY_ADDRESS``)
pays Ray's start-up once; one test starts and stops a local cluster of its own, as ``role=ray`` does by default,
in a temp directory of its own, so that it can check that no process of that cluster is left. Every run has a
deadline; every test checks that the cluster got back every CPU (no actor or placement group left behind).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_utils import CLI_TIMEOUT_S, assert_ok, assert_one_line_error, load_metrics, run_dir
from conditions import needs_ray
from config_utils import compose_config
from ray_utils import assert_all_cpus_back, local_cluster

from refit_app import run
from refit_app.app.config import validate
from refit_app.common.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "ray_refit.py"
CLUSTER_CPUS = 4
"""Logical CPUs of the module's cluster: three ranks of one CPU each, and room for the example's three actors."""
RAY_RUN_S = 240.0
"""Hard limit on one run in these tests (Ray's start-up on a loaded 2-core machine included); only a hang nears it."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster for the module; its address."""
    with local_cluster(CLUSTER_CPUS) as ray:
        yield ray.get_runtime_context().gcs_address


def _all_cpus_back() -> None:
    assert_all_cpus_back(importlib.import_module("ray"), CLUSTER_CPUS)


@pytest.mark.ray
@needs_ray
def test_the_example_refits_two_engine_actors(cluster, cli):
    result = cli.start_command([str(EXAMPLE)], env={"RAY_ADDRESS": cluster}).wait(RAY_RUN_S)
    assert_ok(result)
    assert result.stdout.count("engine 1 verified: True, engine 2 verified: True") == 3, result.describe()
    assert "both engines serve the trainer's last weights: True" in result.stdout, result.describe()
    _all_cpus_back()


@pytest.mark.ray
@needs_ray
def test_role_ray_on_a_cluster_verifies_every_round_and_leaves_nothing(cluster, cli, tmp_path):
    result = cli(f"ray.address={cluster}", "role=ray", "group.world_size=3", "refit.rounds=3", timeout_s=RAY_RUN_S)
    assert_ok(result)
    metrics = load_metrics(run_dir(tmp_path, "ray"))
    assert (metrics["role"], metrics["status"], metrics["verified"], metrics["rounds_done"]) == ("ray", "ok", True, 3)
    consumers = metrics["consumers"]
    assert [c["rank"] for c in consumers] == [1, 2]
    assert all(r["verified"] for c in consumers for r in c["rounds"]) and all(len(c["rounds"]) == 3 for c in consumers)
    assert metrics["world_size"] == 3 and metrics["bytes"] > 0
    _all_cpus_back()


@pytest.mark.ray
@needs_ray
def test_role_ray_runs_a_sharded_refit_each_consumer_verifying_its_slices(cluster, cli, tmp_path):
    # Two producers (each holding its rows of every tensor) and two tensor-parallel consumers, four actors.
    result = cli(
        f"ray.address={cluster}", "role=ray", "group.producers=2", "group.tp_size=2", "refit.rounds=2",
        timeout_s=RAY_RUN_S,
    )  # fmt: skip
    assert_ok(result)
    metrics = load_metrics(run_dir(tmp_path, "ray"))
    assert (metrics["role"], metrics["status"], metrics["verified"], metrics["rounds_done"]) == ("ray", "ok", True, 2)
    assert [p["rank"] for p in metrics["producers"]] == [0, 1] and [c["rank"] for c in metrics["consumers"]] == [2, 3]
    consumers = metrics["consumers"]
    assert all(c["verified"] is True and c["verified_tensors"] == metrics["num_tensors"] for c in consumers)
    # Each consumer received its half of the model, not the whole: together exactly what the producers sent.
    sent = sum(r["bytes"] for r in metrics["rounds"])
    assert sum(c["bytes"] for c in consumers) == sent and all(0 < c["bytes"] < sent for c in consumers)
    assert "[producer 1] rank 1: joined" in result.stdout + result.stderr, result.describe()
    _all_cpus_back()


@pytest.mark.ray
@needs_ray
def test_a_rank_that_fails_fails_the_run_in_one_line_and_leaves_nothing(cluster, cli, tmp_path):
    result = cli(f"ray.address={cluster}", "role=ray", "refit.debug.corrupt_chunk=0", timeout_s=RAY_RUN_S)
    assert_one_line_error(result, "round 1: verification failed")
    metrics = load_metrics(run_dir(tmp_path, "ray"))
    assert metrics["status"] == "failed" and metrics["consumers"][0]["status"] == "failed"
    _all_cpus_back()


@pytest.mark.ray
@needs_ray
def test_bundles_the_cluster_cannot_place_are_one_line_within_the_deadline(cluster, cli):
    result = cli(
        f"ray.address={cluster}",
        "role=ray",
        "ray.strategy=STRICT_SPREAD",
        "ray.start_timeout_s=2",
        timeout_s=RAY_RUN_S,
    )
    assert_one_line_error(result, "within ray.start_timeout_s=2s", "STRICT_SPREAD needs a node per rank, 2")
    _all_cpus_back()


@pytest.mark.ray
@needs_ray
def test_ctrl_c_stops_the_run_and_leaves_nothing(cluster, cli, tmp_path):
    proc = cli.start(f"ray.address={cluster}", "role=ray", "refit.rounds=100000", "sink=discard")
    log = _wait_for_round(tmp_path, 2)
    os.killpg(proc._proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the whole foreground group
    result = proc.wait(60)
    assert result.returncode == 130, result.describe()
    assert_one_line_error(result, "interrupted by SIGINT")
    assert load_metrics(log.parent)["status"] == "failed"
    _all_cpus_back()


@pytest.mark.ray
@needs_ray
def test_role_ray_starts_a_local_cluster_and_stops_it(cli, tmp_path):
    temp = tempfile.mkdtemp(prefix="rl", dir="/tmp")  # the run's cluster's files: its processes name this path
    started = time.monotonic()
    result = cli("role=ray", "group.world_size=3", "refit.rounds=5", env={"RAY_TMPDIR": temp}, timeout_s=RAY_RUN_S)
    assert_ok(result)
    metrics = load_metrics(run_dir(tmp_path, "ray"))
    assert metrics["verified"] is True and metrics["rounds_done"] == 5
    assert all(c["verified"] and c["rounds_done"] == 5 for c in metrics["consumers"])
    assert len(metrics["consumers"]) == 2
    left = [pid for pid in _pids() if temp in _cmdline(pid)]
    assert not left, f"processes of the run's Ray cluster left: {[_cmdline(p) for p in left]}"
    print(f"role=ray with a local cluster: {time.monotonic() - started:.1f}s", file=sys.stderr)


@pytest.mark.ray
@needs_ray
def test_sigterm_to_the_whole_process_group_with_a_local_cluster_is_one_line_and_leaves_nothing(cli, tmp_path):
    """``timeout``, ``kill -- -PGID`` and schedulers signal every process of the job: the local cluster's processes,
    started in the driver's group, must outlive the signal until the driver has cleaned up (else its clean-up
    waited 60 s for a GCS that was gone, and Ray ended it without the one line)."""
    temp = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    proc = cli.start("role=ray", "refit.rounds=100000", "sink=discard", env={"RAY_TMPDIR": temp})
    log = _wait_for_round(tmp_path, 2)
    os.killpg(proc._proc.pid, signal.SIGTERM)
    signalled = time.monotonic()
    result = proc.wait(RAY_RUN_S)
    assert result.returncode == 143, result.describe()
    assert_one_line_error(result, "interrupted by SIGTERM")
    # The clean-up: kill the actors, remove the placement group, stop the cluster (each process gets a second's
    # grace, as its SIGTERM is blocked); well under Ray's 60 s wait for a lost GCS, on two busy cores.
    assert time.monotonic() - signalled < 45, result.describe()
    assert load_metrics(log.parent)["status"] == "failed"
    left = [pid for pid in _pids() if temp in _cmdline(pid)]
    assert not left, f"processes of the run's Ray cluster left: {[_cmdline(p) for p in left]}"


def _wait_for_round(tmp_path: Path, k: int) -> Path:
    """The run's log, once round ``k`` has ended in it (the signal of readiness)."""
    deadline = time.monotonic() + RAY_RUN_S
    while time.monotonic() < deadline:
        logs = list((tmp_path / "outputs").glob("*/*_ray/*.log"))
        if logs and f"round {k}/" in logs[0].read_text():
            return logs[0]
        time.sleep(0.5)
    raise AssertionError(f"no round {k} ended within {RAY_RUN_S:g}s")


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.ray
@needs_ray
def test_an_address_where_nothing_listens_is_one_line_in_seconds(cli):
    result = cli("role=ray", "ray.address=127.0.0.1:1", timeout_s=RAY_RUN_S)
    assert_one_line_error(result, "ray.address=127.0.0.1:1: nothing answers there", "ray start --head")
    assert result.wall_s < 60, result.describe()


# -- without Ray -------------------------------------------------------------------------------------------------


def test_without_ray_role_ray_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(ConfigError, match=r"role=ray needs the ray extra: pip install 'refit_app\[ray\]'"):
        run(compose_config(["role=ray"]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("ray.strategy=FOO", "ray.strategy='FOO' is invalid: choose one of SPREAD, STRICT_SPREAD, PACK"),
        ("ray.cpus_per_rank=0", "ray.cpus_per_rank=0.0 is invalid: must be a number > 0"),
        ("group.port=29500", "role=ray picks a free port on the producer's node"),
        ("group.rank=1", "role=ray assigns ranks itself"),
    ],
)
def test_role_ray_refuses_bad_settings_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate(compose_config(["role=ray", override]))


def test_role_ray_defaults_to_one_consumer_and_other_roles_never_import_ray(cli):
    s = validate(compose_config(["role=ray"]))
    assert (s.role, s.group.world_size, s.group.port, s.ray.strategy, s.ray.address) == ("ray", 2, None, "SPREAD", None)
    assert validate(compose_config([])).ray is None
    check = (
        "import sys, refit_app.__main__, refit_app.app.local, refit_app.app.roles, refit_app.app.ray_role; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    result = cli.start_command(["-c", check]).wait(CLI_TIMEOUT_S)
    assert result.returncode == 0, result.describe()
