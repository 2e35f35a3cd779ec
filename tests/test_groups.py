"""Rendezvous, broadcast groups and the control channel, on real gloo groups in spawned processes.

Spawning is the slow part (each process imports torch), so related multi-process scenarios share one run:
every rank plays the scenarios in the same order, each on its own port, and records each outcome; the tests
then assert on those records. A rank that sits a scenario out records ``None``.
"""

from __future__ import annotations

import os
import signal
import time
from functools import partial
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from conditions import needs_no_cuda
from mp_utils import RankFailure, deadline_budget, free_port, gloo_spec, run_ranks

from refit_app.common.errors import ConfigError, PeerError
from refit_app.transport import backends
from refit_app.transport.backends import resolve_backend
from refit_app.transport.control import Control
from refit_app.transport.groups import GroupSpec, connect

FAIL_TIMEOUT_S = 5.0
"""group.timeout_s where a deadline or a failure is under test."""
OK_TIMEOUT_S = 30.0
"""group.timeout_s where everything should succeed. Ranks start each scenario together (mp_utils), so no deadline
here includes process start-up."""
TOKEN = "s3cret-token-for-tests-0123456789"
"""group.token of the signed variants of the check-in scenarios (test_auth.py tests what a token keeps out)."""


# --- scenarios: each runs on every rank; returns what the tests check, or raises --------------------------


def _broadcast_three(rank: int, port: int):
    with connect(gloo_spec(rank, 3, port, timeout_s=OK_TIMEOUT_S, backend="auto")) as rg:
        assert (rg.rank, rg.world_size) == (rank, 3)
        from_producer = torch.arange(5, dtype=torch.float32) if rank == 0 else torch.zeros(5)
        rg.group.broadcast(from_producer, 0)
        # Any rank can be the source, and async work completes on wait().
        from_rank2 = torch.full((3,), 7, dtype=torch.int64) if rank == 2 else torch.zeros(3, dtype=torch.int64)
        work = rg.group.broadcast_async(from_rank2, 2)
        work.wait()
        for _ in range(2):  # a phase may repeat; each round waits for its own reports
            rg.control.report("step")
            rg.control.gather("step")
        return rg.backend, str(rg.group.device), from_producer.tolist(), from_rank2.tolist()


def _reconnect_two(rank: int, port: int):
    """A second group in a process whose first group was closed (ranks 0 and 1 only)."""
    if rank == 2:
        return None
    rg = connect(gloo_spec(rank, 2, port, timeout_s=OK_TIMEOUT_S))
    t = torch.tensor([41 + rank], dtype=torch.int64)
    rg.group.broadcast(t, 1)
    rg.control.report("done")
    rg.control.gather("done")
    rg.close()
    rg.close()  # idempotent
    return t.item()


def _world_size_mismatch(rank: int, port: int, token: str | None = None):
    if rank == 2:
        return None
    connect(gloo_spec(rank, 2 if rank == 0 else 3, port, timeout_s=FAIL_TIMEOUT_S, token=token))


def _duplicate_rank(rank: int, port: int, token: str | None = None):
    connect(gloo_spec(min(rank, 1), 3, port, timeout_s=FAIL_TIMEOUT_S, token=token))


def _silent_rank(rank: int, port: int):
    """Rank 2 never reports; the others' gather must give up at its deadline and say who was missing."""
    spec = gloo_spec(rank, 3, port, timeout_s=OK_TIMEOUT_S)
    with connect(spec) as rg:
        if rank == 2:
            deadline = time.monotonic() + OK_TIMEOUT_S
            while rg.control.error() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            return rg.control.error()
        rg.control.report("step")
        rg.control.gather("step", timeout_s=1.0)


SCENARIOS = {
    "broadcast_three": _broadcast_three,
    "reconnect_two": _reconnect_two,
    "world_size_mismatch": _world_size_mismatch,
    "duplicate_rank": _duplicate_rank,
    "signed_world_size_mismatch": partial(_world_size_mismatch, token=TOKEN),
    "signed_duplicate_rank": partial(_duplicate_rank, token=TOKEN),
    "silent_rank": _silent_rank,
}
"""Played once on SCENARIO_RANKS ranks by the ``played`` fixture (conftest.py)."""
SCENARIO_RANKS = 3


