"""What ``register`` gives vLLM's factories resolves, in vLLM's own lazy loader, to the engine classes of
:mod:`refit_app.integrations.vllm.engine` (tests/test_vllm_backend.py checks the registration without vLLM)."""

from __future__ import annotations

import pytest


def test_vllms_factories_load_the_engines_by_path() -> None:
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from refit_app.integrations.vllm import backend

    backend.register()
    backend.register()  # a second registration is no error
    from refit_app.integrations.vllm import engine

    # _registry holds vLLM's loader for each name (importlib.import_module(path), then getattr).
    worker = WeightTransferEngineFactory._registry[backend.BACKEND]()
    trainer = WeightTransferTrainerFactory._registry[backend.BACKEND]()
    assert worker is engine.RefitWeightTransferEngine and issubclass(worker, WeightTransferEngine)
    assert trainer is engine.RefitTrainerWeightTransferEngine and issubclass(trainer, TrainerWeightTransferEngine)
    for cls in (worker, trainer):
        assert cls.__module__ == "refit_app.integrations.vllm.engine" and cls.__qualname__ == cls.__name__

    # refit_app 0.2's path still gives the same classes, with a warning naming the new one.
    with pytest.warns(DeprecationWarning, match="refit_app.integrations.vllm.engine"):
        assert backend.RefitWeightTransferEngine is worker
    with pytest.warns(DeprecationWarning, match="refit_app.integrations.vllm.engine"):
        assert backend.RefitTrainerWeightTransferEngine is trainer
