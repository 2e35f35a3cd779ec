"""What the benchmark runs: a :class:`Case` (one configuration, every mode of it on one group and one model), the
defaults its flags start from, and the model as both sides of a case see it."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from refit_app.core.meta import TensorMeta
from refit_app.models.sources import SyntheticSource
from refit_app.packed_tensor import chunk_ids

MODES = ("refit", "session", "limit", "per_tensor")
POSTS = ("none", "cast")
"""``post_iter_func`` on the producer: identity, or an fp32 model cast to bf16 as it is sent (real work per tensor)."""

DEFAULT_PRESETS = ("llama-1b", "lora")
DEFAULT_SIZES = {"llama-1b": ("1GB",), "lora": ("natural", "1GiB")}
"""Per preset without ``--size``: lora at its natural size (2240 matrices, 93 MB) and at 1 GiB (25,844 of them)."""
DEFAULT_REPS = 5
DEFAULT_FLAT_REFITS = 20
DEFAULT_DELTA_ROUNDS = 50
"""Delta rounds of the memory flatness check that follows the dense-against-delta timing (``--delta-shares``)."""
SEED = 0


@dataclass(frozen=True)
class Case:
    """One benchmarked configuration; every mode of it runs on the same group and the same model."""

    preset: str
    size_bytes: int | None
    """Bytes on the wire (the model after ``post``); None for the preset's natural size."""
    buffer_size_bytes: int
    num_buffers: int
    consumers: int
    post: str
    reps: int
    modes: tuple[str, ...]
    flat_refits: int
    """Consecutive refits after the timed ones, each with its own peak-memory measurement (0: none)."""
    delta_shares: tuple[float, ...] = ()
    """Shares of elements changed between rounds at which dense, delta ``on`` and ``auto`` session rounds are timed
    against each other (:mod:`.delta`); empty: no such comparison."""
    delta_rounds: int = 0
    """Delta rounds of the memory flatness check after that comparison (0: none)."""

    @classmethod
    def from_json(cls, fields: dict) -> Case:
        """A case from its ``asdict`` form after a JSON round trip (lists back to tuples, so it stays hashable)."""
        return cls(**{**fields, "modes": tuple(fields["modes"]), "delta_shares": tuple(fields["delta_shares"])})


def make_source(case: Case) -> SyntheticSource:
    """The producer's model before ``post``; consumers build it too, for its manifest."""
    # A cast run starts from fp32 twice the wire size, so both posts move the same architecture and bytes.
    if case.post == "cast":
        size = None if case.size_bytes is None else 2 * case.size_bytes
        return SyntheticSource(case.preset, size, SEED, torch.float32)
    return SyntheticSource(case.preset, case.size_bytes, SEED, torch.bfloat16)


def post_func(post: str) -> Callable[[tuple[str, torch.Tensor]], torch.Tensor]:
    """The producer's ``post_iter_func`` for ``post`` (one of :data:`POSTS`)."""
    if post == "cast":
        return lambda item: item[1].to(torch.bfloat16)
    return lambda item: item[1]


def wire_metas(source: SyntheticSource, post: str) -> list[TensorMeta]:
    """The tensors as they travel: the source's, in bf16 after a cast."""
    metas = source.manifest_tensors()
    if post == "cast":
        return [m._replace(dtype=torch.bfloat16) for m in metas]
    return metas


def chunks(metas: list[TensorMeta], case: Case) -> list[list[int]]:
    """Tensor indices of each chunk, exactly as the packed broadcast plans them."""
    ids = chunk_ids((m.nbytes for m in metas), case.buffer_size_bytes)
    return [[i for i, _ in members] for _, members in itertools.groupby(enumerate(ids), key=lambda p: p[1])]
