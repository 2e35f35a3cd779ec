"""The Hugging Face layout of a model directory: the file names a loader looks for, and the small files that travel
with the weights so that a saved copy opens with ``from_pretrained``.

Torch-free: the config (:mod:`refit_app.app.config`) checks a model directory with these names before any torch
import, and it is the one home of each name (the reader, the writer, the model sources and sinks import them).
"""

from __future__ import annotations

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"
CONFIG_FILE_NAME = "config.json"
"""The model's architecture: ``source=model`` builds its trainer from it, ``sink=model`` and ``sink=vllm`` their
engines from the copy the producer sends."""

COMPANION_FILE_NAMES = (
    CONFIG_FILE_NAME,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "preprocessor_config.json",
)
"""Files of a model directory that travel with its weights, so a saved copy opens with ``from_pretrained``."""
MAX_COMPANION_FILE_BYTES = 32 * 1024**2
"""Larger than any tokenizer.json of a common model (Gemma's, the largest, is about 33 MB: it is left out)."""
MAX_COMPANION_BYTES = 64 * 1024**2
"""All companion files together: they travel in the manifest, which both sides hold in memory."""
