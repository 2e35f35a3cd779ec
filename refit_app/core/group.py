"""The seam between the packed broadcast and a communicator: the one operation it needs, as a Protocol.

Gloo and NCCL groups over ``torch.distributed`` and vLLM's ``PyNcclCommunicator`` all fit; the core never imports
a backend.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class BroadcastGroup(Protocol):
    """The one operation the packed broadcast needs from a communicator.

    vLLM's ``PyNcclCommunicator`` and a thin wrapper over ``torch.distributed.broadcast`` both fit. A group may also
    offer ``broadcast_async(tensor, src)`` returning a handle with ``wait()`` (used for overlap on CPU), and a
    ``device`` attribute naming where its tensors must live.
    """

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...


class Work(Protocol):
    """The handle ``broadcast_async`` returns: ``wait()`` returns once the broadcast has finished (on CUDA, once
    the current stream is ordered after it)."""

    def wait(self) -> Any: ...
