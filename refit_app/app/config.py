"""Validation at the edge: a composed config (checked against :mod:`refit_app.app.schema` while Hydra composed it)
becomes the typed :class:`RunSettings` the rest of the code takes as they are. Ranges and cross-key rules (a
consumer's rank, the world size of a local run) cannot be expressed as types; ``validate`` checks them all at once
and names every offending key in one line.

Over 500 lines as one module on purpose: every section's check writes into the one :class:`_Checker` that
:func:`validate` reports from, and reads other sections' values for the cross-key rules, so the checks of all sections
form one pass that reads top to bottom here."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from refit_app.app.schema import GROUP_SCHEMAS
from refit_app.checkpoint.layout import CONFIG_FILE_NAME
from refit_app.common.checks import Problems, is_int, show
from refit_app.common.errors import ConfigError, one_line
from refit_app.common.memory import memory_problem
from refit_app.common.sizes import format_size, parse_size
from refit_app.core.defaults import DEFAULT_NUM_BUFFERS
from refit_app.integrations.ray.defaults import (
    DEFAULT_CPUS_PER_RANK,
    DEFAULT_ELASTIC_RESTARTS,
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_STRATEGY,
    PLACEMENT_STRATEGIES,
)
from refit_app.integrations.vllm.defaults import MAX_SERVE_REQUESTS, PREFIX_CACHE_MODES
from refit_app.models.defaults import FLOAT_DTYPES, SYNTHETIC_UPDATES
from refit_app.models.presets import PRESETS
from refit_app.protocol.defaults import DEFAULT_DELTA, DEFAULT_ROUNDS, DELTA_MODES
from refit_app.transport.spec import (
    DEFAULT_HOST,
    DEFAULT_ON_CONSUMER_LOSS,
    DEFAULT_PORT,
    DERIVED_FIELDS,
    MAX_TIMEOUT_S,
    MAX_WORLD_SIZE,
    ON_CONSUMER_LOSS,
    GroupSpec,
    elastic_problem,
)


@dataclass(frozen=True)
class RefitSpec:
    """How tensors are packed and moved, and how many refits one run performs: the keys of ``refit`` (their
    meaning is the schema's, :class:`refit_app.app.schema.Refit`; ``refit.debug.*`` flattened), with what the typed
    value adds noted here."""

    buffer_size_bytes: int | None = None
    """None: the library default on a producer, the producer's value on a consumer (which otherwise insists on
    its own at the handshake)."""
    num_buffers: int = DEFAULT_NUM_BUFFERS
    use_legacy_packing: bool | None = False
    """None (a consumer's default): adopt the producer's mode."""
    rounds: int | None = DEFAULT_ROUNDS
    """Refits one run performs over one group; None only on a consumer: adopt the producer's (which otherwise
    insists on its own at the handshake)."""
    delta: str = DEFAULT_DELTA
    corrupt_chunk: int | None = None
    die_in_round: int | None = None
    die_rank: int = 1
    on_consumer_loss: str = DEFAULT_ON_CONSUMER_LOSS

    @property
    def elastic(self) -> bool:
        return self.on_consumer_loss == "continue"


@dataclass(frozen=True)
class SourceSpec:
    """A producer's source: the class that ``_target_`` names and its keyword arguments, already checked."""

    target: str
    params: dict[str, Any] = field(default_factory=dict)
    kind: str = field(default="custom", compare=False)
    """The config's ``source.kind`` (``synthetic``, ``model``, ...; ``custom`` for a user's own)."""


@dataclass(frozen=True)
class SinkSpec:
    """A consumer's sink: the class that ``_target_`` names and its keyword arguments, already checked."""

    target: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RaySpec:
    """Where ``role=ray`` runs its ranks (the ``ray.*`` keys), checked."""

    address: str | None = None
    """None: a local cluster of this run's own."""
    strategy: str = DEFAULT_STRATEGY
    cpus_per_rank: float = DEFAULT_CPUS_PER_RANK
    gpus_per_rank: float | None = None
    """None: 1 where the cluster has a GPU for every rank, else 0."""
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    max_restarts: int = 0
    """How often Ray restarts a consumer's actor (resolved from null: ``DEFAULT_ELASTIC_RESTARTS`` with continue, 0
    with fail)."""


@dataclass(frozen=True)
class ShardedSpec:
    """A sharded refit's layout (``group.producers``, ``group.tp_size``, ``group.replicas``): ranks ``0..producers-1``
    each hold a part of the model, ranks ``producers..`` are ``replicas`` engines of ``tp_size`` consumers each."""

    producers: int
    tp_size: int
    replicas: int
    engines: bool = field(default=False, compare=False)
    """The consumers are an engine's workers (``sink=vllm``): the application runs one engine process per replica,
    whose ``tp_size`` workers join the refit themselves. Not part of the layout ranks compare: a producer learns it
    from the consumers at the settings exchange (:mod:`refit_app.app.sharded_engine`)."""

    @property
    def world_size(self) -> int:
        """The application's processes: the producers, then each consumer, or each replica's engine process."""
        return self.producers + (self.replicas if self.engines else self.tp_size * self.replicas)

    def describe(self) -> str:
        """The layout as its keys, for messages."""
        if self.engines:
            return (
                f"group.producers={self.producers} + group.replicas={self.replicas} engine process(es) of "
                f"group.tp_size={self.tp_size} workers"
            )
        return (
            f"group.producers={self.producers} + group.tp_size={self.tp_size} x group.replicas={self.replicas} "
            f"consumers"
        )


