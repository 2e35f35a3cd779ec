"""Received tensors stay intact for as long as the consumer holds them (issue 10).

vLLM's layerwise reload keeps the tensors it is given until a whole layer is complete; a consumer that reuses a
receive buffer while views of it are still referenced serves wrong weights, silently. These tests keep references
(no clone) with small buffers and many chunks, then compare every byte with what was sent.
"""

from __future__ import annotations

import gc

import pytest
import torch
from fakes import RecordingGroup, ReplayGroup
from mp_utils import gloo_spec, run_ranks
from tensor_utils import IDENTITY, assert_exact, awkward_tensors, digest, metas

from refit_app.core.buffers import HOST_POOL, is_shared, release_buffers
from refit_app.packed_tensor import (
    _packed_broadcast_consumer_batches,
    packed_broadcast_consumer,
    packed_broadcast_producer,
)


def weights(seed: int, count: int = 60) -> list[tuple[str, torch.Tensor]]:
    """Many small fp32/bf16 weights (aligned, so the consumer hands out views of its buffers) and a few oversized."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        if i % 20 == 7:
            out.append((f"big{i}", torch.randn(700, generator=g)))  # 2800 bytes: alone in a 1 KiB chunk
        elif i % 2:
            out.append((f"w{i}", torch.randn(8, 8, generator=g).to(torch.bfloat16)))
        else:
            out.append((f"w{i}", torch.randn(40, generator=g)))
    return out


def send(tensors, target, legacy=False) -> list[torch.Tensor]:
    sender = RecordingGroup()
    packed_broadcast_producer(iter(tensors), sender, 0, IDENTITY, buffer_size_bytes=target, use_legacy_packing=legacy)
    assert len(sender.sent) >= 2 * 3  # more chunks than twice the most buffers used here: every buffer is reused
    return sender.sent


CASES = [(target, nb, legacy) for target in (1024, 2048) for nb in (1, 2, 3) for legacy in (False, True)]


@pytest.mark.parametrize("target, num_buffers, legacy", CASES)
def test_callback_that_keeps_every_tensor(target, num_buffers, legacy):
    tensors = weights(0)
    kept = []
    packed_broadcast_consumer(
        iter(metas(tensors)),
        ReplayGroup(send(tensors, target, legacy)),
        0,
        kept.extend,
        num_buffers=num_buffers,
        buffer_size_bytes=target,
        use_legacy_packing=legacy,
    )
    assert_exact(tensors, kept)


@pytest.mark.parametrize("target, num_buffers, legacy", CASES)
def test_iterator_kept_to_the_end(target, num_buffers, legacy):
    tensors = weights(1)
    it = packed_broadcast_consumer(
        iter(metas(tensors)),
        ReplayGroup(send(tensors, target, legacy)),
        0,
        None,
        True,
        num_buffers=num_buffers,
        buffer_size_bytes=target,
        use_legacy_packing=legacy,
    )
    kept = list(it)
    assert_exact(tensors, kept)


@pytest.mark.parametrize("num_buffers", [1, 2, 3])
def test_batches_kept_to_the_end(num_buffers):
    tensors = weights(2)
    batches = list(
        _packed_broadcast_consumer_batches(
            iter(metas(tensors)),
            ReplayGroup(send(tensors, 1024)),
            0,
            num_buffers=num_buffers,
            buffer_size_bytes=1024,
        )
    )
    assert_exact(tensors, [item for batch in batches for item in batch])


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_layerwise_reload_pattern(num_buffers):
    """vLLM's layerwise reload: hold a layer's tensors (spanning several chunks), check it when complete, drop it."""
    tensors = weights(3, count=90)
    layer = 9
    expected = dict(tensors)
    held: list[tuple[str, torch.Tensor]] = []
    checked = 0
    for name, t in packed_broadcast_consumer(
        iter(metas(tensors)),
        ReplayGroup(send(tensors, 1024)),
        0,
        None,
        True,
        num_buffers=num_buffers,
        buffer_size_bytes=1024,
    ):
        held.append((name, t))
        if len(held) == layer:
            assert_exact([(n, expected[n]) for n, _ in held], held)
            checked += len(held)
            held = []
    assert checked == len(tensors)


def test_awkward_tensors_kept_through_the_iterator():
    tensors = awkward_tensors() * 4
    tensors = [(f"{n}.{i}", t) for i, (n, t) in enumerate(tensors)]
    it = packed_broadcast_consumer(
        iter(metas(tensors)), ReplayGroup(send(tensors, 64)), 0, None, True, buffer_size_bytes=64
    )
    assert_exact([(n, t.resolve_conj().resolve_neg()) for n, t in tensors], list(it))


def test_tensors_kept_from_one_call_survive_the_next_call():
    """The host buffer pool must not hand a buffer whose views are still held to the next refit in this process."""
    release_buffers()
    first, second = weights(4), weights(5)
    kept = list(
        packed_broadcast_consumer(
            iter(metas(first)), ReplayGroup(send(first, 1024)), 0, None, True, buffer_size_bytes=1024
        )
    )
    # The next refit, both as a producer and as a consumer, with other values.
    packed_broadcast_consumer(
        iter(metas(second)), ReplayGroup(send(second, 1024)), 0, lambda batch: None, buffer_size_bytes=1024
    )
    assert_exact(first, kept)
    release_buffers()


# ------------------------------------------------------------------------------------------------ reuse still happens


def test_is_shared_sees_every_other_user_of_a_buffer():
    """The check rests on torch's storage use count: pin what it counts in this torch."""
    buffer = torch.empty(64, dtype=torch.uint8)
    assert not is_shared(buffer)
    for other in (
        lambda: buffer[8:16].view(torch.float32),
        lambda: buffer.numpy(),
        lambda: buffer[:0],
        lambda: torch.nn.Parameter(buffer[:8].view(torch.int64), requires_grad=False),
    ):
        user = other()
        assert is_shared(buffer)
        del user
        assert not is_shared(buffer)
    storage = buffer.untyped_storage()  # a Python storage object is not another tensor
    assert not is_shared(buffer)
    del storage


