"""The CUDA path of the packed broadcast core: exact round trips on the GPU, host tensors fed to a CUDA producer,
cached per-buffer streams, a producer and a consumer sharing one GPU over gloo, and packing throughput.

Marked ``gpu`` and skipped without a CUDA device; ``scripts/gpu_check.sh`` runs them on the device machine.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from conditions import needs_cuda
from fakes import RecordingGroup, ReplayGroup
from mp_utils import gloo_spec, run_ranks
from tensor_utils import IDENTITY, assert_exact, awkward_tensors, digest, metas

from refit_app.core.buffers import get_streams
from refit_app.models.sources import SyntheticSource
from refit_app.packed_tensor import packed_broadcast_consumer, packed_broadcast_producer
from refit_app.transport.groups import connect

pytestmark = [pytest.mark.gpu, needs_cuda]

TARGET = 4096
GiB = 1024**3


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def cuda_tensors() -> list[tuple[str, torch.Tensor]]:
    """The awkward cases on the GPU, with their views made there (``.cuda()`` would densify a strided slice)."""
    dev = _device()
    g = torch.Generator().manual_seed(3)
    moved = [(name, t.to(dev)) for name, t in awkward_tensors()]
    views = [
        ("cuda_transposed", torch.randn(6, 4, generator=g).to(dev).T),
        ("cuda_strided", torch.randn(20, generator=g).to(dev)[::3]),
        ("cuda_size1_view", torch.arange(6, dtype=torch.int64, device=dev).view(3, 2)[:1, 1]),
        ("cuda_oversized", torch.randn(5000, generator=g).to(dev)),
    ]
    assert not views[0][1].is_contiguous() and not views[1][1].is_contiguous()
    return moved + views + moved[:3]


def _round_trip(tensors, *, legacy: bool, nb_producer: int, nb_consumer: int, consumer_device: str = "cuda"):
    sender = RecordingGroup(device="cuda")
    packed_broadcast_producer(
        iter(tensors), sender, 0, IDENTITY, buffer_size_bytes=TARGET, num_buffers=nb_producer, use_legacy_packing=legacy
    )
    chunks = [c.to(consumer_device) for c in sender.sent]
    receiver = ReplayGroup(chunks, device=consumer_device)
    received = []
    packed_broadcast_consumer(
        iter(metas(tensors)),
        receiver,
        0,
        lambda batch: received.extend((n, t.clone()) for n, t in batch),
        num_buffers=nb_consumer,
        buffer_size_bytes=TARGET,
        use_legacy_packing=legacy,
    )
    assert receiver.received == len(sender.sent)
    return sender, received


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("nb_producer,nb_consumer", [(1, 1), (2, 2), (3, 2)])
def test_round_trip_on_cuda(legacy, nb_producer, nb_consumer):
    tensors = cuda_tensors()
    sender, received = _round_trip(tensors, legacy=legacy, nb_producer=nb_producer, nb_consumer=nb_consumer)
    assert all(c.device.type == "cuda" for c in sender.sent)
    assert all(t.device.type == "cuda" for _, t in received)
    assert_exact(tensors, received)


def test_host_tensors_fed_to_cuda_producer():
    tensors = awkward_tensors()  # on the CPU; the producer's buffers are on the GPU
    sender, received = _round_trip(tensors, legacy=False, nb_producer=2, nb_consumer=2, consumer_device="cpu")
    assert all(c.device.type == "cuda" for c in sender.sent)
    assert_exact(tensors, received)


class StreamRecordingGroup(RecordingGroup):
    """Records the stream each broadcast was issued on: the buffer's own one, if the producer is right."""

    def __init__(self) -> None:
        super().__init__(device="cuda")
        self.streams: list[int] = []

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.streams.append(torch.cuda.current_stream(tensor.device).cuda_stream)
        super().broadcast(tensor, src)


def test_streams_cached_per_device_and_count():
    dev = _device()
    tensors = [(f"w{i}", torch.full((25,), float(i), device=dev)) for i in range(12)]  # 6 chunks of 200 bytes

    first = StreamRecordingGroup()
    packed_broadcast_producer(iter(tensors), first, 0, IDENTITY, buffer_size_bytes=200, num_buffers=2)
    cached = [s.cuda_stream for s in get_streams(dev, 2)]
    # Buffers alternate, each on its own stream, never the default one.
    assert first.streams == [cached[i % 2] for i in range(6)]
    assert torch.cuda.default_stream(dev).cuda_stream not in cached

    second = StreamRecordingGroup()
    packed_broadcast_producer(iter(tensors), second, 0, IDENTITY, buffer_size_bytes=200, num_buffers=2)
    assert second.streams == first.streams  # reused across calls, not created anew
    assert get_streams(dev, 2) is get_streams(dev, 2)

    three = [s.cuda_stream for s in get_streams(dev, 3)]
    assert len(set(three)) == 3 and not set(three) & set(cached)


