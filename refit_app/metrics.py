"""What a refit measured: peak memory, the metrics.json schema, and the one-line summary a run logs."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from refit_app.files import write_atomic
from refit_app.sizes import format_decimal, format_size

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"

METRICS_KEYS: dict[str, str] = {
    "role": "producer, consumer or local (local: the producer's figures, each consumer's under `consumers`)",
    "rank": "rank in the refit group; the producer is 0",
    "status": '"ok" or "failed"',
    "error": "null, or the failure as one line",
    "bytes": "payload bytes moved (sum of tensor sizes, without padding)",
    "num_tensors": "tensors moved",
    "num_chunks": "packed chunks the tensors were split into",
    "seconds": "wall time of the transfer, from the first chunk to the last, handshake excluded",
    "gb_per_s": "bytes / 1e9 / seconds",
    "buffer_size_bytes": "packed buffer size actually used",
    "num_buffers": "buffers in flight",
    "use_legacy_packing": "true: vLLM-compatible chunks; false: bounded packing",
    "backend": "collective backend actually used: gloo, nccl or pynccl",
    "world_size": "ranks in the group (1 producer + consumers)",
    "peak_rss_bytes": "highest resident set size of this process during the transfer",
    "peak_extra_bytes": "peak_rss_bytes minus the resident set size when the transfer started",
    "cuda_peak_bytes": "torch.cuda.max_memory_allocated during the transfer; null without CUDA",
    "cuda_peak_extra_bytes": "cuda_peak_bytes minus the memory allocated when the transfer started; null without CUDA",
    "verified": "true: every tensor matched the producer's checksums; false: a mismatch; null: not checked",
    "source": "where the weights came from (synthetic preset or safetensors path)",
    "sink": "what the consumer did with them: verify, save or discard",
    "consumers": "role=local only: a list of each consumer's metrics, with the keys above",
}

EXTRA_METRICS_KEYS: dict[str, str] = {
    "num_broadcasts": "chunks actually broadcast (a chunk of only zero-byte tensors is skipped in bounded mode)",
    "handshake_seconds": "rendezvous-to-accepted-manifest time on this rank (not part of seconds)",
    "checksums": "producer: whether it sent per-tensor checksums (some consumer verifies)",
    "verified_tensors": "sink=verify: tensors checked bit for bit",
    "saved_to": "sink=save: the checkpoint directory",
    "saved_files": "sink=save: the files written there",
}
"""Keys of a successful run that only some roles or sinks write."""

# Enough digits to compare runs, few enough that a diff of two metrics.json files is readable.
_SIGNIFICANT_DIGITS = 5

_PROC_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_SAMPLE_INTERVAL_S = 0.005
_SAMPLER_JOIN_TIMEOUT_S = 5.0


def _read_rss_kib() -> tuple[int, int] | None:
    """(VmRSS, VmHWM) in KiB, or None where /proc is not Linux's."""
    try:
        text = _PROC_STATUS.read_text()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    if len(values) != 2:
        return None
    return values["VmRSS"], values["VmHWM"]


