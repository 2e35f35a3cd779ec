"""Unit tests of the packed broadcast core with in-process fake groups: chunk plans, bytes, ordering, errors."""

from __future__ import annotations

import os

import pytest
import torch
from conditions import needs_no_cuda
from fakes import AsyncRecordingGroup, RecordingGroup, ReplayGroup
from tensor_utils import IDENTITY, assert_exact, awkward_tensors, metas, raw_bytes

from refit_app.packed_tensor import (
    BUFFER_MEMORY_RATIO_ENV,
    NUM_BUFFERS_ENV,
    BroadcastGroup,
    Chunk,
    ChunkPlanner,
    _packed_broadcast_consumer_batches,
    chunk_ids,
    get_num_buffers,
    get_target_packed_tensor_size,
    iter_chunks,
    packed_broadcast_consumer,
    packed_broadcast_producer,
    plan_chunks,
)


def round_trip(tensors, *, target, legacy=False, nb_producer=2, nb_consumer=2, return_iterator=False):
    sender = RecordingGroup()
    packed_broadcast_producer(
        iter(tensors),
        sender,
        0,
        IDENTITY,
        buffer_size_bytes=target,
        num_buffers=nb_producer,
        use_legacy_packing=legacy,
    )
    receiver = ReplayGroup(sender.sent)
    received = []
    if return_iterator:
        it = packed_broadcast_consumer(
            iter(metas(tensors)),
            receiver,
            0,
            None,
            True,
            num_buffers=nb_consumer,
            buffer_size_bytes=target,
            use_legacy_packing=legacy,
        )
        received = [(name, t.clone()) for name, t in it]
    else:
        packed_broadcast_consumer(
            iter(metas(tensors)),
            receiver,
            0,
            lambda batch: received.extend((n, t.clone()) for n, t in batch),
            num_buffers=nb_consumer,
            buffer_size_bytes=target,
            use_legacy_packing=legacy,
        )
    assert receiver.received == len(sender.sent)
    return sender, received


# ---------------------------------------------------------------------------------------------- settings


def test_num_buffers_env(monkeypatch):
    monkeypatch.delenv(NUM_BUFFERS_ENV, raising=False)
    assert get_num_buffers() == 2
    monkeypatch.setenv(NUM_BUFFERS_ENV, "3")
    assert get_num_buffers() == 3  # a changed variable takes effect at the next call
    for bad in ("abc", "0", "-1", "1.5"):
        monkeypatch.setenv(NUM_BUFFERS_ENV, bad)
        with pytest.raises(ValueError, match=rf"{NUM_BUFFERS_ENV}=.*{bad}"):
            get_num_buffers()


@needs_no_cuda
def test_target_size_env_without_a_gpu(monkeypatch):
    monkeypatch.delenv(BUFFER_MEMORY_RATIO_ENV, raising=False)
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # Without a GPU and without the variable: 16 MiB, or 2% of memory where that is less.
    assert get_target_packed_tensor_size() == min(int(phys * 0.02), 16 * 1024**2)
    monkeypatch.setenv(BUFFER_MEMORY_RATIO_ENV, "0.02")  # an explicit ratio is honoured as it stands
    assert get_target_packed_tensor_size() == min(int(phys * 0.02), 5 * 1024**3)
    monkeypatch.setenv(BUFFER_MEMORY_RATIO_ENV, "0.001")
    assert get_target_packed_tensor_size() == int(phys * 0.001)


def test_target_size_env(monkeypatch):
    monkeypatch.setenv(BUFFER_MEMORY_RATIO_ENV, "1")
    assert get_target_packed_tensor_size() <= 5 * 1024**3
    for bad in ("0", "1.5", "-0.1", "abc", "nan"):
        monkeypatch.setenv(BUFFER_MEMORY_RATIO_ENV, bad)
        with pytest.raises(ValueError, match=rf"{BUFFER_MEMORY_RATIO_ENV}=.*{bad}"):
            get_target_packed_tensor_size()


@pytest.mark.parametrize("kwargs", [{"num_buffers": 0}, {"buffer_size_bytes": 0}, {"buffer_size_bytes": -5}])
def test_bad_arguments_raise_before_communication(kwargs):
    group = RecordingGroup()
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        packed_broadcast_producer(iter([("a", torch.ones(2))]), group, 0, IDENTITY, **kwargs)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        packed_broadcast_consumer(iter(metas([("a", torch.ones(2))])), ReplayGroup([]), 0, print, **kwargs)
    assert group.sent == []


