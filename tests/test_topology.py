"""``group.topology=chain`` (issue 13): consumers relay each chunk to the next rank, over real gloo groups.

The setting (refused values, every rank must agree, NCCL refused), the relay's ordering against a fake backend,
bit-exact chain refits with 1-3 consumers, 1-3 buffers and chunk plans with tensors that travel alone, the whole
application with ``sink=verify``, and a consumer killed in the middle of the chain.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cli_utils import CLI_TIMEOUT_S
from config_utils import settings
from failure_utils import Launcher
from mp_utils import STARTUP_LIMIT_S, deadline_budget, free_port, gloo_spec, run_ranks

from refit_app.common.errors import ConfigError
from refit_app.packed_tensor import (
    chunk_ids,
    packed_broadcast_consumer,
    packed_broadcast_producer,
)
from refit_app.transport.backends import resolve_backend
from refit_app.transport.chain import DEFAULT_SEGMENT_BYTES, ChainBroadcastGroup
from refit_app.transport.groups import GroupSpec, connect

# ---------------------------------------------------------------------------------------------------------------
# The setting


def test_topology_is_a_group_setting_defaulting_to_tree() -> None:
    assert settings().group.topology == "tree"
    assert settings("group.topology=chain").group.topology == "chain"
    consumer = settings("role=consumer", "group.rank=1", "group.topology=chain", "group.backend=gloo")
    assert consumer.group.topology == "chain"


def test_an_unknown_topology_names_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as info:
        settings("group.topology=ring")
    assert str(info.value) == "group.topology='ring' is invalid: choose one of tree, chain"


@pytest.mark.parametrize("backend", ["nccl", "pynccl"])
def test_chain_with_nccl_is_refused_in_one_line(backend: str) -> None:
    with pytest.raises(ConfigError) as info:
        GroupSpec(backend=backend, topology="chain")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("group.topology='chain' is invalid: chain relays over gloo only")
    assert f"group.backend={backend}" in message and "group.backend=gloo" in message


def test_the_cli_refuses_chain_with_nccl_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "refit_app", "group.topology=chain", "group.backend=nccl", f"hydra.run.dir={tmp_path}"],
        check=False,
        capture_output=True,
        text=True,
        timeout=STARTUP_LIMIT_S,
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        (
            "refit_app: error: group.topology='chain' is invalid: chain relays over gloo only, and group.backend=nccl "
            "already pipelines its broadcast on GPUs; use group.topology=tree or group.backend=gloo"
        )
    ]


def _info(topology: str | None, backend: str = "auto", cuda: bool = False) -> dict:
    info = {"backend": backend, "cuda": cuda, "vllm": False}
    if topology is not None:
        info["topology"] = topology
    return info


def test_ranks_that_disagree_on_the_topology_are_refused_naming_both_values() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_backend({0: _info("tree"), 1: _info("tree"), 2: _info("chain")})
    assert str(info.value) == (
        "group.topology differs between ranks (rank 0 'tree', rank 1 'tree', rank 2 'chain'); "
        "set the same group.topology on every rank"
    )
    with pytest.raises(ConfigError, match="rank 0 'chain', rank 1 'tree'"):
        resolve_backend({0: _info("chain"), 1: _info(None)})  # a rank that reports none broadcasts along the tree


def test_auto_picks_gloo_for_a_chain_even_where_every_rank_has_a_gpu() -> None:
    assert resolve_backend({0: _info("tree", cuda=True), 1: _info("tree", cuda=True)}) == "nccl"
    assert resolve_backend({0: _info("chain", cuda=True), 1: _info("chain", cuda=True)}) == "gloo"


def _check_in_with_topology(rank: int, world_size: int, port: int) -> str:
    spec = gloo_spec(rank, world_size, port, timeout_s=30, topology="chain" if rank == 2 else "tree")
    try:
        with connect(spec):
            return "connected"
    except ConfigError as e:
        return str(e)


def test_a_topology_mismatch_is_refused_at_the_rendezvous_on_every_rank() -> None:
    expected = (
        "group.topology differs between ranks (rank 0 'tree', rank 1 'tree', rank 2 'chain'); "
        "set the same group.topology on every rank"
    )
    outcomes = run_ranks(_check_in_with_topology, 3, timeout=60)
    # Rank 1 may check in after the producer already saw rank 2's: it then reports the conflict as far as seen.
    assert outcomes[0] in (expected, expected.replace("rank 1 'tree', ", ""))
    assert outcomes[2] == outcomes[0] and outcomes[1] == outcomes[0], outcomes


# ---------------------------------------------------------------------------------------------------------------
# The relay's ordering, against a fake backend


class _FakeWork:
    def __init__(self, log: list[str], name: str) -> None:
        self.done = threading.Event()
        self._log = log
        self._name = name

    def wait(self) -> None:
        assert self.done.wait(10), f"{self._name} never completed"
        self._log.append(f"{self._name} done")


class _FakeBackend:
    """Records each point-to-point call; a work completes when the test says so."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.works: dict[str, _FakeWork] = {}
        self.posted = threading.Condition()

    def _post(self, name: str) -> _FakeWork:
        with self.posted:
            self.log.append(name)
            self.works[name] = _FakeWork(self.log, name)
            self.posted.notify_all()
        return self.works[name]

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _FakeWork:
        return self._post(f"send {tag} to {dst}")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _FakeWork:
        return self._post(f"recv {tag} from {src}")

    def wait_posted(self, name: str) -> _FakeWork:
        with self.posted:
            assert self.posted.wait_for(lambda: name in self.works, 10), self.log
        return self.works[name]