# ------------------------------------------------------------------------------ producer -> consumer on one GPU


def _post(item: tuple[str, torch.Tensor]) -> torch.Tensor:
    """What a trainer sending bf16 does: a real GPU kernel between the iterator and the packing."""
    t = item[1]
    return t.to(torch.bfloat16) if t.dtype == torch.float32 else t


def _model() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    weights = [(f"layer{i}.w", torch.randn(96, 64, generator=g)) for i in range(24)]  # 24 KiB fp32 each
    return awkward_tensors() + weights + [("huge", torch.randn(40_000, generator=g))] + awkward_tensors()[:3]


ONE_GPU_CASES = [(legacy, post) for legacy in (False, True) for post in ("identity", "cast")]


def _one_gpu_rank(rank: int, world_size: int, port: int) -> list:
    torch.cuda.set_device(0)  # both ranks on the same GPU: NCCL refuses that, gloo does not
    dev = _device()
    tensors = [(n, t.to(dev)) for n, t in _model()]
    results = []
    with connect(gloo_spec(rank, world_size, port, timeout_s=60)) as rg:
        for legacy, post_name in ONE_GPU_CASES:
            post = _post if post_name == "cast" else IDENTITY
            kwargs = dict(buffer_size_bytes=64 * 1024, use_legacy_packing=legacy, device=dev)
            if rank == 0:
                packed_broadcast_producer(iter(tensors), rg.group, 0, post, num_buffers=2, **kwargs)
                results.append(digest((n, post((n, t))) for n, t in tensors))
                continue
            wire = [(n, post((n, t))) for n, t in tensors]
            got: list = []
            devices: set[str] = set()

            def consume(batch, devices=devices, got=got):
                devices.update(t.device.type for _, t in batch)
                got.extend(digest(batch))

            packed_broadcast_consumer(iter(metas(wire)), rg.group, 0, consume, num_buffers=2, **kwargs)
            assert devices == {"cuda"}, devices
            results.append(got)
    return results


def test_producer_to_consumer_on_one_gpu_over_gloo():
    producer, consumer = run_ranks(_one_gpu_rank, 2, timeout=300)
    expected_identity = digest(_model())
    assert len(producer) == len(consumer) == len(ONE_GPU_CASES), (len(producer), len(consumer))
    for case, sent, got in zip(ONE_GPU_CASES, producer, consumer):
        assert got == sent, f"case {case}: the consumer's bytes differ from what the producer sent"
        if case[1] == "identity":
            assert got == expected_identity, f"case {case}"


# ------------------------------------------------------------------------------------------- throughput


class _NullGroup:
    """Takes the buffer and does nothing: what remains is the packing itself, on the buffers' streams."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        return None


def _median_seconds(fn, reps: int = 5) -> float:
    fn()  # warm-up: allocator, streams, kernels
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@pytest.mark.parametrize("preset", ["llama-1b", "lora"])
def test_cuda_packing_throughput_vs_device_copy(preset):
    """Packing a model on the GPU against one device-to-device copy of the same bytes; printed, not asserted."""
    dev = _device()
    source = SyntheticSource(preset, None, 0, torch.bfloat16)
    tensors = [(n, t.to(dev)) for n, t in source.tensors()]
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    target = 512 * 1024**2  # above every tensor of both presets: every byte is packed, none sent in place
    assert max(t.numel() * t.element_size() for _, t in tensors) <= target
    group = _NullGroup(dev)

    def pack() -> None:
        packed_broadcast_producer(iter(tensors), group, 0, IDENTITY, buffer_size_bytes=target, num_buffers=2)

    flat_src = torch.empty(total, dtype=torch.uint8, device=dev).fill_(1)
    flat_dst = torch.empty_like(flat_src)
    packing = _median_seconds(pack)
    copying = _median_seconds(lambda: flat_dst.copy_(flat_src))

    # What was timed also packs the right bytes: the chunks, joined, are the tensors' bytes in order.
    recorder = RecordingGroup(device="cuda")
    packed_broadcast_producer(iter(tensors), recorder, 0, IDENTITY, buffer_size_bytes=target, num_buffers=2)
    expected = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in tensors])
    assert torch.equal(torch.cat(recorder.sent), expected)
    print(
        f"\n[gpu] {source.describe()}: {len(tensors)} tensors, {total / 1e9:.2f} GB, {len(recorder.sizes)} chunks of "
        f"<= 512 MiB x 2 buffers: packing {total / 1e9 / packing:.1f} GB/s ({packing * 1e3:.2f} ms), plain "
        f"device-to-device copy {total / 1e9 / copying:.1f} GB/s ({copying * 1e3:.2f} ms), "
        f"packing/copy {copying / packing:.2f}x"
    )