def test_consumer_without_sink_is_refused_before_communication():
    replay = ReplayGroup([])  # any receive would fail: there is nothing to replay
    with pytest.raises(ValueError, match="post_unpack_func"):
        packed_broadcast_consumer(iter(metas([("a", torch.ones(2))])), replay, 0, None, False)
    assert replay.received == 0


def test_group_protocol_is_structural():
    assert isinstance(RecordingGroup(), BroadcastGroup)


# ---------------------------------------------------------------------------------------------- chunk plans


def test_chunk_ids_bounded_hand_computed():
    # target 10: [4, 4] | [5] (4+4+5 > 10) | [12] alone | [0, 3] (a zero-byte tensor after an oversized one)
    assert list(chunk_ids([4, 4, 5, 12, 0, 3], 10)) == [0, 0, 1, 2, 3, 3]
    # exactly the target fits; zero-byte tensors join the open chunk, also at the end
    assert list(chunk_ids([10, 0, 0], 10)) == [0, 0, 0]
    assert list(chunk_ids([3, 12, 3], 10)) == [0, 1, 2]
    assert list(chunk_ids([], 10)) == []


def test_chunk_ids_legacy_hand_computed():
    # vLLM: append, then close once the chunk exceeds the target (strictly)
    assert list(chunk_ids([4, 4, 5, 12, 0, 3], 10, True)) == [0, 0, 0, 1, 2, 2]
    assert list(chunk_ids([10, 0, 1, 1], 10, True)) == [0, 0, 0, 1]
    assert list(chunk_ids([3, 12, 3], 10, True)) == [0, 0, 1]


def test_plan_chunks_hand_computed():
    C = Chunk
    # bounded, target 10: [4, 4] | [5] | [12] alone | [0, 3]
    assert plan_chunks([4, 4, 5, 12, 0, 3], 10) == [
        C(0, 0, 2, 8, True, False),
        C(1, 2, 1, 5, True, False),
        C(2, 3, 1, 12, True, True),
        C(3, 4, 2, 3, True, False),
    ]
    # legacy: the oversized tensor shares the chunk before it, so nothing is ever `alone`
    assert plan_chunks([4, 4, 5, 12, 0, 3], 10, True) == [
        C(0, 0, 3, 13, True, False),
        C(1, 3, 1, 12, True, False),
        C(2, 4, 2, 3, True, False),
    ]
    # a chunk of only zero-byte tensors: skipped in bounded mode, broadcast (0 bytes) in legacy mode
    assert plan_chunks([12, 0, 0], 10) == [C(0, 0, 1, 12, True, True), C(1, 1, 2, 0, False, False)]
    assert plan_chunks([12, 0, 0], 10, True) == [C(0, 0, 1, 12, True, False), C(1, 1, 2, 0, True, False)]
    assert plan_chunks([0], 10, True) == [C(0, 0, 1, 0, True, False)]
    assert plan_chunks([], 10) == [] and plan_chunks([10], 10)[0].alone is False  # exactly the target is not over
    assert plan_chunks([3, 12], 10)[1].stop == 2


@pytest.mark.parametrize("legacy", [False, True])
def test_chunk_ids_and_plan_agree(legacy):
    g = torch.Generator().manual_seed(5)
    sizes = [int(x) for x in torch.randint(0, 40, (500,), generator=g)]
    sizes = [0 if i % 17 == 0 else (300 if i % 29 == 0 else n) for i, n in enumerate(sizes)]
    ids = list(chunk_ids(sizes, 100, legacy))
    plan = plan_chunks(sizes, 100, legacy)
    assert [c.index for c in plan] == list(range(len(plan)))
    assert [i for c in plan for i in [c.index] * c.count] == ids
    assert all(c.nbytes == sum(sizes[c.first : c.stop]) for c in plan)
    assert all(c.broadcast == (c.nbytes > 0 or legacy) for c in plan)
    assert all(c.alone == (not legacy and c.count == 1 and c.nbytes > 100) for c in plan)
    assert sum(c.count for c in plan) == len(sizes) and plan[-1].stop == len(sizes)


def test_iter_chunks_is_lazy():
    def sizes():
        yield from (6, 6)
        raise Boom("read past what the first chunk needed")

    chunks = iter_chunks(sizes(), 10)
    assert next(chunks) == Chunk(0, 0, 1, 6, True, False)  # closed by the second size, before the third is read
    with pytest.raises(Boom):
        next(chunks)


