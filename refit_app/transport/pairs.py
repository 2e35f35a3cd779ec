"""Point-to-point sends and receives over a ``torch.distributed`` process group, as a sharded refit's plan moves its
regions (:class:`refit_app.core.reshard.transfer.PairGroup`). Gloo runs them on CPU; every wait is bounded by the
process group's timeout (``group.timeout_s``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class TorchPairs:
    """Rank ``rank`` of process group ``pg`` (the default group when None), as a :class:`PairGroup`. Peers are ranks
    of ``pg`` (a subgroup's own numbering, as :func:`~refit_app.protocol.sharded.agree` numbers them), and ``pg``
    need not be registered with torch.distributed (the application's group,
    :meth:`refit_app.transport.backends.TorchBroadcastGroup.process_group`)."""

    def __init__(self, rank: int, pg: Any = None) -> None:
        self.rank = rank
        self._pg = dist.group.WORLD if pg is None else pg

    def isend(self, tensor: torch.Tensor, dst: int) -> Any:
        return self._pg.send([tensor], dst, 0)

    def irecv(self, tensor: torch.Tensor, src: int) -> Any:
        return self._pg.recv([tensor], src, 0)