def test_three_ranks_broadcast_from_any_source_and_gather(played):
    for rank in range(3):
        backend, device, from_producer, from_rank2 = played[rank]["broadcast_three"]
        assert (backend, device) == ("shm", "cpu")  # auto: every rank on this host, no GPUs
        assert from_producer == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert from_rank2 == [7, 7, 7]


def test_two_ranks_after_close_in_the_same_process(played):
    assert [played[r]["reconnect_two"] for r in range(3)] == [42, 42, None]


@pytest.mark.parametrize("signed", [False, True], ids=["no_token", "token"])
@pytest.mark.parametrize(
    "scenario, ranks, expected",
    [
        ("world_size_mismatch", (0, 1), "group.world_size differs: the producer has 2, consumer rank 1 has 3"),
        ("duplicate_rank", (0, 1, 2), "group.rank=1 is claimed by two consumers"),
    ],
)
def test_checkin_mismatch_stops_every_rank_with_one_message(played, scenario, ranks, expected, signed):
    """With a token too: the signed outcome carries a real rank's failure to every rank, as the unsigned one does."""
    for rank in ranks:
        error = played[rank][f"signed_{scenario}" if signed else scenario]
        assert isinstance(error, ConfigError), (rank, error)
        assert expected in str(error)


def test_gather_deadline_names_the_silent_rank_everywhere(played):
    for rank in (0, 1):
        error = played[rank]["silent_rank"]
        assert isinstance(error, PeerError), (rank, error)
        assert "rank 2 did not report step within 1s" in str(error)
    # The silent rank learns it too, from the first rank that gave up.
    assert "rank 2 did not report step" in played[2]["silent_rank"]


# --- a consumer killed mid-broadcast: its own run, since the killed process returns nothing -------------------


def _killed_mid_broadcast(rank: int, world_size: int, port: int):
    try:
        with connect(gloo_spec(rank, world_size, port, timeout_s=FAIL_TIMEOUT_S)) as rg:
            buf = torch.ones(1 << 18)
            for i in range(200):
                rg.group.broadcast(buf, 0)
                if rank == 2 and i == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
            rg.control.report("done")
            rg.control.gather("done")
    except PeerError as e:
        return e
    return "completed"


def test_consumer_killed_mid_broadcast_fails_the_others_within_the_deadline():
    # The limit counts from the moment all three ranks start (after their imports); the kill follows within the
    # first broadcasts, so a survivor still running past the deadline budget is reported as a "Timeout" failure.
    producer, survivor, killed = run_ranks(
        _killed_mid_broadcast, 3, timeout=deadline_budget(FAIL_TIMEOUT_S), return_exceptions=True
    )
    assert isinstance(killed, RankFailure) and killed.exc_type == "Died"
    for outcome in (producer, survivor):
        assert isinstance(outcome, PeerError), outcome
        assert "a rank may have died" in str(outcome) or "rank 2 did not report" in str(outcome), outcome


# --- in-process checks ------------------------------------------------------------------------------------


def test_port_in_use_is_refused_at_once():
    holder = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with pytest.raises(ConfigError, match=f"group.port={holder.port} is already in use"):
        connect(gloo_spec(0, 2, holder.port, timeout_s=FAIL_TIMEOUT_S))


def test_consumer_without_producer_gives_up_at_its_deadline():
    port = free_port()
    with pytest.raises(PeerError, match=f"could not reach the producer at 127.0.0.1:{port} within 1s"):
        connect(gloo_spec(1, 2, port, timeout_s=1.0))


def test_unresolvable_host_is_a_config_error():
    with pytest.raises(ConfigError, match=r"group\.host='nonexistent\.invalid' cannot be resolved"):
        connect(gloo_spec(1, 2, free_port(), timeout_s=FAIL_TIMEOUT_S, host="nonexistent.invalid"))


