"""Across hosts: one rank in this process (``--rank``), joining the producer's address like the application's
ranks, so the limit measured is the one of the link between real hosts. Rank 0's cases are everyone's; rank 0
gathers every rank's results over the group itself and writes them."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from refit_app.bench.cases import Case
from refit_app.bench.measure import run_case
from refit_app.bench.report import summarize, write_results
from refit_app.transport.groups import GroupSpec, RefitGroup, connect


def _broadcast_json(rg: RefitGroup, value: Any, src: int) -> Any:
    """``value`` (JSON-able) from rank ``src`` to every rank, over the group itself: its length, then its bytes."""
    data = json.dumps(value, default=str).encode() if rg.rank == src else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    rg.group.broadcast(length, src)
    if data:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        payload = torch.empty(int(length), dtype=torch.uint8)
    rg.group.broadcast(payload, src)
    return value if rg.rank == src else json.loads(payload.numpy().tobytes())


def run_rank(spec: GroupSpec, cases: list[Case], out_dir: Path) -> list[dict[str, Any]] | None:
    """Run rank ``spec.rank`` of a benchmark whose ranks are on other hosts. Rank 0's ``cases`` are everyone's; it
    gathers every rank's results, writes bench.json, table.md and throughput.png and returns the summaries (None
    elsewhere)."""
    load_before = os.getloadavg()
    with connect(spec) as rg:
        cases = [Case.from_json(c) for c in _broadcast_json(rg, [asdict(c) for c in cases], 0)]
        mine = [run_case(rg, case) for case in cases]
        per_rank = [_broadcast_json(rg, mine if rg.rank == r else None, r) for r in range(rg.world_size)]
    if spec.rank != 0:
        return None
    ordered = [summarize(case, [rank[i] for rank in per_rank]) for i, case in enumerate(cases)]
    write_results(
        ordered,
        out_dir,
        load_before,
        f"gloo across hosts (producer at {spec.host}:{spec.port}, {spec.world_size} ranks, one per process)",
    )
    return ordered
