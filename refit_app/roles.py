"""What each rank does in a refit: the producer sends a source, a consumer feeds a sink, ``local`` runs both.

One refit, on every rank::

    connect (rendezvous, checks)  ->  needs (does any consumer verify?)  ->  manifest handshake
    ->  packed broadcast of the data  ->  checksum trailer (if needed)  ->  finish (all ranks agree it worked)

Every failure on any rank ends every rank with that rank's reason, within ``group.timeout_s``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from refit_app.checksum import tensor_checksum
from refit_app.config import DEFAULT_PORT, RunSettings
from refit_app.errors import PeerError, RefitError
from refit_app.groups import GroupSpec, RefitGroup, connect
from refit_app.handshake import ack, check_settings, finish, recv_checksums, recv_manifest, send_checksums, send_manifest
from refit_app.manifest import Manifest
from refit_app.metrics import PeakMemory, error_line, gb_per_s
from refit_app.packed_tensor import (
    _flat_bytes,
    chunk_ids,
    get_target_packed_tensor_size,
    packed_broadcast_consumer,
    packed_broadcast_producer,
)
from refit_app.progress import Progress
from refit_app.sinks import make_sink
from refit_app.sources import make_source

logger = logging.getLogger(__name__)

LOCAL_EXIT_GRACE_S = 5.0
"""How long ``role=local`` waits, after one rank failed, for the others to exit with their own errors before it
stops them. Not the group deadline: a rank that fails before the rendezvous (a bad source, say) would leave its
peers waiting out their whole ``group.timeout_s`` for a root cause that is already known."""


def group_spec(s: RunSettings) -> GroupSpec:
    return GroupSpec(
        backend=s.backend,
        host=s.host,
        port=DEFAULT_PORT if s.port is None else s.port,
        world_size=s.world_size,
        rank=s.rank,
        timeout_s=s.timeout_s,
    )


def _count_chunks(manifest: Manifest) -> int:
    ids = list(chunk_ids((t.nbytes for t in manifest.tensors), manifest.buffer_size_bytes, manifest.use_legacy_packing))
    return ids[-1] + 1 if ids else 0


class _Transfer:
    """Counts what went over the wire and drives the progress display."""

    def __init__(self, manifest: Manifest, label: str, show_progress: bool) -> None:
        self.bytes = 0
        self.chunks = 0
        self.broadcasts = 0
        self._sends_empty_chunks = manifest.use_legacy_packing  # legacy mode broadcasts them, as vLLM does
        self._progress = (
            Progress(manifest.total_bytes, _count_chunks(manifest), label, stream=sys.stderr) if show_progress else None
        )

    def on_chunk(self, nbytes: int, ntensors: int) -> None:
        self.bytes += nbytes
        self.chunks += 1
        self.broadcasts += nbytes > 0 or self._sends_empty_chunks
        if self._progress is not None:
            self._progress.update(nbytes)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()


def _exchange_needs(rg: RefitGroup, wants_checksums: bool) -> bool:
    """Whether any consumer verifies, so the producer computes checksums only when someone will use them.

    One tiny broadcast per consumer, over the same group as the data, so it works with every backend.
    """
    anyone = False
    for rank in range(1, rg.world_size):
        flag = torch.tensor([int(wants_checksums and rg.rank == rank)], dtype=torch.int64, device=rg.group.device)
        rg.group.broadcast(flag, rank)
        anyone |= bool(flag.item())
    return anyone


def _metrics(
    s: RunSettings,
    rg: RefitGroup,
    manifest: Manifest,
    transfer: _Transfer,
    seconds: float,
    handshake_s: float,
    memory: PeakMemory,
) -> dict[str, Any]:
    """The figures both sides report (metrics.py's METRICS_KEYS describes them)."""
    return {
        "role": "producer" if s.rank == 0 else "consumer",
        "rank": s.rank,
        "status": "ok",
        "error": None,
        "num_tensors": len(manifest.tensors),
        "buffer_size_bytes": manifest.buffer_size_bytes,
        "num_buffers": s.num_buffers,
        "use_legacy_packing": manifest.use_legacy_packing,
        "backend": rg.backend,
        "world_size": rg.world_size,
        "source": manifest.source,
        "bytes": transfer.bytes,
        "num_chunks": transfer.chunks,
        "num_broadcasts": transfer.broadcasts,
        "seconds": seconds,
        "gb_per_s": gb_per_s(transfer.bytes, seconds),
        "handshake_seconds": handshake_s,
        **memory.to_metrics(),
    }


def run_producer(s: RunSettings, *, show_progress: bool = True) -> dict[str, Any]:
    """Send the configured source to every consumer; returns this rank's metrics."""
    source = make_source(s.source_kind, **s.source_params)
    target = s.buffer_size_bytes if s.buffer_size_bytes is not None else get_target_packed_tensor_size()
    with connect(group_spec(s)) as rg:
        started = time.perf_counter()
        checksums_needed = _exchange_needs(rg, False)
        manifest = Manifest(
            source.manifest_tensors(),
            target,
            s.use_legacy_packing,
            checksums=checksums_needed,
            metadata=source.metadata(),
            source=source.describe(),
        )
        send_manifest(rg, manifest)
        handshake_s = time.perf_counter() - started

        checksums: list[int] = []

        def post(item: tuple[str, torch.Tensor]) -> torch.Tensor:
            if checksums_needed:
                # Checksummed here, from the exact tensor that is packed: no second pass over the model.
                checksums.append(tensor_checksum(item[1]))
            return item[1]

        transfer = _Transfer(manifest, "producer", show_progress)
        with PeakMemory() as memory:
            started = time.perf_counter()
            try:
                packed_broadcast_producer(
                    source.tensors(),
                    rg.group,
                    0,
                    post,
                    buffer_size_bytes=target,
                    num_buffers=s.num_buffers,
                    use_legacy_packing=s.use_legacy_packing,
                    on_chunk=transfer.on_chunk,
                )
                if checksums_needed:
                    send_checksums(rg, checksums)
            finally:
                transfer.close()
            seconds = time.perf_counter() - started
        finish(rg, None)
        return {
            **_metrics(s, rg, manifest, transfer, seconds, handshake_s, memory),
            "checksums": checksums_needed,
            "verified": None,
            "sink": None,
        }


def _corrupting(consume: Callable[[list], None], chunk: int | None) -> Callable[[list], None]:
    """Test-only fault hook (``refit.debug.corrupt_chunk``): flip one received byte of chunk ``chunk``."""
    if chunk is None:
        return consume
    seen = 0

    def wrapped(batch: list[tuple[str, torch.Tensor]]) -> None:
        nonlocal seen
        if seen == chunk:
            name, t = next(((n, t) for n, t in batch if t.numel()), (None, None))
            if t is not None:
                logger.warning("refit.debug.corrupt_chunk=%d: flipping one byte of %s", chunk, name)
                flat = _flat_bytes(t)
                flat[0] ^= 0x01
        seen += 1
        consume(batch)

    return wrapped


def run_consumer(s: RunSettings, *, show_progress: bool = True) -> dict[str, Any]:
    """Receive the producer's weights into the configured sink; returns this rank's metrics."""
    sink = make_sink(s.sink_kind, None if s.sink_path is None else str(s.sink_path))
    with connect(group_spec(s)) as rg:
        started = time.perf_counter()
        _exchange_needs(rg, s.sink_kind == "verify")
        manifest = recv_manifest(rg)
        try:
            check_settings(
                manifest,
                buffer_size_bytes=s.buffer_size_bytes if s.buffer_size_explicit else None,
                use_legacy_packing=s.use_legacy_packing if s.legacy_explicit else None,
            )
            sink.begin(manifest)
        except RefitError as e:
            ack(rg, str(e))
            sink.abort()
            raise
        ack(rg, None)
        handshake_s = time.perf_counter() - started

        transfer = _Transfer(manifest, f"consumer {s.rank}", show_progress)
        try:
            with PeakMemory() as memory:
                started = time.perf_counter()
                try:
                    packed_broadcast_consumer(
                        ((t.name, (t.shape, t.dtype)) for t in manifest.tensors),
                        rg.group,
                        0,
                        _corrupting(sink.consume, s.corrupt_chunk),
                        num_buffers=s.num_buffers,
                        buffer_size_bytes=manifest.buffer_size_bytes,
                        use_legacy_packing=manifest.use_legacy_packing,
                        on_chunk=transfer.on_chunk,
                    )
                    checksums = recv_checksums(rg, len(manifest.tensors)) if manifest.checksums else None
                finally:
                    transfer.close()
                seconds = time.perf_counter() - started
            try:
                outcome = sink.finish(checksums)
            except RefitError as e:
                # The data arrived but is wrong or cannot be kept: every rank must learn it, with this reason.
                finish(rg, str(e))
                raise
        except BaseException:
            sink.abort()
            raise
        finish(rg, None)
        return {
            **_metrics(s, rg, manifest, transfer, seconds, handshake_s, memory),
            "sink": s.sink_kind,
            **outcome,
        }


# --------------------------------------------------------------------------------------------------------------
# role=local: one producer and N consumers as processes on this machine.


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_rank(s: RunSettings, results: Any, log_files: list[str]) -> None:
    """Entry point of one spawned rank: run it and send back ("ok", metrics) or ("failed", metrics)."""
    label = "producer" if s.rank == 0 else f"consumer {s.rank}"
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    # The parent's log files (Hydra's job log) get the ranks' lines too; appends of whole lines interleave cleanly.
    handlers += [logging.FileHandler(path, mode="a") for path in log_files]
    logging.basicConfig(level=logging.INFO, handlers=handlers, format=f"[%(asctime)s][{label}] %(message)s")
    try:
        runner = run_producer if s.rank == 0 else run_consumer
        # Only the producer draws a live progress line: several ranks rewriting one terminal line is noise.
        results.put((s.rank, "ok", runner(s, show_progress=s.rank == 0), None))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent as one line
        failure = {"role": "producer" if s.rank == 0 else "consumer", "rank": s.rank, "status": "failed",
                   "error": str(e) if isinstance(e, RefitError) else error_line(e)}
        results.put((s.rank, "failed", failure, type(e).__name__))
    finally:
        results.close()
        results.join_thread()


def run_local(s: RunSettings) -> dict[str, Any]:
    """Run the producer and ``num_consumers`` consumers as processes here; producer figures at the top level."""
    if s.source_kind == "safetensors":
        # Reading the headers is cheap: a bad checkpoint fails here in a second, not after the ranks' start-up.
        make_source(s.source_kind, **s.source_params)
    port = _free_port() if s.port is None else s.port
    log_files = [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_local_rank,
            args=(replace(s, role="producer" if r == 0 else "consumer", rank=r, port=port), results, log_files),
            name=f"refit-rank{r}",
        )
        for r in range(s.world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, dict[str, Any], str | None]] = {}
    failed_at: float | None = None
    try:
        while len(outcomes) < len(procs):
            try:
                rank, status, metrics, exc_type = results.get(timeout=0.2)
                outcomes[rank] = (status, metrics, exc_type)
                if status == "failed" and failed_at is None:
                    failed_at = time.monotonic()
                continue
            except queue.Empty:
                pass
            for rank, p in enumerate(procs):
                if rank not in outcomes and not p.is_alive() and p.exitcode is not None:
                    try:  # a result may still be in the pipe
                        rank_, status, metrics, exc_type = results.get(timeout=1.0)
                        outcomes[rank_] = (status, metrics, exc_type)
                    except queue.Empty:
                        outcomes[rank] = ("failed", {"rank": rank, "status": "failed",
                                                     "error": f"rank {rank} died (exit code {p.exitcode})"}, "Died")
                        failed_at = failed_at or time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > LOCAL_EXIT_GRACE_S:
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5.0)
        results.close()
    for rank in range(len(procs)):
        outcomes.setdefault(rank, ("failed", {"rank": rank, "status": "failed",
                                              "error": f"rank {rank} did not exit after another rank failed; killed"},
                                   "Timeout"))
    producer = outcomes[0][1]
    combined = {**producer, "role": "local", "consumers": [outcomes[r][1] for r in range(1, len(procs))]}
    failures = [(r, m["error"], t) for r, (status, m, t) in sorted(outcomes.items()) if status == "failed"]
    if failures:
        # The root cause is the failure that is not just "a peer failed", if there is one.
        root = next((f for f in failures if f[2] not in (PeerError.__name__, "Timeout")), failures[0])
        combined.update(status="failed", error=root[1])
        raise LocalRunError(root[1], combined)
    verified = [c.get("verified") for c in combined["consumers"]]
    combined["verified"] = None if all(v is None for v in verified) else all(v is True for v in verified)
    return combined


class LocalRunError(RefitError):
    """A rank of ``role=local`` failed; carries the metrics gathered from every rank."""

    def __init__(self, message: str, metrics: dict[str, Any]) -> None:
        super().__init__(message)
        self.metrics = metrics


ROLE_RUNNERS: dict[str, Callable[[RunSettings], dict[str, Any]]] = {
    "producer": run_producer,
    "consumer": run_consumer,
    "local": run_local,
}
