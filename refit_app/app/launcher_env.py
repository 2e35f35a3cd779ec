"""``role=auto``: the group settings a launcher (torchrun, SLURM, submitit) gives a task, read from the
environment variables it sets, each named here. Torch-free and pure (the environment is a parameter), so the config
can use it and tests pass plain dicts."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from refit_app.common.errors import ConfigError
from refit_app.transport.spec import DEFAULT_HOST, DEFAULT_PORT

# ---------------------------------------------------------------------------------------------------------------
# role=auto: a launcher's environment. Read through the ${refit_app.launcher:KEY} resolver of conf/role/auto.yaml,
# so an explicit group.KEY on the command line replaces the interpolation and wins without reading anything.
# ---------------------------------------------------------------------------------------------------------------

RANK_ENV = "RANK"
"""torchrun: this process's global rank (its presence is how role=auto recognises torchrun)."""
WORLD_SIZE_ENV = "WORLD_SIZE"
LOCAL_RANK_ENV = "LOCAL_RANK"
MASTER_ADDR_ENV = "MASTER_ADDR"
"""torchrun: rank 0's host; also honoured under the other launchers where a job script exports it."""
MASTER_PORT_ENV = "MASTER_PORT"
"""torchrun: the port its own c10d store already listens on, so the refit group never uses it (see
:data:`LAUNCHER_PORT_OFFSET`)."""
SLURM_PROCID_ENV = "SLURM_PROCID"
SLURM_NTASKS_ENV = "SLURM_NTASKS"
SLURM_LOCALID_ENV = "SLURM_LOCALID"
SLURM_NODELIST_ENVS = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
"""The job's hosts in SLURM's compressed syntax (``node[01-03,07]``); the first one runs task 0."""
SLURM_JOB_ID_ENV = "SLURM_JOB_ID"
SUBMITIT_LOCAL_GLOBALID_ENV = "SUBMITIT_LOCAL_GLOBALID"
"""submitit's local executor (``hydra/launcher=submitit_local`` with ``tasks_per_node``): the task's rank."""
SUBMITIT_LOCAL_NTASKS_ENV = "SUBMITIT_LOCAL_NTASKS"
SUBMITIT_LOCAL_LOCALID_ENV = "SUBMITIT_LOCAL_LOCALID"
SUBMITIT_LOCAL_JOB_ID_ENV = "SUBMITIT_LOCAL_JOB_ID"


@dataclass(frozen=True)
class Launcher:
    """Where one launcher keeps a task's rank, the task count, its index on its host, and its job's id."""

    name: str
    rank: str
    world_size: str
    local_rank: str
    job_id: str | None
    """The job's id (for a port of its own where MASTER_PORT is not set); None: MASTER_PORT is always set."""


TORCHRUN = Launcher("torchrun", RANK_ENV, WORLD_SIZE_ENV, LOCAL_RANK_ENV, None)
SLURM = Launcher("SLURM", SLURM_PROCID_ENV, SLURM_NTASKS_ENV, SLURM_LOCALID_ENV, SLURM_JOB_ID_ENV)
SUBMITIT_LOCAL = Launcher(
    "submitit's local executor",
    SUBMITIT_LOCAL_GLOBALID_ENV,
    SUBMITIT_LOCAL_NTASKS_ENV,
    SUBMITIT_LOCAL_LOCALID_ENV,
    SUBMITIT_LOCAL_JOB_ID_ENV,
)
LAUNCHERS = (TORCHRUN, SLURM, SUBMITIT_LOCAL)
"""In the order role=auto recognises them, by their rank variable. torchrun first: one torchrun per node inside a
SLURM job sets RANK to the global rank, while SLURM_PROCID there counts nodes; SLURM before submitit, whose SLURM
executor sets SLURM's own variables."""
LAUNCHER_ENVS = (
    MASTER_ADDR_ENV,
    MASTER_PORT_ENV,
    *SLURM_NODELIST_ENVS,
    *(v for la in LAUNCHERS for v in (la.rank, la.world_size, la.local_rank, la.job_id) if v),
)
"""Every launcher variable role=auto reads."""

LAUNCHER_PORT_OFFSET = 1
"""The refit group listens on ``MASTER_PORT + 1``. torchrun's agent store already owns MASTER_PORT (and a trainer's
own ``init_process_group`` in the same job expects it), so the refit group's store must not bind it; every rank
derives the same neighbour without talking to anyone. ``group.port`` overrides it."""
JOB_PORT_SPAN = 1000
"""Without MASTER_PORT (SLURM, submitit) the port is ``DEFAULT_PORT + job id % JOB_PORT_SPAN``, so that two jobs
sharing a node do not collide on one fixed port."""

LAUNCHER_KEYS = ("rank", "world_size", "host", "port", "local_rank")
"""The group settings a launcher provides (``${refit_app.launcher:KEY}``)."""

