"""The RL loop with the library: a trainer sends its weights after every optimizer step, an engine loads them.

    python examples/session_loop.py

Both sides run here as two processes; on two hosts, give the engine the trainer's address as ``host``.
"""

import multiprocessing as mp
import socket
import tempfile
from pathlib import Path

import torch

from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.groups import GroupSpec, connect

STEPS = 3


def trainer(port: int, out: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spec = GroupSpec(backend="gloo", host="127.0.0.1", port=port, world_size=2, rank=0, timeout_s=60)
    with connect(spec) as group, ProducerSession(group, buffer_size_bytes=256 * 1024) as session:
        for step in range(STEPS):
            loss = model(torch.randn(32, 256)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            sent = session.send(model.named_parameters())  # the manifest goes in the first round only
            print(f"trainer: step {step}, loss {loss.item():.4f}, sent {sent.bytes} bytes")
        final = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.save(final, out / "trainer.pt")


def engine(port: int, out: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    params = dict(model.named_parameters())

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in batch:  # views into receive buffers: copy what you keep
                params[name].copy_(tensor)

    spec = GroupSpec(backend="gloo", host="127.0.0.1", port=port, world_size=2, rank=1, timeout_s=60)
    with connect(spec) as group:
        session = ConsumerSession(group, verify=True)
        while (received := session.receive(load)) is not None:
            print(
                f"engine: round {received.round} loaded in {received.seconds * 1e3:.1f} ms, "
                f"manifest sent: {received.manifest_sent}, verified: {received.verified}"
            )
    torch.save({name: p.detach().clone() for name, p in params.items()}, out / "engine.pt")


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp())
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=trainer, args=(port, out)), ctx.Process(target=engine, args=(port, out))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    sent, got = torch.load(out / "trainer.pt"), torch.load(out / "engine.pt")
    same = all(torch.equal(sent[name], got[name]) for name in sent)
    print(f"the engine serves the trainer's last weights: {same}")
    raise SystemExit(0 if same and all(p.exitcode == 0 for p in procs) else 1)