def test_planner_knows_alone_on_arrival():
    planner = ChunkPlanner(10)
    assert planner.add(4) is None and not planner.open_alone
    closed = planner.add(12)
    assert closed == Chunk(0, 0, 1, 4, True, False)
    assert planner.open_index == 1 and planner.open_count == 1 and planner.open_alone  # before anything follows
    assert planner.add(0) == Chunk(1, 1, 1, 12, True, True)
    assert planner.finish() == Chunk(2, 2, 1, 0, False, False) and planner.finish() is None
    with pytest.raises(ValueError, match="target_bytes=0"):
        ChunkPlanner(0)


@pytest.mark.parametrize("legacy", [False, True])
def test_both_sides_report_the_planned_chunks(legacy):
    tensors = awkward_tensors()
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    sent_chunks, received_chunks, counts = [], [], []
    sender = RecordingGroup()
    packed_broadcast_producer(
        iter(tensors),
        sender,
        0,
        IDENTITY,
        buffer_size_bytes=200,
        use_legacy_packing=legacy,
        on_chunk_done=sent_chunks.append,
        on_chunk=lambda n, k: counts.append((n, k)),
    )
    packed_broadcast_consumer(
        iter(metas(tensors)),
        ReplayGroup(sender.sent),
        0,
        lambda batch: None,
        buffer_size_bytes=200,
        use_legacy_packing=legacy,
        on_chunk_done=received_chunks.append,
    )
    plan = plan_chunks(sizes, 200, legacy)
    assert sent_chunks == received_chunks == plan
    assert counts == [(c.nbytes, c.count) for c in plan]
    assert sender.sizes == [c.nbytes for c in plan if c.broadcast]
    assert any(not c.broadcast for c in plan) != legacy  # the trailing zero-byte chunk: skipped only when bounded


def test_producer_streams_chunks_as_tensors_arrive():
    group = RecordingGroup()
    pulled = []

    def source():
        for i in range(6):
            pulled.append(i)
            yield f"w{i}", torch.full((25,), float(i))  # 100 bytes: 2 per chunk of 200

    def post(item):
        # When tensor 2 is requested, chunk 0 (tensors 0, 1) went out once tensor 2's size was known, not later.
        if item[0] == "w3":
            assert group.sizes == [200]
        return item[1]

    packed_broadcast_producer(source(), group, 0, post, buffer_size_bytes=200)
    assert group.sizes == [200, 200, 200] and pulled == list(range(6))


@pytest.mark.parametrize(
    "legacy, expected",
    [
        # sizes: 2 140 54 | 22 72 13 5 24 32 9 17 19 | 40 4 0 96 28 8 | 1200 | 0 (zero-byte chunk, not sent)
        (False, [196, 194, 195, 1200]),
        # sizes: 2 140 54 22 | 72 13 5 24 32 9 17 19 40 | 4 0 96 28 8 1200 | 0 (sent empty, as vLLM does)
        (True, [218, 231, 1336, 0]),
    ],
)
def test_broadcast_sizes_exact_sequence(legacy, expected):
    tensors = awkward_tensors()
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    assert sizes[:3] == [2, 140, 54] and sizes[-2:] == [1200, 0]
    sender, received = round_trip(tensors, target=200, legacy=legacy)
    assert sender.sizes == expected
    assert sum(expected) == sum(sizes)
    assert_exact(tensors, received)


def test_golden_packed_bytes():
    """One chunk, byte for byte: raw little-endian bytes, concatenated, no padding or header."""
    tensors = [
        ("u8", torch.tensor([7], dtype=torch.uint8)),
        ("f32", torch.tensor([1.0], dtype=torch.float32)),  # lands at offset 1: unaligned, still no padding
        ("f16", torch.tensor(-2.0, dtype=torch.float16)),  # 0-dim
        ("i16_T", torch.tensor([[1, 2], [3, 4]], dtype=torch.int16).T),  # row-major of the view: 1, 3, 2, 4
        ("b", torch.tensor([True, False])),
    ]
    sender, received = round_trip(tensors, target=1024)
    golden = (
        bytes([7])
        + bytes.fromhex("0000803f")
        + bytes.fromhex("00c0")
        + bytes.fromhex("0100030002000400")
        + bytes([1, 0])
    )
    assert len(sender.sent) == 1
    assert bytes(sender.sent[0].numpy()) == golden
    assert_exact(tensors, received)