SHARDED_SOURCES = ("synthetic", "model")
"""The sources a sharded refit reads so far: synthetic (each producer takes its rows of every tensor) and model (the
producers train it under FSDP2 and send their shards)."""
SHARDED_SINKS = ("verify", "discard", "save", "model", "vllm")
"""The sinks a sharded refit feeds so far (save: each consumer of replica 0 saves its slices; model: each consumer
a whole model, group.tp_size=1; vllm: an engine process per replica whose tensor-parallel workers are the consumers;
docs/sharded.md)."""
SHARDED_ELASTIC_SINKS = ("verify", "discard", "model", "save")
"""The sinks a sharded refit with ``refit.on_consumer_loss=continue`` feeds so far (each checks, drops or loads every
round it received, whatever round it joined at; model: a trainer's, its probe asked of the producers; save: at the
end, for each tensor-parallel rank the last generation's saving consumer of the lowest replica)."""
ENGINE_SINKS = ("vllm",)
"""Sinks whose consumers are an engine's workers: one process per replica (:attr:`ShardedSpec.engines`)."""


@dataclass(frozen=True)
class RunSettings:
    """Every setting of a run, checked; what the application runs with."""

    role: str
    group: GroupSpec
    """``group.port`` is None only for role=local, whose launcher picks a free port; rank 0 for role=local."""
    refit: RefitSpec
    source: SourceSpec | None
    """None where this role reads no source (a consumer)."""
    sink: SinkSpec | None
    """None where this role feeds no sink (a producer)."""
    sink_name: str | None = None
    """The built-in sink's name (verify, save, discard), or the user's class path; for metrics."""
    ray: RaySpec | None = None
    """role=ray's cluster and bundles; None for every other role."""
    sharded: ShardedSpec | None = None
    """A sharded refit's layout; None for a refit from one producer that holds the model whole."""

    @property
    def rank(self) -> int:
        return self.group.rank


CUSTOM = "custom"
"""What ``Checker.option`` returns for a user's own ``_target_`` source or sink."""

_ABSENT = object()
_ENV_REF = re.compile(r"oc\.env:\s*([A-Za-z_][A-Za-z0-9_]*)")


class _Checker(Problems):
    """Reads keys one by one and collects every problem, so that the user fixes them all in one go."""

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def get(self, key: str, required: bool = True, allowed: str = "") -> Any:
        """The value at ``key``, or ``_ABSENT`` after recording why it cannot be read.

        ``allowed`` describes valid values, for a key whose value comes from an environment variable that turned
        out not to fit its type.
        """
        try:
            value = OmegaConf.select(self.cfg, key, default=_ABSENT, throw_on_missing=True)
        except MissingMandatoryValue:
            if required:
                self.errors.append(f"{key} is required: add {key}=<value> to the command line")
            return _ABSENT
        except OmegaConfBaseException as e:
            env = self._env_var(key)
            cause = _config_error_in(e)
            if cause is not None:
                # role=auto's launcher lookup: its message names the variable; several keys share it, so once.
                if str(cause) not in self.errors:
                    self.errors.append(str(cause))
            elif env is not None:
                raw = os.environ.get(env)
                problem = " is not set" if raw is None else f"={raw!r} is invalid"
                self.errors.append(f"{key}: environment variable {env}{problem}: {allowed or one_line(e)}")
            else:
                self.errors.append(f"{key} cannot be read: {one_line(e)}")
            return _ABSENT
        if value is _ABSENT:
            self.errors.append(f"{key} is not in the config (was conf/ changed?)")
        return value

    def option(self, group: str, field_name: str, *, custom_allowed: bool = False) -> Any:
        """The option name a group node records (role.name, source.kind), checked against the option chosen.

        Overriding e.g. role.name=producer while role=local is selected would run one role with another's
        settings; the group option is the only way to choose.
        """
        key = f"{group}.{field_name}"
        options = GROUP_SCHEMAS[group]
        if OmegaConf.is_missing(self.cfg, group):
            self.errors.append(f"no {group} chosen: add {group}=<option>, {_one_of(tuple(options))}")
            return _ABSENT
        if custom_allowed and OmegaConf.get_type(OmegaConf.select(self.cfg, group)) not in options.values():
            # A user's own source or sink: a node with _target_ and no schema of ours.
            return CUSTOM if self.get(f"{group}._target_") is not _ABSENT else _ABSENT
        value = self.get(key)
        node = OmegaConf.select(self.cfg, group)
        chosen = next((name for name, schema in options.items() if OmegaConf.get_type(node) is schema), None)
        if value is not _ABSENT and value != chosen:
            how = f"{group}={value}" if value in options else f"{group}=<option>, {_one_of(tuple(options))}"
            self.fail(key, value, f"choose the {group} with {how}, not with {key}")
            return _ABSENT
        return value

    def unknown_keys(self, node: DictConfig, prefix: str = "") -> None:
        """Keys the schema does not know: Hydra refuses them unless added with ``+``, which its own error message
        suggests, and then a misspelled setting would be silently ignored."""
        schema = OmegaConf.get_type(node)
        if not dataclasses.is_dataclass(schema):
            return
        known = [f.name for f in dataclasses.fields(schema)]
        for key in node:
            key = str(key)
            if key not in known:
                where = f"keys under {prefix[:-1]}" if prefix else "top-level keys"
                self.errors.append(f"unknown key {prefix + key!r}; {where}: {', '.join(known)}")
            elif not OmegaConf.is_missing(node, key) and dataclasses.is_dataclass(OmegaConf.get_type(node, key)):
                self.unknown_keys(node[key], f"{prefix}{key}.")

    def env_note(self, key: str) -> str:
        env = self._env_var(key)
        return f" (from environment variable {env})" if env is not None else ""

    def _env_var(self, key: str) -> str | None:
        """The environment variable ``key`` interpolates, so that a bad value names where it came from."""
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(self.cfg, parent_key) if parent_key else self.cfg
        if not isinstance(parent, DictConfig) or not OmegaConf.is_interpolation(parent, leaf):
            return None
        raw = OmegaConf.to_container(parent, resolve=False).get(leaf)
        match = _ENV_REF.search(str(raw))
        return match.group(1) if match else None


