"""Bit-for-bit verification of a round: every received tensor's checksum against the one the producer sent, and
every manifest tensor arrived exactly once with its declared shape and dtype."""

from __future__ import annotations

import logging
from collections import Counter

import torch

from refit_app.common.errors import VerificationError, some_of
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import host_bytes
from refit_app.protocol.checksum import checksum_function

logger = logging.getLogger(__name__)


def _names(names: list[str]) -> str:
    return some_of([repr(n) for n in names])


class _Arrivals:
    """Which manifest tensors arrived, how often, and whether each matched its declared shape and dtype."""

    def __init__(self, tensors: list[TensorMeta]):
        self.index = {m.name: i for i, m in enumerate(tensors)}
        self.tensors = tensors
        self.counts: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.mismatched: list[str] = []

    def record(self, name: str, t: torch.Tensor) -> int | None:
        """The tensor's manifest position, or None when it is not in the manifest."""
        i = self.index.get(name)
        if i is None:
            self.unexpected.append(name)
            return None
        self.counts[name] += 1
        meta = self.tensors[i]
        if tuple(t.shape) != meta.shape or t.dtype != meta.dtype:
            self.mismatched.append(f"{name} ({t.dtype} {list(t.shape)}, expected {meta.dtype} {list(meta.shape)})")
        return i

    def problems(self) -> list[str]:
        problems = []
        missing = [m.name for m in self.tensors if self.counts[m.name] == 0]
        repeated = [n for n, c in self.counts.items() if c > 1]
        if missing:
            problems.append(f"{len(missing)} tensor(s) never arrived: {_names(missing)}")
        if repeated:
            problems.append(f"{len(repeated)} tensor(s) arrived more than once: {_names(repeated)}")
        if self.unexpected:
            problems.append(f"{len(self.unexpected)} tensor(s) not in the manifest: {_names(self.unexpected)}")
        if self.mismatched:
            problems.append(
                f"{len(self.mismatched)} tensor(s) with the wrong shape or dtype: {_names(self.mismatched)}"
            )
        return problems


class Verifier:
    """Checks one manifest's tensors, round after round: each is checksummed as it arrives (the views die after
    ``consume``), so verification needs no second pass and no copy of the model.

    ``algorithm``: the producer's (``Manifest.checksum_algorithm``); HandshakeError when this host lacks it."""

    def __init__(self, tensors: list[TensorMeta], algorithm: str) -> None:
        self._tensors = tensors
        self._checksum = checksum_function(algorithm)
        self._arrivals = _Arrivals(tensors)
        self._received: list[int | None] = [None] * len(tensors)

    def consume(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in batch:
            i = self._arrivals.record(name, t)
            if i is not None:
                self._received[i] = self._checksum(host_bytes(t))

    def verdict(self, checksums: list[int] | None) -> dict:
        """This round's result as metrics, or VerificationError naming what differs; then ready for the next
        round."""
        tensors = self._tensors
        arrivals, received = self._arrivals, self._received
        self._arrivals = _Arrivals(tensors)
        self._received = [None] * len(tensors)
        if checksums is None:
            raise VerificationError("cannot verify: the producer sent no checksums")
        if len(checksums) != len(tensors):
            raise VerificationError(
                f"cannot verify: the producer sent {len(checksums)} checksums for a manifest of {len(tensors)} tensors"
            )
        problems = arrivals.problems()
        differ = [m.name for m, got, want in zip(tensors, received, checksums) if got is not None and got != want]
        if differ:
            problems.insert(
                0, f"{len(differ)} of {len(tensors)} tensor(s) differ from what the producer sent: {_names(differ)}"
            )
        if problems:
            raise VerificationError("verification failed: " + "; ".join(problems))
        logger.debug("verified %d tensors bit for bit", len(tensors))
        return {"verified": True, "verified_tensors": len(tensors)}
