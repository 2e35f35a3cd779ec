"""Issue 31: a consumer vouches for its delta base by the bytes its tensors hold, not by torch's version counter.

A write the version counter does not see (``t.data.copy_``, vLLM's ``default_weight_loader`` idiom, or through
``t.numpy()``) used to leave the consumer claiming the round it held, so the next delta was applied onto other
bytes: wrong weights without verification, a failed run with it. Each scenario runs two real gloo ranks for five
rounds, with 1% of the elements changed each round, and writes the consumer's tensors (targets, or a view of its
mirror) before round 3: the consumer must end every round with exactly the producer's bytes, round 3 must be dense
and round 4 a delta round again; a write that leaves the bytes as they were keeps the deltas going.
"""

from __future__ import annotations

import functools

import torch
from mp_utils import gloo_spec, play_scenarios

from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.groups import connect

TIMEOUT_S = 30.0
BUFFER = 4096
ROUNDS = 5
TAMPER_BEFORE = 3


def _model(k: int) -> dict[str, torch.Tensor]:
    """Round ``k``'s weights: seeded, then each later round flips one bit in 1% of each tensor's elements."""
    g = torch.Generator().manual_seed(0)
    model = {
        "w": torch.randn(64, 48, generator=g).to(torch.bfloat16),  # first: aligned at the mirror's start, a view
        "b": torch.randn(97, generator=g),
        "i8": torch.randint(-128, 127, (513,), generator=g, dtype=torch.int8),
    }
    for r in range(2, k + 1):
        gr = torch.Generator().manual_seed(r)
        for t in model.values():
            rows = t.view(-1).view(torch.uint8).view(t.numel(), t.element_size())
            rows[torch.randperm(t.numel(), generator=gr)[: max(1, t.numel() // 100)], 0] ^= 0x10
    return model


def _bytes(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}


def _tamper(how: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write the consumer's tensors behind the session's back, as an engine might between rounds."""
    if how == "data_copy":  # vLLM's default_weight_loader: param.data.copy_(loaded): no version bump
        tensors["w"].data.copy_(torch.full_like(tensors["w"], 0.5))
    elif how == "numpy":  # through numpy: no version bump either
        tensors["b"].numpy()[:7] = 3.0
    elif how == "same_bytes":  # a reload of the very bytes held: still a valid base
        tensors["w"].data.copy_(tensors["w"].clone())
    elif how == "add_":  # seen by the version counter
        tensors["w"].add_(1.0)
    else:
        raise AssertionError(how)


def _scenario(rank: int, port: int, *, how: str, verify: bool, mirror: bool = False, check_base: bool = True):
    with connect(gloo_spec(rank, 2, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            with ProducerSession(rg, buffer_size_bytes=BUFFER, delta="on") as session:
                return [session.send(list(_model(k).items())).base_round for k in range(1, ROUNDS + 1)]
        session = ConsumerSession(rg, verify=verify, mirror=mirror, check_base=check_base)
        targets = None if mirror else {n: torch.zeros_like(t) for n, t in _model(1).items()}
        seen: dict[str, torch.Tensor] = {}
        out = []
        while True:
            if session.rounds == TAMPER_BEFORE - 1:
                # With a mirror: the views the last round handed out (its memory; "w" is a view, not a copy).
                _tamper(how, seen if mirror else targets)
            seen.clear()
            r = session.receive(seen.update, targets=targets)
            if r is None:
                return out
            held = dict(seen) if mirror else targets
            out.append((r.round, r.base_round, r.plain, r.verified, _bytes(held)))


SCENARIOS = {
    "data_copy": functools.partial(_scenario, how="data_copy", verify=False),
    "data_copy_verified": functools.partial(_scenario, how="data_copy", verify=True),
    "numpy": functools.partial(_scenario, how="numpy", verify=False),
    "numpy_verified": functools.partial(_scenario, how="numpy", verify=True),
    "mirror_data_copy": functools.partial(_scenario, how="data_copy", verify=False, mirror=True),
    "same_bytes": functools.partial(_scenario, how="same_bytes", verify=False),
    "opt_out_still_sees_add_": functools.partial(_scenario, how="add_", verify=False, check_base=False),
}
DELTA_AGAIN = [0, 1, 0, 3, 4]
"""Round 3 dense (the base is not vouched for), round 4 a delta against it."""


def test_a_base_written_behind_the_version_counter_gets_a_dense_round_never_a_wrong_delta():
    producer, consumer = play_scenarios(SCENARIOS, 2, timeout=240)
    problems = []
    for name in SCENARIOS:
        sent, got = producer[name], consumer[name]
        if isinstance(sent, Exception) or isinstance(got, Exception):
            problems.append(f"{name}: producer {sent!r}, consumer {got!r}")
            continue
        want = [0, 1, 2, 3, 4] if name == "same_bytes" else DELTA_AGAIN
        if sent != want:
            problems.append(f"{name}: the producer's bases {sent}, expected {want}")
        for (k, base, plain, verified, held), sent_base in zip(got, sent):
            if base != sent_base or plain:
                problems.append(f"{name}: round {k} base {base} (plain {plain}), the producer's {sent_base}")
            if held != _bytes(_model(k)):
                problems.append(f"{name}: round {k} left other bytes than the producer's")
            if name.endswith("verified") and verified is not True:
                problems.append(f"{name}: round {k} not verified")
    assert not problems, "\n".join(problems)
