"""Safetensors checkpoints on disk: header validation before anything trusts a file, reading (one file or a
sharded Hugging Face directory), a streaming writer, and the atomic publish of a saved directory.

Imports only :mod:`refit_app.common` and :mod:`refit_app.core`.
"""
