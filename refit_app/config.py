"""The typed configuration of ``python -m refit_app``: the schema Hydra checks conf/ against, and the validation
that turns a composed config into plain settings before anything starts.

The dataclasses are registered with Hydra's ConfigStore as ``base_*`` and every YAML file under conf/ names its
schema first in its defaults list (Hydra's "Config Store + YAML" pattern), so a misspelled key or a value of the
wrong type is refused while the config is composed. Ranges and cross-key rules (a consumer's rank, the world
size of a local run) cannot be expressed as types; ``validate`` checks them all at once.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from refit_app.errors import ConfigError
from refit_app.sizes import parse_size

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
"""Absolute path of the top-level conf/ directory (the project is installed editable, so it sits beside the
package)."""

CONFIG_NAME = "config"

# The same names as refit_app.groups.BACKENDS and refit_app.sources.PRESETS (a test keeps them equal); repeated
# here so that checking a config does not import torch.
BACKENDS = ("auto", "gloo", "nccl", "pynccl")
SYNTHETIC_PRESETS = ("tiny", "llama-1b", "llama-8b", "qwen-0.5b", "lora")
SYNTHETIC_DTYPES = ("bfloat16", "float16", "float32", "float64")

DEFAULT_PORT = 29500
"""Rendezvous port of a producer/consumer run when ``group.port`` is null (``role=local`` picks a free one)."""

NUM_BUFFERS_ENV = "NRL_REFIT_NUM_BUFFERS"

# ---------------------------------------------------------------------------------------------------------------
# Schema. Field docstrings are the reference for every key; README lists the same keys.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Role:
    """Which part of a refit this process plays (the ``role`` config group)."""

    name: str = MISSING
    """local, producer or consumer; set by the chosen ``role=`` option."""
    output_name: str = MISSING
    """Suffix of this process's Hydra output directories: the role and rank, so that a producer and a consumer
    started in the same second never share one."""


@dataclass
class LocalRole(Role):
    name: str = "local"
    output_name: str = "local"
    num_consumers: int = 1
    """How many consumer processes to start next to the producer on this machine."""


@dataclass
class ProducerRole(Role):
    name: str = "producer"
    output_name: str = "producer"


@dataclass
class ConsumerRole(Role):
    name: str = "consumer"
    output_name: str = "consumer${group.rank}"


@dataclass
class RefitDebug:
    """Test-only fault hooks that prove the failure paths work; users never need them."""

    corrupt_chunk: Optional[int] = None
    """Index of a received chunk whose bytes a consumer flips, to show that ``sink=verify`` catches corruption."""


@dataclass
class Refit:
    """How tensors are packed and moved."""

    buffer_size_bytes: Optional[str] = None
    """Target packed-buffer size: bytes or a size such as 256MiB, 1GiB, 64MB. null: the library default on a
    producer; the producer's value on a consumer."""
    num_buffers: int = II(f"oc.env:{NUM_BUFFERS_ENV},2")
    """How many buffers are in flight at once; each side chooses its own."""
    use_legacy_packing: Optional[bool] = False
    """true: vLLM-compatible chunks. null (a consumer's default): adopt the producer's mode."""
    debug: RefitDebug = field(default_factory=RefitDebug)
    """Test-only fault hooks; not for users."""


@dataclass
class Group:
    """The process group: who talks to whom, over what, with which deadline."""

    backend: str = "auto"
    """auto (NCCL where every rank has a GPU, gloo otherwise), gloo, nccl or pynccl (needs vLLM)."""
    host: str = "127.0.0.1"
    """Address of the producer (rank 0) that every rank rendezvouses at."""
    port: Optional[int] = None
    """Rendezvous port. null: a free port for role=local, 29500 for a producer and its consumers."""
    world_size: Optional[int] = None
    """Number of ranks: the producer plus the consumers. null: 1 + role.num_consumers (role=local)."""
    rank: Optional[int] = None
    """This process's rank: 0 for the producer, 1..world_size-1 for a consumer; null for role=local."""
    timeout_s: float = 60.0
    """Deadline in seconds for the rendezvous and for every collective; a lost peer fails the run after it."""


