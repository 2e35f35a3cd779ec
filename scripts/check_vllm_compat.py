"""Check refit_app's legacy packing against vLLM's own ``pack_tensors`` / ``unpack_tensor`` (vLLM 0.33).

Run with a Python that has vLLM installed, e.g. a throwaway venv outside the project (never in CI):

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm==0.33.0
    /tmp/vllm-venv/bin/python scripts/check_vllm_compat.py

Without vLLM it prints ``SKIP: vLLM not installed`` and exits 0. Exit 1 on any mismatch, 2 when vLLM is installed
but lacks the module under test. Everything runs on CPU: vLLM's two helpers are plain torch ops.

For every case and target size it checks, over fake groups that record or replay broadcasts:
  producer     refit_app's legacy producer sends exactly the chunks (count, order, bytes) that repeated calls of
               vLLM's ``pack_tensors`` produce, as vLLM's own producer loop does.
  vllm-loop    vLLM's real ``packed_nccl_broadcast_producer`` (CUDA stream calls replaced by no-ops) sends the same
               chunks as the ``pack_tensors`` reference; a sanity check of the reference.
  consumer     refit_app's legacy consumer, fed vLLM's chunks, returns every tensor bit for bit (and takes every
               chunk, no more).
  vllm-unpack  vLLM's ``unpack_tensor`` on refit_app's chunks returns every tensor bit for bit. vLLM cannot unpack
               a tensor that starts at an offset not divisible by its element size (no padding in the layout);
               such cases are reported as n/a, not as failures.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from unittest import mock

import torch

# Check this checkout's refit_app, not whatever else may be installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refit_app.packed_tensor import packed_broadcast_consumer, packed_broadcast_producer

VLLM_MODULE = "vllm.distributed.weight_transfer.packed_tensor"
EXPECTED_VLLM = "0.33."
SRC = 0

Item = tuple[str, torch.Tensor]
PostIter = Callable[[Item], torch.Tensor]


def _identity(item: Item) -> torch.Tensor:
    return item[1]


def _fp32_to_bf16(item: Item) -> torch.Tensor:
    """What trainers do before sending: cast fp32 master weights to bf16."""
    t = item[1]
    return t.to(torch.bfloat16) if t.dtype == torch.float32 else t


# ----------------------------------------------------------------------------------------------------------------
# Fake groups.


class RecordingGroup:
    """Keeps a copy of every broadcast: the producer reuses its buffers, so the tensor itself changes later."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if src != SRC:
            raise AssertionError(f"broadcast from src={src}, expected {SRC}")
        self.sent.append(tensor.detach().clone())


class ReplayGroup:
    """Answers each receive with the next recorded chunk, refusing a receive of the wrong size or one too many."""

    device = torch.device("cpu")

    def __init__(self, chunks: Sequence[torch.Tensor]) -> None:
        self.pending = deque(chunks)
        self._index = 0

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if src != SRC:
            raise AssertionError(f"receive from src={src}, expected {SRC}")
        if not self.pending:
            raise AssertionError(f"receive #{self._index} but the producer sent only {self._index} chunks")
        chunk = self.pending.popleft()
        if tensor.dtype != torch.uint8 or tensor.shape != chunk.shape:
            raise AssertionError(
                f"receive #{self._index} is {tuple(tensor.shape)} {tensor.dtype}, "
                f"the producer sent {tuple(chunk.shape)} {chunk.dtype}"
            )
        tensor.copy_(chunk)
        self._index += 1


# ----------------------------------------------------------------------------------------------------------------
# Cases.


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs, infs, -0.0 included), so only a byte-exact path can pass."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


@dataclass
class Case:
    name: str
    items: list[Item]
    targets: list[int]
    post_iter_func: PostIter = _identity


