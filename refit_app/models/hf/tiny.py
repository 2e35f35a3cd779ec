"""A checkpoint for tests and examples: a random tiny Llama written with ``save_pretrained``, nothing downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

from refit_app.common.errors import SourceError
from refit_app.models.hf.spec import transformers_module


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
    transformers = transformers_module(SourceError)
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