# ---------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("nb_producer, nb_consumer", [(1, 1), (2, 2), (3, 3), (1, 3), (3, 1), (2, 1)])
@pytest.mark.parametrize("target", [64, 200, 1 << 20])
def test_round_trip_exact(legacy, nb_producer, nb_consumer, target):
    tensors = awkward_tensors()
    _, received = round_trip(tensors, target=target, legacy=legacy, nb_producer=nb_producer, nb_consumer=nb_consumer)
    assert_exact(tensors, received)


@pytest.mark.parametrize("legacy", [False, True])
def test_round_trip_return_iterator(legacy):
    tensors = awkward_tensors()
    _, received = round_trip(tensors, target=100, legacy=legacy, return_iterator=True)
    assert_exact(tensors, received)


def test_empty_iterator_sends_nothing():
    sender, received = round_trip([], target=100)
    assert sender.sent == [] and received == []
    empties = [("e", torch.empty(0)), ("f", torch.empty(0, 3))]
    sender, received = round_trip(empties, target=100)
    assert sender.sent == []  # a chunk with no bytes is skipped by both sides
    assert_exact(empties, received)
    sender, received = round_trip(empties, target=100, legacy=True)
    assert sender.sizes == [0]  # legacy mode broadcasts it, like vLLM, so a vLLM peer stays in step
    assert_exact(empties, received)


def test_shapes_as_list_tuple_or_size():
    tensors = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.arange(4.0)), ("c", torch.ones(1, 1))]
    sender = RecordingGroup()
    packed_broadcast_producer(iter(tensors), sender, 0, IDENTITY, buffer_size_bytes=16)
    spec = [("a", ([2, 3], torch.float32)), ("b", ((4,), torch.float32)), ("c", (torch.Size([1, 1]), torch.float32))]
    out = []
    packed_broadcast_consumer(
        iter(spec),
        ReplayGroup(sender.sent),
        0,
        lambda b: out.extend((n, t.clone()) for n, t in b),
        buffer_size_bytes=16,
    )
    assert_exact(tensors, out)


def test_post_iter_func_output_is_what_travels():
    tensors = [("a", torch.randn(10)), ("b", torch.randn(3, 3))]
    sender = RecordingGroup()
    packed_broadcast_producer(iter(tensors), sender, 0, lambda item: item[1].to(torch.bfloat16), buffer_size_bytes=1000)
    assert sender.sizes == [38]
    expected = [(n, t.to(torch.bfloat16)) for n, t in tensors]
    _, received = round_trip(expected, target=1000)
    assert_exact(expected, received)


# ---------------------------------------------------------------------------------------------- buffers & ordering


def test_send_buffers_are_reused_not_reallocated():
    tensors = [(f"w{i}", torch.full((25,), float(i))) for i in range(40)]  # 100 bytes each, 2 per chunk
    sender = RecordingGroup()
    packed_broadcast_producer(iter(tensors), sender, 0, IDENTITY, buffer_size_bytes=200, num_buffers=3)
    assert len(sender.sent) == 20
    assert len(set(sender.data_ptrs)) == 3  # one buffer per slot, allocated once per call
    assert sender.data_ptrs[:3] == sender.data_ptrs[3:6]


def test_oversized_contiguous_tensor_is_sent_in_place():
    big = torch.randn(1000)
    sender = RecordingGroup()
    packed_broadcast_producer(iter([("s", torch.ones(2)), ("big", big)]), sender, 0, IDENTITY, buffer_size_bytes=64)
    assert sender.sizes == [8, 4000]
    assert sender.data_ptrs[1] == big.data_ptr()


def test_consumer_receive_buffers_are_reused():
    tensors = [(f"w{i}", torch.full((25,), float(i))) for i in range(12)]
    sender = RecordingGroup()
    packed_broadcast_producer(iter(tensors), sender, 0, IDENTITY, buffer_size_bytes=200)
    ptrs = []
    for batch in _packed_broadcast_consumer_batches(
        iter(metas(tensors)), ReplayGroup(sender.sent), 0, num_buffers=2, buffer_size_bytes=200
    ):
        ptrs.append(batch[0][1].data_ptr())  # aligned tensors are views of the receive buffer
        assert [t[0].item() for _, t in batch] == [float(n[1:]) for n, _ in batch]
        del batch  # a buffer is refilled only once no tensor from it is referenced (issue 10)
    assert len(ptrs) == 6 and len(set(ptrs)) == 2
    # A loop variable still bound to the previous batch while asking for the next costs exactly one more buffer.
    ptrs = []
    for batch in _packed_broadcast_consumer_batches(
        iter(metas(tensors)), ReplayGroup(sender.sent), 0, num_buffers=2, buffer_size_bytes=200
    ):
        ptrs.append(batch[0][1].data_ptr())
    assert len(ptrs) == 6 and len(set(ptrs)) == 3


