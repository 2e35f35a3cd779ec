"""The packed broadcast over real gloo groups: 1 producer + 1 and + 2 consumers, in spawned processes."""

from __future__ import annotations

import itertools

import pytest
import torch
from mp_utils import gloo_spec, run_ranks
from tensor_utils import awkward_tensors, digest, metas

from refit_app.packed_tensor import packed_broadcast_consumer, packed_broadcast_producer
from refit_app.transport.groups import connect

TARGET = 4096
TIMEOUT_S = 30.0
"""group.timeout_s of these refits; nothing here waits for it."""

# (legacy, producer buffers, consumer buffers, consumer uses return_iterator)
CASES = [
    (legacy, nb_p, nb_c, it)
    for legacy, (nb_p, nb_c), it in itertools.product(
        [False, True], [(1, 1), (2, 2), (3, 3), (1, 3), (3, 2)], [False, True]
    )
]


def model() -> list[tuple[str, torch.Tensor]]:
    """The awkward cases plus enough weight to need many chunks of TARGET bytes and one oversized tensor."""
    g = torch.Generator().manual_seed(1)
    weights = [(f"layer{i}.w", torch.randn(33, 17, generator=g).to(torch.bfloat16)) for i in range(40)]
    return awkward_tensors() + weights + [("huge", torch.randn(5000, generator=g))] + awkward_tensors()[:3]


def _refit_rank(rank: int, world_size: int, port: int, cases) -> list:
    tensors = model()
    results = []
    with connect(gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S)) as rg:
        for legacy, nb_p, nb_c, use_iterator in cases:
            if rank == 0:
                packed_broadcast_producer(
                    iter(tensors),
                    rg.group,
                    0,
                    lambda x: x[1],
                    buffer_size_bytes=TARGET,
                    num_buffers=nb_p,
                    use_legacy_packing=legacy,
                )
                results.append(None)
                continue
            kwargs = dict(num_buffers=nb_c, buffer_size_bytes=TARGET, use_legacy_packing=legacy)
            if use_iterator:
                # Load each weight as it arrives (what vLLM's reload_weights does): hash it, keep nothing.
                it = packed_broadcast_consumer(iter(metas(tensors)), rg.group, 0, None, True, **kwargs)
                results.append(digest(it))
            else:
                got = []
                packed_broadcast_consumer(
                    iter(metas(tensors)), rg.group, 0, lambda b, got=got: got.extend(digest(b)), **kwargs
                )
                results.append(got)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_round_trips_over_gloo(world_size):
    results = run_ranks(_refit_rank, world_size, CASES, timeout=120)
    expected = digest(model())
    for rank in range(1, world_size):
        assert len(results[rank]) == len(CASES), f"rank {rank} ran {len(results[rank])} of {len(CASES)} cases"
        for case, got in zip(CASES, results[rank]):
            assert got == expected, f"rank {rank}, case {case}"


def _callback_error_then_next_refit(rank: int, world_size: int, port: int) -> list:
    tensors = model()
    with connect(gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S)) as rg:
        outcomes = []
        for attempt in range(2):
            if rank == 0:
                packed_broadcast_producer(iter(tensors), rg.group, 0, lambda x: x[1], buffer_size_bytes=TARGET)
                outcomes.append("sent")
                continue
            got = []

            def sink(batch, got=got, attempt=attempt):
                got.extend(digest(batch))
                if attempt == 0 and len(got) == len(tensors):
                    raise KeyError("consumer rejected the last batch")

            try:
                packed_broadcast_consumer(iter(metas(tensors)), rg.group, 0, sink, buffer_size_bytes=TARGET)
                outcomes.append(got)
            except KeyError as e:
                outcomes.append(f"raised {e}")
    return outcomes


def test_consumer_error_propagates_and_next_refit_works():
    results = run_ranks(_callback_error_then_next_refit, 2, timeout=60)
    assert results[0] == ["sent", "sent"]
    assert results[1][0] == "raised 'consumer rejected the last batch'"
    assert results[1][1] == digest(model())
