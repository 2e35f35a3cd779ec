"""The launchers users already have: ``role=auto`` under a real torchrun and with SLURM's environment, and sweeps
through hydra-submitit-launcher's local executor (one directory per task). The GPU each rank of a host takes is in
test_devices.py.

The environment parsing is pure (:mod:`refit_app.app.launcher_env`) and tested with plain dicts; the config tests
compose the real conf/ with the variables set in this process; the torchrun and submitit tests run the application as
a user types it.
"""

from __future__ import annotations

import csv
import json
import re
import socket
from pathlib import Path

import pytest
from cli_utils import COVER_STARTUP, assert_ok, assert_one_line_error, load_metrics, sweep_dir
from conditions import needs_submitit_launcher
from config_utils import compose_config, refused, settings
from mp_utils import STARTUP_LIMIT_S
from omegaconf import OmegaConf

from refit_app.app.launcher_env import (
    JOB_PORT_SPAN,
    LAUNCHER_ENVS,
    LAUNCHER_PORT_OFFSET,
    expand_nodelist,
    launcher_setting,
)
from refit_app.common.errors import ConfigError
from refit_app.transport.spec import DEFAULT_PORT

TORCHRUN = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "trainer-0", "MASTER_PORT": "29400", "LOCAL_RANK": "1"}
SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[07-09,12]",
         "SLURM_JOB_ID": "123456"}  # fmt: skip


@pytest.fixture
def launcher_env(monkeypatch):
    """``launcher_env({...})`` makes exactly these the launcher variables of this process (which the config
    reads); none at all until it is called."""

    def set_env(values: dict[str, str]) -> None:
        for name in LAUNCHER_ENVS:
            monkeypatch.delenv(name, raising=False)
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    set_env({})
    return set_env


