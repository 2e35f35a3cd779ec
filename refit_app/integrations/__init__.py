"""refit_app inside other systems' processes: one room (subpackage) per engine or framework
(:mod:`refit_app.integrations.vllm`, :mod:`refit_app.integrations.ray`). A new one goes in a subpackage of its own
here, imported lazily, so that a CPU-only install never needs it."""