def _distinct_buffers(batches) -> int:
    ptrs = set()
    for batch in batches:
        ptrs.add(batch[0][1].untyped_storage().data_ptr())
        del batch  # a consumer that does not keep the batch
    return len(ptrs)


@pytest.mark.parametrize("num_buffers", [1, 2, 3])
def test_consumer_that_drops_tensors_reuses_its_buffers(num_buffers):
    """The fix costs nothing when nothing is held: the callback form receives into exactly num_buffers buffers."""
    tensors = [(f"w{i}", torch.full((25,), float(i))) for i in range(40)]  # 100 bytes each, 2 per chunk
    storages = set()

    def load(batch):
        storages.update(t.untyped_storage().data_ptr() for _, t in batch)
        for name, t in batch:
            assert t[0].item() == float(name[1:])

    release_buffers()
    packed_broadcast_consumer(
        iter(metas(tensors)), ReplayGroup(send(tensors, 200)), 0, load, num_buffers=num_buffers, buffer_size_bytes=200
    )
    assert len(storages) == num_buffers


@pytest.mark.parametrize("num_buffers", [2, 3])
def test_iterator_that_drops_tensors_reuses_its_buffers(num_buffers):
    """`for name, t in it: load(t)` keeps its last tensor bound while it asks for the next one; that alone must not
    cost a buffer per chunk (the buffer is refilled once the caller has moved on)."""
    tensors = [(f"w{i}", torch.full((25,), float(i))) for i in range(40)]
    storages = set()
    release_buffers()
    for name, t in packed_broadcast_consumer(
        iter(metas(tensors)),
        ReplayGroup(send(tensors, 200)),
        0,
        None,
        True,
        num_buffers=num_buffers,
        buffer_size_bytes=200,
    ):
        storages.add(t.untyped_storage().data_ptr())
        assert t[0].item() == float(name[1:])
    assert len(storages) == num_buffers


def test_pool_keeps_held_buffers_out_of_the_next_call():
    """The pool keeps a finished call's buffers and hands out none whose memory a caller's tensor still uses; once
    the caller lets go, it hands them out again."""
    release_buffers()
    tensors = weights(6)
    kept = list(
        packed_broadcast_consumer(
            iter(metas(tensors)), ReplayGroup(send(tensors, 1024)), 0, None, True, buffer_size_bytes=1024
        )
    )
    held = {t.untyped_storage().data_ptr() for _, t in kept}
    # The subject must be there: the call gave its buffers back to the pool, and the caller holds tensors in them.
    assert len(HOST_POOL) > 0, "the call kept no buffers: the test would not test"
    assert HOST_POOL.take() is None, "the pool handed out a buffer whose memory a kept tensor uses"
    del kept
    gc.collect()
    again = HOST_POOL.take()  # let go: handed out as before
    assert again is not None and again.untyped_storage().data_ptr() in held
    release_buffers()


# ------------------------------------------------------------------------------------------------ real gloo group


def _keep_everything_rank(rank: int, world_size: int, port: int, target: int, rounds: int) -> list:
    from refit_app.transport.groups import connect

    results = []
    with connect(gloo_spec(rank, world_size, port, timeout_s=30)) as rg:
        kept_rounds = []
        for r in range(rounds):
            tensors = weights(10 + r, count=120)
            if rank == 0:
                packed_broadcast_producer(iter(tensors), rg.group, 0, IDENTITY, buffer_size_bytes=target)
                continue
            if r % 2:
                kept = []
                packed_broadcast_consumer(iter(metas(tensors)), rg.group, 0, kept.extend, buffer_size_bytes=target)
            else:
                kept = list(
                    packed_broadcast_consumer(iter(metas(tensors)), rg.group, 0, None, True, buffer_size_bytes=target)
                )
            kept_rounds.append(kept)
        # Every round's tensors, still held, compared only after all rounds have been received.
        results = [digest(kept) for kept in kept_rounds]
    return results


def test_kept_tensors_survive_over_gloo():
    rounds = 4
    results = run_ranks(_keep_everything_rank, 2, 1024, rounds, timeout=120)
    assert results[1] == [digest(weights(10 + r, count=120)) for r in range(rounds)]