_MAX_SEED = 2**63 - 1
"""The largest ``source.seed``: torch's generators take a 64-bit signed seed; a larger one failed after the ranks
started, in a line naming no key."""


def _config_error_in(e: BaseException) -> ConfigError | None:
    """The ConfigError a resolver raised (OmegaConf wraps it), or None."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ConfigError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _one_of(options: tuple[str, ...]) -> str:
    return "choose one of " + ", ".join(options)


def validate(cfg: DictConfig) -> RunSettings:
    """Check every value of a composed config and return the settings a run uses.

    Raises ConfigError with one line that lists every offending key, its value and what is allowed.
    """
    c = _Checker(cfg)
    c.unknown_keys(cfg)

    role = c.option("role", "name")
    num_consumers = c.get("role.num_consumers") if role == "local" else None
    if (
        role == "local"
        and num_consumers is not _ABSENT
        and not (is_int(num_consumers) and 1 <= num_consumers < MAX_WORLD_SIZE)
    ):
        c.fail("role.num_consumers", num_consumers, f"must be an integer in 1..{MAX_WORLD_SIZE - 1}")

    refit = _check_refit(c)
    sharded = _check_sharded(c, role, num_consumers)
    group = _check_group(c, role, num_consumers, sharded)
    if role == "auto" and group is not None:
        # Under a launcher every rank runs the same command: rank 0 produces (a sharded layout: ranks below
        # group.producers), the others consume.
        producer = group.rank < sharded.producers if sharded is not None else group.is_producer
        role = "producer" if producer else "consumer"
    if refit is not None and refit.rounds is None and role != "consumer":
        refit = dataclasses.replace(refit, rounds=DEFAULT_ROUNDS)
    source = _check_source(c, needed=role in ("local", "ray", "producer"))
    sink, sink_name = _check_sink(c, needed=role in ("local", "ray", "consumer"))
    ray = _check_ray(c) if role == "ray" else None
    if refit is not None and group is not None and refit.elastic:
        _check_elastic(c, role, group)
    if refit is not None and group is not None:
        _check_fault_hooks(c, refit, group, sharded)
        if role in ("local", "producer"):
            group = _check_shm_ring(c, refit, group)

    if c.errors:
        c.raise_any()
    return RunSettings(
        role=role, group=group, refit=refit, source=source, sink=sink, sink_name=sink_name, ray=ray, sharded=sharded
    )


def _check_sharded(c: _Checker, role: Any, num_consumers: Any) -> ShardedSpec | None:
    """``group.producers``, ``group.tp_size`` and ``group.replicas``; where any is above 1 (a sharded refit), what
    the application runs of one so far, every other setting refused in one line naming it."""
    sizes = {key: c.get(f"group.{key}") for key in ("producers", "tp_size", "replicas")}
    bad = False
    for key, value in sizes.items():
        if value is not _ABSENT and not (is_int(value) and 1 <= value < MAX_WORLD_SIZE):
            c.fail(f"group.{key}", value, f"must be an integer in 1..{MAX_WORLD_SIZE - 1}")
            bad = True
    if bad or _ABSENT in sizes.values() or all(v == 1 for v in sizes.values()):
        return None
    sink_kind = OmegaConf.select(c.cfg, "sink.kind", default=None)
    spec = ShardedSpec(**sizes, engines=_engines(c, role, sink_kind, ShardedSpec(**sizes)))
    if spec.world_size > MAX_WORLD_SIZE:
        c.fail(
            "group.producers",
            spec.producers,
            f"{spec.describe()} are {spec.world_size} ranks, more than {MAX_WORLD_SIZE}",
        )
    what = "a sharded refit"
    if role not in ("local", "ray", "auto", "producer", "consumer", _ABSENT):
        c.fail("role", role, f"{what} runs under role=local, ray, auto, producer or consumer, not role={role} yet")
    if role == "local" and num_consumers not in (1, _ABSENT):
        c.fail("role.num_consumers", num_consumers, f"{what} has group.tp_size x group.replicas consumers; leave it 1")
    kind = OmegaConf.select(c.cfg, "source.kind", default=None)
    if role in ("local", "ray", "auto", "producer", "consumer") and kind not in SHARDED_SOURCES:
        c.errors.append(f"{what} reads source=synthetic or source=model only so far, not source={kind or 'custom'}")
    device = c.get("source.device") if kind == "model" and role in ("local", "ray", "auto", "producer") else _ABSENT
    if device not in (_ABSENT, None, "cpu"):
        c.fail("source.device", device, f"{what} trains source=model on the CPU (FSDP2, gloo) so far: leave it null")
    kind = sink_kind
    if role in ("local", "ray", "auto", "consumer") and kind not in SHARDED_SINKS:
        c.errors.append(
            f"{what} feeds sink=verify, discard, save, model or vllm only so far, not sink={kind or 'custom'}"
        )
    if kind in ENGINE_SINKS and role in ("local", "ray", "auto", "consumer"):
        _check_engine_sink(c, role, kind, spec)
    if kind == "model" and spec.tp_size != 1:
        c.fail(
            "group.tp_size",
            spec.tp_size,
            f"{what} into sink=model builds the whole model on each consumer: give group.tp_size=1 (group.replicas "
            "for several models)",
        )
    source_kind = OmegaConf.select(c.cfg, "source.kind", default=None)
    if kind == "model" and role in ("local", "ray", "auto") and source_kind != "model":
        c.errors.append(f"{what} into sink=model needs a trainer to build the model from: source=model")
    for key, allowed, why in (
        ("refit.use_legacy_packing", (False, None), "does not send vLLM's legacy chunks"),
        ("group.topology", ("tree",), "takes no topology (its replicas chain by themselves): leave it tree"),
        ("group.backend", ("auto", "gloo"), "runs over gloo: leave it auto or give gloo"),
    ):
        value = c.get(key)
        if value is not _ABSENT and value not in allowed:
            c.fail(key, value, f"{what} {why}")
    if c.get("refit.on_consumer_loss") == "continue":
        _check_sharded_elastic(c, role)
    return spec


def _check_sharded_elastic(c: _Checker, role: Any) -> None:
    """What a sharded refit with refit.on_consumer_loss=continue runs so far (:mod:`refit_app.app.sharded_elastic`),
    every other setting refused in one line naming it."""
    what = "a sharded refit with refit.on_consumer_loss=continue"
    # Every role runs it: role=auto is a producer or a consumer by its rank (under torchrun on one host its agent
    # stops every worker when one fails; SLURM's srun and one launcher per host leave the others running).
    # Every source a sharded refit reads goes on too (source=model: the producers' FSDP2 trainer, its process group
    # on the run's store beside the generations; its consumers check keyed sums).
    sink = OmegaConf.select(c.cfg, "sink.kind", default=None)
    if role in ("local", "consumer", "auto", _ABSENT) and sink not in SHARDED_ELASTIC_SINKS:
        c.errors.append(f"{what} feeds sink=verify, discard, model or save only so far, not sink={sink or 'custom'}")
    corrupt_chunk = c.get("refit.debug.corrupt_chunk")
    if corrupt_chunk not in (None, _ABSENT):
        # Its fault hook kills a rank only: a chunk asked to be corrupted would arrive intact, and the run verified.
        c.fail("refit.debug.corrupt_chunk", corrupt_chunk, f"{what} injects refit.debug.die_in_round only so far")


def _engines(c: _Checker, role: Any, sink_kind: Any, layout: ShardedSpec) -> bool:
    """Whether this process's view of the layout has engine processes for consumers (:attr:`ShardedSpec.engines`):
    a consumer or role=local with an engine's sink; a producer (which has no sink) where its ``group.world_size``
    counts engine processes rather than consumers (the settings exchange confirms it)."""
    if role != "producer":
        return sink_kind in ENGINE_SINKS
    engine_world = dataclasses.replace(layout, engines=True).world_size
    return c.get("group.world_size") == engine_world != layout.world_size


def _check_engine_sink(c: _Checker, role: Any, kind: str, spec: ShardedSpec) -> None:
    """What a sharded refit into an engine (sink=vllm) does not run yet, in one line each."""
    what = f"a sharded refit into sink={kind}"
    if role not in ("local", "consumer"):
        c.fail("role", role, f"{what} runs under role=local, or role=producer and role=consumer, so far")
    if role == "local" and OmegaConf.select(c.cfg, "source.kind", default=None) != "model":
        c.errors.append(f"{what} needs a trainer to build the engine's model from: source=model")
    model = c.get("sink.model")
    if model not in (_ABSENT, None):
        c.fail("sink.model", model, f"{what} builds the engine from the trainer's config.json: leave it null")


def _check_fault_hooks(c: _Checker, refit: RefitSpec, group: GroupSpec, sharded: ShardedSpec | None) -> None:
    """A test hook that could never fire would let a test pass without its fault: refuse it."""
    if refit.die_in_round is None:
        return
    if sharded is not None and refit.die_rank >= sharded.world_size:
        c.fail(
            "refit.debug.die_rank",
            refit.die_rank,
            f"must be a rank in 1..{sharded.world_size - 1} ({sharded.describe()})",
        )
    elif sharded is None and refit.die_rank >= group.world_size:
        c.fail(
            "refit.debug.die_rank",
            refit.die_rank,
            f"must be a consumer rank in 1..{group.world_size - 1} (group.world_size={group.world_size})",
        )
    if refit.rounds is not None and refit.die_in_round > refit.rounds:
        c.fail("refit.debug.die_in_round", refit.die_in_round, f"must be a round in 1..{refit.rounds} (refit.rounds)")


def _check_shm_ring(c: _Checker, refit: RefitSpec, group: GroupSpec) -> GroupSpec:
    """The producer's shared-memory ring, refused here (naming the app's keys) where ``group.backend=shm`` would
    not fit it in this host's memory; the rendezvous checks it again for ``auto``, which then takes gloo."""
    if refit.buffer_size_bytes is None:
        return group  # the library's default target: a small share of memory, checked segment by segment
    ring = refit.num_buffers * refit.buffer_size_bytes
    if group.backend == "shm" and (problem := memory_problem(ring)) is not None:
        c.fail(
            "refit.buffer_size_bytes",
            c.get("refit.buffer_size_bytes"),
            f"group.backend=shm allocates refit.num_buffers={refit.num_buffers} x "
            f"{format_size(refit.buffer_size_bytes)} of shared memory in full, and {problem}; lower "
            "refit.buffer_size_bytes or refit.num_buffers, or use group.backend=gloo",
        )
    return dataclasses.replace(group, shm_ring_bytes=ring)