def _reset_high_water_mark() -> bool:
    """Lower VmHWM to the current RSS (Linux >= 4.0); False where the kernel or a sandbox forbids it."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError as e:
        logger.debug("cannot reset VmHWM through %s (%s); sampling RSS instead", _CLEAR_REFS, e)
        return False
    return True


class PeakMemory:
    """Peak memory of this process during a block, above what it held when the block started.

    The kernel's high-water mark (VmHWM) counts pages resident however briefly, so no short peak escapes;
    it is reset at the start so that one refit's peak does not hide the next one's. Where the reset is not
    permitted, a thread samples VmRSS every few milliseconds, which can miss a peak shorter than that.
    RSS counts file-backed pages too, so a memory-mapped safetensors source shows up as the pages it touched.
    On CUDA the caching allocator's own peak is measured as well, for ``device``.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.baseline_rss: int | None = None
        self.peak_rss: int | None = None
        self.cuda_baseline_bytes: int | None = None
        self.cuda_peak_bytes: int | None = None
        self._sampled_peak_kib = 0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    @property
    def peak_extra_bytes(self) -> int | None:
        if self.peak_rss is None or self.baseline_rss is None:
            return None
        return self.peak_rss - self.baseline_rss

    @property
    def cuda_peak_extra_bytes(self) -> int | None:
        if self.cuda_peak_bytes is None or self.cuda_baseline_bytes is None:
            return None
        return self.cuda_peak_bytes - self.cuda_baseline_bytes

    def _uses_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def start(self) -> None:
        if self._uses_cuda():
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.cuda_baseline_bytes = torch.cuda.memory_allocated(self.device)
        self.peak_rss = None
        reset = _reset_high_water_mark()
        rss = _read_rss_kib()
        if rss is None:
            logger.warning("no /proc/self/status on this system: peak memory is not measured")
            self.baseline_rss = None
            return
        self.baseline_rss = rss[0] * 1024
        if not reset:
            self._sampled_peak_kib = rss[0]
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sample, name="refit-peak-memory", daemon=True)
            self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(_SAMPLE_INTERVAL_S):
            rss = _read_rss_kib()
            if rss is not None:
                self._sampled_peak_kib = max(self._sampled_peak_kib, rss[0])

    def stop(self) -> None:
        if self._uses_cuda():
            import torch

            torch.cuda.synchronize(self.device)
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated(self.device)
        if self.baseline_rss is None:
            return
        rss = _read_rss_kib()
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join(timeout=_SAMPLER_JOIN_TIMEOUT_S)
            self._sampler = None
            current = rss[0] if rss is not None else 0
            self.peak_rss = max(self._sampled_peak_kib, current) * 1024
        elif rss is not None:
            self.peak_rss = rss[1] * 1024

    def to_metrics(self) -> dict[str, int | None]:
        return {
            "peak_rss_bytes": self.peak_rss,
            "peak_extra_bytes": self.peak_extra_bytes,
            "cuda_peak_bytes": self.cuda_peak_bytes,
            "cuda_peak_extra_bytes": self.cuda_peak_extra_bytes,
        }

    def __enter__(self) -> PeakMemory:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def gb_per_s(nbytes: int, seconds: float) -> float | None:
    """Throughput as the metrics report it (decimal GB); None when no time was measured."""
    if seconds <= 0:
        return None
    return nbytes / 1e9 / seconds


def overall_verified(metrics: Mapping[str, Any]) -> bool | None:
    """The run's verdict: its own ``verified``, or for role=local without one, the consumers' combined."""
    verified = metrics.get("verified")
    if verified is not None:
        return bool(verified)
    verdicts = [c.get("verified") for c in metrics.get("consumers") or []]
    if any(v is False for v in verdicts):
        return False
    if verdicts and all(v is True for v in verdicts):
        return True
    return None


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.{_SIGNIFICANT_DIGITS}g}")
    if isinstance(value, Mapping):
        return {str(k): _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def write_metrics(path_dir: str | os.PathLike[str], metrics: Mapping[str, Any]) -> Path:
    """Write ``metrics.json`` into ``path_dir`` (see METRICS_KEYS); returns its path."""
    path = Path(path_dir) / METRICS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # default=str: a dtype, device or Path in the dict is recorded rather than failing the run at its end.
    text = json.dumps(_rounded(metrics), indent=2, default=str, allow_nan=False) + "\n"
    write_atomic(path, text.encode())
    return path


def summary_line(metrics: Mapping[str, Any]) -> str:
    """The run in one log line: what moved, how fast, with which settings, how much memory, and the verdict."""
    who = str(metrics.get("role", "refit"))
    if metrics.get("role") == "consumer" and metrics.get("rank") is not None:
        who += f" {metrics['rank']}"
    if metrics.get("status") == "failed":
        return f"{who}: failed: {metrics.get('error') or 'unknown error'}"

    parts = [f"{who}: {format_decimal(metrics.get('bytes') or 0)}"]
    parts.append(f" in {metrics.get('num_tensors', '?')} tensors / {metrics.get('num_chunks', '?')} chunks")
    seconds = metrics.get("seconds")
    if seconds is not None:
        parts.append(f" in {seconds:.2f} s")
    if metrics.get("gb_per_s") is not None:
        parts.append(f" = {metrics['gb_per_s']:.2f} GB/s")

    settings = []
    if metrics.get("buffer_size_bytes") is not None:
        settings.append(f"buffer {format_size(metrics['buffer_size_bytes'])} x {metrics.get('num_buffers', '?')}")
    if metrics.get("use_legacy_packing") is not None:
        settings.append("legacy packing" if metrics["use_legacy_packing"] else "bounded packing")
    if metrics.get("backend"):
        settings.append(str(metrics["backend"]))
    if settings:
        parts.append(f" ({', '.join(settings)})")

    consumers = metrics.get("consumers") or []
    if consumers:
        parts.append(f", {len(consumers)} consumer{'s' if len(consumers) != 1 else ''}")
    extra = metrics.get("peak_extra_bytes")
    if extra is not None:
        parts.append(f", peak {'-' if extra < 0 else '+'}{format_size(abs(extra))}")
    verified = overall_verified(metrics)
    if verified is True:
        parts.append(", verified")
    elif verified is False:
        parts.append(", VERIFICATION FAILED")
    return "".join(parts)
