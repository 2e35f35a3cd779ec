"""CPU microseconds per tensor of the packed broadcast's own work, through a group whose broadcasts cost nothing.

Isolates the library's per-tensor Python and copy cost from the transport (issue 14): the producer's one-shot call
and a round that follows a :class:`PackedPlan`, the consumer's one-shot call (callback and iterator forms) and a
planned round. Time is this thread's CPU time (everything runs on the calling thread here), so other work on the
machine inflates it less than wall time; still compare rows of one run, not runs. Paths alternate within every
repetition; each row is the median of ``--reps`` with the range.

    python scripts/per_tensor_cost.py                      # the 25,844-matrix adapter (lora at 1 GiB)
    python scripts/per_tensor_cost.py --model tiny         # 25,000 tensors of 128 bytes: Python cost alone
    python scripts/per_tensor_cost.py --model lora --size natural --reps 9

The producer's figures include copying the bytes (about 5 us for a 41 KB adapter matrix at 8 GB/s); ``tiny``
leaves out nearly all of that.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from refit_app import packed_tensor as pt
from refit_app.common.sizes import parse_size
from refit_app.models.sources import SyntheticSource


class _Done:
    def wait(self) -> None:
        pass


class _NullGroup:
    """Accepts every broadcast at once and moves nothing."""

    device = torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        pass

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> _Done:
        return _Done()


def _model(name: str, size: str) -> list[tuple[str, torch.Tensor]]:
    if name == "tiny":
        return [(f"t{i}", torch.full((8, 8), float(i % 7), dtype=torch.bfloat16)) for i in range(25_000)]
    return list(SyntheticSource(name, None if size == "natural" else parse_size(size), 0, torch.bfloat16).tensors())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="lora", help="a source preset (lora, llama-1b, ...) or tiny (default: lora)")
    p.add_argument("--size", default="1GiB", help="model size, or natural (default: 1GiB; ignored for tiny)")
    p.add_argument("--reps", type=int, default=7, help="repetitions (default: %(default)s)")
    args = p.parse_args()

    named = _model(args.model, args.size)
    metas = [(name, (list(t.shape), t.dtype)) for name, t in named]
    group, post, drop = _NullGroup(), (lambda item: item[1]), (lambda batch: None)
    send_plan, recv_plan = pt.PackedPlan(), pt.PackedPlan()
    pt.packed_broadcast_producer(iter(named), group, 0, post, plan=send_plan)  # records the plans
    pt.packed_broadcast_consumer(iter(metas), group, 0, drop, plan=recv_plan)
    paths: dict[str, Callable[[], object]] = {
        "producer one-shot": lambda: pt.packed_broadcast_producer(iter(named), group, 0, post),
        "producer planned": lambda: pt.packed_broadcast_producer(iter(named), group, 0, post, plan=send_plan),
        "consumer one-shot": lambda: pt.packed_broadcast_consumer(iter(metas), group, 0, drop),
        "consumer iterator": lambda: sum(1 for _ in pt.packed_broadcast_consumer(iter(metas), group, 0, None, True)),
        "consumer planned": lambda: pt.packed_broadcast_consumer(iter(metas), group, 0, drop, plan=recv_plan),
    }
    per_tensor: dict[str, list[float]] = {path: [] for path in paths}
    for _ in range(args.reps + 1):  # the first repetition warms up and is not counted
        for path, run in paths.items():
            started = time.thread_time()
            run()
            per_tensor[path].append((time.thread_time() - started) / len(named) * 1e6)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    print(f"{args.model}: {len(named)} tensors, {nbytes / 1e6:.1f} MB, torch {torch.__version__}, CPU us per tensor")
    for path, values in per_tensor.items():
        values = sorted(values[1:])
        print(f"  {path:18s} {statistics.median(values):6.2f} ({values[0]:.2f}-{values[-1]:.2f})")
    pt.release_buffers()


if __name__ == "__main__":
    main()
