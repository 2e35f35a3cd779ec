"""``role=local`` names the root cause of a failure, with what a rank it had to stop was doing.

Seen before: a producer still reading a slow source (a 39 MB header of 600k tensors) when its consumer's deadline
ran out ended as "rank 0 did not exit after another rank failed; killed", hiding both the consumer's reason and the
producer's step. Here the producer reads a generated header of many tiny tensors and then stalls (a read slower
than any deadline, without depending on this machine's speed), and the consumer has ``group.timeout_s=2``.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from cli_utils import local_metrics
from mp_utils import STARTUP_LIMIT_S

from refit_app.app.rank_harness import RankOutcome, root_cause

STALLED_SOURCE = '''
import threading
from refit_app.models.sources import SafetensorsSource

class StalledSource(SafetensorsSource):
    """Reads the checkpoint, then never finishes: a source slower than the consumers' deadline."""

    def __init__(self, path):
        super().__init__(path)
        threading.Event().wait()
'''


def many_tiny_tensors(path: Path, n: int) -> Path:
    header = {
        f"model.layers.{i}.bias": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(n)
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4 * n))
    return path


def test_a_slow_producer_is_named_with_its_step_and_the_consumers_reason(cli, tmp_path):
    (tmp_path / "stalled_source.py").write_text(STALLED_SOURCE)
    ckpt = many_tiny_tensors(tmp_path / "many.safetensors", 20_000)
    result = cli(
        "source=custom",
        "source._target_=stalled_source.StalledSource",
        f"+source.path={ckpt}",
        "sink=discard",
        "group.timeout_s=2",
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 1, result.describe()
    lines = [line for line in result.stderr_lines() if line.startswith("refit_app: error:")]
    assert len(lines) == 1, result.describe()
    line = lines[0]
    assert "consumer 1 (rank 1) failed first: could not reach the producer" in line, result.describe()
    assert f"producer (rank 0) was still running (its last step: reading the tensor list of {ckpt})" in line, line
    assert "raise group.timeout_s (now 2s)" in line, line
    assert "Traceback" not in result.stderr, result.describe()
    metrics = local_metrics(tmp_path)
    assert metrics["status"] == "failed" and metrics["error"] == line.removeprefix("refit_app: error: ")


def test_root_cause_prefers_the_first_real_failure():
    peer = RankOutcome(2, False, error="the producer failed", exc_type="PeerError", failed_at=3.0)
    own = RankOutcome(0, False, error="disk full", exc_type="SinkError", failed_at=2.0)
    gave_up = RankOutcome(1, False, error="could not reach the producer", exc_type="PeerError", failed_at=1.0)
    stopped = RankOutcome(
        0,
        False,
        error="rank 0 did not exit within 5s after rank 1 failed; killed",
        exc_type="Timeout",
        activity="reading the tensor list of /x",
    )
    labels = ["producer", "consumer 1", "consumer 2"]
    # A rank's own failure beats one that only reports a peer's, whatever came first.
    assert root_cause([own, gave_up, peer], labels, secondary=("PeerError",)) == "disk full"
    # Only reports of peers: the first of them, with the rank that had to be stopped and its step.
    assert root_cause(
        [stopped, gave_up, RankOutcome(2, True)], labels, secondary=("PeerError",), stopped_hint="raise it"
    ) == (
        "consumer 1 (rank 1) failed first: could not reach the producer; producer (rank 0) was still running "
        "(its last step: reading the tensor list of /x) and was stopped; raise it"
    )
    # A rank's own failure is the whole story, even when another rank had to be stopped after it.
    assert root_cause([stopped, own], labels, secondary=("PeerError",), stopped_hint="raise it") == "disk full"
    assert root_cause([RankOutcome(0, True)], labels[:1]) == ""


def _write_lines_forever(array, stop) -> None:
    from refit_app.app import rank_harness

    rank_harness._activity = (array, 1)
    i = 0
    while not stop.is_set():
        rank_harness.note_activity(("A" if i % 2 else "B") * 239)
        i += 1


def test_the_supervisor_never_reads_a_half_written_step():
    """A rank logs while the supervisor reads its last step (it has just failed, or is being stopped): the line read
    is one the rank wrote, never the start of one and the end of another."""
    import ctypes
    import multiprocessing as mp

    from refit_app.app import rank_harness

    ctx = mp.get_context("spawn")
    array = ctx.Array(ctypes.c_char, 2 * rank_harness._ACTIVITY_SLOT, lock=False)
    stop = ctx.Event()
    writer = ctx.Process(target=_write_lines_forever, args=(array, stop), daemon=True)
    writer.start()
    try:
        deadline = time.monotonic() + STARTUP_LIMIT_S  # a fresh interpreter's start-up: only a hang gets near it
        while not rank_harness._read_activity(array, 1):
            assert writer.is_alive() and time.monotonic() < deadline, "the writer never wrote a line"
            time.sleep(0.01)  # a busy wait here would take a core from the writer's start-up
        seen = set()
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            seen.add(rank_harness._read_activity(array, 1))
    finally:
        stop.set()
        writer.join(10)
        if writer.is_alive():
            writer.kill()
    assert seen and seen <= {"A" * 239, "B" * 239}, sorted({s[:3] + "..." + s[-3:] for s in seen})