@dataclass
class Source:
    """Where the producer's weights come from (the ``source`` config group)."""

    kind: str = MISSING
    """synthetic or safetensors; set by the chosen ``source=`` option."""


@dataclass
class SyntheticSource(Source):
    kind: str = "synthetic"
    preset: str = "tiny"
    """Model shape: tiny, llama-1b, llama-8b, qwen-0.5b or lora (thousands of small adapter matrices)."""
    size: Optional[str] = None
    """Scale the preset to this total size (e.g. 2GiB); null keeps the preset's own size."""
    seed: int = 0
    """Seed of the generated values, so that two runs send identical bytes."""
    dtype: str = "bfloat16"
    """Element type of the generated tensors: bfloat16, float16, float32 or float64."""


@dataclass
class SafetensorsSource(Source):
    kind: str = "safetensors"
    path: str = MISSING
    """A .safetensors file or a Hugging Face model directory (sharded or not)."""


@dataclass
class Sink:
    """What a consumer does with the tensors it receives (the ``sink`` config group)."""

    kind: str = MISSING
    """verify, save or discard; set by the chosen ``sink=`` option."""


@dataclass
class VerifySink(Sink):
    kind: str = "verify"


@dataclass
class SaveSink(Sink):
    kind: str = "save"
    path: str = MISSING
    """Directory that receives the checkpoint in Hugging Face layout (created if absent)."""


@dataclass
class DiscardSink(Sink):
    kind: str = "discard"


@dataclass
class Config:
    """The whole application config."""

    role: Role = MISSING
    refit: Refit = field(default_factory=Refit)
    group: Group = field(default_factory=Group)
    source: Source = MISSING
    sink: Sink = MISSING


_GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "role": {"local": LocalRole, "producer": ProducerRole, "consumer": ConsumerRole},
    "source": {"synthetic": SyntheticSource, "safetensors": SafetensorsSource},
    "sink": {"verify": VerifySink, "save": SaveSink, "discard": DiscardSink},
}


def register_schemas() -> None:
    """Make the schemas known to Hydra; YAML files refer to them as ``base_config`` and ``<group>/base_<option>``.

    Storing is idempotent, so importing this module more than once (tests, scripts) is harmless.
    """
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for group, options in _GROUP_SCHEMAS.items():
        for option, schema in options.items():
            store.store(group=group, name=f"base_{option}", node=schema)


register_schemas()


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The config ``python -m refit_app <overrides>`` would run with (without the ``hydra`` node), for tests and
    experiment scripts."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name=CONFIG_NAME, overrides=list(overrides or []))


def resolved_yaml(cfg: DictConfig) -> str:
    """The config actually used, interpolations resolved, as saved beside metrics.json."""
    return OmegaConf.to_yaml(cfg, resolve=True)


# ---------------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSettings:
    """Every setting of a run as plain Python values, checked; what the application runs with."""

    role: str
    num_consumers: int
    """Consumers in the group (world_size - 1)."""
    buffer_size_bytes: int | None
    """None: the library default (producer), the producer's value (consumer)."""
    buffer_size_explicit: bool
    """Whether refit.buffer_size_bytes was set: a consumer then insists on it at the handshake."""
    num_buffers: int
    use_legacy_packing: bool
    legacy_explicit: bool
    """Whether refit.use_legacy_packing was set (not null): a consumer then insists on it at the handshake."""
    corrupt_chunk: int | None
    backend: str
    host: str
    port: int | None
    """None only for role=local: pick a free port."""
    world_size: int
    rank: int
    """This process's rank; 0 for role=local, whose consumers take 1..world_size-1."""
    timeout_s: float
    source_kind: str
    source_params: Mapping[str, Any]
    """Keyword arguments of ``sources.make_source``: synthetic ``preset``, ``size`` (bytes or None), ``seed``,
    ``dtype`` (a name); safetensors ``path``."""
    sink_kind: str
    sink_path: Path | None


