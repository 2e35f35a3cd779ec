"""What a refit measured: peak memory, the metrics.json schema, and the one-line summary a run logs."""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from refit_app.common.errors import some_of
from refit_app.common.files import write_atomic
from refit_app.common.sizes import format_decimal, format_size, gb_per_s

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass
class RoundMetrics:
    """One refit of a run (``rounds`` in metrics.json); docs/metrics.md shows these fields (markdown_table)."""

    round: int = field(metadata=_doc("1 for the first refit of the run"))
    seconds: float = field(metadata=_doc("wall time of this round's transfer, checksums included"))
    gb_per_s: float | None = field(metadata=_doc("bytes / 1e9 / seconds"))
    bytes: int = field(metadata=_doc("the model's bytes this round brought up to date"))
    verified: bool | None = field(metadata=_doc("consumer: true when this round was checked bit for bit"))
    manifest_sent: bool = field(metadata=_doc("whether this round carried a manifest (the first, or a changed list)"))
    handshake_seconds: float = field(metadata=_doc("time to send and accept this round's manifest; 0 without one"))
    peak_extra_bytes: int | None = field(metadata=_doc("resident memory above this round's start, at its peak"))
    peak_rss_bytes: int | None = field(metadata=_doc("highest resident set size during this round"))
    loss: float | None = field(
        default=None, metadata=_doc("source=model: mean training loss of the steps before this round")
    )
    model_check: dict[str, Any] | None = field(
        default=None,
        metadata=_doc(
            "sink=model/vllm: `{max_abs_logit_diff, tokens_match}` of the consumer's model against the "
            "producer's after this round (a sharded refit into sink=vllm: also `next_tokens`, the trainer's "
            "greedy tokens on the probe)"
        ),
    )
    engine_load: dict[str, Any] | None = field(
        default=None,
        metadata=_doc(
            "sink=vllm: how the engine took this round: `delta`, `reloaded` (checkpoint tensors loaded "
            "whole through vLLM's layerwise reload) and, in a delta round, `patched` (tensors changed in "
            "place through vLLM's checkpoint-patch loader), `layers` (layers reloaded), `patch_seconds`, "
            "`reload_seconds`"
        ),
    )
    staged: dict[str, Any] | None = field(
        default=None,
        metadata=_doc(
            "sink=vllm sink.staged=true: `applied` (or `error`: not applied, the engine kept the round before), "
            "`stage_seconds` (the round received and verified beside generation), `pause_seconds` (the engine's "
            "stop, pause to resume), `apply_seconds`, `swap_seconds`, `load_seconds` (reloaded in the pause), "
            "`prepared`, `prepared_layers`, `prepare_seconds`, `fallback`, `version`, `base_round`, "
            "`tokens_per_s_receiving` and `tokens_per_s_idle` (the engine's generation while the round arrived, "
            "and with none arriving), `requests_at_pause`, `spans_split_at_pause` (every request in flight at the "
            "pause carries weight_versions spans that split exactly there)"
        ),
    )
    workers: list[dict[str, Any]] | None = field(
        default=None,
        metadata=_doc(
            "a sharded refit into sink=vllm: each tensor-parallel worker's `rank`, `bytes` received this round "
            "(its boxes of every tensor) and `model_bytes` (the whole model's)"
        ),
    )
    wire_bytes: int | None = field(
        default=None,
        metadata=_doc(
            "bytes that crossed the group for this round's data: the packed chunks, or a "
            "delta round's stream with its chunk headers"
        ),
    )
    delta: bool = field(default=False, metadata=_doc("whether this round sent only the changed elements"))
    base_round: int | None = field(default=None, metadata=_doc("the round a delta round was based on"))
    plain: bool = field(
        default=False,
        metadata=_doc(
            "a dense round of refit.delta=auto sent as without deltas, the snapshot left alone (deltas did not pay)"
        ),
    )
    auto_reason: str | None = field(
        default=None,
        metadata=_doc(
            "a sharded refit with refit.delta=auto: the kind of round every rank chose (delta, keep: dense into "
            "the snapshot, plain) and why, as `kind: reason`"
        ),
    )
    changed_elements: int | None = field(
        default=None,
        metadata=_doc(
            "elements whose bytes changed since the last round: counted in a delta round, "
            "estimated from a 1/32 sample in a dense round of refit.delta=auto"
        ),
    )
    changed_fraction: float | None = field(
        default=None, metadata=_doc("changed_elements over all the model's elements")
    )
    encodings: dict[str, int] | None = field(
        default=None,
        metadata=_doc(
            "delta rounds: tensors sent per encoding (dense, bitmask, gaps8, gaps16); unchanged tensors are not sent"
        ),
    )
    diff_seconds: float | None = field(
        default=None, metadata=_doc("producer, delta rounds: time spent comparing and encoding")
    )
    apply_seconds: float | None = field(
        default=None, metadata=_doc("consumer, delta rounds: time spent decoding and applying")
    )
    members: list[int] | None = field(
        default=None,
        metadata=_doc(
            "refit.on_consumer_loss=continue: the consumer ranks that took part in this round (its generation's "
            "members); null otherwise"
        ),
    )


