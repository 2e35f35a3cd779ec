"""refit_app inside other systems' processes: one subpackage per engine (:mod:`refit_app.integrations.vllm`).
A new engine goes in a subpackage of its own here, imported lazily, so that a CPU-only install never needs it."""
