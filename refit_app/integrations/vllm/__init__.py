"""vLLM: the ``refit_app`` weight-transfer backend (:mod:`~refit_app.integrations.vllm.backend`, registered by the
``vllm.general_plugins`` entry point) and ``sink=vllm`` (:mod:`~refit_app.integrations.vllm.sink`), a real engine
refitted every round. vLLM itself is imported only inside these modules' functions."""