def _check_elastic(c: _Checker, role: str, group: GroupSpec) -> None:
    """What refit.on_consumer_loss=continue cannot run on, in one line (the group's rules are the transport's)."""
    # role=local and role=ray make a token of their own for every run.
    per_run = role in ("local", "ray")
    problem = elastic_problem(dataclasses.replace(group, token=group.token or "per-run") if per_run else group)
    if problem is not None:
        c.errors.append(problem)


def _check_refit(c: _Checker) -> RefitSpec | None:
    buffer_size = _size(c, "refit.buffer_size_bytes")
    num_buffers = c.get("refit.num_buffers", allowed="must be an integer >= 1")
    if num_buffers is not _ABSENT and not (is_int(num_buffers) and num_buffers >= 1):
        c.fail("refit.num_buffers", num_buffers, "must be an integer >= 1" + c.env_note("refit.num_buffers"))
    legacy = c.get("refit.use_legacy_packing")
    if legacy not in (None, _ABSENT) and not isinstance(legacy, bool):
        c.fail("refit.use_legacy_packing", legacy, "must be true, false or null (a consumer: adopt the producer's)")
    rounds = c.get("refit.rounds")
    if rounds not in (None, _ABSENT) and not (is_int(rounds) and rounds >= 1):
        c.fail("refit.rounds", rounds, "must be an integer >= 1, or null (a consumer: adopt the producer's)")
    delta = c.get("refit.delta")
    if delta is not _ABSENT and delta not in DELTA_MODES:
        c.fail("refit.delta", delta, _one_of(DELTA_MODES))
    on_loss = c.get("refit.on_consumer_loss")
    if on_loss is not _ABSENT and on_loss not in ON_CONSUMER_LOSS:
        c.fail("refit.on_consumer_loss", on_loss, _one_of(ON_CONSUMER_LOSS))
    corrupt_chunk = c.get("refit.debug.corrupt_chunk")
    if corrupt_chunk not in (None, _ABSENT) and not (is_int(corrupt_chunk) and corrupt_chunk >= 0):
        c.fail("refit.debug.corrupt_chunk", corrupt_chunk, "must be null or a chunk index >= 0")
    die_in_round = c.get("refit.debug.die_in_round")
    if die_in_round not in (None, _ABSENT) and not (is_int(die_in_round) and die_in_round >= 1):
        c.fail("refit.debug.die_in_round", die_in_round, "must be null or a round >= 1")
    die_rank = c.get("refit.debug.die_rank")
    if die_rank is not _ABSENT and not (is_int(die_rank) and die_rank >= 1):
        c.fail("refit.debug.die_rank", die_rank, "must be a rank >= 1 (a consumer's, or a sharded refit's producer)")
    if c.errors:
        return None
    return RefitSpec(
        buffer_size_bytes=buffer_size,
        num_buffers=num_buffers,
        use_legacy_packing=legacy,
        rounds=rounds,
        delta=delta,
        corrupt_chunk=corrupt_chunk,
        on_consumer_loss=on_loss,
        die_in_round=die_in_round,
        die_rank=die_rank,
    )


