"""``group.backend=shm`` on real processes: every packing mode and dtype round trip, consumers that keep what they
are handed (the buffer-lifetime rule across processes), broadcasts from any rank, the segment ring's reuse, and a
stranger who tries to join the run's shared memory. Kills are in ``test_shm_faults.py``."""

from __future__ import annotations

import gc
import itertools
import json
import os
import socket
import time

import pytest
import torch
from mp_utils import gloo_spec
from tensor_utils import IDENTITY, awkward_tensors, digest, metas

from refit_app.packed_tensor import (
    PackedPlan,
    _packed_broadcast_consumer_batches,
    packed_broadcast_consumer,
    packed_broadcast_producer,
)
from refit_app.transport.groups import connect
from refit_app.transport.shm import host_identity
from refit_app.transport.shm import producer as shm_transport
from refit_app.transport.shm.link import CHALLENGE, JOIN, Link

TIMEOUT_S = 30.0
"""group.timeout_s of these groups; nothing here waits for it."""
TARGET = 4096
TOKEN = "shm-test-token"
SCENARIO_RANKS = 3


def model(seed: int = 1) -> list[tuple[str, torch.Tensor]]:
    """Every dtype and awkward layout, enough weights for many chunks of TARGET bytes, one tensor larger than a
    chunk and zero-byte tensors (which legacy packing broadcasts as chunks of their own)."""
    g = torch.Generator().manual_seed(seed)
    weights = [(f"layer{i}.w", torch.randn(33, 17, generator=g).to(torch.bfloat16)) for i in range(40)]
    huge = ("huge", torch.randn(5000, generator=g))
    return awkward_tensors() + weights + [huge] + [("z0", torch.empty(0)), ("z1", torch.empty(0, 2))] + weights[:3]


def _spec(rank: int, port: int, **fields):
    return gloo_spec(rank, SCENARIO_RANKS, port, timeout_s=TIMEOUT_S, backend="shm", **fields)


# --- scenarios: each runs on every rank of one group of processes -------------------------------------------------

ROUND_TRIPS = [
    (legacy, nb_p, nb_c, form)
    for legacy, (nb_p, nb_c), form in itertools.product(
        [False, True], [(1, 1), (2, 2), (3, 3), (1, 3), (3, 2)], ["callback", "iterator", "batches"]
    )
]


def _round_trips(rank: int, port: int) -> list:
    """Every packing mode, producer and consumer buffer counts and consumer form; rank 2 keeps every tensor it is
    handed (no clone) and checks them only at the end, rank 1 drops each."""
    tensors = model()
    out = []
    with connect(_spec(rank, port)) as rg:
        assert rg.backend == "shm"
        for legacy, nb_p, nb_c, form in ROUND_TRIPS:
            settings = dict(buffer_size_bytes=TARGET, use_legacy_packing=legacy)
            if rank == 0:
                packed_broadcast_producer(iter(tensors), rg.group, 0, IDENTITY, num_buffers=nb_p, **settings)
                continue
            keep = rank == 2
            kept: list = []
            if form == "callback":
                got: list = []
                packed_broadcast_consumer(
                    iter(metas(tensors)),
                    rg.group,
                    0,
                    kept.extend if keep else (lambda b, got=got: got.extend(digest(b))),
                    num_buffers=nb_c,
                    **settings,
                )
            elif form == "iterator":
                it = packed_broadcast_consumer(
                    iter(metas(tensors)), rg.group, 0, None, True, num_buffers=nb_c, **settings
                )
                got = [] if keep else digest(it)
                if keep:
                    kept = list(it)
            else:
                got = []
                for batch in _packed_broadcast_consumer_batches(
                    iter(metas(tensors)), rg.group, 0, num_buffers=nb_c, **settings
                ):
                    if keep:
                        kept.extend(batch)
                    else:
                        got.extend(digest(batch))
            out.append(digest(kept) if keep else got)
    return out