def test_rank_out_of_range_is_refused_before_any_rendezvous():
    with pytest.raises(ConfigError, match=r"group.rank=2 is invalid: must be in 0..1 \(0 is the producer\)"):
        GroupSpec(port=free_port(), world_size=2, rank=2)


def test_invalid_spec_lists_every_problem_at_once():
    with pytest.raises(ConfigError) as info:
        connect(GroupSpec(backend="mpi", port=70000, world_size=1, timeout_s=0))
    message = str(info.value)
    for fragment in ("group.backend='mpi'", "group.port=70000", "group.world_size=1", "group.timeout_s=0"):
        assert fragment in message


@needs_no_cuda
@pytest.mark.parametrize("backend", ["nccl", "pynccl"])
def test_gpu_backends_without_gpu_are_refused(backend):
    with pytest.raises(ConfigError, match=f"group.backend={backend} needs a CUDA GPU on every rank; use gloo"):
        connect(gloo_spec(0, 2, free_port(), timeout_s=FAIL_TIMEOUT_S, backend=backend))


def test_pynccl_without_vllm_is_refused(monkeypatch):
    monkeypatch.setattr(backends, "has_cuda", lambda: True)
    monkeypatch.setattr(backends, "has_vllm", lambda: False)
    with pytest.raises(ConfigError, match=r"group.backend=pynccl needs vLLM: pip install 'refit_app\[vllm\]'"):
        connect(gloo_spec(0, 2, free_port(), timeout_s=FAIL_TIMEOUT_S, backend="pynccl"))


def _info(backend: str, cuda: bool = False, vllm: bool = False, host: str | None = None, **more: str) -> dict:
    """A check-in's capabilities; ``host`` None: one that cannot share memory (or predates the field)."""
    return {"backend": backend, "cuda": cuda, "vllm": vllm, "host": host, **more}


@pytest.mark.parametrize(
    "infos, expected",
    [
        ({0: _info("auto"), 1: _info("auto")}, "gloo"),
        ({0: _info("auto", cuda=True), 1: _info("auto", cuda=True)}, "nccl"),
        ({0: _info("auto", cuda=True), 1: _info("auto")}, "gloo"),  # one rank without a GPU
        ({0: _info("auto", cuda=True), 1: _info("gloo", cuda=True)}, "gloo"),  # auto adopts an explicit choice
        ({0: _info("pynccl", True, True), 1: _info("auto", True, True)}, "pynccl"),
        ({0: _info("auto", host="h"), 1: _info("auto", host="h"), 2: _info("auto", host="h")}, "shm"),
        ({0: _info("auto", host="h"), 1: _info("auto", host="h"), 2: _info("auto", host="other")}, "gloo"),
        ({0: _info("auto", host="h"), 1: _info("auto")}, "gloo"),  # a consumer that cannot share memory
        ({0: _info("auto", True, host="h"), 1: _info("auto", host="h")}, "shm"),  # host memory: one has no GPU
        ({0: _info("auto", True, host="h"), 1: _info("auto", True, host="h")}, "nccl"),  # AUTO_SHM_ON_CUDA off
        ({0: _info("auto", host="h", topology="chain"), 1: _info("auto", host="h", topology="chain")}, "gloo"),
        ({0: _info("gloo", host="h"), 1: _info("auto", host="h")}, "gloo"),
        ({0: _info("shm", True, host="h"), 1: _info("auto", True, host="h")}, "shm"),
    ],
)
def test_backend_resolution(infos, expected):
    assert resolve_backend(infos) == expected


@pytest.mark.parametrize(
    "infos, expected",
    [
        (
            {0: _info("gloo"), 1: _info("nccl", cuda=True)},
            "group.backend differs between ranks (rank 0 'gloo', rank 1 'nccl')",
        ),
        (
            {0: _info("nccl", cuda=True), 1: _info("auto")},
            "group.backend=nccl needs a CUDA GPU on every rank, but rank 1 has none",
        ),
        (
            {0: _info("pynccl", True, True), 1: _info("auto", True)},
            "group.backend=pynccl needs vLLM on every rank, but rank 1 lacks it",
        ),
        (
            {0: _info("shm", host="h"), 1: _info("auto", host="h"), 2: _info("auto", host="x"), 3: _info("shm")},
            "group.backend=shm needs every rank on the producer's host, but ranks 2, 3 are elsewhere",
        ),
    ],
)
def test_backend_conflicts_name_the_ranks(infos, expected):
    with pytest.raises(ConfigError) as info:
        resolve_backend(infos)
    assert expected in str(info.value)


