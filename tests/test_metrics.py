"""Peak-memory measurement, the metrics file and its summary line, and the progress display."""

from __future__ import annotations

import io
import json
import logging
import mmap
from pathlib import Path

import pytest
import torch
from conditions import needs_cuda, needs_linux_proc

from refit_app.app import metrics as metrics_mod
from refit_app.app.metrics import (
    METRICS_KEYS,
    PeakMemory,
    RunMetrics,
    summary_line,
    write_metrics,
)
from refit_app.app.progress import Progress
from refit_app.common.errors import one_line
from refit_app.common.sizes import gb_per_s

MiB = 2**20


def _touch(nbytes: int) -> torch.Tensor:
    # torch.ones writes every page, so all of them become resident (torch.empty would not).
    return torch.ones(nbytes, dtype=torch.uint8)


def _fresh_pages(nbytes: int) -> mmap.mmap:
    """``nbytes`` of newly mapped, resident memory, whatever the allocator did before.

    torch's allocator goes through malloc, which may serve a block from pages an earlier test left resident in
    the heap (then RSS does not grow and there is no peak to see); an anonymous mapping is always fresh, and
    ``close()`` unmaps it.
    """
    pages = mmap.mmap(-1, nbytes)
    pages[:: mmap.PAGESIZE] = b"\x01" * (nbytes // mmap.PAGESIZE)
    return pages


@needs_linux_proc
def test_peak_memory_sees_a_freed_allocation_and_restarts_from_the_new_baseline() -> None:
    _touch(MiB)  # torch's first-use allocations are not part of what is measured
    with PeakMemory() as first:
        _fresh_pages(200 * MiB).close()
    assert first.peak_extra_bytes == pytest.approx(200 * MiB, rel=0.05)

    with PeakMemory() as second:
        _fresh_pages(48 * MiB).close()
    # Without the reset the high-water mark would still hold the 200 MiB from before.
    assert second.peak_extra_bytes == pytest.approx(48 * MiB, rel=0.05)
    assert second.baseline_rss < first.peak_rss - 150 * MiB
    assert second.cuda_peak_bytes is None


@needs_linux_proc
def test_peak_memory_samples_when_the_high_water_mark_cannot_be_reset(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(metrics_mod, "_CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    _touch(MiB)
    with PeakMemory() as pm:
        assert pm._sampler is not None and pm._sampler.is_alive()
        # Still held at exit, so the final sample sees it however the sampler thread was scheduled.
        t = _touch(100 * MiB)
    assert pm._sampler is None
    assert pm.peak_extra_bytes == pytest.approx(100 * MiB, rel=0.05)
    del t


@pytest.mark.gpu
@needs_cuda
def test_peak_memory_measures_the_cuda_allocator() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    keep = torch.ones(64 * MiB, dtype=torch.uint8, device=device)
    with PeakMemory(device) as pm:
        t = torch.ones(256 * MiB, dtype=torch.uint8, device=device)
        del t
    assert pm.cuda_baseline_bytes >= keep.numel()
    assert pm.cuda_peak_extra_bytes == pytest.approx(256 * MiB, rel=0.01)
    assert pm.cuda_peak_bytes is not None


def _producer_metrics(**changes: object) -> dict[str, object]:
    m = RunMetrics(
        role="producer",
        rank=0,
        bytes=1_070_000_000,
        num_tensors=412,
        num_chunks=5,
        seconds=0.6114285714285714,
        gb_per_s=gb_per_s(1_070_000_000, 0.6114285714285714),
        buffer_size_bytes=256 * MiB,
        num_buffers=2,
        use_legacy_packing=False,
        backend="gloo",
        world_size=2,
        peak_rss_bytes=2_000 * MiB,
        peak_extra_bytes=520 * MiB,
        verified=True,
        source="synthetic",
    ).to_json()
    m.update(changes)
    return m


def test_write_metrics_is_atomic_rounded_and_covers_the_schema(tmp_path: Path) -> None:
    consumer = _producer_metrics(role="consumer", rank=1, sink="verify", seconds=float("nan"))
    data = _producer_metrics(role="local", consumers=[consumer], dtype=torch.bfloat16)
    path = write_metrics(tmp_path / "job", data)

    assert path == tmp_path / "job" / "metrics.json"
    assert [p.name for p in path.parent.iterdir()] == ["metrics.json"]  # no temp file left behind
    written = json.loads(path.read_text())
    assert set(METRICS_KEYS) <= set(written)
    assert written["seconds"] == 0.61143
    assert written["gb_per_s"] == 1.75
    assert written["bytes"] == 1_070_000_000  # integers are never rounded
    assert written["consumers"][0]["seconds"] is None  # NaN is not valid JSON
    assert written["consumers"][0]["rank"] == 1
    assert written["dtype"] == "torch.bfloat16"

    write_metrics(tmp_path / "job", _producer_metrics(status="failed", error="PeerError: rank 1 died"))
    assert json.loads(path.read_text())["status"] == "failed"


def test_gb_per_s_needs_a_measured_time() -> None:
    assert gb_per_s(3_000_000_000, 2.0) == 1.5
    assert gb_per_s(10, 0.0) is None


def test_summary_line() -> None:
    assert summary_line(_producer_metrics()) == (
        "producer: 1.07 GB in 412 tensors / 5 chunks in 0.61 s = 1.75 GB/s "
        "(buffer 256 MiB x 2, bounded packing, gloo), peak +520 MiB, verified"
    )
    consumer = summary_line(
        _producer_metrics(role="consumer", rank=2, use_legacy_packing=True, verified=False, buffer_size_bytes=2**30)
    )
    assert consumer.startswith("consumer 2: 1.07 GB")
    assert "(buffer 1 GiB x 2, legacy packing, gloo)" in consumer
    assert consumer.endswith("VERIFICATION FAILED")

    local = _producer_metrics(
        role="local", verified=None, consumers=[_producer_metrics(verified=True), _producer_metrics(verified=True)]
    )
    assert summary_line(local).endswith(", 2 consumers, peak +520 MiB, verified")
    assert summary_line(_producer_metrics(verified=None, sink="discard")).endswith("peak +520 MiB")

    failed = _producer_metrics(role="consumer", rank=1, status="failed", error="PeerError: producer died")
    assert summary_line(failed) == "consumer 1: failed: PeerError: producer died"


def test_one_line_is_one_bounded_line() -> None:
    assert one_line(ValueError("bad\n  value\tthere"), with_type=True) == "ValueError: bad; value there"
    assert one_line(KeyError()) == "KeyError"
    assert (
        one_line(
            RuntimeError(
                "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                "This is typically caused by a crash"
            )
        )
        == "Connection closed by peer"
    )
    long = one_line(RuntimeError("x" * 2000), with_type=True)
    assert len(long) == 500 and long.endswith("...")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeTerminal(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_is_silent_for_short_transfers(caplog: pytest.LogCaptureFixture) -> None:
    for tty in (True, False):
        clock, stream = FakeClock(), FakeTerminal(tty)
        with (
            caplog.at_level(logging.INFO, logger="refit_app.app.progress"),
            Progress(10 * 10**9, 10, "producer", stream=stream, clock=clock) as progress,
        ):
            for _ in range(10):
                clock.now += 0.19
                progress.update(10**9)
        assert stream.getvalue() == ""
    assert caplog.records == []


def test_progress_redraws_one_terminal_line_at_most_five_times_a_second(caplog: pytest.LogCaptureFixture) -> None:
    clock, stream = FakeClock(), FakeTerminal(tty=True)
    progress = Progress(4 * 10**9, 32, "producer", stream=stream, clock=clock)
    with caplog.at_level(logging.INFO, logger="refit_app.app.progress"):
        for _ in range(32):
            clock.now += 0.125  # eight chunks a second, 1 GB/s
            progress.update(125 * 10**6)
        progress.close()
        progress.close()

    out = stream.getvalue()
    draws = out.split("\r")[1:]
    # Nothing before 2 s; then at most every 0.2 s, so every other chunk, up to 4 s; then close()'s final line.
    assert len(draws) == 9 + 1
    assert all(d.endswith("\x1b[K") for d in draws[:-1]) and draws[-1].endswith("\x1b[K\n")
    assert out.count("\n") == 1
    assert draws[0] == "producer: 2 GB / 4 GB, 16/32 chunks, 1.00 GB/s, ETA 2 s\x1b[K"
    assert draws[1].startswith("producer: 2.25 GB / 4 GB, 18/32 chunks")
    assert draws[-1] == "producer: 4 GB / 4 GB, 32/32 chunks, 1.00 GB/s\x1b[K\n"
    assert caplog.records == []  # a terminal gets the live line, not log records


def test_progress_logs_periodically_when_not_on_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    clock, stream = FakeClock(), FakeTerminal(tty=False)
    progress = Progress(10**11, 100, "consumer 1", stream=stream, clock=clock, log_every_s=10.0)
    with caplog.at_level(logging.INFO, logger="refit_app.app.progress"):
        for _ in range(100):
            clock.now += 0.5
            progress.update(10**9)
        progress.close()

    assert stream.getvalue() == ""
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 5  # at 10, 20, 30, 40 and 50 s
    assert messages[0] == "consumer 1: 20 GB / 100 GB, 20/100 chunks, 2.00 GB/s, ETA 40 s"
    assert messages[-1] == "consumer 1: 100 GB / 100 GB, 100/100 chunks, 2.00 GB/s"


def test_progress_long_eta_reads_in_minutes() -> None:
    clock, stream = FakeClock(), FakeTerminal(tty=True)
    progress = Progress(10**12, 1000, "producer", stream=stream, clock=clock)
    clock.now += 3.0
    progress.update(3 * 10**9)
    assert "ETA 16m37s" in stream.getvalue()


def test_the_docs_tables_are_the_schema() -> None:
    # docs/metrics.md is these tables (docs/hooks.py): every key once, in order, with its meaning, in a cell that a
    # "|" in a meaning would split.
    from refit_app.app.metrics import ROUND_KEYS, markdown_table

    for keys in (METRICS_KEYS, ROUND_KEYS):
        lines = markdown_table(keys).splitlines()
        assert lines[:2] == ["| key | meaning |", "| --- | --- |"]
        rows = [line.strip("|").split("|") for line in lines[2:]]
        assert [(k.strip().strip("`"), m.strip()) for k, m in rows] == list(keys.items())