def _held_across_calls(rank: int, port: int) -> list:
    """Tensors a consumer keeps from call 1 keep their values while calls 2-4 (other values) reuse the ring; then
    the kept segments come back as spares."""
    out = []
    with connect(_spec(rank, port)) as rg:
        kept = None
        for call in range(4):
            tensors = model(seed=10 + call)
            if rank == 0:
                packed_broadcast_producer(iter(tensors), rg.group, 0, IDENTITY, buffer_size_bytes=TARGET)
                continue
            received = list(
                packed_broadcast_consumer(iter(metas(tensors)), rg.group, 0, None, True, buffer_size_bytes=TARGET)
            )
            if call == 0:
                kept = received
                # Handed out without a copy: views of the producer's segments as this rank mapped them.
                out.append(all(_in_shared_memory(rg.group, t) for n, t in received if n == "huge"))
            out.append(digest(received))
            del received
        if rank != 0:
            out.append(digest(kept))
            del kept
            gc.collect()
        # One more call: what was kept is freed by now, and the producer's segments stay bounded.
        if rank == 0:
            packed_broadcast_producer(iter(model(seed=20)), rg.group, 0, IDENTITY, buffer_size_bytes=TARGET)
            out.append(len(rg.group._segments()))
        else:
            packed_broadcast_consumer(
                iter(metas(model(seed=20))), rg.group, 0, lambda b: None, buffer_size_bytes=TARGET
            )
    return out


def _in_shared_memory(group, t: torch.Tensor) -> bool:
    return any(0 <= t.data_ptr() - m.data_ptr() < m.numel() for m in group._maps.values())


def _planned_rounds(rank: int, port: int) -> list:
    """A session's planned rounds (PackedPlan: later rounds copy by precomputed offsets) over shm, consumers in the
    layerwise-reload pattern: a layer of tensors held across chunks, checked, dropped."""
    out = []
    plan = PackedPlan()
    with connect(_spec(rank, port)) as rg:
        for k in range(4):
            tensors = model(seed=30 + k)
            if rank == 0:
                packed_broadcast_producer(iter(tensors), rg.group, 0, IDENTITY, buffer_size_bytes=TARGET, plan=plan)
                continue
            got, held = [], []
            for item in packed_broadcast_consumer(
                iter(metas(tensors)), rg.group, 0, None, True, buffer_size_bytes=TARGET, plan=plan, num_buffers=1
            ):
                held.append(item)
                if len(held) == 9:
                    got.extend(digest(held))
                    held = []
            got.extend(digest(held))
            out.append(got)
    return out


def _any_source(rank: int, port: int) -> list:
    """Broadcasts from every rank, small (inside the message) and large (through staging), async and in order."""
    out = []
    with connect(_spec(rank, port, token=TOKEN)) as rg:
        for src in range(SCENARIO_RANKS):
            for n in (1, 1000, 200_000, 3 << 20):
                value = torch.arange(n, dtype=torch.int32) * (src + 1)
                t = value.clone() if rank == src else torch.zeros(n, dtype=torch.int32)
                rg.group.broadcast(t, src)
                out.append(bool(torch.equal(t, value)))
        # Several from the producer in flight at once, each received into a tensor of its own.
        sent = [torch.full((n,), i, dtype=torch.int64) for i, n in enumerate((5, 300_000, 70_000, 1 << 20, 9))]
        bufs = [s.clone() if rank == 0 else torch.zeros_like(s) for s in sent]
        works = [rg.group.broadcast_async(b, 0) for b in bufs]
        for w in works:
            w.wait()
        out.append([bool(torch.equal(a, b)) for a, b in zip(sent, bufs)])
    return out


def _stranger(rank: int, port: int) -> dict:
    """Before consumer 2 joins the producer's shared memory, a stranger on the host (another token) connects to the
    producer's socket, claims rank 2, and must get no segment; the run then goes on."""
    result: dict = {}
    if rank == 2:
        original = shm_transport.connect_producer

        def late_connect(name, auth, *args, **kwargs):
            result["stranger"] = _try_to_join(name, claim=2)
            return original(name, auth, *args, **kwargs)

        shm_transport.connect_producer = late_connect
    try:
        with connect(_spec(rank, port, token=TOKEN)) as rg:
            tensors = model()
            if rank == 0:
                packed_broadcast_producer(iter(tensors), rg.group, 0, IDENTITY, buffer_size_bytes=TARGET)
            else:
                result["data"] = digest(
                    packed_broadcast_consumer(iter(metas(tensors)), rg.group, 0, None, True, buffer_size_bytes=TARGET)
                )
            result["dev_shm"] = sorted(os.listdir("/dev/shm"))
    finally:
        if rank == 2:
            shm_transport.connect_producer = original
    return result


