"""What a transformers model is built from and how: the transformers package (imported only here, when a model is
built), the dtype a model computes in, the config and rebuild key for a manifest, and the model itself.
``sink=vllm`` builds its engine from the same :func:`model_spec`."""

from __future__ import annotations

import json
from typing import Any

import torch

from refit_app.checkpoint.layout import CONFIG_FILE_NAME
from refit_app.common.errors import RefitError, SinkError
from refit_app.core.meta import TensorMeta
from refit_app.protocol.manifest import Manifest

TRANSFORMERS_REQUIREMENT = "transformers>=5,<6"
"""The range this module is tested with (5.24.0); also what the install hint in errors names."""


def transformers_module(error: type[RefitError]) -> Any:
    """The transformers package, or ``error`` with the install line when it is missing."""
    try:
        import transformers
    except ImportError as e:
        raise error(
            f"a transformers model needs the transformers package: pip install '{TRANSFORMERS_REQUIREMENT}'"
        ) from e
    return transformers


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
            raise SinkError(
                f"the producer sent no {CONFIG_FILE_NAME} to build the model from ({manifest.source}); {hint}"
            )
    try:
        config = json.loads(config_json)
    except json.JSONDecodeError as e:
        raise SinkError(f"the model config is not valid JSON: {e}") from e
    dtype = main_dtype(list(manifest.tensors)) or torch.float32
    return config, dtype, (json.dumps(config, sort_keys=True), dtype)


def build_model(config_dict: dict, dtype: torch.dtype | None, device: torch.device, error: type[RefitError]):
    """A causal LM of the config's architecture, in ``dtype`` (the config's own when None), on ``device``.

    Built with its random initialisation, which every load overwrites: skipping it (``no_init_weights``) also
    skips tying the embeddings in transformers 5, which would silently untie the LM head.
    """
    transformers = transformers_module(error)
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


def vocab_rows(model: torch.nn.Module) -> int:
    """Rows of the input embedding: the token ids the model accepts."""
    return model.get_input_embeddings().num_embeddings
