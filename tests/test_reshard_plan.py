"""The sharded refit's plan (refit_app.core.reshard) against its oracle: every consumer's box, assembled from the
regions the plan sends it, is the full tensor sliced; each region comes from a rank that holds it; no producer
sends a region twice. Over random shapes (0-3 dims), uneven and empty shards, K and M from 1 to 5, 2-D meshes with
one dim sharded on both axes, replicated tensors and replica chains."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refit_app.core.reshard.plan import (
    Layout,
    LayoutError,
    Need,
    Replicate,
    Shard,
    TensorSpec,
    chunk_range,
    describe,
    digest,
    first_difference,
    held_boxes,
    plan,
    shard_box,
    volume,
    whole,
)


def _slice(box):
    return tuple(slice(a, b) for a, b in box)


def _check(tensors, needs, chains=()):
    """Run the plan through the oracle; return the transfers."""
    transfers = plan(tensors, needs, chains=chains)
    assert plan(tensors, needs, chains=chains) == transfers  # deterministic
    full = {t.name: np.arange(volume(whole(t.shape))).reshape(t.shape) for t in tensors}
    held = {t.name: held_boxes(t) for t in tensors}
    got = {(n.rank, n.name): np.full(t_shape(tensors, n.name), -1) for n in needs}
    count = {key: np.zeros(t_shape(tensors, key[1]), dtype=int) for key in got}
    for t in transfers:  # in plan order: a relay's source has its region by then
        if t.relayed:
            data = got[(t.src, t.name)][_slice(t.box)]
        else:
            hb = held[t.name][t.src]
            assert all(h0 <= b0 and b1 <= h1 for (h0, h1), (b0, b1) in zip(hb, t.box)), (t, hb)
            data = full[t.name][_slice(t.box)]
        assert (data >= 0).all(), f"{t} sends a region its source does not have yet"
        got[(t.dst, t.name)][_slice(t.box)] = data
        count[(t.dst, t.name)][_slice(t.box)] += 1
    for n in needs:
        want = np.zeros(t_shape(tensors, n.name), dtype=int)
        want[_slice(n.box)] = 1
        c = count[(n.rank, n.name)]
        np.testing.assert_array_equal(c, want, err_msg=f"{n}: an element sent twice, or not at all")
        np.testing.assert_array_equal(got[(n.rank, n.name)][_slice(n.box)], full[n.name][_slice(n.box)])
    return transfers


def t_shape(tensors, name):
    return next(t.shape for t in tensors if t.name == name)


@st.composite
def layouts(draw, ndim, k):
    two_d = k >= 4 and draw(st.booleans())
    if two_d:
        a = draw(st.sampled_from([d for d in range(2, k + 1) if k % d == 0 and k // d >= 2] or [1]))
        mesh = (a, k // a) if a > 1 else (k,)
    else:
        mesh = (k,)
    choices = [Replicate()] + [Shard(d) for d in range(ndim)]
    placements = tuple(draw(st.sampled_from(choices)) for _ in mesh)
    ranks = tuple(draw(st.permutations(range(k))))
    return Layout(mesh, ranks, placements)


@st.composite
def cases(draw):
    k = draw(st.integers(1, 5))
    m = draw(st.integers(1, 5))
    tensors, needs = [], []
    for i in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
        spec = TensorSpec(f"t{i}", "float32", shape, 4, draw(layouts(ndim, k)))
        tensors.append(spec)
        how = draw(st.sampled_from(["replicated"] + [f"shard{d}" for d in range(ndim)]))
        for c in range(m):
            box = whole(shape) if how == "replicated" else shard_box(shape, int(how[5:]), m, c)
            needs.append(Need(k + c, spec.name, box))
    return tensors, needs


@settings(max_examples=300, deadline=None)
@given(cases())
def test_every_consumer_box_is_the_full_tensor_sliced(case):
    tensors, needs = case
    transfers = _check(tensors, needs)
    # nothing is sent that no consumer needs (a 0-dim tensor's box is one element)
    assert sum(volume(t.box) for t in transfers) == sum(volume(n.box) for n in needs)


@settings(max_examples=100, deadline=None)
@given(cases(), st.integers(2, 3))
def test_replicas_get_their_regions_along_the_chain_and_producers_send_each_once(case, d):
    tensors, needs = case
    k = min(n.rank for n in needs)
    m = max(n.rank for n in needs) - k + 1
    replicated = list(needs)
    for r in range(1, d):
        replicated += [Need(n.rank + r * m, n.name, n.box) for n in needs]
    chains = [[k + c + r * m for r in range(d)] for c in range(m)]
    transfers = _check(tensors, replicated, chains)
    from_producers = [t for t in transfers if not t.relayed]
    assert all(t.src < k for t in from_producers) and all(t.dst < k + m for t in from_producers)
    assert sorted((t.name, t.box) for t in from_producers) == sorted((t.name, t.box) for t in plan(tensors, needs))


def test_chunks_split_as_torch_chunk_does():
    torch = pytest.importorskip("torch")
    for size in range(0, 12):
        for parts in range(1, 6):
            pieces = torch.arange(size).chunk(parts)
            for i in range(parts):
                start, stop = chunk_range(size, parts, i)
                expect = pieces[i].tolist() if i < len(pieces) else []
                assert list(range(start, stop)) == expect, (size, parts, i)


def test_33_rows_over_2_ranks_are_17_and_16_and_a_2d_mesh_shards_a_dim_twice():
    spec = TensorSpec("w", "bfloat16", (33, 4), 2, Layout.one_dim([0, 1], Shard(0)))
    assert held_boxes(spec) == {0: ((0, 17), (0, 4)), 1: ((17, 33), (0, 4))}
    # DTensor's rule: mesh dim 0 splits first, mesh dim 1 splits each part again
    spec = TensorSpec("w", "bfloat16", (10, 4), 2, Layout((2, 2), (0, 1, 2, 3), (Shard(0), Shard(0))))
    assert [held_boxes(spec)[r][0] for r in range(4)] == [(0, 3), (3, 5), (5, 8), (8, 10)]


def test_a_replicated_tensor_is_sent_by_its_replicas_in_turn():
    spec = TensorSpec("w", "float32", (8, 8), 4, Layout.one_dim([0, 1], Replicate()))
    needs = [Need(2 + c, "w", shard_box((8, 8), 0, 4, c)) for c in range(4)]
    assert [t.src for t in _check([spec], needs)] == [0, 1, 0, 1]


def test_a_layout_no_plan_can_serve_is_refused_naming_the_tensor():
    ok = Layout.one_dim([0, 1], Shard(0))
    bad = [
        (TensorSpec("a", "float32", (4,), 4, Layout((3,), (0, 1), (Shard(0),))), "cannot hold the 2 ranks"),
        (TensorSpec("b", "float32", (4,), 4, Layout.one_dim([0, 1], Shard(1))), "Shard(1) of a 1-dim"),
        (TensorSpec("c", "float32", (4,), 4, Layout.one_dim([0, 0], Shard(0))), "appears twice"),
    ]
    for spec, words in bad:
        with pytest.raises(LayoutError, match=re.escape(words)) as e:
            plan([spec], [])
        assert repr(spec.name) in str(e.value)
    spec = TensorSpec("w", "float32", (4, 2), 4, ok)
    with pytest.raises(LayoutError, match=r"consumer rank 2 needs \[\(0, 5\), \(0, 2\)\] of tensor 'w'"):
        plan([spec], [Need(2, "w", ((0, 5), (0, 2)))])
    with pytest.raises(LayoutError, match="'v', which no producer has"):
        plan([spec], [Need(2, "v", ((0, 1), (0, 2)))])
    with pytest.raises(LayoutError, match="replicas of one another but need different boxes"):
        plan([spec], [Need(2, "w", ((0, 2), (0, 2))), Need(3, "w", ((2, 4), (0, 2)))], chains=[[2, 3]])


def test_ranks_with_different_layouts_find_the_first_difference_and_different_digests():
    spec = TensorSpec("w", "float32", (33, 8), 4, Layout.one_dim([0, 1], Shard(0)))
    other = TensorSpec("w", "float32", (32, 8), 4, Layout.one_dim([0, 1], Shard(0)))
    needs = [Need(2, "w", whole((33, 8)))]
    mine, theirs = describe([spec], needs), describe([other], needs)
    why = first_difference(mine, theirs, rank=3)
    assert why is not None and "[33, 8]" in why and "[32, 8]" in why and "rank 3" in why
    assert first_difference(mine, mine, rank=3) is None
    assert digest(mine, plan([spec], needs)) != digest(theirs, plan([other], needs[:0]))
    assert digest(mine, plan([spec], needs)) == digest(describe([spec], needs), plan([spec], needs))
    assert "only on rank 3" in first_difference(mine, [*mine, "chain [2, 3]"], rank=3)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 200),
)
def test_a_region_larger_than_a_buffer_is_cut_into_pieces_that_tile_it(shape, itemsize, limit):
    from refit_app.core.reshard.transfer import pieces

    box = whole(shape)
    cut = pieces(box, itemsize, limit)
    count = np.zeros(shape, dtype=int)
    for piece in cut:
        assert volume(piece) * itemsize <= limit or volume(piece) == 1, (piece, limit)
        count[_slice(piece)] += 1
    assert (count == 1).all()
    assert pieces(box, itemsize, limit) == cut  # both ends cut alike


def test_a_replica_chain_that_loops_or_holds_a_stranger_is_refused():
    spec = TensorSpec("w", "float32", (4, 2), 4, Layout.one_dim([0], Shard(0)))
    needs = [Need(r, "w", whole((4, 2))) for r in (1, 2, 3)]
    with pytest.raises(LayoutError, match=re.escape("the replica chain [1, 2, 1] holds a rank twice")):
        plan([spec], needs, chains=[[1, 2, 1]])
    with pytest.raises(LayoutError, match="holds rank 7, which needs nothing"):
        plan([spec], needs, chains=[[1, 7]])


def test_the_tensor_parallel_rule_and_the_settings_are_checked_before_anything_moves():
    import torch.distributed.tensor as dtensor

    from refit_app.protocol.sharded import COLUMN, Expected, ShardedPlan, allocate, receive, send, tp_needs

    expected = [Expected("w", "float32", (4, 2))]
    with pytest.raises(LayoutError, match="give 0 <= tp_rank < tp_size"):
        tp_needs(expected, 1, 2, 2, lambda name: COLUMN)
    with pytest.raises(LayoutError, match="not torch's"):
        tp_needs(expected, 1, 0, 2, lambda name: dtensor.Shard(0))
    with pytest.raises(LayoutError, match="'v', which the expected tensors do not"):
        allocate(expected, [Need(1, "v", ((0, 1),))])
    with pytest.raises(LayoutError, match=r"needs \[\(0, 9\), \(0, 2\)\] of tensor 'w'"):
        allocate(expected, [Need(1, "w", ((0, 9), (0, 2)))])
    agreed = ShardedPlan([], 1024, None, True, "")
    with pytest.raises(ValueError, match=re.escape("agreed with delta=True: call send(delta=ProducerDeltas())")):
        send(None, 0, agreed, {})
    with pytest.raises(ValueError, match="num_buffers=0"):
        receive(None, 1, agreed, {}, num_buffers=0)