_ABSENT = object()
_ENV_REF = re.compile(r"oc\.env:\s*([A-Za-z_][A-Za-z0-9_]*)")


class _Checker:
    """Reads keys one by one and collects every problem, so that the user fixes them all in one go."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.errors: list[str] = []

    def fail(self, key: str, value: Any, allowed: str) -> None:
        self.errors.append(f"{key}={_show(value)} is invalid: {allowed}")

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
            if env is not None:
                raw = os.environ.get(env)
                problem = " is not set" if raw is None else f"={raw!r} is invalid"
                self.errors.append(f"{key}: environment variable {env}{problem}: {allowed or _squeeze(str(e))}")
            else:
                self.errors.append(f"{key} cannot be read: {_squeeze(str(e))}")
            return _ABSENT
        if value is _ABSENT:
            self.errors.append(f"{key} is not in the config (was conf/ changed?)")
        return value

    def option(self, group: str, field_name: str) -> Any:
        """The option name a group node records (role.name, source.kind), checked against the option chosen.

        Overriding e.g. role.name=producer while role=local is selected would run one role with another's
        settings; the group option is the only way to choose.
        """
        key = f"{group}.{field_name}"
        options = _GROUP_SCHEMAS[group]
        if OmegaConf.is_missing(self.cfg, group):
            self.errors.append(f"no {group} chosen: add {group}=<option>, {_one_of(tuple(options))}")
            return _ABSENT
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
        for key in node.keys():
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


def _show(value: Any) -> str:
    """A value as the user would type it back: strings quoted, None as null."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value)
    return str(value)