class _NoControl:
    timeout_s = 5.0


@pytest.mark.parametrize(("rank", "before", "after"), [(0, None, 1), (1, 0, 2), (2, 1, 3), (3, 2, None)])
def test_neighbours_follow_the_ranks_from_the_source(rank: int, before: int | None, after: int | None) -> None:
    group = ChainBroadcastGroup(_FakeBackend(), rank, 4, _NoControl())
    assert group.neighbours(0) == (before, after)
    assert group.neighbours(2) == ((rank - 1) % 4 if rank != 2 else None, (rank + 1) % 4 if rank != 1 else None)


def test_segments_are_consecutive_views_cut_the_same_way_for_every_size() -> None:
    group = ChainBroadcastGroup(_FakeBackend(), 1, 3, _NoControl(), segment_bytes=4)
    t = torch.arange(5, dtype=torch.int16)  # 10 bytes
    pieces = group.segments(t)
    assert [p.numel() for p in pieces] == [4, 4, 2]
    assert all(p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for p in pieces)
    assert torch.equal(torch.cat(pieces), t.view(torch.uint8))
    assert [p.numel() for p in group.segments(torch.tensor(1.5, dtype=torch.float64))] == [4, 4]
    assert [p.numel() for p in group.segments(torch.empty(0, 3))] == [0]  # an empty broadcast is one message
    with pytest.raises(ValueError, match="contiguous"):
        group.segments(torch.zeros(4, 4).t())


def test_a_relay_forwards_each_chunk_once_it_arrived_and_holds_the_buffer_until_then() -> None:
    backend = _FakeBackend()
    group = ChainBroadcastGroup(backend, 1, 3, _NoControl())
    first, second = torch.zeros(4), torch.zeros(4)
    works = [group.broadcast_async(first, 0), group.broadcast_async(second, 0)]
    # Both receives are posted at once (two buffers in flight); nothing is forwarded before its chunk arrived.
    assert backend.log == ["recv 0 from 0", "recv 1 from 0"]
    backend.works["recv 0 from 0"].done.set()
    send0 = backend.wait_posted("send 0 to 2")  # forwarded by the relay, before anyone waits for chunk 0
    waiter = threading.Thread(target=works[0].wait)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "wait() returned while the forward send still reads the buffer"
    send0.done.set()
    waiter.join(10)
    assert not waiter.is_alive()
    backend.works["recv 1 from 0"].done.set()
    backend.wait_posted("send 1 to 2").done.set()
    works[1].wait()
    assert backend.log == [
        "recv 0 from 0",
        "recv 1 from 0",
        "recv 0 from 0 done",
        "send 0 to 2",
        "send 0 to 2 done",
        "recv 1 from 0 done",
        "send 1 to 2",
        "send 1 to 2 done",
    ]
    group.shutdown(abort=False)


