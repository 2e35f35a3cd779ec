"""Adversarial findings on ``group.backend=shm`` (issue 31): segments that would not fit the host's memory are
refused before anything is allocated (memfd pages are allocated in full and no /dev/shm size bounds them, so the
OOM killer would pick a victim), and more consumers than the listen backlog connecting at once all get in.

No test here allocates more than a few MiB: each lowers what the check believes is available (a monkeypatched
probe, a fake cgroup tree) or asks for far more than any host has, which is refused before any allocation.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from refit_app.common import memory
from refit_app.common.errors import ConfigError
from refit_app.transport.auth import RunAuth
from refit_app.transport.backends import resolve_backend
from refit_app.transport.shm import link as shm_link
from refit_app.transport.shm import producer as shm_transport
from refit_app.transport.spec import MAX_WORLD_SIZE

MiB = 1 << 20

_RUN_CLI = """
import resource, runpy, sys
limit = {limit!r}
if limit is not None:
    try:  # absent before the check existed: the run then goes ahead as it did
        import refit_app.common.memory as memory
        memory.available_memory = lambda: (limit, "a test's limit")
    except ImportError:
        pass
sys.argv = ["refit_app", *{overrides!r}]
try:
    runpy.run_module("refit_app", run_name="__main__", alter_sys=True)
