"""Refit into a ``torch.nn.Module`` that this script owns, through a sink of its own (``sink._target_``).

    python examples/custom_sink.py

A trainer would own the producer side; here a second process plays it: ``python -m refit_app role=producer``
sends a checkpoint of another instance of the same network. This script is the consumer: it composes refit_app's
config with ``sink=custom sink._target_=__main__.ModuleSink`` and runs it in this process, so the sink loads every
received tensor straight into ``MODEL``'s parameters. It then checks that both networks give the same outputs.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_module

from refit_app import run
from refit_app.app.schema import CONF_MODULE
from refit_app.checkpoint import save_tensors
from refit_app.common.errors import RefitError, SinkError
from refit_app.protocol.manifest import Manifest


def make_network(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


MODEL = make_network(seed=0)
"""The network this script serves; the refit replaces its weights in place."""


class ModuleSink:
    """Loads every received tensor into the parameter of ``MODEL`` with the same name, as it arrives."""

    def __init__(self) -> None:
        self.params = dict(MODEL.named_parameters())
        self.loaded: set[str] = set()

    def begin(self, manifest: Manifest) -> None:
        # Refuse a checkpoint that does not fit before any tensor moves: every rank then stops with this line.
        wrong = [
            f"{t.name} {list(t.shape)}"
            for t in manifest.tensors
            if t.name not in self.params or tuple(self.params[t.name].shape) != t.shape
        ]
        if wrong:
            raise SinkError(f"these tensors do not fit the network: {', '.join(wrong)}")

    def consume(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, t in batch:
                self.params[name].copy_(t)  # the received views die after this call; the copy stays
                self.loaded.add(name)

    def finish(self, checksums: list[int] | None) -> dict:
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            raise SinkError(f"never received: {', '.join(missing)}")
        return {"loaded_tensors": len(self.loaded)}

    def close(self) -> dict:
        return {}

    def abort(self) -> None:
        """Nothing to undo: a failed round leaves the network to the next full round."""


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    trained = make_network(seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_tensors(Path(tmp) / "model.safetensors", dict(trained.state_dict()))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        group = [f"group.port={port}", "group.timeout_s=120"]
        producer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "refit_app",
                "role=producer",
                "source=safetensors",
                f"source.path={checkpoint}",
                "hydra.run.dir=" + tmp,
                *group,
            ]
        )
        error = None
        try:
            with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
                cfg = compose(
                    "config", overrides=["role=consumer", "sink=custom", "sink._target_=__main__.ModuleSink", *group]
                )
            metrics = run(cfg)
        except RefitError as e:
            error = e
        finally:
            producer_code = producer.wait(timeout=120)
        if error is not None:
            print(f"custom_sink: refit failed: {error}", file=sys.stderr)
            return 1
        if producer_code != 0:
            print(f"custom_sink: the producer exited {producer_code}", file=sys.stderr)
            return 1
    x = torch.randn(4, 32)
    same = torch.equal(MODEL(x), trained(x))
    print(f"loaded {metrics['num_tensors']} tensors into the network; outputs match the trainer's: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