def _size(c: _Checker, key: str) -> int | None:
    """A size key in bytes; None where it is null."""
    value = c.get(key)
    if value in (None, _ABSENT):
        return None
    try:
        return parse_size(value, key=key)
    except ConfigError as e:
        c.errors.append(str(e))
        return None


def _check_group(c: _Checker, role: Any, num_consumers: Any, sharded: ShardedSpec | None) -> GroupSpec | None:
    """The group settings, with the rules that depend on the role checked here and the rest by GroupSpec."""
    # Every field of GroupSpec but the derived ones comes from the key of the same name: a new group knob is a
    # schema field and a GroupSpec field (with its rule), nothing here.
    names = [f.name for f in dataclasses.fields(GroupSpec) if f.name not in DERIVED_FIELDS]
    values = {name: c.get(f"group.{name}") for name in names}
    if _ABSENT in values.values() or role is _ABSENT:
        # Which ranks are valid depends on the role; its own error already tells the user what to fix.
        return None
    world_size, rank = values["world_size"], values["rank"]
    if role == "local":
        # A local run starts every rank itself, so the group's shape follows from role.num_consumers.
        expected = 1 + num_consumers if is_int(num_consumers) and 1 <= num_consumers < MAX_WORLD_SIZE else None
        ranks = f"1 producer + role.num_consumers={show(num_consumers)} consumers"
        if sharded is not None:
            expected, ranks = sharded.world_size, sharded.describe()
        if world_size not in (None, expected):
            c.fail("group.world_size", world_size, f"role=local runs {ranks}; leave it null")
        if rank is not None:
            c.fail("group.rank", rank, "role=local assigns ranks itself; leave it null")
        if values.get("local_rank") is not None:
            c.fail(
                "group.local_rank", values["local_rank"], "role=local gives each rank its own (its rank); leave it null"
            )
        values.update(world_size=expected or 2, rank=0)
    elif role == "ray":
        # Every rank is an actor that this run starts: ranks in order, the port on the producer's node.
        for key, why in (
            ("rank", "role=ray assigns ranks itself"),
            ("local_rank", "each actor uses the GPU Ray gives it"),
            ("port", "role=ray picks a free port on the producer's node"),
        ):
            if values[key] is not None:
                c.fail(f"group.{key}", values[key], f"{why}; leave it null")
        if values["host"] != DEFAULT_HOST:
            c.fail("group.host", values["host"], "role=ray takes the producer's address from its node; leave it unset")
        if sharded is not None:
            if world_size not in (None, sharded.world_size):
                c.fail("group.world_size", world_size, f"role=ray runs {sharded.describe()}; leave it null")
            values["world_size"] = sharded.world_size
        elif world_size is None:
            values["world_size"] = 2
        values.update(rank=0, local_rank=None)
    else:
        if values["port"] is None:
            values["port"] = DEFAULT_PORT
        if sharded is not None:
            return _sharded_rank_group(c, role, values, sharded)
        known_size = world_size if is_int(world_size) and world_size >= 2 else None
        if role == "producer" and rank not in (0, None):
            c.fail("group.rank", rank, "the producer is rank 0")
        if role == "consumer":
            top = known_size - 1 if known_size else None
            if not is_int(rank) or rank < 1 or (top is not None and rank > top):
                span = f"1..{top}" if top else "1..world_size-1"
                c.fail(
                    "group.rank",
                    rank,
                    f"a consumer's rank must be in {span} (rank 0 is the producer; group.world_size="
                    f"{show(known_size)})",
                )
        if role == "producer" or (role == "consumer" and not (is_int(rank) and known_size and 1 <= rank < known_size)):
            values["rank"] = 0  # refused above where it matters; GroupSpec checks the rest
    try:
        return GroupSpec(**values)
    except ConfigError as e:
        c.errors.append(str(e))
        return None


