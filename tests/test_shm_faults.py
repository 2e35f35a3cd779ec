"""``group.backend=shm`` when ranks die: a consumer killed while it holds views of the producer's segments, the
producer killed mid-round, every rank killed at once. The survivors leave with one line within the deadline
(a killed peer's socket closes at once: they notice in well under it), and nothing is left in ``/dev/shm``."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from mp_utils import STARTUP_LIMIT_S, RankFailure, deadline_budget, gloo_spec, run_ranks
from tensor_utils import IDENTITY, metas

from refit_app.common.errors import PeerError
from refit_app.packed_tensor import packed_broadcast_consumer, packed_broadcast_producer
from refit_app.transport.groups import connect

TIMEOUT_S = 6.0
TARGET = 64 << 10


def _model() -> list[tuple[str, torch.Tensor]]:
    """200 chunks of 64 KiB: a round takes long enough to be killed in the middle of it."""
    return [(f"w{i}", torch.full((16 << 10,), float(i))) for i in range(200)]


def _dev_shm() -> set[str]:
    """What lies in /dev/shm, less POSIX semaphores (``sem.*``): multiprocessing makes those for any process on the
    machine (another test run, say), and refit_app makes none."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


def _kill_mid_round(rank: int, world_size: int, port: int, victims: tuple[int, ...], marks: str, how: str) -> dict:
    """Three rounds; in round 2, at tensor 50 (a consumer) or once chunk 50 went out (the producer: one tensor
    per chunk), each victim notes its pid and the time, and then (``how="self"``) SIGKILLs itself, a consumer while
    it holds views of the producer's memory; or (``how="wait"``) waits there, holding them, for the test to kill
    it. A survivor returns how it failed and when."""
    spec = gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S, backend="shm")
    tensors = _model()
    try:
        with connect(spec) as rg:
            for k in range(3):
                if rank == 0:

                    def stop_after(chunk, k=k):
                        if k == 1 and chunk.index == 50 and 0 in victims:
                            _stop(marks, rank, how)

                    packed_broadcast_producer(
                        iter(tensors), rg.group, 0, IDENTITY, buffer_size_bytes=TARGET, on_chunk_done=stop_after
                    )
                else:
                    held = []
                    it = packed_broadcast_consumer(
                        iter(metas(tensors)), rg.group, 0, None, True, buffer_size_bytes=TARGET
                    )
                    for i, (_, t) in enumerate(it):
                        held.append(t)  # a view of the producer's memory, still referenced when the kill comes
                        if k == 1 and i == 50 and rank in victims:
                            _stop(marks, rank, how)
                    del held
                rg.control.report("round")
                rg.control.gather("round")
    except PeerError as e:
        return {"error": str(e), "at": time.time()}
    return {"error": None, "at": time.time()}


def _stop(marks: str, rank: int, how: str) -> None:
    Path(marks, f"killed-{rank}").write_text(f"{os.getpid()} {time.time()!r}")
    if how == "self":
        os.kill(os.getpid(), signal.SIGKILL)
    signal.pause()  # until the test's SIGKILL


def _killed_at(marks: Path) -> float:
    return min(float(p.read_text().split()[1]) for p in marks.glob("killed-*"))


@pytest.mark.parametrize(
    "world_size, victims",
    [(3, (1,)), (3, (0,)), (2, (1,))],
    ids=["consumer-of-two", "producer", "only-consumer"],
)
def test_survivors_of_a_kill_leave_within_the_deadline_and_leave_nothing(tmp_path: Path, world_size, victims):
    before = _dev_shm()
    results = run_ranks(
        _kill_mid_round,
        world_size,
        victims,
        str(tmp_path),
        "self",
        timeout=4 * deadline_budget(TIMEOUT_S),
        return_exceptions=True,
    )
    killed_at = _killed_at(tmp_path)
    for rank, result in enumerate(results):
        if rank in victims:
            assert isinstance(result, RankFailure) and result.exc_type == "Died", result
            continue
        assert not isinstance(result, RankFailure), result
        assert result["error"] is not None, f"rank {rank} did not notice the kill"
        assert "\n" not in result["error"]
        waited = result["at"] - killed_at
        assert waited <= deadline_budget(TIMEOUT_S), f"rank {rank} left {waited:.1f}s after the kill: {result}"
        # Nobody waited out the deadline: a killed peer's socket closes at once.
        assert waited < TIMEOUT_S, f"rank {rank} took {waited:.1f}s to notice a killed peer: {result}"
    assert _dev_shm() <= before, _dev_shm() - before


def test_every_rank_killed_mid_round_leaves_nothing_in_dev_shm(tmp_path: Path):
    """Every rank stopped mid-round, the consumers holding views of the producer's segments, then all SIGKILLed at
    once: nobody is left to clean up, and nothing needs it."""
    before = _dev_shm()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            run_ranks,
            _kill_mid_round,
            3,
            (0, 1, 2),
            str(tmp_path),
            "wait",
            timeout=4 * deadline_budget(TIMEOUT_S),
            return_exceptions=True,
        )
        deadline = time.monotonic() + STARTUP_LIMIT_S + 4 * deadline_budget(TIMEOUT_S)
        while len(marks := list(tmp_path.glob("killed-*"))) < 3 and not future.done():
            assert time.monotonic() < deadline, "the ranks never reached the middle of round 2"
            time.sleep(0.05)
        for mark in marks:
            os.kill(int(mark.read_text().split()[0]), signal.SIGKILL)
        results = future.result()
    assert len(marks) == 3, results
    assert all(isinstance(r, RankFailure) and r.exc_type == "Died" for r in results), results
    assert _dev_shm() <= before, _dev_shm() - before