def test_buffer_reused_only_after_its_broadcast_completed():
    tensors = [(f"w{i}", torch.full((25,), float(i))) for i in range(10)]  # 5 chunks of 200 bytes
    group = AsyncRecordingGroup()
    packed_broadcast_producer(iter(tensors), group, 0, IDENTITY, buffer_size_bytes=200, num_buffers=2)
    events = group.events
    # chunk k's broadcast is waited for before chunk k+2 (same buffer) starts, and all are waited for at the end
    for k in range(3):
        assert events.index(("wait", k)) < [i for i, e in enumerate(events) if e[0] == "broadcast"][k + 2]
    assert sorted(i for kind, i in events if kind == "wait") == list(range(5))
    assert events[:3] == [("broadcast", 200), ("broadcast", 200), ("wait", 0)]


def test_consumer_batch_valid_until_resumed():
    tensors = [(f"w{i}", torch.full((50,), float(i))) for i in range(6)]
    sender = RecordingGroup()
    packed_broadcast_producer(iter(tensors), sender, 0, IDENTITY, buffer_size_bytes=200)
    replay = ReplayGroup(sender.sent)
    batches = _packed_broadcast_consumer_batches(iter(metas(tensors)), replay, 0, num_buffers=2, buffer_size_bytes=200)
    first = next(batches)
    assert replay.received == 2  # the next chunk is already being received while the first is processed
    assert first[0][1][0].item() == 0.0
    second = next(batches)
    assert second[0][1][0].item() == 1.0
    assert replay.received == 3
    batches.close()


# ---------------------------------------------------------------------------------------------- errors mid-way


class Boom(Exception):
    pass


def test_producer_error_propagates_after_draining_and_next_call_works():
    tensors = [(f"w{i}", torch.full((25,), float(i))) for i in range(10)]
    group = AsyncRecordingGroup()

    def post(item):
        if item[0] == "w7":
            raise Boom("bad tensor")
        return item[1]

    with pytest.raises(Boom, match="bad tensor"):
        packed_broadcast_producer(iter(tensors), group, 0, post, buffer_size_bytes=200, num_buffers=2)
    started = [e for e in group.events if e[0] == "broadcast"]
    waited = [e for e in group.events if e[0] == "wait"]
    assert len(started) == 3 and len(waited) == 3  # nothing left in flight
    _sender, received = round_trip(tensors, target=200)
    assert_exact(tensors, received)


def test_iterator_error_propagates_unchanged():
    def gen():
        yield "a", torch.ones(3)
        raise Boom("source broke")

    with pytest.raises(Boom, match="source broke"):
        packed_broadcast_producer(gen(), RecordingGroup(), 0, IDENTITY, buffer_size_bytes=100)


def test_consumer_callback_error_propagates_after_draining():
    tensors = [(f"w{i}", torch.full((25,), float(i))) for i in range(10)]
    sender = RecordingGroup()
    packed_broadcast_producer(iter(tensors), sender, 0, IDENTITY, buffer_size_bytes=200)
    replay = ReplayGroup(sender.sent)
    seen = []

    def sink(batch):
        seen.append(batch[0][0])
        if len(seen) == 2:
            raise Boom("sink full")

    with pytest.raises(Boom, match="sink full"):
        packed_broadcast_consumer(iter(metas(tensors)), replay, 0, sink, num_buffers=3, buffer_size_bytes=200)
    assert seen == ["w0", "w2"] and replay.received == 4


def test_host_buffers_are_kept_for_the_next_call_and_bounded():
    """Repeated refits reuse resident host buffers instead of faulting in new ones, and memory does not grow."""
    from refit_app.core.buffers import HOST_POOL, release_buffers

    tensors = [(f"w{i}", torch.full((25,), float(i))) for i in range(12)]
    release_buffers()
    first = RecordingGroup()
    packed_broadcast_producer(iter(tensors), first, 0, IDENTITY, buffer_size_bytes=200, num_buffers=3)
    for _ in range(20):
        again = RecordingGroup()
        packed_broadcast_producer(iter(tensors), again, 0, IDENTITY, buffer_size_bytes=200, num_buffers=3)
        assert set(again.data_ptrs) == set(first.data_ptrs)
        assert len(HOST_POOL) == 3
    # A call with fewer buffers shrinks what is kept.
    packed_broadcast_producer(iter(tensors), RecordingGroup(), 0, IDENTITY, buffer_size_bytes=200, num_buffers=1)
    assert len(HOST_POOL) == 1
    release_buffers()
    assert len(HOST_POOL) == 0


