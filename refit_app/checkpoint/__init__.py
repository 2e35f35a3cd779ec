"""Safetensors checkpoints on disk, one module per job:

- :mod:`~refit_app.checkpoint.layout`: the Hugging Face names (``model.safetensors``, the index, ``config.json``, the
  companion files); torch-free.
- :mod:`~refit_app.checkpoint.header`: header validation before anything trusts a file; torch-free.
- :mod:`~refit_app.checkpoint.dtypes`: the format's dtype codes and torch's dtypes.
- :mod:`~refit_app.checkpoint.reader`: reading one file or a sharded model directory (:class:`Checkpoint`).
- :mod:`~refit_app.checkpoint.writer`: the streaming writer (:class:`CheckpointWriter`, :func:`save_tensors`).
- :mod:`~refit_app.checkpoint.publish`: the atomic publish of a saved directory.
- :mod:`~refit_app.checkpoint.slices`: a sharded refit's saved slices: their boxes in the file's metadata, read
  back and assembled into whole tensors.

The public names are importable from this package too. Imports only :mod:`refit_app.common` and
:mod:`refit_app.core`.
"""

from typing import Any

_EXPORTS = {
    **dict.fromkeys(
        (
            "SINGLE_FILE_NAME",
            "INDEX_FILE_NAME",
            "CONFIG_FILE_NAME",
            "COMPANION_FILE_NAMES",
            "MAX_COMPANION_FILE_BYTES",
            "MAX_COMPANION_BYTES",
        ),
        "refit_app.checkpoint.layout",
    ),
    **dict.fromkeys(
        (
            "METADATA_KEY",
            "MAX_HEADER_BYTES",
            "INT64_MAX",
            "HeaderProblem",
            "load_json",
            "read_header",
            "regular_file_problem",
        ),
        "refit_app.checkpoint.header",
    ),
    **dict.fromkeys(("DTYPE_CODES", "DTYPE_TO_CODE"), "refit_app.checkpoint.dtypes"),
    **dict.fromkeys(("SafetensorsFile", "Checkpoint", "read_companion_files"), "refit_app.checkpoint.reader"),
    **dict.fromkeys(
        ("SafetensorsWriter", "CheckpointWriter", "save_tensors", "shard_layout", "companion_name_problems"),
        "refit_app.checkpoint.writer",
    ),
    **dict.fromkeys(
        ("SLICES_KEY", "SavedSlices", "slices_metadata", "read_slices", "assemble_slices"),
        "refit_app.checkpoint.slices",
    ),
    **dict.fromkeys(("exchange_dirs", "switch_dirs", "carry_over", "remove_leftovers"), "refit_app.checkpoint.publish"),
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy: importing refit_app.checkpoint.layout runs this file first, and the config imports layout without
    # torch; the reader and the writer need torch.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