@dataclass
class RunMetrics:
    """What one rank of a run reports in metrics.json (failed runs too, with what was known)."""

    role: str = field(
        metadata=_doc("producer, consumer or local (local: the producer's figures, each consumer's under `consumers`)")
    )
    rank: int | None = field(metadata=_doc("rank in the refit group; the producer is 0"))
    status: str = field(default="ok", metadata=_doc('"ok" or "failed"'))
    error: str | None = field(default=None, metadata=_doc("null, or the failure as one line"))
    bytes: int | None = field(default=None, metadata=_doc("the model's bytes refitted, summed over rounds"))
    wire_bytes: int | None = field(
        default=None, metadata=_doc("bytes that crossed the group for the rounds' data, summed over rounds")
    )
    delta: str | None = field(default=None, metadata=_doc("producer: refit.delta (off, on or auto)"))
    num_tensors: int | None = field(default=None, metadata=_doc("tensors per round"))
    num_chunks: int | None = field(default=None, metadata=_doc("packed chunks per round"))
    num_broadcasts: int | None = field(
        default=None, metadata=_doc("chunks broadcast per round (bounded mode skips chunks of only empty tensors)")
    )
    seconds: float | None = field(
        default=None, metadata=_doc("transfer wall time summed over rounds, handshake excluded")
    )
    gb_per_s: float | None = field(default=None, metadata=_doc("bytes / 1e9 / seconds"))
    rounds_done: int | None = field(default=None, metadata=_doc("rounds completed"))
    first_round_seconds: float | None = field(default=None, metadata=_doc("the first round's transfer time"))
    steady_round_seconds: float | None = field(
        default=None, metadata=_doc("median transfer time of the rounds after the first; null with one round")
    )
    handshake_seconds: float | None = field(
        default=None, metadata=_doc("rendezvous-to-accepted-manifest time of the first round (not part of seconds)")
    )
    buffer_size_bytes: int | None = field(default=None, metadata=_doc("packed buffer size actually used"))
    num_buffers: int | None = field(default=None, metadata=_doc("buffers in flight on this rank"))
    use_legacy_packing: bool | None = field(
        default=None, metadata=_doc("true: vLLM-compatible chunks; false: bounded packing")
    )
    backend: str | None = field(
        default=None, metadata=_doc("collective backend actually used: gloo, nccl, pynccl or shm")
    )
    world_size: int | None = field(default=None, metadata=_doc("ranks in the group (1 producer + consumers)"))
    peak_rss_bytes: int | None = field(default=None, metadata=_doc("highest resident set size during any round"))
    peak_extra_bytes: int | None = field(
        default=None, metadata=_doc("the largest per-round peak above that round's starting resident set size")
    )
    cuda_peak_bytes: int | None = field(
        default=None, metadata=_doc("torch.cuda.max_memory_allocated during the rounds; null without CUDA")
    )
    cuda_peak_extra_bytes: int | None = field(
        default=None, metadata=_doc("cuda_peak_bytes minus the memory allocated at the start; null without CUDA")
    )
    verified: bool | None = field(
        default=None, metadata=_doc("true: every round matched the producer's checksums; null: not checked")
    )
    verified_tensors: int | None = field(default=None, metadata=_doc("sink=verify: tensors checked per round"))
    checksums: bool | None = field(
        default=None, metadata=_doc("producer: whether it sent per-tensor checksums (some consumer verifies)")
    )
    source: str | None = field(default=None, metadata=_doc("where the weights came from"))
    sink: str | None = field(
        default=None, metadata=_doc("what the consumer did with them (verify, save, discard, model, or your class)")
    )
    saved_to: str | None = field(default=None, metadata=_doc("sink=save: the checkpoint directory"))
    saved_files: list[str] | None = field(default=None, metadata=_doc("sink=save: the files written there"))
    rounds: list[RoundMetrics] = field(default_factory=list, metadata=_doc("one entry per round (table below)"))
    restarts: int | None = field(
        default=None,
        metadata=_doc(
            "role=ray with refit.on_consumer_loss=continue, a consumer: how often Ray restarted its actor (its "
            "`rounds` are those since it last rejoined)"
        ),
    )
    producers: list[dict[str, Any]] | None = field(
        default=None,
        metadata=_doc(
            "a sharded refit under role=local: each producer's metrics, with the keys above (the top level is the "
            "run's: `bytes` what the producers sent, `wire_bytes` what the consumers received, a round's `seconds` "
            "its slowest rank's)"
        ),
    )
    consumers: list[dict[str, Any]] | None = field(
        default=None, metadata=_doc("role=local and role=ray: each consumer's metrics, with the keys above")
    )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def round_times(seconds: list[float]) -> dict[str, Any]:
    """A run's timing keys of :class:`RunMetrics` from its rounds' seconds: ``seconds`` (their sum),
    ``rounds_done``, ``first_round_seconds`` and ``steady_round_seconds`` (the median of rounds 2..N)."""
    return {
        "seconds": sum(seconds),
        "rounds_done": len(seconds),
        "first_round_seconds": seconds[0] if seconds else None,
        "steady_round_seconds": statistics.median(seconds[1:]) if len(seconds) > 1 else None,
    }


