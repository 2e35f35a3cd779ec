"""Point-to-point sends and receives over a ``torch.distributed`` process group, as a sharded refit's plan moves its
regions (:class:`refit_app.core.reshard.transfer.PairGroup`). Gloo runs them on CPU; every wait is bounded by the
process group's timeout (``group.timeout_s``). A send or receive that gloo refuses as it is posted (the peer's
connection already closed) fails when it is waited for, as one that fails later does: the caller names the lost
peer in one place (:func:`refit_app.core.reshard.transfer.wait_for`)."""

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
        try:
            return self._pg.send([tensor], dst, 0)
        except RuntimeError as e:
            return FailedWork(e)

    def irecv(self, tensor: torch.Tensor, src: int) -> Any:
        try:
            return self._pg.recv([tensor], src, 0)
        except RuntimeError as e:
            return FailedWork(e)


class FailedWork:
    """A send or receive that failed as it was posted; :meth:`wait` raises its error."""

    def __init__(self, error: RuntimeError) -> None:
        self.error = error

    def wait(self) -> None:
        raise self.error