def _sharded_rank_group(c: _Checker, role: str, values: dict[str, Any], sharded: ShardedSpec) -> GroupSpec | None:
    """role=producer, consumer or auto in a sharded refit: the world size stated (every rank must agree on the
    layout) and a rank of this role's part of it (role=auto: any rank, its role follows from it)."""
    world, k, rank = sharded.world_size, sharded.producers, values["rank"]
    if values["world_size"] != world:
        # role=auto's world size is the launcher's task count, unless group.world_size was given.
        fix = (
            f"start {world} tasks (torchrun --nproc-per-node={world}, srun --ntasks={world})"
            if role == "auto"
            else f"give group.world_size={world} on every rank"
        )
        c.fail("group.world_size", values["world_size"], f"{sharded.describe()} are {world} ranks; {fix}")
    span = {"producer": range(k), "consumer": range(k, world)}.get(role, range(world))
    if not (is_int(rank) and rank in span):
        who = f"a {role}" if role != "auto" else "a rank"
        c.fail("group.rank", rank, f"{who} of {sharded.describe()} is one of ranks {span[0]}..{span[-1]}")
    if c.errors:
        return None
    try:
        return GroupSpec(**values)
    except ConfigError as e:
        c.errors.append(str(e))
        return None


def _check_ray(c: _Checker) -> RaySpec | None:
    """role=ray's ``ray.*`` keys."""
    address = c.get("ray.address")
    if address not in (None, _ABSENT) and not address.strip():
        c.fail("ray.address", address, "must be host:port of the cluster's head, auto, or null (a local cluster)")
    strategy = c.get("ray.strategy")
    if strategy is not _ABSENT and strategy not in PLACEMENT_STRATEGIES:
        c.fail("ray.strategy", strategy, _one_of(PLACEMENT_STRATEGIES))
    cpus = c.get("ray.cpus_per_rank")
    if cpus is not _ABSENT and not (_number(cpus) and cpus > 0):
        c.fail("ray.cpus_per_rank", cpus, "must be a number > 0")
    gpus = c.get("ray.gpus_per_rank")
    if gpus not in (None, _ABSENT) and not (_number(gpus) and gpus >= 0):
        c.fail("ray.gpus_per_rank", gpus, "must be a number >= 0, or null (1 where the cluster has a GPU per rank)")
    start = c.get("ray.start_timeout_s")
    if start is not _ABSENT and not (_number(start) and 0 < start <= MAX_TIMEOUT_S):
        c.fail("ray.start_timeout_s", start, f"must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}")
    elastic = c.get("refit.on_consumer_loss") == "continue"
    restarts = c.get("ray.max_restarts")
    if restarts not in (None, _ABSENT) and not (is_int(restarts) and restarts >= 0):
        c.fail(
            "ray.max_restarts",
            restarts,
            f"must be an integer >= 0, or null ({DEFAULT_ELASTIC_RESTARTS} with continue, 0 with fail)",
        )
    elif restarts not in (None, _ABSENT, 0) and not elastic:
        c.fail(
            "ray.max_restarts",
            restarts,
            "a restarted consumer can rejoin only with refit.on_consumer_loss=continue (with fail the run has failed)",
        )
    if c.errors:
        return None
    if restarts in (None, _ABSENT):
        restarts = DEFAULT_ELASTIC_RESTARTS if elastic else 0
    return RaySpec(
        address=address,
        strategy=strategy,
        cpus_per_rank=cpus,
        gpus_per_rank=gpus,
        start_timeout_s=start,
        max_restarts=restarts,
    )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value < float("inf")