# --- SLURM node lists -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a,b", ["a", "b"]),
        ("gpu-[9-11],cpu5", ["gpu-9", "gpu-10", "gpu-11", "cpu5"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("x[2],y[5-6]", ["x2", "y5", "y6"]),
    ],
)
def test_nodelist_expands_like_slurm(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[01-", "node[3-1]", "node[a-b]", "node]1[", "", " , "])
def test_malformed_nodelist_is_refused_with_its_text(nodelist):
    with pytest.raises(ConfigError, match="node list") as info:
        expand_nodelist(nodelist)
    assert repr(nodelist) in str(info.value) and "group.host" in str(info.value)


# --- Which launcher, and what it gives -----------------------------------------------------------------------


def test_torchrun_environment():
    assert {k: launcher_setting(k, TORCHRUN) for k in ("rank", "world_size", "host", "port", "local_rank")} == {
        "rank": 2, "world_size": 3, "host": "trainer-0", "port": 29400 + LAUNCHER_PORT_OFFSET, "local_rank": 1,
    }  # fmt: skip
    # torchrun's own store listens on MASTER_PORT: the refit group never takes it.
    assert launcher_setting("port", TORCHRUN) != int(TORCHRUN["MASTER_PORT"])


def test_slurm_environment():
    got = {k: launcher_setting(k, SLURM) for k in ("rank", "world_size", "host", "port", "local_rank")}
    assert got == {"rank": 1, "world_size": 4, "host": "gpu07", "port": DEFAULT_PORT + 123456 % JOB_PORT_SPAN,
                   "local_rank": 1}  # fmt: skip
    # SLURM_NODELIST (older SLURM) is read where SLURM_JOB_NODELIST is absent; a job script's MASTER_* win.
    older = {**{k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "SLURM_NODELIST": "login,c[1-2]"}
    assert launcher_setting("host", older) == "login"
    scripted = {**SLURM, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "31000"}
    assert (launcher_setting("host", scripted), launcher_setting("port", scripted)) == ("10.0.0.5", 31001)


def test_submitit_local_environment():
    # hydra/launcher=submitit_local with tasks_per_node: every task on this machine, the job id is a process id.
    env = {"SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_LOCALID": "1",
           "SUBMITIT_LOCAL_JOB_ID": "40123"}  # fmt: skip
    got = {k: launcher_setting(k, env) for k in ("rank", "world_size", "host", "port", "local_rank")}
    assert got == {"rank": 1, "world_size": 2, "host": "127.0.0.1", "port": DEFAULT_PORT + 123, "local_rank": 1}
    # submitit's SLURM executor sets SLURM's variables, which come first.
    assert launcher_setting("rank", {**env, **SLURM}) == 1 and launcher_setting("host", {**env, **SLURM}) == "gpu07"


def test_torchrun_inside_slurm_uses_torchrun_ranks():
    # One torchrun per node in a SLURM job: SLURM_PROCID counts nodes, RANK counts processes.
    both = {**SLURM, **TORCHRUN}
    assert (launcher_setting("rank", both), launcher_setting("world_size", both)) == (2, 3)
    assert launcher_setting("local_rank", both) == 1


@pytest.mark.parametrize(
    "env,key,fragments",
    [
        (
            {},
            "rank",
            [
                "found no launcher",
                "RANK",
                "WORLD_SIZE",
                "MASTER_ADDR",
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_JOB_NODELIST",
                "group.rank",
            ],
        ),
        ({"RANK": "1"}, "world_size", ["torchrun", "WORLD_SIZE is not set", "group.world_size"]),
        ({"RANK": "1"}, "host", ["MASTER_ADDR is not set", "group.host"]),
        ({"RANK": "1"}, "port", ["MASTER_PORT is not set", "group.port"]),
        ({"RANK": "one"}, "rank", ["RANK='one' is not an integer"]),
        ({"RANK": "0", "MASTER_PORT": "65535"}, "port", ["MASTER_PORT=65535 leaves no port"]),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "host", ["SLURM_JOB_NODELIST or SLURM_NODELIST is not set"]),
        ({"SLURM_PROCID": "0"}, "world_size", ["SLURM", "SLURM_NTASKS is not set"]),
        ({"SLURM_PROCID": "0", "SLURM_LOCALID": "-1"}, "local_rank", ["SLURM_LOCALID='-1'"]),
    ],
)
def test_missing_or_malformed_variables_are_named(env, key, fragments):
    with pytest.raises(ConfigError) as info:
        launcher_setting(key, env)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_without_a_launcher_only_the_given_keys_are_needed():
    # group.rank, world_size and host given by hand: the port falls back to the producer/consumer default and the
    # current CUDA device is kept.
    assert launcher_setting("port", {}) == DEFAULT_PORT
    assert launcher_setting("local_rank", {}) is None
    assert launcher_setting("local_rank", {"RANK": "0"}) is None


# --- role=auto composed from the real conf/ ------------------------------------------------------------------


def test_role_auto_under_torchrun_is_a_consumer_or_the_producer(launcher_env):
    launcher_env(TORCHRUN)
    s = settings("role=auto")
    assert s.role == "consumer" and s.sink is not None
    g = s.group
    assert (g.rank, g.world_size, g.host, g.port, g.local_rank) == (2, 3, "trainer-0", 29401, 1)
    assert s.refit.use_legacy_packing is None  # consumers adopt the producer's packing mode
    assert compose_config(["role=auto"]).role.output_name == "auto2"

    launcher_env({**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"})
    s = settings("role=auto")
    assert s.role == "producer" and s.rank == 0 and s.source is not None and s.sink is None


def test_role_auto_in_a_sharded_layout_produces_below_group_producers(launcher_env):
    layout = ("role=auto", "group.producers=2", "group.tp_size=2")
    for rank, role in ((0, "producer"), (1, "producer"), (2, "consumer"), (3, "consumer")):
        launcher_env({**TORCHRUN, "RANK": str(rank), "WORLD_SIZE": "4"})
        s = settings(*layout)
        assert (s.role, s.rank, s.group.world_size, s.group.port) == (role, rank, 4, 29401), rank
        assert (s.sharded.producers, s.sharded.tp_size) == (2, 2) and (s.sink is None) == (role == "producer")
    launcher_env({**SLURM, "SLURM_PROCID": "3"})  # every launcher role=auto reads: SLURM's task 3 of 4
    assert settings(*layout).role == "consumer"
    launcher_env(TORCHRUN)  # three tasks started for a layout of four ranks
    assert refused(*layout) == (
        "group.world_size=3 is invalid: group.producers=2 + group.tp_size=2 x group.replicas=1 consumers are 4 ranks; "
        "start 4 tasks (torchrun --nproc-per-node=4, srun --ntasks=4)"
    )


def test_role_auto_under_slurm(launcher_env):
    launcher_env(SLURM)
    g = settings("role=auto").group
    assert (g.rank, g.world_size, g.host, g.port, g.local_rank) == (1, 4, "gpu07", DEFAULT_PORT + 456, 1)


def test_explicit_group_values_win_over_the_environment(launcher_env):
    launcher_env(TORCHRUN)
    g = settings("role=auto", "group.rank=1", "group.host=10.0.0.9", "group.port=31234", "group.local_rank=3").group
    assert (g.rank, g.world_size, g.host, g.port, g.local_rank) == (1, 3, "10.0.0.9", 31234, 3)
    # Given by hand, a key needs no variable at all.
    launcher_env({})
    s = settings("role=auto", "group.rank=1", "group.world_size=2", "group.host=10.0.0.9")
    assert (s.role, s.group.port, s.group.local_rank) == ("consumer", DEFAULT_PORT, None)


def test_role_auto_without_a_launcher_is_one_line_naming_what_is_missing(launcher_env):
    message = refused("role=auto")
    # Four keys read the launcher; the user reads the reason once.
    assert message.count("found no launcher") == 1, message
    assert message.startswith("role=auto found no launcher environment") and "SLURM_PROCID" in message
    assert compose_config(["role=auto"]).role.output_name == "auto"  # Hydra can still make the run directory


def test_role_auto_with_part_of_torchrun_names_each_missing_variable(launcher_env):
    launcher_env({"RANK": "1"})
    message = refused("role=auto")
    for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert f"{name} is not set" in message, message


def test_role_auto_rank_outside_the_world_is_refused(launcher_env):
    launcher_env({**TORCHRUN, "RANK": "3"})
    assert "group.rank=3 is invalid: must be in 0..2" in refused("role=auto")


def test_local_rank_is_checked(launcher_env):
    assert "group.local_rank=1 is invalid: role=local gives each rank its own" in refused("group.local_rank=1")
    assert "group.local_rank=-1 is invalid" in refused("role=consumer", "group.local_rank=-1")
    launcher_env({**TORCHRUN, "LOCAL_RANK": "x"})
    assert "LOCAL_RANK='x' is not an integer" in refused("role=auto")


def test_cli_role_auto_without_a_launcher(cli, launcher_env):
    result = cli("role=auto")
    assert_one_line_error(result, "role=auto found no launcher environment", "RANK", "SLURM_PROCID", "group.rank")


# --- torchrun, for real -------------------------------------------------------------------------------------


_MASTER_PORT_LOG = re.compile(r"master_port=(\d+)")


def _free_port_pair_below_the_ephemeral_range() -> int:
    """A port P such that P and P + 1 are free, below the kernel's ephemeral range.

    An OS-assigned port (``--rdzv-endpoint localhost:0``) lies inside that range, where P + 1 (the refit group's
    port under role=auto) can be the local end of any outgoing connection, torchrun's workers' own among them: seen
    in CI. Real jobs use a fixed MASTER_PORT (29500, 29501 for the group), outside the range, as this test does.
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in range(max(low - 4000, 1025), low - 1, 2):
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    # Not a property of the machine to skip on: 2000 pairs all taken at once means something holds them.
    pytest.fail(f"no free pair of ports among the 4000 below the ephemeral range ({low})")


def _torchrun(nproc: int, *overrides: str) -> list[str]:
    """``python -m torch.distributed.run`` arguments: ``nproc`` workers of ``python -m refit_app *overrides``, its
    c10d rendezvous on a free port below the ephemeral range, no restarts."""
    return [
        "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{_free_port_pair_below_the_ephemeral_range()}",
        "--max-restarts", "0",
        "-m", "refit_app", *overrides,
    ]  # fmt: skip


@pytest.mark.slow
def test_torchrun_three_ranks_verified_refit(cli, tmp_path, launcher_env):
    """``torchrun --nproc-per-node 3 -m refit_app role=auto``: rank 0 sends, ranks 1 and 2 verify, all exit 0, one
    run directory and metrics.json per rank, and the refit group beside torchrun's store, never on its port."""
    result = cli.start_command(
        _torchrun(3, "role=auto", COVER_STARTUP),
        # torchrun's agent logs the MASTER_PORT it gives its workers
        env={"LOGLEVEL": "INFO"},
    ).wait()
    assert_ok(result)
    ports = set(_MASTER_PORT_LOG.findall(result.stderr + result.stdout))
    assert len(ports) == 1, f"torchrun's master_port not found once in its log\n{result.describe()}"
    master_port = int(ports.pop())

    dirs = {r: sorted(tmp_path.glob(f"outputs/*/*_auto{r}")) for r in range(3)}
    assert all(len(d) == 1 for d in dirs.values()), dirs
    for rank, (directory,) in dirs.items():
        m = load_metrics(directory)
        assert (m["status"], m["rank"], m["world_size"]) == ("ok", rank, 3), m
        assert m["role"] == ("producer" if rank == 0 else "consumer")
        if rank:
            assert m["verified"] is True and m["verified_tensors"] == m["num_tensors"] > 0, m
        # The values this rank ran with.
        group = OmegaConf.load(directory / "config_resolved.yaml").group
        assert (group.rank, group.local_rank, group.host) == (rank, rank, "localhost")
        assert group.port == master_port + LAUNCHER_PORT_OFFSET, (group.port, master_port)


@pytest.mark.slow
def test_torchrun_sharded_layout_two_producers_two_consumers_verified(cli, tmp_path, launcher_env):
    """``torchrun --nproc-per-node 4 -m refit_app role=auto group.producers=2 group.tp_size=2``: ranks 0 and 1 send
    their rows, ranks 2 and 3 check their slices bit for bit every round; every rank exits 0 with its metrics."""
    result = cli.start_command(
        _torchrun(4, "role=auto", "group.producers=2", "group.tp_size=2", "refit.rounds=2", COVER_STARTUP)
    ).wait()
    assert_ok(result)
    for rank in range(4):
        (directory,) = tmp_path.glob(f"outputs/*/*_auto{rank}")
        m = load_metrics(directory)
        assert (m["status"], m["rank"], m["world_size"], m["rounds_done"]) == ("ok", rank, 4, 2), m
        assert m["role"] == ("producer" if rank < 2 else "consumer")
        if rank >= 2:
            assert m["verified"] is True and m["verified_tensors"] == m["num_tensors"] > 0, m


# --- hydra-submitit-launcher ----------------------------------------------------------------------------------


@pytest.mark.slow
@needs_submitit_launcher
def test_submitit_local_sweep_one_directory_per_task(cli, tmp_path):
    jobs = 2  # submitit's local executor runs them side by side, each a fresh interpreter that starts its ranks
    result = cli("-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10", "refit.num_buffers=1,2",
                 "sink=discard", COVER_STARTUP, timeout_s=(1 + jobs) * STARTUP_LIMIT_S)  # fmt: skip
    assert_ok(result)
    sweep = sweep_dir(tmp_path)
    assert (sweep / ".submitit").is_dir(), "the jobs did not go through submitit"

    metrics = {n: load_metrics(sweep / str(n)) for n in range(jobs)}
    assert [metrics[n]["num_buffers"] for n in range(jobs)] == [1, 2]
    assert all(m["status"] == "ok" and m["bytes"] > 0 for m in metrics.values()), metrics
    # One metrics.json per task, each in its own directory; no other directory holds one.
    assert sorted(p.parent.name for p in sweep.rglob("metrics.json")) == [str(n) for n in range(jobs)]

    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert sorted((r["job"], r["status"], r["num_buffers"]) for r in rows) == [("0", "ok", "1"), ("1", "ok", "2")]


@pytest.mark.slow
@needs_submitit_launcher
def test_submitit_local_tasks_are_role_auto_ranks_each_in_its_own_directory(cli, tmp_path):
    """Two tasks per job (as ``submitit_slurm`` runs a multi-task job): role=auto makes task 0 the producer and
    task 1 a consumer; each rank's jobs go to a sweep directory of its own (``..._auto0/<job>``, ``..._auto1/<job>``),
    with its own summary."""
    jobs = 2
    result = cli("-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
                 "hydra.launcher.timeout_min=10", "role=auto", "refit.num_buffers=1,2", COVER_STARTUP,
                 timeout_s=(1 + jobs) * STARTUP_LIMIT_S)  # fmt: skip
    assert_ok(result)
    multirun = tmp_path / "outputs" / "multirun"
    found = sorted(p.relative_to(multirun) for p in multirun.glob("*/*/*/metrics.json"))
    assert [(p.parts[1].rsplit("_", 1)[1], p.parts[2]) for p in found] == [
        ("auto0", "0"), ("auto0", "1"), ("auto1", "0"), ("auto1", "1"),
    ], found  # fmt: skip
    for path in found:
        m = json.loads((multirun / path).read_text())
        rank = int(path.parts[1][-1])
        assert (m["status"], m["rank"], m["world_size"]) == ("ok", rank, 2), m
        assert m["num_buffers"] == int(path.parts[2]) + 1
        if rank:
            assert m["verified"] is True, m
        rows = list(csv.DictReader((multirun / path.parents[1] / "summary.csv").open()))
        assert [(r["job"], r["status"], r["role"]) for r in rows] == [
            ("0", "ok", m["role"]), ("1", "ok", m["role"]),
        ]  # fmt: skip