METRICS_KEYS: dict[str, str] = {f.name: f.metadata["doc"] for f in fields(RunMetrics)}
"""Every key of metrics.json and its meaning, from :class:`RunMetrics`."""
ROUND_KEYS: dict[str, str] = {f.name: f.metadata["doc"] for f in fields(RoundMetrics)}
"""Every key of a ``rounds`` entry and its meaning, from :class:`RoundMetrics`."""


def markdown_table(keys: Mapping[str, str]) -> str:
    """``keys`` (:data:`METRICS_KEYS` or :data:`ROUND_KEYS`) as a Markdown table of key and meaning: docs/hooks.py
    puts both into docs/metrics.md when the site is built, so the page is these fields. The meanings are written as
    Markdown already (their ``code`` spans)."""
    return "\n".join(["| key | meaning |", "| --- | --- |", *(f"| `{k}` | {m} |" for k, m in keys.items())])


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


STEADY_ROUND = "steady round"
"""Headline basis: one steady round (median of rounds 2..N), for a run of more than one round."""
WHOLE_RUN = "whole run"
"""Headline basis: the whole run, for a run of one round (or a metrics file without per-round figures)."""


@dataclass(frozen=True)
class Headline:
    """The figures a run is judged by: the sweep summary's and its plot's, and the value the optuna sweeper
    maximizes. With more than one round they are one steady round's, since every step of an RL loop is a steady
    round; the whole run's figures would count the first round's manifest handshake and cold buffers, which a
    training run pays once, and would favour settings that start fast over settings that refit fast."""

    basis: str
    """:data:`STEADY_ROUND` or :data:`WHOLE_RUN`: which figures the others are."""
    bytes: int | None
    """The model's bytes one steady round brings up to date (median of rounds 2..N); else the run's ``bytes``."""
    seconds: float | None
    """``steady_round_seconds``; else the run's ``seconds``."""
    gb_per_s: float | None
    """Effective throughput: ``bytes`` / 1e9 / ``seconds`` (a delta round counts the model's bytes, not the wire's)."""
    wire_bytes: int | None
    """What crossed the group: median of rounds 2..N's ``wire_bytes``; else the run's. None in a metrics file
    written before wire bytes were counted."""


def _median_of(entries: list[Mapping[str, Any]], key: str) -> int | None:
    """Median of ``key`` over the entries, as a whole number of bytes; None when any entry lacks it."""
    values = [e.get(key) for e in entries]
    if not values or any(not isinstance(v, (int, float)) for v in values):
        return None
    return round(statistics.median(values))