def _check_source(c: _Checker, needed: bool) -> SourceSpec | None:
    """The source and its keyword arguments; a path is required only where the source is read."""
    kind = c.option("source", "kind", custom_allowed=True)
    if kind is _ABSENT or (not needed and kind != "synthetic"):
        return None
    node = OmegaConf.select(c.cfg, "source")
    target = c.get("source._target_")
    if kind == "synthetic":
        preset = c.get("source.preset")
        if preset is not _ABSENT and preset not in PRESETS:
            c.fail("source.preset", preset, _one_of(tuple(PRESETS)))
        size_bytes = _size(c, "source.size")
        seed = c.get("source.seed")
        if seed is not _ABSENT and not (is_int(seed) and 0 <= seed <= _MAX_SEED):
            c.fail("source.seed", seed, f"must be an integer in 0..{_MAX_SEED}")
        dtype = c.get("source.dtype")
        if dtype is not _ABSENT and dtype not in FLOAT_DTYPES:
            c.fail("source.dtype", dtype, _one_of(FLOAT_DTYPES))
        update = c.get("source.update")
        if update is not _ABSENT and update not in SYNTHETIC_UPDATES:
            c.fail("source.update", update, _one_of(SYNTHETIC_UPDATES))
        params = {
            "preset": preset,
            "size_bytes": size_bytes,
            "seed": seed,
            "dtype": dtype,
            "update": update,
            "lr": _learning_rate(c),
        }
    elif kind == "safetensors":
        path = c.get("source.path")
        if path is not _ABSENT and not Path(path).exists():
            c.fail("source.path", path, "no such file or directory; give a .safetensors file or a model directory")
        params = {"path": path}
    elif kind == "model":
        params = _check_model_source(c)
    else:
        params = _user_params(node)
    return SourceSpec(target, params, kind)