def _squeeze(text: str) -> str:
    return " ".join(text.split())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


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
    if role == "local" and num_consumers is not _ABSENT and not (_is_int(num_consumers) and num_consumers >= 1):
        c.fail("role.num_consumers", num_consumers, "must be an integer >= 1")

    buffer_size = _size(c, "refit.buffer_size_bytes")
    num_buffers = c.get("refit.num_buffers", allowed="must be an integer >= 1")
    if num_buffers is not _ABSENT and not (_is_int(num_buffers) and num_buffers >= 1):
        c.fail("refit.num_buffers", num_buffers, "must be an integer >= 1" + c.env_note("refit.num_buffers"))
    legacy = c.get("refit.use_legacy_packing")
    if legacy not in (None, _ABSENT) and not isinstance(legacy, bool):
        c.fail("refit.use_legacy_packing", legacy, "must be true, false or null (a consumer: adopt the producer's)")
    corrupt_chunk = c.get("refit.debug.corrupt_chunk")
    if corrupt_chunk not in (None, _ABSENT) and not (_is_int(corrupt_chunk) and corrupt_chunk >= 0):
        c.fail("refit.debug.corrupt_chunk", corrupt_chunk, "must be null or a chunk index >= 0")

    backend = c.get("group.backend")
    if backend is not _ABSENT and backend not in BACKENDS:
        c.fail("group.backend", backend, _one_of(BACKENDS))
    host = c.get("group.host")
    if host is not _ABSENT and not (isinstance(host, str) and host.strip()):
        c.fail("group.host", host, "must be the producer's host name or IP address")
    port = c.get("group.port")
    if port not in (None, _ABSENT) and not (_is_int(port) and 1 <= port <= 65535):
        c.fail("group.port", port, "must be a port number in 1..65535 (or null)")
    timeout_s = c.get("group.timeout_s")
    if timeout_s is not _ABSENT and not _is_positive_number(timeout_s):
        c.fail("group.timeout_s", timeout_s, "must be a number of seconds > 0")
    world_size, rank = _check_ranks(c, role, num_consumers)

    source_kind, source_params = _check_source(c, needed=role in ("local", "producer"))
    sink_kind, sink_path = _check_sink(c, needed=role in ("local", "consumer"))

    if c.errors:
        raise ConfigError("; ".join(c.errors))
    return RunSettings(
        role=role,
        num_consumers=world_size - 1,
        buffer_size_bytes=buffer_size,
        buffer_size_explicit=buffer_size is not None,
        num_buffers=num_buffers,
        use_legacy_packing=bool(legacy),
        legacy_explicit=legacy is not None,
        corrupt_chunk=corrupt_chunk,
        backend=backend,
        host=host,
        port=DEFAULT_PORT if port is None and role != "local" else port,
        world_size=world_size,
        rank=rank,
        timeout_s=float(timeout_s),
        source_kind=source_kind,
        source_params=dict(source_params),
        sink_kind=sink_kind,
        sink_path=sink_path,
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


def _check_ranks(c: _Checker, role: Any, num_consumers: Any) -> tuple[int, int]:
    """The world size and this process's rank, each checked against the role."""
    world_size = c.get("group.world_size")
    rank = c.get("group.rank")
    if role is _ABSENT:
        # Which ranks are valid depends on the role; its own error already tells the user what to fix.
        return 2, 0
    if role == "local":
        # A local run starts every rank itself, so the group's shape follows from role.num_consumers.
        expected = 1 + num_consumers if _is_int(num_consumers) else None
        if world_size not in (None, _ABSENT, expected):
            c.fail("group.world_size", world_size,
                   f"role=local runs 1 producer + role.num_consumers={_show(num_consumers)} consumers; "
                   f"leave it null")
        if rank not in (None, _ABSENT):
            c.fail("group.rank", rank, "role=local assigns ranks itself; leave it null")
        return expected or 2, 0
    if world_size is not _ABSENT and not (_is_int(world_size) and world_size >= 2):
        c.fail("group.world_size", world_size, "must be an integer >= 2 (the producer and at least one consumer)")
    known_size = world_size if _is_int(world_size) and world_size >= 2 else None
    if role == "producer":
        if rank not in (0, None, _ABSENT):
            c.fail("group.rank", rank, "the producer is rank 0")
        return known_size or 2, 0
    if role == "consumer" and rank is not _ABSENT:
        top = known_size - 1 if known_size else None
        if not _is_int(rank) or rank < 1 or (top is not None and rank > top):
            span = f"1..{top}" if top else "1..world_size-1"
            c.fail("group.rank", rank,
                   f"a consumer's rank must be in {span} (rank 0 is the producer; group.world_size="
                   f"{_show(known_size)})")
    return known_size or 2, rank if _is_int(rank) else 0


def _check_source(c: _Checker, needed: bool) -> tuple[str, dict[str, Any]]:
    """The source kind and its keyword arguments; a path is required only where the source is read."""
    kind = c.option("source", "kind")
    if kind == "synthetic":
        preset = c.get("source.preset")
        if preset is not _ABSENT and preset not in SYNTHETIC_PRESETS:
            c.fail("source.preset", preset, _one_of(SYNTHETIC_PRESETS))
        size_bytes = _size(c, "source.size")
        seed = c.get("source.seed")
        if seed is not _ABSENT and not (_is_int(seed) and seed >= 0):
            c.fail("source.seed", seed, "must be an integer >= 0")
        dtype = c.get("source.dtype")
        if dtype is not _ABSENT and dtype not in SYNTHETIC_DTYPES:
            c.fail("source.dtype", dtype, _one_of(SYNTHETIC_DTYPES))
        return kind, {"preset": preset, "size": size_bytes, "seed": seed, "dtype": dtype}
    if kind == "safetensors":
        path = c.get("source.path", required=needed)
        if path is _ABSENT:
            return kind, {"path": None}
        if needed and not Path(path).exists():
            c.fail("source.path", path, "no such file or directory; give a .safetensors file or a model directory")
        return kind, {"path": Path(path)}
    return "", {}


def _check_sink(c: _Checker, needed: bool) -> tuple[str, Path | None]:
    """The sink kind and its directory; a path is required only where the sink is used."""
    kind = c.option("sink", "kind")
    if kind != "save":
        return ("" if kind is _ABSENT else kind), None
    path = c.get("sink.path", required=needed)
    if path is _ABSENT:
        return kind, None
    if not path.strip():
        c.fail("sink.path", path, "must name the directory to write the checkpoint into")
        return kind, None
    return kind, Path(path)
