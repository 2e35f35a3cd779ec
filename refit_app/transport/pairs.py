"""Point-to-point sends and receives over a ``torch.distributed`` process group, as a sharded refit's plan moves its
regions (:class:`refit_app.core.reshard.transfer.PairGroup`). Gloo runs them on CPU; every wait is bounded by the
process group's timeout (``group.timeout_s``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class TorchPairs:
    """Rank ``rank`` of process group ``pg`` (the default group when None), as a :class:`PairGroup`."""

    def __init__(self, rank: int, pg: Any = None) -> None:
        self.rank = rank
        self._pg = pg

    def isend(self, tensor: torch.Tensor, dst: int) -> Any:
        return dist.isend(tensor, dst, group=self._pg)

    def irecv(self, tensor: torch.Tensor, src: int) -> Any:
        return dist.irecv(tensor, src, group=self._pg)
