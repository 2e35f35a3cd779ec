"""The RL loop on Ray: a trainer actor refits two engine actors after every optimizer step.

    pip install 'refit_app[ray]'
    python examples/ray_refit.py

The actors are plain Ray actors that know nothing of refit_app; :class:`~refit_app.integrations.ray.RayRefitGroup`
joins them in a refit group (the trainer's actor gives its node's address) and each refit sends the trainer's
parameters to both engines, verified bit for bit. It starts a local Ray cluster, or joins the one ``RAY_ADDRESS``
names; where the actors run is Ray's business (a placement group, on a real cluster).
"""

import os

import ray
import torch

from refit_app.integrations.ray import RayRefitGroup

STEPS = 3
WAIT_S = 300
"""Every ray.get here has a deadline: one without hangs for good if an actor dies."""


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))


@ray.remote
class Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = make_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def train_step(self) -> float:
        loss = self.model(torch.randn(32, 256)).square().mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()

    def weights(self):
        return self.model.named_parameters()

    def state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


@ray.remote
class Engine:
    def __init__(self) -> None:
        self.model = make_model()
        self.params = dict(self.model.named_parameters())

    def load_weights(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in batch:  # views into receive buffers: copy what you keep
                self.params[name].copy_(tensor)

    def state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.params.items()}


def main() -> bool:
    trainer, engines = Trainer.remote(), [Engine.remote() for _ in range(2)]
    with RayRefitGroup.connect(
        trainer, engines, backend="gloo", producer_options={"buffer_size_bytes": 256 * 1024},
        consumer_options={"verify": True},
    ) as group:  # fmt: skip
        for step in range(STEPS):
            loss = ray.get(trainer.train_step.remote(), timeout=WAIT_S)
            sent, *received = group.refit(tensors="weights", load="load_weights")
            verified = ", ".join(f"engine {k} verified: {r.verified}" for k, r in enumerate(received, 1))
            print(f"step {step}: loss {loss:.4f}, sent {sent.bytes} bytes in round {sent.round}; {verified}")
    last, *served = ray.get([trainer.state.remote()] + [e.state.remote() for e in engines], timeout=WAIT_S)
    same = all(torch.equal(last[name], got[name]) for got in served for name in last)
    print(f"both engines serve the trainer's last weights: {same}")
    return same


if __name__ == "__main__":
    # A local cluster of our own unless RAY_ADDRESS names one: ray.init() alone would join whichever cluster this
    # machine started last.
    # Ray runs its workers at niceness 15 by default: on busy cores a niced actor gets a few percent of a core.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address=os.environ.get("RAY_ADDRESS", "local"), include_dashboard=False)
    try:
        ok = main()
    finally:
        ray.shutdown()
    raise SystemExit(0 if ok else 1)