def test_control_keeps_the_first_error_and_explains_with_it():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    control = Control(store, rank=1, world_size=3, timeout_s=5.0, address=f"127.0.0.1:{store.port}")
    assert control.error() is None
    control.publish_error(2, "sink.path /ro is not writable")
    control.publish_error(1, "later failure")
    assert control.error() == "rank 2 failed: sink.path /ro is not writable"
    reset = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    assert control.explain(reset) == "rank 2 failed: sink.path /ro is not writable"


def test_control_explains_a_reset_without_a_published_error():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    control = Control(store, rank=0, world_size=2, timeout_s=5.0, address=f"127.0.0.1:{store.port}")
    reset = RuntimeError(
        "[/w/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:735. "
        "This is typically caused by a remote worker crashing."
    )
    assert control.explain(reset) == (
        "lost the connection to rank 1; it may have died (Connection closed by peer [127.0.0.1]:735.)"
    )


@pytest.mark.parametrize(
    ("world_size", "expected"),
    [
        (2, "no progress from rank 1 within 5s; it may have stalled or died, or the network to it failed (Timed out"),
        (3, "no progress from a peer within 5s; a rank may have stalled or died (Timed out"),
    ],
)
def test_control_names_the_silent_peer_when_there_is_only_one(world_size, expected):
    """A producer whose send timed out (a consumer frozen, or its link cut) names the consumer when there is one;
    with several, a broadcast does not say which one stopped."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    control = Control(store, rank=0, world_size=world_size, timeout_s=5.0, address=f"127.0.0.1:{store.port}")
    timeout = RuntimeError(
        "[/w/gloo/transport/tcp/unbound_buffer.cc:133] Timed out waiting 5000ms for send operation to complete"
    )
    assert control.explain(timeout).startswith(expected)


def test_gather_sees_a_late_report_within_milliseconds(monkeypatch):
    """A round ends with a gather in which the other ranks are usually a millisecond behind: its polling must not
    sleep 5 ms first (that was 5.5 ms of every round of a refit loop). The peer reports during the gather's third
    sleep; the sleeps asked for until the gather returns stay under 4 ms (they were 5 + 10 + 20 ms)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{store.port}"
    producer = Control(store, rank=0, world_size=2, timeout_s=5.0, address=address)
    consumer = Control(store, rank=1, world_size=2, timeout_s=5.0, address=address)
    slept: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(seconds)
        if len(slept) == 3:
            consumer.report("done")

    producer.report("done")
    monkeypatch.setattr(time, "sleep", sleep)
    producer.gather("done")
    monkeypatch.setattr(time, "sleep", real_sleep)
    assert len(slept) == 3
    assert sum(slept) < 0.004, slept


def test_pynccl_event_wait_polls_in_microseconds(monkeypatch):
    """A pynccl broadcast's wait polls its CUDA event: first after tens of microseconds, then at most every
    millisecond, never the store's 5-100 ms (a GPU broadcast of one chunk takes about a millisecond)."""

    class Event:
        queries = 0

        def query(self) -> bool:
            Event.queries += 1
            return Event.queries > 12

    class Stream:
        waited: ClassVar[list] = []

        def wait_event(self, event: Event) -> None:
            Stream.waited.append(event)

    class FakeControl:
        timeout_s = 5.0

        def error(self) -> None:
            return None

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(backends.torch.cuda, "current_stream", lambda device: Stream())
    event = Event()
    backends._EventWork(event, torch.device("cuda", 0), FakeControl()).wait()
    assert Event.queries == 13 and Stream.waited == [event]
    assert slept[0] <= 50e-6 and max(slept) <= 1e-3, slept