class _OwnMemoryGroup(RecordingGroup):
    """A producer-side group that gives each slot a buffer of its own memory (as group.backend=shm does)."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: dict[int, torch.Tensor] = {}

    def slot_buffer(self, index: int, nbytes: int, keep: int) -> torch.Tensor:
        if index not in self.buffers or self.buffers[index].numel() < nbytes:
            self.buffers[index] = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffers[index]


def test_a_call_through_the_groups_own_memory_leaves_the_kept_host_buffers_alone():
    """A process with a gloo group and an shm group: the shm call neither takes the gloo call's kept buffers nor
    drops them, so the next gloo call finds its buffers resident (the same memory) instead of faulting new ones."""
    from refit_app.core.buffers import HOST_POOL, release_buffers

    tensors = [(f"w{i}", torch.full((25,), float(i))) for i in range(12)]
    release_buffers()
    first = RecordingGroup()
    packed_broadcast_producer(iter(tensors), first, 0, IDENTITY, buffer_size_bytes=200, num_buffers=3)
    assert len(HOST_POOL) == 3
    own = _OwnMemoryGroup()
    packed_broadcast_producer(iter(tensors), own, 0, IDENTITY, buffer_size_bytes=200, num_buffers=3)
    assert own.buffers and set(own.data_ptrs) <= {b.data_ptr() for b in own.buffers.values()}  # the group's memory
    assert len(HOST_POOL) == 3
    again = RecordingGroup()
    packed_broadcast_producer(iter(tensors), again, 0, IDENTITY, buffer_size_bytes=200, num_buffers=3)
    assert set(again.data_ptrs) == set(first.data_ptrs)
    release_buffers()


def test_failed_call_keeps_no_buffers():
    from refit_app.core.buffers import HOST_POOL, release_buffers

    release_buffers()

    def post(item):
        if item[0] == "w5":
            raise Boom("stop")
        return item[1]

    tensors = [(f"w{i}", torch.full((25,), float(i))) for i in range(8)]
    with pytest.raises(Boom):
        packed_broadcast_producer(iter(tensors), AsyncRecordingGroup(), 0, post, buffer_size_bytes=200)
    assert len(HOST_POOL) == 0  # a buffer a failed broadcast may still touch is never handed out again


def test_parameters_and_lazy_views_travel_as_their_values():
    g = torch.Generator().manual_seed(3)
    param = torch.nn.Parameter(torch.randn(4, 4, generator=g))
    conj = torch.randn(40, dtype=torch.complex64, generator=g).conj()  # lazy conjugate: stored bytes differ
    neg = torch.randn(6, dtype=torch.complex64, generator=g).conj().imag  # lazy negation
    tensors = [("bf16_scalar", torch.tensor(1.0, dtype=torch.bfloat16)), ("param", param), ("conj", conj), ("neg", neg)]
    for target in (16, 1 << 20):  # oversized (sent alone) and packed, unaligned after the scalar
        expected = [(n, t.detach().resolve_conj().resolve_neg()) for n, t in tensors]
        _, received = round_trip(tensors, target=target)
        assert_exact(expected, received)


def test_signatures_keep_the_spec():
    """Names, order and defaults of ../shared/spec/packed_tensor_api.txt; additions only keyword-only with defaults."""
    import inspect

    def shape(fn):
        return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]

    POS, KW, empty = "POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY", inspect.Parameter.empty
    assert shape(get_target_packed_tensor_size) == [] and shape(get_num_buffers) == []
    producer = shape(packed_broadcast_producer)
    assert producer[:7] == [
        ("iterator", POS, empty),
        ("group", POS, empty),
        ("src", POS, empty),
        ("post_iter_func", POS, empty),
        ("buffer_size_bytes", KW, None),
        ("num_buffers", KW, None),
        ("use_legacy_packing", KW, False),
    ]
    batches = shape(_packed_broadcast_consumer_batches)
    assert batches[:4] == [
        ("iterator", POS, empty),
        ("group", POS, empty),
        ("src", POS, empty),
        ("num_buffers", KW, None),
    ]
    consumer = shape(packed_broadcast_consumer)
    assert consumer[:6] == [
        ("iterator", POS, empty),
        ("group", POS, empty),
        ("src", POS, empty),
        ("post_unpack_func", POS, empty),
        ("return_iterator", POS, False),
        ("num_buffers", KW, None),
    ]
    for extra in producer[7:] + batches[4:] + consumer[6:]:
        assert extra[1] == KW and extra[2] is not empty, extra
    assert ("buffer_size_bytes", KW, None) in consumer and ("use_legacy_packing", KW, False) in consumer
    assert ("buffer_size_bytes", KW, None) in batches and ("use_legacy_packing", KW, False) in batches


# --------------------------------------------------------------------------------------------- plans kept across rounds


def _rounds_with_plans(rounds, *, target, legacy=False, return_iterator=False):
    from refit_app.packed_tensor import PackedPlan

    send_plan, recv_plan = PackedPlan(), PackedPlan()
    kept = []
    for r in rounds:
        sender = RecordingGroup()
        packed_broadcast_producer(
            iter(r), sender, 0, IDENTITY, buffer_size_bytes=target, use_legacy_packing=legacy, plan=send_plan
        )
        kwargs = {"buffer_size_bytes": target, "use_legacy_packing": legacy, "plan": recv_plan}
        if return_iterator:
            got = list(packed_broadcast_consumer(iter(metas(r)), ReplayGroup(sender.sent), 0, None, True, **kwargs))
        else:
            got = []
            packed_broadcast_consumer(iter(metas(r)), ReplayGroup(sender.sent), 0, got.extend, **kwargs)
        kept.append((sender.sizes, got))
    assert send_plan.ready and recv_plan.ready and send_plan.chunks == recv_plan.chunks
    return kept


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("target", [64, 200, 1 << 20])
@pytest.mark.parametrize("return_iterator", [False, True])
def test_plan_rounds_are_exact_and_send_the_same_chunks(legacy, target, return_iterator):
    """Rounds with other values but the same list: the followed plan sends exactly what a fresh plan sends, and
    every round's tensors, all kept (no clone), stay exact."""
    g = torch.Generator().manual_seed(9)
    base = awkward_tensors()
    rounds = [base] + [
        [
            (
                n,
                (torch.randn(t.shape, generator=g) * 3).to(t.dtype)
                if t.is_floating_point() or t.is_complex()
                else t.clone(),
            )
            for n, t in base
        ]
        for _ in range(3)
    ]
    rounds = [[(n, t.resolve_conj().resolve_neg()) for n, t in r] for r in rounds]
    results = _rounds_with_plans(rounds, target=target, legacy=legacy, return_iterator=return_iterator)
    fresh_sender, _ = round_trip(rounds[0], target=target, legacy=legacy)
    for r, (sizes, got) in zip(rounds, results):
        assert sizes == fresh_sender.sizes
        assert_exact(r, got)