_NO_LAUNCHER = (
    f"role=auto found no launcher environment: neither torchrun's ({RANK_ENV}, {WORLD_SIZE_ENV}, {MASTER_ADDR_ENV}, "
    f"{MASTER_PORT_ENV}) nor SLURM's ({SLURM_PROCID_ENV}, {SLURM_NTASKS_ENV}, {SLURM_NODELIST_ENVS[0]}) is set; "
    "start it with torchrun or srun, or give group.rank, group.world_size and group.host"
)


def detect_launcher(env: Mapping[str, str]) -> Launcher | None:
    """The launcher that started this process, by its rank variable (see :data:`LAUNCHERS`), or None."""
    return next((la for la in LAUNCHERS if la.rank in env), None)


def launcher_setting(key: str, env: Mapping[str, str] | None = None) -> int | str | None:
    """The value of ``group.<key>`` that the launcher's environment gives (``env``: ``os.environ`` when None).

    Raises :class:`ConfigError` naming the variable that is missing or malformed and the key that would replace it.
    ``local_rank`` is None where the launcher does not say (the current CUDA device is kept).
    """
    env = os.environ if env is None else env
    if key not in LAUNCHER_KEYS:
        raise ConfigError(f"${{refit_app.launcher:{key}}}: unknown key; one of {', '.join(LAUNCHER_KEYS)}")
    la = detect_launcher(env)
    if la is None:
        # Without a launcher every key but these must be given; then role=auto is a producer or consumer by rank.
        if key in ("local_rank", "port"):
            return None if key == "local_rank" else DEFAULT_PORT
        raise ConfigError(_NO_LAUNCHER)
    if key in ("rank", "world_size"):
        return _int_env(env, getattr(la, key), key, la)
    if key == "local_rank":
        return _int_env(env, la.local_rank, key, la) if la.local_rank in env else None
    if key == "host":
        if la is TORCHRUN or env.get(MASTER_ADDR_ENV):
            return _str_env(env, MASTER_ADDR_ENV, key, la)
        if la is SUBMITIT_LOCAL:
            return DEFAULT_HOST  # submitit's local executor: every task runs on this machine
        nodelist = next((env[n] for n in SLURM_NODELIST_ENVS if env.get(n)), None)
        if nodelist is None:
            raise ConfigError(
                f"role=auto under SLURM: {' or '.join(SLURM_NODELIST_ENVS)} is not set; "
                "give group.host=<the host of task 0>"
            )
        return first_host(nodelist)
    # key == "port"
    if la.job_id is None or env.get(MASTER_PORT_ENV):
        master_port = _int_env(env, MASTER_PORT_ENV, key, la)
        port = master_port + LAUNCHER_PORT_OFFSET
        if not 1 <= port <= 65535:
            raise ConfigError(
                f"role=auto: {MASTER_PORT_ENV}={master_port} leaves no port for the refit group "
                f"({MASTER_PORT_ENV} + {LAUNCHER_PORT_OFFSET}); give group.port"
            )
        return port
    job = env.get(la.job_id, "")
    return DEFAULT_PORT + (int(job) % JOB_PORT_SPAN if job.isdigit() else 0)


def _str_env(env: Mapping[str, str], name: str, key: str, la: Launcher) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise ConfigError(f"role=auto under {la.name}: {name} is not set; give group.{key}")
    return value


def _int_env(env: Mapping[str, str], name: str, key: str, la: Launcher) -> int:
    raw = _str_env(env, name, key, la)
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"role=auto under {la.name}: {name}={raw!r} is not an integer >= 0; give group.{key}")
    return value


_BRACKETS = re.compile(r"\[([^\]]*)\]")


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list in full: ``node[01-03,07],gpu5`` -> node01, node02, node03, node07, gpu5.

    Ranges keep the zero padding of their lower bound; several bracket groups in one name (``r[1-2]n[1-2]``) expand
    as a product, the first varying slowest. Raises :class:`ConfigError` on a malformed list (no ``scontrol`` is
    needed).
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts += _expand_name(item, nodelist)
    if not hosts:
        raise ConfigError(f"role=auto: the SLURM node list {nodelist!r} names no host; give group.host")
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, where task 0 runs."""
    return expand_nodelist(nodelist)[0]


def _split_top_level(nodelist: str) -> list[str]:
    """Split at the commas outside brackets: ``a[1,3],b`` -> ``a[1,3]``, ``b``."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ConfigError(f"role=auto: malformed SLURM node list {nodelist!r}; give group.host")
        if ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"role=auto: malformed SLURM node list {nodelist!r} (unclosed '['); give group.host")
    items.append(nodelist[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_name(name: str, nodelist: str) -> list[str]:
    match = _BRACKETS.search(name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    return [
        head + part + rest for part in _expand_ranges(match.group(1), nodelist) for rest in _expand_name(tail, nodelist)
    ]


def _expand_ranges(spec: str, nodelist: str) -> list[str]:
    """``01-03,07`` -> 01, 02, 03, 07."""
    out: list[str] = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ConfigError(
                f"role=auto: malformed range {part!r} in the SLURM node list {nodelist!r}; give group.host"
            )
        width = len(lo)
        out += [str(n).zfill(width) for n in range(int(lo), int(hi if sep else lo) + 1)]
    return out