# ---------------------------------------------------------------------------------------------------------------
# Bit-exact chain refits over real gloo groups

TARGET = 64 * 1024
"""Chunk target of the library cases: small, so that the tensors below make many chunks and two travel alone."""


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(13)
    base = torch.randn(96, 80, generator=g)
    return [
        ("scalar", torch.tensor(3.25, dtype=torch.bfloat16)),
        ("int8", torch.randint(-128, 127, (333,), dtype=torch.int8, generator=g)),
        ("alone.fp32", torch.randn(5 * TARGET // 4, generator=g)),  # 5x the target: a chunk of its own
        ("strided", base.t()),  # a non-contiguous view, packed by copy
        ("empty", torch.empty(0, 7)),
        ("bf16", torch.randn(7000, generator=g).to(torch.bfloat16)),
        ("int64", torch.arange(9001, dtype=torch.int64)),
        ("alone.fp64", torch.randn(3 * TARGET // 8 + 5, generator=g, dtype=torch.float64)),
        ("bool", torch.rand(77, generator=g) > 0.5),
    ]


PLANS = [(buffers, legacy) for buffers in (1, 2, 3) for legacy in (False, True)]
"""Every plan runs over one chain group per consumer count, one refit after the other, as an RL loop's do."""
SEGMENT_BYTES = {1: DEFAULT_SEGMENT_BYTES, 2: 10_000, 3: 4099}
"""The chain's slice size per consumer count: the default (no chunk here is cut), and sizes that cut chunks, the
tensors that travel alone and single elements at odd places."""


def _chain_cases(rank: int, world_size: int, port: int, ports: list[int]) -> list[str]:
    expected = _tensors()
    metas = [(name, (tuple(t.shape), t.dtype)) for name, t in expected]
    checked = []
    for consumers, group_port in zip((1, 2, 3), ports):
        if rank > consumers:
            continue
        with connect(gloo_spec(rank, consumers + 1, group_port, timeout_s=60, topology="chain")) as rg:
            assert isinstance(rg.group, ChainBroadcastGroup)
            rg.group.segment_bytes = SEGMENT_BYTES[consumers]  # the same on every rank of the group
            for buffers, legacy in PLANS:
                plan_settings = {"buffer_size_bytes": TARGET, "num_buffers": buffers, "use_legacy_packing": legacy}
                if rank == 0:
                    packed_broadcast_producer(iter(expected), rg.group, 0, lambda item: item[1], **plan_settings)
                    continue
                # A consumer's buffer count is its own: mirror the producer's count backwards.
                plan_settings["num_buffers"] = 4 - buffers
                got = [
                    (name, t.clone())
                    for name, t in packed_broadcast_consumer(
                        iter(metas), rg.group, 0, None, return_iterator=True, **plan_settings
                    )
                ]
                assert [name for name, _ in got] == [name for name, _ in expected]
                for (name, t), (_, want) in zip(got, expected):
                    assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want), (
                        f"{name} differs on rank {rank} ({consumers} consumers, {buffers} buffers, legacy={legacy})"
                    )
                checked.append(f"{consumers}/{buffers}/{legacy}")
    return checked


def test_chain_refits_are_bit_exact_for_1_to_3_consumers_buffers_and_plans() -> None:
    sizes = [t.numel() * t.element_size() for _, t in _tensors()]
    for legacy in (False, True):
        assert len(set(chunk_ids(sizes, TARGET, legacy))) >= 3
    bounded = list(chunk_ids(sizes, TARGET, False))
    assert bounded.count(bounded[2]) == 1 and bounded.count(bounded[7]) == 1, "the big tensors travel alone"
    outcomes = run_ranks(_chain_cases, 4, [free_port() for _ in range(3)], timeout=300)
    for rank, checked in enumerate(outcomes[1:], start=1):
        assert checked == [f"{c}/{b}/{legacy}" for c in (1, 2, 3) if rank <= c for b, legacy in PLANS]


@pytest.mark.parametrize("consumers", [1, 2, 3])
def test_a_chain_refit_through_the_application_is_verified(tmp_path: Path, consumers: int) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "refit_app",
            f"role.num_consumers={consumers}",
            "group.topology=chain",
            "sink=verify",
            "source.preset=llama-1b",
            "source.size=24MiB",
            "refit.buffer_size_bytes=1MiB",
            "refit.rounds=2",
            f"hydra.run.dir={tmp_path}",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["status"], metrics["verified"], metrics["rounds_done"]) == ("ok", True, 2), metrics
    assert metrics["bytes"] > 40 * 2**20  # two rounds of 24 MiB
    log = result.stdout + result.stderr + "".join(p.read_text() for p in tmp_path.rglob("*.log"))
    assert f"rank {consumers}: chain topology: receives from rank {consumers - 1}, forwards to nobody" in log, log


# ---------------------------------------------------------------------------------------------------------------
# A consumer killed in the middle of the chain

TIMEOUT_S = 6
"""group.timeout_s of the failure case: short, so that its deadline stays cheap."""
HANDSHAKE_DONE = r"accepted the manifest"
"""The producer logs this right before the first chunk moves."""
MID_TRANSFER_DELAY_S = 0.3
# Not a wait for readiness (HANDSHAKE_DONE is the signal): it moves the kill into the transfer, which lasts seconds
# (1 GiB relayed three times on a 2-core machine). Had the transfer ended first, the producer would succeed and the
# test fail.


def test_a_consumer_killed_mid_chain_fails_every_rank_within_the_deadline_naming_it(tmp_path: Path) -> None:
    port, world = free_port(), 4
    group = [
        f"group.port={port}",
        f"group.world_size={world}",
        f"group.timeout_s={TIMEOUT_S}",
        "group.topology=chain",
        "group.backend=gloo",
    ]
    ranks = {
        "producer": [
            "role=producer",
            *group,
            "source.preset=llama-1b",
            "source.size=1GiB",
            "refit.buffer_size_bytes=8MiB",
        ]
    }
    ranks |= {f"consumer{r}": ["role=consumer", *group, f"group.rank={r}", "sink=discard"] for r in (1, 2, 3)}
    budget = deadline_budget(TIMEOUT_S)
    with Launcher(tmp_path) as launcher:
        procs = launcher.start_together(ranks, STARTUP_LIMIT_S)
        procs["producer"].wait_for(HANDSHAKE_DONE, budget * 4)
        time.sleep(MID_TRANSFER_DELAY_S)
        killed_at = time.monotonic()
        procs["consumer2"].signal(signal.SIGKILL)
        outcomes = {
            name: procs[name].wait(budget * 4, event_at=killed_at) for name in ("producer", "consumer1", "consumer3")
        }
    for name, o in outcomes.items():
        assert o.returncode == 1, o.describe()
        assert "Traceback" not in o.stderr and len(o.error_lines) == 1, o.describe()
        assert o.error.startswith("refit_app: error: "), o.describe()
        assert re.search(r"\brank 2\b", o.error), f"{name} does not name the killed rank\n{o.describe()}"
        assert o.since_event_s <= budget, f"{name} took {o.since_event_s:.1f}s; allowed {budget:g}s\n{o.describe()}"
