"""A real model on both sides of a refit: a transformers causal LM as the trainer (source) and as the engine (sink).

``ModelSource`` builds the model from a Hugging Face directory's ``config.json``, loads the checkpoint's weights,
sends what a trainer holds (parameters and persistent buffers, tied weights once, under the checkpoint's names)
and, between rounds, takes real AdamW steps. ``ModelSink`` builds the same architecture from the config text the
producer sends (no files on the consumer host) and copies every received tensor into its parameters as it
arrives, as an engine's ``load_weights`` does. After each round both run the same probe, and the consumer
compares logits and greedy tokens::

    producer (ModelSource)                          consumer (ModelSink)
    model_config(), manifest_tensors() --------->  begin(manifest, config_json)     (first round, or on change)
    tensors()  ------ packed broadcast ---------->  consume(batch) ...               (copy_ into parameters)
                                                    finish_round()                   (every tensor arrived)
    probe(probe_tokens) --- encode_probe() ------>  check(decode_probe(...), probe_tokens)
    advance(round_index)                            (next round: consume ... again, no begin)

transformers is imported inside the functions that need it: importing this module costs nothing, and a run
that uses neither ``source=model`` nor ``sink=model`` never loads transformers.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch

from refit_app.checkpoint.reader import Checkpoint, read_companion_files
from refit_app.common.errors import RefitError, SinkError, SourceError, VerificationError, some_of
from refit_app.common.sizes import format_size
from refit_app.core.meta import TensorMeta, dtype_to_str
from refit_app.models.defaults import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_LR,
    DEFAULT_SEED,
    DEFAULT_TRAIN_STEPS,
)
from refit_app.models.probe import (
    DEFAULT_PROBE_TOKENS,
    MAX_PROBE_COLUMNS,
    decisive_token_mismatch,
    forward_logits,
    logit_tolerance,
    probe_token_ids,
)
from refit_app.protocol.manifest import Manifest

logger = logging.getLogger(__name__)

CONFIG_FILE_NAME = "config.json"
TRANSFORMERS_REQUIREMENT = "transformers>=5,<6"
"""The range this module is tested with (5.24.0); also what the install hint in errors names."""

TRAIN_SEQ_LEN = 128
"""Training batches are ``batch_tokens`` tokens in sequences of at most this many (rounded down to whole sequences)."""


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers


def _transformers(error: type[RefitError]) -> Any:
    """The transformers package, or ``error`` with the install line when it is missing."""
    try:
        import transformers
    except ImportError as e:
        raise error(
            f"a transformers model needs the transformers package: pip install '{TRANSFORMERS_REQUIREMENT}'"
        ) from e
    return transformers


def _listing(items: list[str]) -> str:
    return some_of(items)


def _as_dtype(value: torch.dtype | str | None, error: type[RefitError]) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise error(f"dtype {value!r} is not a torch floating-point dtype; use e.g. bfloat16, float16, float32")
    return dtype


def main_dtype(metas: list[TensorMeta]) -> torch.dtype | None:
    """The floating-point dtype holding the most bytes: the dtype a model is built in."""
    by_dtype: dict[torch.dtype, int] = {}
    for m in metas:
        if m.dtype.is_floating_point:
            by_dtype[m.dtype] = by_dtype.get(m.dtype, 0) + m.nbytes
    return max(by_dtype, key=by_dtype.__getitem__) if by_dtype else None

def model_spec(manifest: Manifest, config_json: str | None, *, hint: str) -> tuple[dict, torch.dtype, tuple]:
    """What an engine builds for a manifest: the model config (``config_json``, else the ``config.json`` the
    producer sent), the dtype it computes in, and a key that changes exactly when a rebuild is needed."""
    if config_json is None:
        config_json = manifest.files.get(CONFIG_FILE_NAME)
        if config_json is None:
            raise SinkError(f"the producer sent no {CONFIG_FILE_NAME} to build the model from ({manifest.source}); {hint}")
    try:
        config = json.loads(config_json)
    except json.JSONDecodeError as e:
        raise SinkError(f"the model config is not valid JSON: {e}") from e
    dtype = main_dtype(list(manifest.tensors)) or torch.float32
    return config, dtype, (json.dumps(config, sort_keys=True), dtype)



def _build_model(config_dict: dict, dtype: torch.dtype | None, device: torch.device, error: type[RefitError]):
    """A causal LM of the config's architecture, in ``dtype`` (the config's own when None), on ``device``.

    Built with its random initialisation, which every load overwrites: skipping it (``no_init_weights``) also
    skips tying the embeddings in transformers 5, which would silently untie the LM head.
    """
    transformers = _transformers(error)
    config_dict = dict(config_dict)
    model_type = config_dict.pop("model_type", None)
    if not model_type:
        raise error("config.json has no model_type; it is not a transformers model config")
    try:
        config = transformers.AutoConfig.for_model(model_type, **config_dict)
        kwargs = {} if dtype is None else {"dtype": dtype}
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    except (ValueError, KeyError, TypeError, ImportError, OSError) as e:
        raise error(f"cannot build a causal LM of model_type {model_type!r} with transformers: {e}") from e
    return model.to(device).eval()


class _NamedWeights:
    """A model's parameters and persistent buffers by name, with tied aliases resolved to one tensor.

    ``names`` lists one name per distinct tensor in module order: the alias found in ``preferred`` (the
    checkpoint's or the manifest's spelling) when there is one, else the module's first name for it.
    """

    def __init__(self, model: torch.nn.Module, preferred: Collection[str] = ()):
        preferred = set(preferred)
        groups: dict[int, list[str]] = {}
        self._tensor: dict[str, torch.Tensor] = {}
        # keep_vars: the Parameter objects themselves, so tied names (one object) group together and copy_
        # writes into the live model.
        for name, t in model.state_dict(keep_vars=True).items():
            groups.setdefault(id(t), []).append(name)
            self._tensor[name] = t
        self.names: list[str] = []
        self._canonical: dict[str, str] = {}
        self._aliases: dict[str, list[str]] = {}
        for aliases in groups.values():
            name = next((a for a in aliases if a in preferred), aliases[0])
            self.names.append(name)
            self._aliases[name] = aliases
            for a in aliases:
                self._canonical[a] = name

    def canonical(self, name: str) -> str | None:
        return self._canonical.get(name)

    def aliases(self, canonical: str) -> list[str]:
        return self._aliases[canonical]

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensor[name]

    def coverage_problems(
        self, incoming: dict[str, tuple[tuple[int, ...], torch.dtype | None]], what: str
    ) -> list[str]:
        """What is wrong with loading ``incoming`` (name -> shape, dtype or None for any) into this model."""
        unknown = [repr(n) for n in incoming if n not in self._canonical]
        wrong = []
        for n, (shape, dtype) in incoming.items():
            if n in self._canonical:
                t = self._tensor[n]
                if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
                    got = f"{dtype_to_str(dtype)} " if dtype is not None else ""
                    wrong.append(
                        f"{n!r} ({got}{list(shape)} in the {what}, {dtype_to_str(t.dtype)} {list(t.shape)} in the model)"
                    )
        missing, twice = [], []
        for name in self.names:
            present = [a for a in self._aliases[name] if a in incoming]
            if not present:
                missing.append(repr(name))
            elif len(present) > 1:
                twice.append(" = ".join(map(repr, present)))
        problems = []
        if unknown:
            problems.append(f"{len(unknown)} tensor(s) in the {what} are not in the model: {_listing(unknown)}")
        if wrong:
            problems.append(f"{len(wrong)} tensor(s) with the wrong shape or dtype: {_listing(wrong)}")
        if missing:
            problems.append(f"{len(missing)} model tensor(s) missing from the {what}: {_listing(missing)}")
        if twice:
            problems.append(f"{len(twice)} tied tensor(s) listed under several names: {_listing(twice)}")
        return problems


def _vocab_rows(model: torch.nn.Module) -> int:
    return model.get_input_embeddings().num_embeddings


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return main_dtype([TensorMeta(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]) or torch.float32


# ---------------------------------------------------------------------------------------------------------------
# The trainer


class ModelSource:
    """A trainer's model: a transformers causal LM built from ``path``'s config.json and loaded from its
    safetensors, sending its parameters and persistent buffers (tied weights once, under the checkpoint's names).

    ``advance(round_index)`` takes ``train_steps`` AdamW steps on seeded token batches between rounds; the
    optimizer (and its two moments per parameter) exists from the first ``advance`` on, as a trainer's does.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        train_steps: int = DEFAULT_TRAIN_STEPS,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        lr: float = DEFAULT_LR,
        seed: int = DEFAULT_SEED,
    ):
        if train_steps < 1:
            raise SourceError(f"train_steps={train_steps} must be at least 1 optimizer step per round")
        if batch_tokens < 2:
            raise SourceError(f"batch_tokens={batch_tokens} must be at least 2 (a causal LM predicts token 2 from 1)")
        self.path = Path(path)
        config_path = self.path / CONFIG_FILE_NAME
        if not config_path.is_file():
            raise SourceError(
                f"source path {self.path} has no {CONFIG_FILE_NAME}; give a Hugging Face model directory "
                "(config.json + safetensors, as save_pretrained writes it)"
            )
        self._config_text = config_path.read_text()
        try:
            config_dict = json.loads(self._config_text)
        except json.JSONDecodeError as e:
            raise SourceError(f"{config_path} is not valid JSON: {e}") from e
        checkpoint = Checkpoint(self.path)
        ckpt_metas = checkpoint.metas()
        self.dtype = _as_dtype(dtype, SourceError) or main_dtype(ckpt_metas) or torch.float32
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.train_steps, self.batch_tokens, self.lr, self.seed = train_steps, batch_tokens, lr, seed

        self.model = _build_model(config_dict, self.dtype, self.device, SourceError)
        self._weights = _NamedWeights(self.model, preferred={m.name for m in ckpt_metas})
        problems = self._weights.coverage_problems({m.name: (m.shape, None) for m in ckpt_metas}, "checkpoint")
        if problems:
            raise SourceError(f"{self.path} does not fit its config's model: " + "; ".join(problems))
        with torch.no_grad():
            for name, t in checkpoint.iter_tensors():
                self._weights.tensor(name).copy_(t)
        self._metadata = checkpoint.metadata()
        self._files = read_companion_files(self.path)
        shards = {m.name: m.shard for m in ckpt_metas}
        self._metas = []
        for name in self._weights.names:
            t = self._weights.tensor(name)
            self._metas.append(TensorMeta(name, tuple(t.shape), t.dtype, shards.get(name)))
        self._optimizer: torch.optim.Optimizer | None = None
        # Training data: random start tokens, each followed by a fixed seeded permutation of the vocabulary.
        # Uniform noise would keep the loss at ln(vocab) whatever the optimizer does; on a learnable chain the
        # loss falls over the rounds (noisily: each round draws new start tokens), showing real training.
        vocab = _vocab_rows(self.model)
        self._chain = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
        logger.info("%s", self.describe())

    def describe(self) -> str:
        total = sum(m.nbytes for m in self._metas)
        arch = type(self.model).__name__
        return (
            f"model {self.path} ({arch}, {len(self._metas)} tensors, {format_size(total)} "
            f"{dtype_to_str(self.dtype)} on {self.device}, {self.train_steps} AdamW step(s) of "
            f"{self.batch_tokens} tokens per round)"
        )

    def manifest_tensors(self) -> list[TensorMeta]:
        return list(self._metas)

    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def model_config(self) -> str:
        """The checkpoint's config.json text, verbatim: all a consumer needs to build the same model."""
        return self._config_text

    def companion_files(self) -> dict[str, str | bytes]:
        """config.json (as :meth:`model_config` gives it) and the directory's tokenizer files, for a consumer
        that saves the model (``sink=save``)."""
        return {**self._files, CONFIG_FILE_NAME: self._config_text}

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The live weights (detached views): read them before the next ``advance``, never write them."""
        for name in self._weights.names:
            yield name, self._weights.tensor(name).detach()

    def _batch(self, generator: torch.Generator) -> torch.Tensor:
        seq = min(self.batch_tokens, TRAIN_SEQ_LEN)
        rows = self.batch_tokens // seq
        ids = torch.empty(rows, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, len(self._chain), (rows,), generator=generator)
        for i in range(1, seq):
            ids[:, i] = self._chain[ids[:, i - 1]]
        return ids.to(self.device)

    def advance(self, round_index: int) -> dict:
        """Take ``train_steps`` AdamW steps on the round's batches; ``{"loss": mean training loss}``.

        The batches depend only on ``seed`` and ``round_index``, so a rerun trains identically.
        """
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + round_index)
        losses = []
        self.model.train()
        try:
            for _ in range(self.train_steps):
                ids = self._batch(generator)
                loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                self._optimizer.step()
                self._optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
        finally:
            self.model.eval()
        mean = sum(losses) / len(losses)
        if not math.isfinite(mean):
            raise SourceError(f"training diverged in round {round_index}: loss {mean}; lower the learning rate")
        return {"loss": mean}

    def probe(self, probe_tokens: int = DEFAULT_PROBE_TOKENS) -> dict:
        """The fixed probe through the model, as a consumer's ``check`` needs it.

        ``token_ids`` the input; ``next_tokens`` the greedy token after each position (full vocabulary);
        ``margins`` top-1 minus top-2 logit per position (a mismatch within twice the tolerance is a tie,
        not an error); ``column_stride`` and ``logits``: float32 ``[probe_tokens, ceil(vocab / stride)]``,
        every ``stride``-th vocabulary column (all of them up to ``MAX_PROBE_COLUMNS``).
        """
        token_ids = probe_token_ids(_vocab_rows(self.model), probe_tokens)
        logits = forward_logits(self.model, token_ids)
        top2 = logits.topk(min(2, logits.shape[-1]), dim=-1).values
        margins = (top2[:, 0] - top2[:, -1]).tolist()
        stride = max(1, -(-logits.shape[-1] // MAX_PROBE_COLUMNS))
        return {
            "token_ids": token_ids,
            "next_tokens": logits.argmax(dim=-1).tolist(),
            "margins": margins,
            "column_stride": stride,
            "dtype": dtype_to_str(self.dtype),
            "logits": logits[:, ::stride].contiguous(),
        }


# ---------------------------------------------------------------------------------------------------------------
# The engine


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
        self._weights: _NamedWeights | None = None
        self._metas: dict[str, TensorMeta] = {}
        self._arrived: set[str] = set()
        self.builds = 0
        """How many times a model was built (a test and the metrics can see that rounds reuse it)."""

    def begin(self, manifest: Manifest, config_json: str | None = None) -> None:
        """Build (or keep) the model for ``config_json``, by default the ``config.json`` the manifest carries."""
        config_dict, dtype, key = model_spec(manifest, config_json, hint="use source=model")
        metas = list(manifest.tensors)
        if self._built_for != key:
            self.model = None  # free the old model before building the new one
            self.model = _build_model(config_dict, dtype, self.device, SinkError)
            self._built_for = key
            self.builds += 1
            logger.info(
                "built %s (%s) for the producer's config on %s",
                type(self.model).__name__,
                dtype_to_str(dtype),
                self.device,
            )
        weights = _NamedWeights(self.model, preferred={m.name for m in metas})
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
                self._weights.tensor(name).copy_(t)
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
                f"rounds: {_listing(missing)}"
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
        vocab = _vocab_rows(self.model)
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


# ---------------------------------------------------------------------------------------------------------------
# A checkpoint for tests and examples


def write_tiny_llama(
    path: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    tie_word_embeddings: bool = True,
) -> Path:
    """Save a random 2-layer Llama (hidden 64, head_dim 32, vocab 256, about 0.2 M parameters) at ``path``.

    ``save_pretrained`` writes config.json and model.safetensors; nothing is downloaded. The same seed gives
    the same weights, and the global RNG is left as it was.
    """
    transformers = _transformers(SourceError)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    model = model.to(dtype)
    path = Path(path)
    hub_logging = transformers.utils.logging
    bars_were_disabled = hub_logging.is_progress_bar_enabled() is False
    hub_logging.disable_progress_bar()  # "Writing model shards: 100%" is noise in tests and examples
    try:
        model.save_pretrained(path)
    finally:
        if not bars_were_disabled:
            hub_logging.enable_progress_bar()
    return path
