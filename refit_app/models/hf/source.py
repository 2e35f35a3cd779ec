"""The trainer side of a real-model refit: :class:`ModelSource`, a transformers causal LM built from a Hugging Face
directory and loaded from its checkpoint, taking real AdamW steps between rounds (see :mod:`refit_app.models.hf`)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from refit_app.checkpoint.layout import CONFIG_FILE_NAME
from refit_app.checkpoint.reader import Checkpoint, read_companion_files
from refit_app.common.errors import RefitError, SourceError
from refit_app.common.sizes import format_size
from refit_app.core.meta import TensorMeta, dtype_to_str
from refit_app.models.defaults import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_LR,
    DEFAULT_SEED,
    DEFAULT_TRAIN_STEPS,
)
from refit_app.models.hf.spec import build_model, main_dtype, vocab_rows
from refit_app.models.hf.weights import NamedWeights
from refit_app.models.probe import (
    DEFAULT_PROBE_TOKENS,
    MAX_PROBE_COLUMNS,
    forward_logits,
    probe_token_ids,
)

logger = logging.getLogger(__name__)

TRAIN_SEQ_LEN = 128
"""Training batches are ``batch_tokens`` tokens in sequences of at most this many (rounded down to whole sequences)."""


def _as_dtype(value: torch.dtype | str | None, error: type[RefitError]) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise error(f"dtype {value!r} is not a torch floating-point dtype; use e.g. bfloat16, float16, float32")
    return dtype


class ModelSource:
    """A trainer's model: a transformers causal LM built from ``path``'s config.json and loaded from its
    safetensors, sending its parameters and persistent buffers (tied weights once, under the checkpoint's names).

    ``advance(round_index)`` takes ``train_steps`` AdamW steps on seeded token batches between rounds; the
    optimizer (and its two moments per parameter) exists from the first ``advance`` on, as a trainer's does.

    With ``send_dtype`` (mixed precision: train in float32, send bfloat16), the model trains in ``dtype`` and what
    is sent is a second model of the same architecture built in ``send_dtype``, its weights the trained ones cast
    after every step (memory: one more copy of the weights, in ``send_dtype``). The probe runs that copy, so the
    consumer, which builds its model in the manifest's dtype, checks itself against the weights as sent; a round
    then changes only the elements whose rounding the step moved.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        dtype: torch.dtype | str | None = None,
        send_dtype: torch.dtype | str | None = None,
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
        self.send_dtype = _as_dtype(send_dtype, SourceError) or self.dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.train_steps, self.batch_tokens, self.lr, self.seed = train_steps, batch_tokens, lr, seed

        self.model = build_model(config_dict, self.dtype, self.device, SourceError)
        self._weights = NamedWeights(self.model, preferred={m.name for m in ckpt_metas})
        problems = self._weights.coverage_problems({m.name: (m.shape, None) for m in ckpt_metas}, "checkpoint")
        if problems:
            raise SourceError(f"{self.path} does not fit its config's model: " + "; ".join(problems))
        with torch.no_grad():
            for name, t in checkpoint.iter_tensors():
                self._weights.tensor(name).copy_(t)
        self._metadata = checkpoint.metadata()
        self._files = read_companion_files(self.path)
        # What is sent, and what the probe runs: the trained model itself, or its cast in send_dtype.
        self._sent_model, self._sent = self.model, self._weights
        if self.send_dtype != self.dtype:
            self._sent_model = build_model(config_dict, self.send_dtype, self.device, SourceError)
            self._sent = NamedWeights(self._sent_model, preferred=self._weights.names)
            self._cast_for_sending()
        shards = {m.name: m.shard for m in ckpt_metas}
        self._metas = []
        for name in self._sent.names:
            t = self._sent.tensor(name)
            self._metas.append(TensorMeta(name, tuple(t.shape), t.dtype, shards.get(name)))
        self._optimizer: torch.optim.Optimizer | None = None
        self._mesh_size: int | None = None
        # Training data: random start tokens, each followed by a fixed seeded permutation of the vocabulary.
        # Uniform noise would keep the loss at ln(vocab) whatever the optimizer does; on a learnable chain the
        # loss falls over the rounds (noisily: each round draws new start tokens), showing real training.
        vocab = vocab_rows(self.model)
        self._chain = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
        logger.info("%s", self.describe())

    def describe(self) -> str:
        total = sum(m.nbytes for m in self._metas)
        arch = type(self.model).__name__
        trained = f", trained in {dtype_to_str(self.dtype)}" if self._sent_model is not self.model else ""
        fsdp = f" under FSDP2 over {self._mesh_size} rank(s)" if self._mesh_size is not None else ""
        return (
            f"model {self.path} ({arch}, {len(self._metas)} tensors, {format_size(total)} "
            f"{dtype_to_str(self.send_dtype)}{trained} on {self.device}{fsdp}, {self.train_steps} AdamW step(s) of "
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
        """The live weights as sent (detached views): read them before the next ``advance``, never write them."""
        for name in self._sent.names:
            yield name, self._sent.tensor(name).detach()

    def fully_shard(self, mesh: Any) -> None:
        """Shard the trainer under FSDP2 over ``mesh`` (a 1-D ``DeviceMesh`` of the trainer's ranks), as a
        data-parallel trainer does: each decoder layer and then the whole model ``fully_shard``-ed, every parameter
        a DTensor holding ``Shard(0)``, this rank's rows (uneven where they do not divide). From then on
        :meth:`tensors` yields the DTensors, each rank's shard live under ``to_local()``; :meth:`advance` trains as
        before, the ranks' gradients reduced over the mesh. With ``send_dtype`` the cast copy is sharded alike, so
        each rank casts only its own rows. Call it before the first :meth:`advance`: an optimizer made before holds
        the unsharded parameters."""
        if self._optimizer is not None:
            raise SourceError("fully_shard must come before the first training step: the optimizer holds the weights")
        from torch.distributed.fsdp import fully_shard

        for model in dict.fromkeys((self.model, self._sent_model)):
            for layer in getattr(getattr(model, "model", None), "layers", ()):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        # fully_shard puts new (DTensor) parameters in place of the old: look them up again.
        self._weights = NamedWeights(self.model, preferred=self._weights.names)
        self._sent = NamedWeights(self._sent_model, preferred=self._weights.names)
        self._mesh_size = mesh.size()
        logger.info("%s", self.describe())

    def _cast_for_sending(self) -> None:
        """Refresh the send_dtype copy from the trained weights: without it a round would send the last round's."""
        with torch.no_grad():
            for name in self._weights.names:
                self._sent.tensor(name).copy_(self._weights.tensor(name))

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
        if self._sent_model is not self.model:
            self._cast_for_sending()
        return {"loss": mean}

    def probe(self, probe_tokens: int = DEFAULT_PROBE_TOKENS) -> dict:
        """The fixed probe through the model as sent, as a consumer's ``check`` needs it.

        ``token_ids`` the input; ``next_tokens`` the greedy token after each position (full vocabulary);
        ``margins`` top-1 minus top-2 logit per position (a mismatch within twice the tolerance is a tie,
        not an error); ``column_stride`` and ``logits``: float32 ``[probe_tokens, ceil(vocab / stride)]``,
        every ``stride``-th vocabulary column (all of them up to ``MAX_PROBE_COLUMNS``).
        """
        token_ids = probe_token_ids(vocab_rows(self._sent_model), probe_tokens)
        logits = forward_logits(self._sent_model, token_ids)
        top2 = logits.topk(min(2, logits.shape[-1]), dim=-1).values
        margins = (top2[:, 0] - top2[:, -1]).tolist()
        stride = max(1, -(-logits.shape[-1] // MAX_PROBE_COLUMNS))
        return {
            "token_ids": token_ids,
            "next_tokens": logits.argmax(dim=-1).tolist(),
            "margins": margins,
            "column_stride": stride,
            "dtype": dtype_to_str(self.send_dtype),
            "logits": logits[:, ::stride].contiguous(),
        }
