"""The vLLM backend's registration, without vLLM (tests/vllm_engine runs the real engines): importing the backend,
the sink and the package never imports vLLM, and ``register`` hands vLLM's factories a module path and class names
that name the engine classes, without importing them; settings that cannot go together are refused."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import refit_app
from refit_app.integrations.vllm import backend

PACKAGE = Path(refit_app.__file__).parent


def test_importing_the_backend_imports_no_vllm() -> None:
    # In a fresh interpreter where any vLLM import fails, so the check means the same where vLLM is installed.
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class NoVllm(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    raise ImportError(f"{name} imported")

        sys.meta_path.insert(0, NoVllm())
        import refit_app.integrations.vllm
        import refit_app.integrations.vllm.backend as backend
        import refit_app.integrations.vllm.sink
        backend.RefitTrainerInitInfo(master_address="h", master_port=1, world_size=2, rank=0)
        assert "refit_app.integrations.vllm.engine" not in sys.modules
        assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_register_gives_vllm_the_engine_module_by_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, str, str]] = []

    def factory(name: str) -> type:
        def register_engine(cls: type, backend_name: str, module_path: str, class_name: str) -> None:
            if any(c[:2] == (name, backend_name) for c in calls):
                raise ValueError(f"{backend_name} already registered")
            calls.append((name, backend_name, module_path, class_name))

        return type(name, (), {"register_engine": classmethod(register_engine)})

    fake = types.ModuleType("vllm.distributed.weight_transfer.factory")
    fake.WeightTransferEngineFactory = factory("WeightTransferEngineFactory")  # type: ignore[attr-defined]
    fake.WeightTransferTrainerFactory = factory("WeightTransferTrainerFactory")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.factory", fake)
    monkeypatch.delitem(sys.modules, backend.ENGINE_MODULE, raising=False)

    backend.register()
    backend.register()  # vLLM may load the plugin again; a second registration is no error
    assert calls == [
        ("WeightTransferEngineFactory", "refit_app", "refit_app.integrations.vllm.engine", "RefitWeightTransferEngine"),
        (
            "WeightTransferTrainerFactory",
            "refit_app",
            "refit_app.integrations.vllm.engine",
            "RefitTrainerWeightTransferEngine",
        ),
    ]
    assert backend.ENGINE_MODULE not in sys.modules, "register imported the engines"


def test_the_registered_path_names_the_engine_classes() -> None:
    # Read statically (the module imports vLLM at its top): each registered name is a class of that module.
    path = PACKAGE.parent / (backend.ENGINE_MODULE.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text(), str(path))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    assert {backend.WORKER_ENGINE, backend.TRAINER_ENGINE} <= set(classes)
    bases = {name: ast.unparse(classes[name].bases[0]) for name in (backend.WORKER_ENGINE, backend.TRAINER_ENGINE)}
    assert bases[backend.WORKER_ENGINE].startswith("WeightTransferEngine[")
    assert bases[backend.TRAINER_ENGINE].startswith("TrainerWeightTransferEngine[")
    # The vLLM import is at the module's top, not inside a function, so type checkers and mkdocstrings see it.
    top = [node for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert any(node.module == "vllm.distributed.weight_transfer.base" for node in top)


def test_staged_rounds_of_a_sharded_refit_are_refused_in_one_line() -> None:
    from refit_app.integrations.vllm.backend import RefitWorkerInitInfo

    common = dict(master_address="127.0.0.1", master_port=1, buffer_size_bytes=1 << 20, num_buffers=2)
    with pytest.raises(ValueError, match=r"^staged=True with producers=2: a sharded refit's rounds are not staged"):
        RefitWorkerInitInfo(rank_offset=2, world_size=4, producers=2, staged=True, **common)
    assert RefitWorkerInitInfo(rank_offset=1, world_size=2, staged=True, **common).staged


def test_the_group_token_comes_from_each_sides_environment_never_from_the_init_info(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from refit_app.common.errors import ConfigError
    from refit_app.transport.groups import connect

    info = backend.RefitTrainerInitInfo(master_address="10.77.0.1", master_port=29999, world_size=2, rank=0)
    monkeypatch.delenv("REFIT_APP_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"10\.77\.0\.1 is not a loopback address and group\.token is not set"):
        connect(backend._spec(info, 0))  # refused before it binds or dials anything
    monkeypatch.setenv("REFIT_APP_TOKEN", "secret-of-this-side")
    assert backend._spec(info, 0).token == "secret-of-this-side"
    assert backend._spec(backend.worker_init_info(info), 1).token == "secret-of-this-side"
    assert "secret-of-this-side" not in repr(backend.worker_init_info(info))  # what vLLM's control plane carries