def _cases() -> list[Case]:
    gen = torch.Generator().manual_seed(0)

    def r(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return _random(shape, dtype, gen)

    mixed: list[Item] = [
        ("embed.bf16", r((64, 48), torch.bfloat16)),
        ("norm.fp32", r((48,), torch.float32)),
        ("scale.fp32.0dim", r((), torch.float32)),
        ("qweight.int8.odd", r((37,), torch.int8)),  # every later offset is odd
        ("proj.fp16.transposed", r((40, 24), torch.float16).t()),
        ("bias.fp64", r((5,), torch.float64)),
        ("mask.bool", r((7,), torch.bool)),
        ("index.int64", r((3, 4), torch.int64)),
        ("empty.fp32", r((0, 16), torch.float32)),
        ("strided.fp32", r((32, 32), torch.float32)[::2, 1::3]),
        ("scale.bf16.0dim", r((), torch.bfloat16)),
        ("fp8.e4m3", r((33,), torch.float8_e4m3fn)),
        ("rope.complex64", r((6,), torch.complex64)),
        ("lm_head.fp32.oversized", r((4096,), torch.float32)),  # 16 KiB, larger than most targets below
        ("scale.int8.0dim", r((), torch.int8)),
        ("tail.int32", r((9,), torch.int32)),
    ]
    # Every byte size a multiple of 8, so every offset stays aligned and vLLM's unpack_tensor can read it.
    aligned: list[Item] = [
        ("a.bf16", r((16, 32), torch.bfloat16)),
        ("b.fp32.transposed", r((6, 10), torch.float32).t()),
        ("c.fp64.0dim", r((), torch.float64)),
        ("d.int8", r((24,), torch.int8)),
        ("e.bool", r((16,), torch.bool)),
        ("f.fp32.oversized", r((2048,), torch.float32)),
        ("g.fp16", r((12,), torch.float16)),
        ("h.empty.bf16", r((0,), torch.bfloat16)),
        ("i.int64", r((5,), torch.int64)),
    ]
    kib = [(f"w{i}.fp32", r((256,), torch.float32)) for i in range(7)]  # 1 KiB each
    oversized_runs: list[Item] = [
        ("small0", r((10,), torch.float32)),
        ("big0", r((1000,), torch.float32)),
        ("big1", r((700,), torch.bfloat16)),
        ("small1", r((3,), torch.float16)),
        ("small2", r((3,), torch.float16)),
        ("big2", r((600,), torch.int64)),
    ]
    trailing_empty: list[Item] = [
        ("x", r((8,), torch.float32)),
        ("y", r((8,), torch.float32)),
        ("empty0", r((0,), torch.float32)),
        ("empty1", r((0, 3), torch.bfloat16)),
    ]
    master: list[Item] = [
        ("w.fp32", r((32, 16), torch.float32)),
        ("norm.fp32", r((16,), torch.float32)),
        ("idx.int64", r((4,), torch.int64)),
        ("s.fp32.0dim", r((), torch.float32)),
        ("big.fp32", r((1024,), torch.float32)),
    ]
    return [
        Case("mixed dtypes/shapes", mixed, [1, 100, 4096, 10_000, 1 << 20]),
        Case("aligned for vLLM unpack", aligned, [64, 1000, 4096, 1 << 20]),
        Case("sums hit target exactly", kib, [1024, 2048, 3072]),
        Case("oversized runs", oversized_runs, [1000]),
        Case("trailing zero-element", trailing_empty, [16, 1 << 20]),
        Case("only zero-element", [("e0", r((0,), torch.float32)), ("e1", r((0, 4), torch.int8))], [16]),
        Case("single tensor", [("only", r((300,), torch.bfloat16))], [64, 1 << 20]),
        Case("empty iterator", [], [64]),
        Case("post_iter_func fp32->bf16", master, [100, 1000], _fp32_to_bf16),
        # Contiguous, yet its last stride is 2: vLLM's `.view(-1).view(torch.uint8)` refuses it.
        Case("size-1 dim, stride 2", [("s", r((3, 2), torch.float32)[:1, 1])], [64]),
    ]


# ----------------------------------------------------------------------------------------------------------------
# The four checks. Each returns a short cell: "PASS", "FAIL: why" or "n/a: why".


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same_tensor(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    if not torch.equal(_bytes(got), _bytes(want)):
        return "bytes differ"
    return None


def _compare_chunks(got: list[torch.Tensor], want: list[torch.Tensor]) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        if g.dtype != torch.uint8 or g.dim() != 1:
            return f"FAIL: chunk {i} is {tuple(g.shape)} {g.dtype}, vLLM sends 1-D uint8"
        if g.numel() != w.numel():
            return f"FAIL: chunk {i} has {g.numel()} B, vLLM {w.numel()} B"
        if not torch.equal(g, w):
            first = int((g != w).nonzero()[0])
            return f"FAIL: chunk {i} differs from byte {first}"
    if len(got) != len(want):
        sizes = [c.numel() for c in want[len(got) :]] or [c.numel() for c in got[len(want) :]]
        return f"FAIL: {len(got)} chunks, vLLM {len(want)} (extra sizes {sizes})"
    return "PASS"


def _check_tensors(got: list[Item], want: list[Item]) -> str:
    got_names, want_names = [n for n, _ in got], [n for n, _ in want]
    if got_names != want_names:
        return f"FAIL: names {got_names} != {want_names}"
    for (name, g), (_, w) in zip(got, want):
        problem = _same_tensor(g, w)
        if problem:
            return f"FAIL: {name}: {problem}"
    return "PASS"


def vllm_chunks(vpt: ModuleType, case: Case, target: int) -> list[tuple[torch.Tensor, list[str]]]:
    """The reference: vLLM's producer loop calls pack_tensors on one iterator until it returns None."""
    items = iter(case.items)
    chunks = []
    while (chunk := vpt.pack_tensors(items, case.post_iter_func, target)) is not None:
        chunks.append((chunk.packed_tensor, chunk.names))
    return chunks


def check_vllm_loop(vpt: ModuleType, case: Case, target: int, reference: list[torch.Tensor]) -> str:
    """Run vLLM's real producer; only its CUDA stream calls are stand-ins, so the broadcast sequence is vLLM's."""

    class _NoStream:
        def synchronize(self) -> None:
            pass

    group = RecordingGroup()
    try:
        with (
            mock.patch.object(vpt, "_get_streams", lambda _device, count: tuple(_NoStream() for _ in range(count))),
            mock.patch.object(torch.accelerator, "current_device_index", lambda: 0),
            mock.patch.object(torch.cuda, "stream", lambda _stream: contextlib.nullcontext()),
        ):
            vpt.packed_nccl_broadcast_producer(
                iter(case.items), group, SRC, case.post_iter_func, buffer_size_bytes=target, num_buffers=2
            )
    except Exception as e:
        return f"n/a: vLLM loop not runnable on CPU ({type(e).__name__}: {e})"
    return _compare_chunks(group.sent, reference)


def check_producer(case: Case, target: int, reference: list[torch.Tensor]) -> tuple[str, list[torch.Tensor]]:
    group = RecordingGroup()
    try:
        packed_broadcast_producer(
            iter(case.items),
            group,
            SRC,
            case.post_iter_func,
            buffer_size_bytes=target,
            num_buffers=2,
            use_legacy_packing=True,
        )
    except Exception as e:
        return f"FAIL: {type(e).__name__}: {e}", group.sent
    return _compare_chunks(group.sent, reference), group.sent


def check_consumer(case: Case, target: int, sent: list[Item], chunks: list[torch.Tensor]) -> str:
    """refit_app's legacy consumer on vLLM's chunks, told each tensor's (shape, dtype) as sent."""
    metas = [(name, (list(t.shape), t.dtype)) for name, t in sent]
    group = ReplayGroup(chunks)
    received: list[Item] = []

    def keep(batch: list[Item]) -> None:
        # The batch views a receive buffer that the next chunk overwrites.
        received.extend((name, t.clone()) for name, t in batch)

    try:
        packed_broadcast_consumer(
            iter(metas),
            group,
            SRC,
            keep,
            num_buffers=2,
            buffer_size_bytes=target,
            use_legacy_packing=True,
        )
    except Exception as e:
        return f"FAIL: {type(e).__name__}: {e}"
    if group.pending:
        return f"FAIL: {len(group.pending)} chunk(s) never received (sizes {[c.numel() for c in group.pending]})"
    return _check_tensors(received, sent)


def check_vllm_unpack(
    vpt: ModuleType, sent: list[Item], refit: list[torch.Tensor], vllm: list[tuple[torch.Tensor, list[str]]]
) -> str:
    """vLLM's unpack_tensor on refit_app's chunks, with the chunk membership vLLM's own consumer computes (the
    same > rule over the same sizes, which is what pack_tensors' names record)."""
    if len(refit) != len(vllm):
        return "n/a: chunk counts differ (see producer)"
    by_name = dict(sent)
    received: list[Item] = []
    for chunk, (_, names) in zip(refit, vllm):
        tensors = [by_name[n] for n in names]
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        misaligned = [n for n, t, o in zip(names, tensors, offsets) if o % t.element_size()]
        try:
            received.extend(
                vpt.unpack_tensor(chunk, names, [list(t.shape) for t in tensors], [t.dtype for t in tensors], sizes)
            )
        except RuntimeError as e:
            if misaligned and "storage_offset" in str(e):
                return f"n/a: vLLM cannot unpack misaligned {misaligned[0]}"
            return f"FAIL: {type(e).__name__}: {e}"
    return _check_tensors(received, sent)


# ----------------------------------------------------------------------------------------------------------------


def _import_vllm() -> tuple[ModuleType | None, str]:
    try:
        import vllm
    except ModuleNotFoundError as e:
        if e.name == "vllm":
            return None, ""
        raise
    try:
        return importlib.import_module(VLLM_MODULE), vllm.__version__
    except ImportError as e:
        message = f"ERROR: vLLM {vllm.__version__} has no usable {VLLM_MODULE} ({e}); install vllm==0.33.0"
        print(message, file=sys.stderr)
        sys.exit(2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)

    vpt, version = _import_vllm()
    if vpt is None:
        print("SKIP: vLLM not installed")
        return 0
    print(f"vLLM {version} ({vpt.__file__}), torch {torch.__version__}")
    if not version.startswith(EXPECTED_VLLM):
        print(f"WARNING: this check was written against vLLM {EXPECTED_VLLM}x")

    columns = ("case", "target", "tensors", "chunks", "producer", "vllm-loop", "consumer", "vllm-unpack")
    rows: list[tuple[str, ...]] = []
    for case in _cases():
        sent = [(name, case.post_iter_func((name, t))) for name, t in case.items]
        for target in case.targets:
            with warnings.catch_warnings():
                # vLLM warns about every tensor larger than the target; those are deliberate here.
                warnings.simplefilter("ignore", UserWarning)
                try:
                    reference = vllm_chunks(vpt, case, target)
                except RuntimeError as e:
                    # No reference to compare with: vLLM itself cannot send this list.
                    reason = str(e).split(" to view")[0]
                    rows.append((case.name, str(target), str(len(sent)), "-", f"n/a: vLLM raises: {reason}", *"---"))
                    continue
                ref_chunks = [c for c, _ in reference]
                loop = check_vllm_loop(vpt, case, target, ref_chunks)
            producer, refit_chunks = check_producer(case, target, ref_chunks)
            consumer = check_consumer(case, target, sent, ref_chunks)
            unpack = check_vllm_unpack(vpt, sent, refit_chunks, reference)
            rows.append(
                (case.name, str(target), str(len(sent)), str(len(ref_chunks)), producer, loop, consumer, unpack)
            )

    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    line = "  ".join(f"{{:{w}}}" for w in widths)
    print(line.format(*columns))
    print(line.format(*("-" * w for w in widths)))
    for row in rows:
        print(line.format(*row))

    cells = [cell for row in rows for cell in row[4:]]
    passed = cells.count("PASS")
    failures = sum(cell.startswith("FAIL") for cell in cells)
    verdict = "FAIL" if failures else "PASS"
    print(f"\n{verdict}: {passed} passed, {failures} failed, {len(cells) - passed - failures} not applicable")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