def test_plan_refuses_a_changed_tensor_list():
    from refit_app.packed_tensor import PackedPlan

    tensors = [(f"w{i}", torch.full((25,), float(i))) for i in range(6)]
    plan = PackedPlan()
    packed_broadcast_producer(iter(tensors), RecordingGroup(), 0, IDENTITY, buffer_size_bytes=200, plan=plan)
    changed = [*tensors[:3], ("w3", torch.zeros(25, dtype=torch.float64)), *tensors[4:]]
    with pytest.raises(ValueError, match=r"tensor 3 .*float64.*w3"):
        packed_broadcast_producer(iter(changed), RecordingGroup(), 0, IDENTITY, buffer_size_bytes=200, plan=plan)
    with pytest.raises(ValueError, match=r"tensor 6 .*(one more|end)"):
        packed_broadcast_producer(
            iter(tensors + tensors[:1]), RecordingGroup(), 0, IDENTITY, buffer_size_bytes=200, plan=plan
        )
    with pytest.raises(ValueError, match=r"tensor 5 .*missing"):
        packed_broadcast_producer(iter(tensors[:5]), RecordingGroup(), 0, IDENTITY, buffer_size_bytes=200, plan=plan)
    with pytest.raises(ValueError, match="use a new PackedPlan"):
        packed_broadcast_producer(iter(tensors), RecordingGroup(), 0, IDENTITY, buffer_size_bytes=400, plan=plan)
    recv = PackedPlan()
    sender = RecordingGroup()
    packed_broadcast_producer(iter(tensors), sender, 0, IDENTITY, buffer_size_bytes=200)
    packed_broadcast_consumer(
        iter(metas(tensors)), ReplayGroup(sender.sent), 0, print, buffer_size_bytes=200, plan=recv
    )
    renamed = metas(tensors)
    renamed[2] = ("other", renamed[2][1])
    with pytest.raises(ValueError, match=r"tensor 2 .*other"):
        packed_broadcast_consumer(iter(renamed), ReplayGroup(sender.sent), 0, print, buffer_size_bytes=200, plan=recv)