def _check_sink(c: _Checker, needed: bool) -> tuple[SinkSpec | None, str | None]:
    """The sink, its keyword arguments and its name; a path is required only where the sink is used."""
    kind = c.option("sink", "kind", custom_allowed=True)
    if kind is _ABSENT or not needed:
        return None, None
    node = OmegaConf.select(c.cfg, "sink")
    target = c.get("sink._target_")
    if kind == "save":
        path = c.get("sink.path")
        if path is not _ABSENT and not path.strip():
            c.fail("sink.path", path, "must name the directory to write the checkpoint into")
        return SinkSpec(target, {"path": path}), kind
    if kind == "model":
        probe_tokens = c.get("sink.probe_tokens")
        if probe_tokens is not _ABSENT and not (is_int(probe_tokens) and probe_tokens >= 0):
            c.fail("sink.probe_tokens", probe_tokens, "must be an integer >= 0 (0: no model check)")
        params = {"probe_tokens": probe_tokens, "verify": c.get("sink.verify"), "device": c.get("sink.device")}
        return SinkSpec(target, params), kind
    if kind == "vllm":
        params = {
            key: c.get(f"sink.{key}")
            for key in (
                "model", "probe_tokens", "verify", "strict", "max_model_len", "kv_cache_gib", "seed", "staged",
                "prefix_cache", "prepare", "serve_requests",
            )
        }  # fmt: skip
        model = params["model"]
        if model not in (None, _ABSENT) and not (Path(model) / CONFIG_FILE_NAME).is_file():
            c.fail("sink.model", model, "must be a Hugging Face model directory with a config.json, or null")
        probe_tokens, max_len = params["probe_tokens"], params["max_model_len"]
        if probe_tokens is not _ABSENT and not (is_int(probe_tokens) and probe_tokens >= 0):
            c.fail("sink.probe_tokens", probe_tokens, "must be an integer >= 0 (0: no model check)")
        elif max_len is not _ABSENT and not (is_int(max_len) and max_len > probe_tokens):
            c.fail("sink.max_model_len", max_len, f"must be an integer above sink.probe_tokens={probe_tokens}")
        kv = params["kv_cache_gib"]
        if kv is not _ABSENT and not (is_int(kv) and kv >= 1):
            c.fail("sink.kv_cache_gib", kv, "must be an integer >= 1")
        _check_staged_sink(c, params)
        return SinkSpec(target, params), kind
    if kind == CUSTOM:
        return SinkSpec(target, _user_params(node)), target
    return SinkSpec(target, {}), kind


def _check_staged_sink(c: _Checker, params: dict[str, Any]) -> None:
    """``sink.staged`` and its settings, and what a staged ``sink=vllm`` does not run."""
    for key in ("staged", "prepare"):
        if params[key] not in (_ABSENT, True, False):
            c.fail(f"sink.{key}", params[key], "must be true or false")
    if params["prefix_cache"] not in (_ABSENT, *PREFIX_CACHE_MODES):
        c.fail("sink.prefix_cache", params["prefix_cache"], _one_of(PREFIX_CACHE_MODES))
    serve = params["serve_requests"]
    if serve is not _ABSENT and not (is_int(serve) and 0 <= serve <= MAX_SERVE_REQUESTS):
        c.fail("sink.serve_requests", serve, f"must be an integer in 0..{MAX_SERVE_REQUESTS} (0: the engine idles)")
    if params["staged"] is not True:
        return
    what = "sink.staged=true"
    for key, allowed, why in (
        ("refit.on_consumer_loss", (DEFAULT_ON_CONSUMER_LOSS,), "stages in one session: leave it fail"),
        ("refit.use_legacy_packing", (False, None), "stages the packed format only"),
        ("refit.debug.corrupt_chunk", (None,), "stages rounds the sink never consumes chunk by chunk"),
    ):
        value = c.get(key)
        if value is not _ABSENT and value not in allowed:
            c.fail(key, value, f"{what} {why}")
    for key in ("group.producers", "group.tp_size", "group.replicas"):
        value = c.get(key)
        if is_int(value) and value > 1:
            c.fail(key, value, f"{what} stages a one-producer refit into one engine so far")


def _check_model_source(c: _Checker) -> dict[str, Any]:
    """A transformers model directory and the training settings of the trainer that sends it."""
    path = c.get("source.path")
    if path is not _ABSENT and not (Path(path) / CONFIG_FILE_NAME).is_file():
        c.fail("source.path", path, f"must be a Hugging Face model directory with a {CONFIG_FILE_NAME}")
    dtype = c.get("source.dtype")
    if dtype not in (None, _ABSENT) and dtype not in FLOAT_DTYPES:
        c.fail("source.dtype", dtype, _one_of(FLOAT_DTYPES) + " (or null: the checkpoint's)")
    send_dtype = c.get("source.send_dtype")
    if send_dtype not in (None, _ABSENT) and send_dtype not in FLOAT_DTYPES:
        c.fail("source.send_dtype", send_dtype, _one_of(FLOAT_DTYPES) + " (or null: as trained)")
    params: dict[str, Any] = {"path": path, "dtype": dtype, "send_dtype": send_dtype, "device": c.get("source.device")}
    for key, least in (("train_steps", 1), ("batch_tokens", 2), ("seed", 0)):
        value = c.get(f"source.{key}")
        if value is not _ABSENT and not (is_int(value) and value >= least and (key != "seed" or value <= _MAX_SEED)):
            c.fail(
                f"source.{key}",
                value,
                f"must be an integer in 0..{_MAX_SEED}" if key == "seed" else f"must be an integer >= {least}",
            )
        params[key] = value
    params["lr"] = _learning_rate(c)
    return params


def _learning_rate(c: _Checker) -> Any:
    """``source.lr``: a finite number > 0 (an infinite one would turn every weight into inf or NaN)."""
    lr = c.get("source.lr")
    if lr is not _ABSENT and not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr < float("inf")):
        c.fail("source.lr", lr, "must be a number > 0")
    return lr


def _user_params(node: DictConfig) -> dict[str, Any]:
    """A user's own source or sink: every key but ``_target_``, resolved, as keyword arguments."""
    params = OmegaConf.to_container(node, resolve=True)
    params.pop("_target_", None)
    return params
