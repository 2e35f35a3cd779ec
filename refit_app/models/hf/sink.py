"""The engine side of a real-model refit: :class:`ModelSink`, a transformers causal LM built from the config the
producer sends, loaded in place as tensors arrive, and checked against the producer's probe after every round (see
:mod:`refit_app.models.hf`)."""

from __future__ import annotations

import logging

import torch

from refit_app.common.errors import SinkError, VerificationError, some_of
from refit_app.core.meta import TensorMeta, dtype_to_str
from refit_app.models.hf.spec import build_model, main_dtype, model_spec, vocab_rows
from refit_app.models.hf.weights import NamedWeights
from refit_app.models.probe import (
    DEFAULT_PROBE_TOKENS,
    decisive_token_mismatch,
    forward_logits,
    logit_tolerance,
)
from refit_app.protocol.manifest import Manifest

logger = logging.getLogger(__name__)


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return main_dtype([TensorMeta(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]) or torch.float32


class ModelSink:
    """An inference engine's model: built from the producer's config text, loaded in place as tensors arrive.

    ``begin`` builds the model (only on the first call, or when the config or the weights' dtype changed) and
    checks the manifest against it before any tensor moves; ``consume`` copies each tensor into its parameter
    or buffer, so the model exists once; ``finish_round`` checks that every tensor arrived; ``check`` compares
    the producer's probe with this model's. Rounds after the first repeat ``consume``/``finish_round`` only.
    """

    def __init__(
        self, *, probe_tokens: int = DEFAULT_PROBE_TOKENS, verify: bool = True, device: torch.device | str | None = None
    ):
        self.verifies = verify
        """Whether the session also checks every tensor bit for bit against the producer's checksums."""
        self.probe_tokens = probe_tokens
        """Positions of the probe compared after every round (the app asks the producer for it); 0: no check."""
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.model: torch.nn.Module | None = None
        self._built_for: tuple[str, torch.dtype] | None = None
        self._weights: NamedWeights | None = None
        self._metas: dict[str, TensorMeta] = {}
        self._arrived: set[str] = set()
        self.builds = 0
        """How many times a model was built (a test and the metrics can see that rounds reuse it)."""

    delta_storage = "targets"
    """Delta rounds patch the model's own parameters and buffers (:meth:`targets`)."""

    def targets(self) -> dict[str, torch.Tensor]:
        """The model's tensor under each manifest name: what every round writes into, in place."""
        if self._weights is None:
            raise RuntimeError("ModelSink.targets() before begin()")
        return {name: self._weights.tensor(name) for name in self._metas}

    def begin(self, manifest: Manifest, config_json: str | None = None) -> None:
        """Build (or keep) the model for ``config_json``, by default the ``config.json`` the manifest carries."""
        config_dict, dtype, key = model_spec(manifest, config_json, hint="use source=model")
        metas = list(manifest.tensors)
        if self._built_for != key:
            self.model = None  # free the old model before building the new one
            self.model = build_model(config_dict, dtype, self.device, SinkError)
            self._built_for = key
            self.builds += 1
            logger.info(
                "built %s (%s) for the producer's config on %s",
                type(self.model).__name__,
                dtype_to_str(dtype),
                self.device,
            )
        weights = NamedWeights(self.model, preferred={m.name for m in metas})
        problems = weights.coverage_problems({m.name: (m.shape, m.dtype) for m in metas}, "manifest")
        if problems:
            raise SinkError(
                "the producer's manifest does not fit the model built from its config: " + "; ".join(problems)
            )
        self._weights = weights
        self._metas = {m.name: m for m in metas}
        self._arrived = set()

    def consume(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """Copy each received tensor into the model; the views are not kept."""
        if self._weights is None:
            raise RuntimeError("ModelSink.consume() before begin()")
        with torch.no_grad():
            for name, t in batch:
                meta = self._metas.get(name)
                if meta is None:
                    raise SinkError(f"received tensor {name!r} is not in the manifest")
                if tuple(t.shape) != meta.shape or t.dtype != meta.dtype:
                    raise SinkError(
                        f"received tensor {name!r} is {dtype_to_str(t.dtype)} {list(t.shape)}, the manifest and "
                        f"the model say {dtype_to_str(meta.dtype)} {list(meta.shape)}"
                    )
                if name in self._arrived:
                    raise SinkError(f"received tensor {name!r} twice in one round")
                own = self._weights.tensor(name)
                if own is not t:  # the session wrote into it already (targets)
                    own.copy_(t)
                self._arrived.add(name)

    def finish_round(self) -> dict:
        """Raise unless every manifest tensor arrived this round; then get ready for the next round."""
        if self._weights is None:
            raise RuntimeError("ModelSink.finish_round() before begin()")
        missing = [repr(n) for n in self._metas if n not in self._arrived]
        self._arrived = set()
        if missing:
            raise SinkError(
                f"{len(missing)} of {len(self._metas)} tensor(s) never arrived, the model holds a mix of "
                f"rounds: {some_of(missing)}"
            )
        return {"loaded_tensors": len(self._metas)}

    def finish(self, checksums: list[int] | None = None) -> dict:
        """The ``Sink`` protocol's end of a round: ``finish_round``; checksums are the session's business."""
        return self.finish_round()

    def close(self) -> dict:
        """Nothing to publish: the model serves the last round's weights in place."""
        return {}

    def abort(self) -> None:
        """Forget this round's arrivals. The model keeps what was copied: the next full round overwrites it all."""
        self._arrived = set()

    def check(self, probe: dict, probe_tokens: int, *, strict: bool = True) -> dict:
        """Run the producer's probe here and compare: ``{"max_abs_logit_diff": float, "tokens_match": bool}``.

        With ``strict`` (the default) a difference beyond ``logit_tolerance`` raises VerificationError, as does
        a greedy token that differs where the producer's top-2 margin exceeds twice the tolerance (within it,
        the two sides' rounding may legitimately break a near-tie differently).
        """
        if self.model is None:
            raise RuntimeError("ModelSink.check() before begin()")
        token_ids = [int(i) for i in probe["token_ids"]]
        if len(token_ids) != probe_tokens:
            raise VerificationError(
                f"the producer probed {len(token_ids)} tokens, this consumer expects probe_tokens={probe_tokens}"
            )
        vocab = vocab_rows(self.model)
        if any(not 0 <= i < vocab for i in token_ids):
            raise VerificationError(f"the producer's probe has token ids outside this model's vocabulary of {vocab}")
        logits = forward_logits(self.model, token_ids)
        theirs = probe["logits"]
        mine = logits[:, :: int(probe["column_stride"])]
        if tuple(mine.shape) != tuple(theirs.shape):
            raise VerificationError(
                f"the producer's probe logits are {list(theirs.shape)}, this model gives {list(mine.shape)}: "
                "the two models differ in architecture"
            )
        diff = float((mine - theirs).abs().max()) if mine.numel() else 0.0
        next_tokens = logits.argmax(dim=-1).tolist()
        expected = [int(t) for t in probe["next_tokens"]]
        result = {"max_abs_logit_diff": diff, "tokens_match": next_tokens == expected}
        if strict:
            dtype = _model_dtype(self.model)
            tolerance = logit_tolerance(dtype, float(theirs.abs().max()) if theirs.numel() else 0.0)
            problems = []
            if not diff <= tolerance:  # also catches NaN
                problems.append(
                    f"max |logit difference| {diff:.3g} exceeds the {dtype_to_str(dtype)} tolerance {tolerance:.3g}"
                )
            mismatch = decisive_token_mismatch(next_tokens, expected, probe["margins"], 2 * tolerance, "consumer")
            if mismatch is not None:
                problems.append(mismatch)
            if problems:
                raise VerificationError("model check failed: " + "; ".join(problems))
        return result
