"""``sink=vllm``'s defaults, torch- and vLLM-free: the sink takes them as keyword defaults and the config schema
(:mod:`refit_app.app.schema`) names them."""

DEFAULT_MAX_MODEL_LEN = 256
"""The engine's context length (capped by the config's ``max_position_embeddings``): the probe needs
``probe_tokens + 1`` positions, and vLLM sizes its KV cache for at least one sequence this long."""
DEFAULT_KV_CACHE_GIB = 1
"""``VLLM_CPU_KVCACHE_SPACE`` unless the environment sets it: vLLM's CPU default is a share of the machine's memory."""
DEFAULT_ENGINE_SEED = 0
"""The engine's sampling seed."""
