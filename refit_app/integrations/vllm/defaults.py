"""``sink=vllm``'s defaults, torch- and vLLM-free: the sink takes them as keyword defaults and the config schema
(:mod:`refit_app.app.schema`) names them."""

DEFAULT_MAX_MODEL_LEN = 256
"""The engine's context length (capped by the config's ``max_position_embeddings``): the probe needs
``probe_tokens + 1`` positions, and vLLM sizes its KV cache for at least one sequence this long."""
DEFAULT_KV_CACHE_GIB = 1
"""``VLLM_CPU_KVCACHE_SPACE`` unless the environment sets it: vLLM's CPU default is a share of the machine's memory."""
DEFAULT_ENGINE_SEED = 0
"""The engine's sampling seed."""
PREFIX_CACHE_MODES = ("reset", "keep")
"""What a staged refit's pause does with vLLM's KV cache: ``reset`` clears the prefix cache and preempts the requests
in flight, which recompute their KV with the new weights when generation resumes (no token of round N+1 is computed
from round N's KV); ``keep`` leaves it all (the requests in flight go on from KV computed with round N: off-policy
tokens, which their outputs' ``weight_versions`` spans count)."""
DEFAULT_SERVE_REQUESTS = 2
"""A staged ``sink=vllm``'s generation requests kept in flight while a round arrives."""
MAX_SERVE_REQUESTS = 6
