"""vLLM: the ``refit_app`` weight-transfer backend (:mod:`~refit_app.integrations.vllm.backend`, registered by the
``vllm.general_plugins`` entry point; its two engines in :mod:`~refit_app.integrations.vllm.engine`) and
``sink=vllm`` (:mod:`~refit_app.integrations.vllm.sink`), a real engine refitted every round. Only
:mod:`~refit_app.integrations.vllm.engine` imports vLLM at its top, and nothing imports it but vLLM's factories
(by path, on the first engine they create); the other modules import vLLM only inside their functions."""