finally:
    print("maxrss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
"""


def _run_cli(cli, overrides: list[str], limit: int | None):
    result = cli.start_command(["-c", _RUN_CLI.format(limit=limit, overrides=overrides)]).wait()
    rss_kib = int(result.stdout.split("maxrss_kib")[-1].split()[0])
    return result, rss_kib


def _assert_refused_in_one_line(result, rss_kib: int) -> None:
    assert result.returncode != 0, result.describe()
    lines = result.stderr_lines()
    assert len(lines) == 1 and lines[0].startswith("refit_app: error: "), result.describe()
    assert "refit.buffer_size_bytes" in lines[0] and "group.backend=gloo" in lines[0], lines[0]
    # Refused while checking the config: no rank started, no segment made.
    assert rss_kib < 512 * 1024, f"peak RSS {rss_kib} KiB"


def test_cli_refuses_a_ring_larger_than_the_host(cli) -> None:
    """The reported command: 2 x 64 GiB of segments on a host with far less is refused in one line, at once."""
    result, rss_kib = _run_cli(cli, ["group.backend=shm", "refit.buffer_size_bytes=64GiB"], limit=None)
    _assert_refused_in_one_line(result, rss_kib)
    assert "128 GiB" in result.stderr, result.describe()
    # Start-up of the interpreter and Hydra only; a refit would start ranks that import torch.
    assert result.wall_s < 30, result.describe()


def test_cli_refuses_a_ring_over_a_lowered_limit(cli) -> None:
    """The same refusal against a limit of 256 MiB with 2 x 512 MiB buffers: safe to run on the code before the
    check, which allocated the 1 GiB and refitted."""
    overrides = ["group.backend=shm", "refit.buffer_size_bytes=512MiB", "source.preset=lora", "refit.rounds=1"]
    result, rss_kib = _run_cli(cli, overrides, limit=256 * MiB)
    _assert_refused_in_one_line(result, rss_kib)
    assert "256 MiB this process can still take" in result.stderr, result.describe()


def _limit(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    monkeypatch.setattr(memory, "available_memory", lambda: (nbytes, "a test's limit"))


def test_producer_refuses_a_segment_over_the_limit_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor larger than the buffer gets a segment of its own size: refused (library names) before the memfd
    is made, and a segment that fits is still made."""
    _limit(monkeypatch, 64 * MiB)
    group = shm_transport.ShmProducerGroup({}, 2, control=None, timeout_s=5.0)
    assert group.slot_buffer(0, 4 * MiB).numel() == 4 * MiB
    made: list[int] = []
    real = shm_transport.HostSegment
    monkeypatch.setattr(shm_transport, "HostSegment", lambda i, n: made.append(n) or real(i, n))
    with pytest.raises(ConfigError) as e:
        group.slot_buffer(1, 512 * MiB)
    assert made == []
    message = str(e.value)
    assert "\n" not in message
    for part in ("group.backend=shm", "buffer_size_bytes", "a tensor larger than it", "512 MiB", "group.backend=gloo"):
        assert part in message, message
    group.shutdown(abort=False)


def test_producer_counts_the_segments_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments made count against the budget with what is still available: a ring that fits as a whole fits
    segment by segment, and one more segment past 80% of the whole is refused."""
    _limit(monkeypatch, 20 * MiB)  # a constant figure: as if the probe did not see the group's own pages
    group = shm_transport.ShmProducerGroup({}, 2, control=None, timeout_s=5.0)
    for i in range(4):
        group.slot_buffer(i, 4 * MiB)  # 16 MiB of (20 + held) * 0.8
    with pytest.raises(ConfigError, match="on top of the 16 MiB held already"):
        group.slot_buffer(4, 16 * MiB)
    group.shutdown(abort=False)


_INFOS = {r: {"backend": "auto", "cuda": False, "vllm": False, "host": "h"} for r in range(2)}


def test_auto_takes_gloo_and_shm_refuses_when_the_ring_does_not_fit() -> None:
    """Decided at the rendezvous, before any rank has allocated a segment: auto keeps working on gloo, an
    explicit shm is refused in one line naming the parameters."""
    problem = "128 GiB would not fit in the 20 GiB this process can still take"
    assert resolve_backend(_INFOS) == "shm"
    assert resolve_backend(_INFOS, problem) == "gloo"
    explicit = {r: {**info, "backend": "shm"} for r, info in _INFOS.items()}
    with pytest.raises(ConfigError) as e:
        resolve_backend(explicit, problem)
    assert "buffer_size_bytes" in str(e.value) and problem in str(e.value)
    # With a GPU on every rank the segments are device memory: the host's memory is not what bounds them.
    gpus = {r: {**info, "cuda": True} for r, info in explicit.items()}
    assert resolve_backend(gpus, problem) == "shm"


def test_available_memory_reads_cgroup_limits(tmp_path: Path) -> None:
    """cgroup v2 (the process's group and its ancestors; ``max`` is no limit) and v1's memory controller."""
    leaf = tmp_path / "cg" / "a" / "b"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.current").write_text(f"{10 * MiB}\n")
    (leaf.parent / "memory.max").write_text(f"{300 * MiB}\n")
    (leaf.parent / "memory.current").write_text(f"{100 * MiB}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert memory.cgroup_room(tmp_path / "cg", proc) == 200 * MiB
    v1 = tmp_path / "cg" / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{64 * MiB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{60 * MiB}\n")
    proc.write_text("4:memory:/job\n0::/a/b\n")
    assert memory.cgroup_room(tmp_path / "cg", proc) == 4 * MiB
    (v1 / "memory.limit_in_bytes").write_text(f"{(1 << 63) - 4096}\n")  # v1's "no limit"
    assert memory.cgroup_room(tmp_path / "cg", proc) == 200 * MiB
    assert memory.available_memory() is not None  # this host's MemAvailable at least


def _handshake_many(backlog: int, consumers: int) -> None:
    """``consumers`` ranks connect at once, all before the producer accepts any, to a queue of ``backlog``."""
    auth = RunAuth.derive("token", "run", "nonce", 0)
    listener, name = shm_link.listen(auth, backlog)
    deadline = time.monotonic() + 60
    results: dict[int, BaseException | str] = {}
    started = threading.Barrier(consumers + 1)

    def consumer(rank: int) -> None:
        started.wait()
        try:
            link, device = shm_link.connect_producer(
                name, RunAuth.derive("token", "run", "nonce", rank), rank, False, deadline
            )
            results[rank] = device
            link.close()
        except BaseException as e:  # reported below with its rank
            results[rank] = e

    threads = [threading.Thread(target=consumer, args=(r,), daemon=True) for r in range(1, consumers + 1)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.5)  # every consumer has tried (and those past the queue failed once) before any is accepted
    try:
        links, device = shm_link.accept_consumers(listener, auth, consumers + 1, False, deadline, lambda: None)
    finally:
        listener.close()
    for t in threads:
        t.join(timeout=60)
    for link in links.values():
        link.close()
    assert device == "cpu" and sorted(links) == list(range(1, consumers + 1))
    assert results == dict.fromkeys(range(1, consumers + 1), "cpu"), {r: v for r, v in results.items() if v != "cpu"}


def test_more_consumers_than_the_backlog_connect_at_once() -> None:
    """A queue of 2 and 8 consumers at once: the six it could not hold retry until they are accepted."""
    _handshake_many(backlog=2, consumers=8)


def test_more_than_64_consumers_connect_at_once() -> None:
    """The reported case: 70 consumers connecting together to a queue of 64 (the old fixed backlog)."""
    _handshake_many(backlog=64, consumers=70)


def test_the_producer_queues_every_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer's queue holds the whole group (and never less than the system's default)."""
    seen: list[int] = []

    def record(auth, backlog=64):
        seen.append(backlog)
        raise OSError("stop here")

    monkeypatch.setattr(shm_transport, "listen", record)
    spec = shm_transport.GroupSpec(backend="shm", world_size=MAX_WORLD_SIZE, rank=0)
    control = type("C", (), {"auth": RunAuth.derive(None, "run", "nonce", 0)})()
    with pytest.raises(OSError, match="stop here"):
        shm_transport.make_shm_group(None, spec, control)
    assert seen and seen[0] >= MAX_WORLD_SIZE