def test_plan_producer_copies_into_its_own_buffers_every_round():
    from refit_app.packed_tensor import PackedPlan

    tensors = [(f"w{i}", torch.full((25,), float(i))) for i in range(40)]
    plan = PackedPlan()
    ptrs = []
    for _ in range(3):
        sender = RecordingGroup()
        packed_broadcast_producer(iter(tensors), sender, 0, IDENTITY, buffer_size_bytes=200, num_buffers=2, plan=plan)
        ptrs.append(sender.data_ptrs)
    assert len(set(ptrs[1])) == 2 and ptrs[1] == ptrs[2]  # the plan's two buffers, the same every round


# ------------------------------------------------------------------------------ receive buffers: sizes and late release


class _LateWork:
    def __init__(self, group: _LateReleaseGroup, tensor: torch.Tensor) -> None:
        self._group = group
        self._tensor: torch.Tensor | None = tensor

    def wait(self) -> None:
        self._group.held, self._tensor = self._tensor, None  # the previous receive's tensor is released only now


class _LateReleaseGroup(ReplayGroup):
    """Replays chunks like ReplayGroup, and lets go of a finished receive's tensor late, as gloo's worker thread
    does: only when the next receive is waited for. Records each receive's buffer (address and capacity)."""

    def __init__(self, chunks: list[torch.Tensor]) -> None:
        super().__init__(chunks)
        self.held: torch.Tensor | None = None
        self.ptrs: list[int] = []
        self.capacities: list[int] = []

    def broadcast_async(self, tensor: torch.Tensor, src: int):
        self.broadcast(tensor, src)
        self.ptrs.append(tensor.data_ptr())
        self.capacities.append(tensor.untyped_storage().nbytes())
        return _LateWork(self, tensor)


def test_consumer_receives_into_two_target_sized_buffers_and_waits_out_a_late_release_without_sleeping(monkeypatch):
    """Each receive buffer is sized for the target from its first chunk (never grown: a grown buffer leaves the
    old one behind in the allocator), and a buffer the transport still references just after its receive is
    reused once the next receive has been waited for, not slept on (TRANSPORT_RELEASE_S) nor replaced."""
    from refit_app.core import buffers

    def no_sleep(seconds):
        raise AssertionError(f"the consumer slept {seconds} s waiting for the transport to let go of a buffer")

    monkeypatch.setattr(buffers.time, "sleep", no_sleep)
    buffers.release_buffers()
    sizes = [60, 100, 40, 100, 100, 20, 100, 60, 100, 100, 100]  # chunks of 200, 220, 160, 200, 100 bytes
    tensors = [(f"w{i}", torch.arange(n, dtype=torch.uint8) + i) for i, n in enumerate(sizes)]
    sender = RecordingGroup()
    packed_broadcast_producer(iter(tensors), sender, 0, IDENTITY, buffer_size_bytes=256, num_buffers=2)
    assert sender.sizes == [200, 220, 160, 200, 100]  # the second is larger than the first
    buffers.release_buffers()  # the producer's, kept in this process's pool: the consumer allocates its own
    group = _LateReleaseGroup(sender.sent)
    got = []
    packed_broadcast_consumer(
        iter(metas(tensors)),
        group,
        0,
        lambda batch: got.extend((n, t.clone()) for n, t in batch),
        buffer_size_bytes=256,
        num_buffers=2,
    )
    assert [(n, raw_bytes(t)) for n, t in got] == [(n, raw_bytes(t)) for n, t in tensors]
    assert len(set(group.ptrs)) == 2
    assert group.capacities == [256] * 5
    buffers.release_buffers()


def test_a_single_chunk_gets_a_buffer_of_its_exact_size():
    from refit_app.core import buffers

    buffers.release_buffers()
    tensors = [("a", torch.ones(30, dtype=torch.uint8)), ("b", torch.zeros(20, dtype=torch.uint8))]
    sender = RecordingGroup()
    packed_broadcast_producer(iter(tensors), sender, 0, IDENTITY, buffer_size_bytes=1 << 20)
    buffers.release_buffers()
    group = _LateReleaseGroup(sender.sent)
    packed_broadcast_consumer(iter(metas(tensors)), group, 0, lambda batch: None, buffer_size_bytes=1 << 20)
    assert group.capacities == [50]
    buffers.release_buffers()
