"""The typed schema of ``python -m refit_app``: one dataclass per config group option, registered with Hydra's
ConfigStore as ``base_*``. Every YAML file under conf/ names its schema first in its defaults list (Hydra's "Config
Store + YAML" pattern), so a misspelled key or a value of the wrong type is refused while the config is composed.
The field docstrings are the reference for every key; :mod:`refit_app.config` checks what types cannot express.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING

from refit_app.environment import DEFAULT_NUM_BUFFERS, NUM_BUFFERS_ENV

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
"""Absolute path of the top-level conf/ directory (the project is installed editable, so it sits beside the
package)."""

CONFIG_NAME = "config"

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
    num_buffers: int = II(f"oc.env:{NUM_BUFFERS_ENV},{DEFAULT_NUM_BUFFERS}")
    """How many buffers are in flight at once; each side chooses its own."""
    use_legacy_packing: Optional[bool] = False
    """true: vLLM-compatible chunks. null (a consumer's default): adopt the producer's mode."""
    rounds: int = 1
    """How many refits one run performs over one group (the RL loop); the source changes between rounds."""
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
    """Where the producer's weights come from (the ``source`` config group). A source of your own is a config
    file with ``_target_: your.module.YourSource`` and its keyword arguments (see README, "Plug in your own")."""

    _target_: str = MISSING
    """The class that builds the source, called with the other keys as keyword arguments."""
    kind: str = MISSING
    """The built-in source's name, set by the chosen ``source=`` option."""


@dataclass
class SyntheticSource(Source):
    _target_: str = "refit_app.sources.SyntheticSource"
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
    _target_: str = "refit_app.sources.SafetensorsSource"
    kind: str = "safetensors"
    path: str = MISSING
    """A .safetensors file or a Hugging Face model directory (sharded or not)."""


@dataclass
class ModelSource(Source):
    _target_: str = "refit_app.hf_model.ModelSource"
    kind: str = "model"
    path: str = MISSING
    """A Hugging Face model directory (config.json + safetensors); the trainer's model is built from it."""
    dtype: Optional[str] = None
    """float32, bfloat16, float16 or float64; null: the checkpoint's own."""
    device: Optional[str] = None
    """Where the model lives (cpu, cuda:0); null: the CPU."""
    train_steps: int = 1
    """Optimizer steps (AdamW) before every round after the first."""
    batch_tokens: int = 256
    """Tokens per training batch (random token sequences of a fixed seed)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    seed: int = 0
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
    _target_: str = "refit_app.sinks.VerifySink"
    kind: str = "verify"


@dataclass
class SaveSink(Sink):
    _target_: str = "refit_app.sinks.SaveSink"
    kind: str = "save"
    path: str = MISSING
    """Directory that receives the checkpoint in Hugging Face layout (created if absent)."""


@dataclass
class ModelSink(Sink):
    _target_: str = "refit_app.hf_model.ModelSink"
    kind: str = "model"
    probe_tokens: int = 16
    """After every round, compare this many positions of the model's logits and greedy tokens with the producer's
    model; 0: no check."""
    verify: bool = True
    """Also check every received tensor bit for bit against the producer's checksums, every round."""
    device: Optional[str] = None
    """Where the model lives (cpu, cuda:0); null: the CPU."""


@dataclass
class DiscardSink(Sink):
    _target_: str = "refit_app.sinks.DiscardSink"
    kind: str = "discard"


@dataclass
class Config:
    """The whole application config."""

    role: Role = MISSING
    refit: Refit = field(default_factory=Refit)
    group: Group = field(default_factory=Group)
    source: Any = MISSING
    """A built-in source schema, or a user's node with ``_target_``."""
    sink: Any = MISSING
    """A built-in sink schema, or a user's node with ``_target_``."""


GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "role": {"local": LocalRole, "producer": ProducerRole, "consumer": ConsumerRole},
    "source": {"synthetic": SyntheticSource, "safetensors": SafetensorsSource, "model": ModelSource},
    "sink": {"verify": VerifySink, "save": SaveSink, "discard": DiscardSink, "model": ModelSink},
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


register_schemas()