def headline(metrics: Mapping[str, Any]) -> Headline:
    """The figures ``metrics`` (a metrics.json dict, see :class:`RunMetrics`) is judged by; see :class:`Headline`."""
    steady_rounds = list(metrics.get("rounds") or [])[1:]
    steady_s = metrics.get("steady_round_seconds")
    if steady_rounds and isinstance(steady_s, (int, float)) and math.isfinite(steady_s):
        nbytes = _median_of(steady_rounds, "bytes")
        return Headline(
            basis=STEADY_ROUND,
            bytes=nbytes,
            seconds=steady_s,
            gb_per_s=None if nbytes is None else gb_per_s(nbytes, steady_s),
            wire_bytes=_median_of(steady_rounds, "wire_bytes"),
        )
    return Headline(
        basis=WHOLE_RUN,
        bytes=metrics.get("bytes"),
        seconds=metrics.get("seconds"),
        gb_per_s=metrics.get("gb_per_s"),
        wire_bytes=metrics.get("wire_bytes"),
    )


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
    """Write ``metrics.json`` into ``path_dir`` (see :class:`RunMetrics`); returns its path."""
    path = Path(path_dir) / METRICS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # default=str: a dtype, device or Path in the dict is recorded rather than failing the run at its end.
    text = json.dumps(_rounded(metrics), indent=2, default=str, allow_nan=False) + "\n"
    write_atomic(path, text.encode())
    return path


def summary_line(metrics: Mapping[str, Any]) -> str:
    """The run in one log line: what moved, how fast, with which settings, how much memory, and the verdict."""
    who = str(metrics.get("role", "refit"))
    if metrics.get("rank") and who in ("consumer", "producer"):  # a sharded refit's producers 1.. too
        who += f" {metrics['rank']}"
    if metrics.get("status") == "failed":
        return f"{who}: failed: {metrics.get('error') or 'unknown error'}"

    parts = [f"{who}: {format_decimal(metrics.get('bytes') or 0)}"]
    wire = metrics.get("wire_bytes")
    if wire is not None and metrics.get("bytes") and wire != metrics.get("bytes"):
        parts.append(f" ({format_decimal(wire)} on the wire)")
    chunks = metrics.get("num_chunks", "?")
    parts.append(f" in {metrics.get('num_tensors', '?')} tensors" + ("" if chunks is None else f" / {chunks} chunks"))
    rounds = metrics.get("rounds_done") or 0
    if rounds > 1:
        parts.append(f" x {rounds} rounds")
    seconds = metrics.get("seconds")
    if seconds is not None:
        parts.append(f" in {seconds:.2f} s")
    if metrics.get("gb_per_s") is not None:
        parts.append(f" = {metrics['gb_per_s']:.2f} GB/s")
    if rounds > 1 and metrics.get("steady_round_seconds") is not None:
        first, steady = metrics["first_round_seconds"], metrics["steady_round_seconds"]
        parts.append(f" (first round {first:.3f} s, then {steady:.3f} s)")

    settings = []
    if metrics.get("buffer_size_bytes") is not None:
        settings.append(f"buffer {format_size(metrics['buffer_size_bytes'])} x {metrics.get('num_buffers', '?')}")
    if metrics.get("use_legacy_packing") is not None:
        settings.append("legacy packing" if metrics["use_legacy_packing"] else "bounded packing")
    if metrics.get("backend"):
        settings.append(str(metrics["backend"]))
    if settings:
        parts.append(f" ({', '.join(settings)})")

    producers = metrics.get("producers") or []
    if producers:  # a sharded refit
        parts.append(f", {len(producers)} producer{'s' if len(producers) != 1 else ''}")
    consumers = metrics.get("consumers") or []
    if consumers:
        parts.append(f", {len(consumers)} consumer{'s' if len(consumers) != 1 else ''}")
        lost = [str(c.get("rank")) for c in consumers if c.get("status") != "ok"]
        if lost:  # an elastic run goes on without them (refit.on_consumer_loss=continue)
            parts.append(f" ({'consumer' if len(lost) == 1 else 'consumers'} {some_of(lost)} lost)")
    extra = metrics.get("peak_extra_bytes")
    if extra is not None:
        parts.append(f", peak {'-' if extra < 0 else '+'}{format_size(abs(extra))}")
    verified = overall_verified(metrics)
    if verified is True:
        parts.append(", verified")
    elif verified is False:
        parts.append(", VERIFICATION FAILED")
    workers = [w for c in consumers for r in (c.get("rounds") or [])[-1:] for w in r.get("workers") or []]
    if workers:  # an engine's tensor-parallel workers, each receiving its part of the model
        shares = "/".join(f"{w['bytes'] / w['model_bytes']:.0%}" for w in workers if w["model_bytes"])
        parts.append(f", {len(workers)} engine workers receiving {shares} of the model")
    checks = [r["model_check"] for c in [metrics, *consumers] for r in c.get("rounds") or [] if r.get("model_check")]
    if checks:
        worst = max(c["max_abs_logit_diff"] for c in checks)
        same = all(c["tokens_match"] for c in checks)
        parts.append(f", models match (max logit diff {worst:.3g})" if same else ", MODEL TOKENS DIFFER")
    return "".join(parts)
