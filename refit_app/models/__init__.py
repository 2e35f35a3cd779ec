"""What a refit moves and where it lands: the synthetic model presets, the producer's sources (synthetic,
safetensors, a transformers trainer) and the consumer's sinks (verify, save, discard, a transformers model), the
model probe that compares both sides, and building a user's own source or sink from its ``_target_``.

The transformers model (a trainer's source, a serving sink, the tiny test models) is one room,
:mod:`refit_app.models.hf`. A new source or sink goes here (or in your own package, named by ``_target_``). Imports
only the layers below: :mod:`refit_app.common`, :mod:`refit_app.core`, :mod:`refit_app.protocol` (the manifest) and
:mod:`refit_app.checkpoint`.
"""