def _try_to_join(name: str, claim: int) -> dict:
    """A stranger's attempt: connect to the abstract socket (its name is visible in /proc/net/unix), answer the
    challenge with a guessed signature, and see whether a descriptor ever comes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect("\0" + name)
    link = Link(sock, 0)
    deadline = time.monotonic() + 10
    challenge = link.recv_wait(deadline)
    link.send(JOIN, payload=json.dumps({"rank": claim, "cuda": False, "mac": "00" * 32}).encode(), deadline=deadline)
    fds, kinds = [], []
    try:
        while (msg := link.recv_wait(deadline)) is not None:
            kinds.append(msg.kind)
            fds.extend(msg.fds)
    except ConnectionError:
        closed = True
    else:
        closed = False
    link.close()
    return {
        "challenged": challenge is not None and challenge.kind == CHALLENGE,
        "fds": fds,
        "kinds": kinds,
        "closed": closed,
    }


SCENARIOS = {
    "round_trips": _round_trips,
    "held_across_calls": _held_across_calls,
    "planned_rounds": _planned_rounds,
    "any_source": _any_source,
    "stranger": _stranger,
}
"""Played once on SCENARIO_RANKS ranks by the ``played`` fixture (conftest.py)."""


def test_every_packing_mode_and_dtype_round_trips_and_kept_views_keep_their_values(played):
    expected = digest(model())
    for rank in (1, 2):
        results = played[rank]["round_trips"]
        assert not isinstance(results, Exception), results
        assert len(results) == len(ROUND_TRIPS)
        for case, got in zip(ROUND_TRIPS, results):
            assert got == expected, f"rank {rank}, case {case}"


def test_tensors_kept_from_one_call_survive_the_next_calls_and_the_ring_stays_bounded(played):
    for rank in (1, 2):
        results = played[rank]["held_across_calls"]
        assert not isinstance(results, Exception), results
        assert results[0] is True, "the consumer copied instead of handing out views of shared memory"
        for call in range(4):
            assert results[1 + call] == digest(model(seed=10 + call)), (rank, call)
        assert results[5] == digest(model(seed=10)), "the tensors kept from call 1 changed"
    segments = played[0]["held_across_calls"][-1]
    # The ring (2 slots), spares and staging: bounded, however many segments the kept views retired.
    assert segments <= 2 + shm_transport.SPARE_SEGMENTS + shm_transport.STAGING_SEGMENTS, segments


def test_planned_rounds_and_the_layerwise_pattern(played):
    for rank in (1, 2):
        results = played[rank]["planned_rounds"]
        assert not isinstance(results, Exception), results
        assert results == [digest(model(seed=30 + k)) for k in range(4)]


def test_broadcasts_from_every_rank_small_and_large(played):
    for rank in range(SCENARIO_RANKS):
        results = played[rank]["any_source"]
        assert not isinstance(results, Exception), results
        assert all(results[:-1]) and all(results[-1]), (rank, results)


def test_a_stranger_without_the_token_gets_no_segment(played):
    before = played[0]["stranger"]
    assert not isinstance(before, Exception), before
    attempt = played[2]["stranger"]["stranger"]
    assert attempt["challenged"]
    assert attempt["fds"] == [] and attempt["kinds"] == [] and attempt["closed"], attempt
    for rank in (1, 2):
        assert played[rank]["stranger"]["data"] == digest(model())
    # Nothing of the run is in /dev/shm: its segments are memory files without names.
    assert not [n for n in played[0]["stranger"]["dev_shm"] if "refit" in n]


def test_host_identity_is_stable_and_names_the_network_namespace():
    assert host_identity() == host_identity()
    assert len(host_identity()) == 32


def test_a_strided_receive_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        shm_transport._group_bytes(torch.zeros(4, 4).t(), torch.device("cpu"), writable=True)


def test_a_tensor_on_another_device_than_the_groups_is_refused():
    with pytest.raises(ValueError, match="moves tensors on cuda, and this one is on cpu"):
        shm_transport._group_bytes(torch.zeros(4), torch.device("cuda"), writable=False)
