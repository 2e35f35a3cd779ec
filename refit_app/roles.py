"""What each rank does in a refit: the producer sends a source, a consumer feeds a sink, ``local`` runs both.

One refit, on every rank::

    connect (rendezvous, checks)  ->  needs (does any consumer verify?)  ->  manifest handshake
    ->  packed broadcast of the data  ->  checksum trailer (if needed)  ->  finish (all ranks agree it worked)

Every failure on any rank ends every rank with that rank's reason, within ``group.timeout_s``.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch

from refit_app.checksum import tensor_checksum
from refit_app.config import RunSettings
from refit_app.errors import RefitError
from refit_app.groups import RefitGroup, connect
from refit_app.handshake import (
    accept_manifest,
    finish,
    recv_checksums,
    send_checksums,
    send_manifest,
)
from refit_app.manifest import Manifest
from refit_app.metrics import PeakMemory, gb_per_s
from refit_app.packed_tensor import (
    chunk_ids,
    get_target_packed_tensor_size,
    packed_broadcast_consumer,
    packed_broadcast_producer,
)
from refit_app.progress import Progress
from refit_app.sinks import make_sink
from refit_app.sources import make_source

logger = logging.getLogger(__name__)

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
        "num_buffers": s.refit.num_buffers,
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
    source = make_source(s.source.target, s.source.params)
    target = s.refit.buffer_size_bytes if s.refit.buffer_size_bytes is not None else get_target_packed_tensor_size()
    with connect(s.group) as rg:
        started = time.perf_counter()
        checksums_needed = _exchange_needs(rg, False)
        manifest = Manifest(
            source.manifest_tensors(),
            target,
            bool(s.refit.use_legacy_packing),
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
                    num_buffers=s.refit.num_buffers,
                    use_legacy_packing=manifest.use_legacy_packing,
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


def run_consumer(s: RunSettings, *, show_progress: bool = True) -> dict[str, Any]:
    """Receive the producer's weights into the configured sink; returns this rank's metrics."""
    sink = make_sink(s.sink.target, s.sink.params, corrupt_chunk=s.refit.corrupt_chunk)
    with connect(s.group) as rg:
        started = time.perf_counter()
        _exchange_needs(rg, s.verifies)
        try:
            manifest = accept_manifest(
                rg,
                buffer_size_bytes=s.refit.buffer_size_bytes,
                use_legacy_packing=s.refit.use_legacy_packing,
                prepare=sink.begin,
            )
        except RefitError:
            sink.abort()
            raise
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
                        sink.consume,
                        num_buffers=s.refit.num_buffers,
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
            "sink": s.sink_name,
            **outcome,
        }


def run_role(s: RunSettings) -> dict[str, Any]:
    """Run this process's role and return its metrics."""
    if s.role == "local":
        from refit_app.local import run_local

        return run_local(s)
    return (run_producer if s.role == "producer" else run_consumer)(s)
