"""Bring your own group: a ``torch.distributed`` process group that a trainer already has, as a refit group.

:func:`from_process_group` wraps the default group or a subgroup (gloo or NCCL) so that the packed broadcast, the
handshake and :mod:`refit_app.protocol.session` run over it, with the asynchronous broadcast that lets gloo overlap
packing
and sending. Phase reports and errors travel through a store (by default the default group's), so a failing rank's
reason still reaches every other rank. Ranks are the group's own: rank 0 of the group is the producer.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from refit_app.common.errors import ConfigError, PeerError, some_of
from refit_app.transport.backends import TorchBroadcastGroup
from refit_app.transport.chain import ChainBroadcastGroup
from refit_app.transport.control import Control, DeadlineStore
from refit_app.transport.groups import RefitGroup
from refit_app.transport.spec import DEFAULT_TIMEOUT_S, DEFAULT_TOPOLOGY, PRODUCER_RANK, TOPOLOGIES, GroupSpec

_WRAPS = itertools.count()
"""Each wrap gets its own key prefix in the shared store; every rank wraps in the same order, so they agree."""


def _default_store() -> dist.Store:
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError) as e:
        raise ValueError(
            "from_process_group needs a store for its control channel: pass store= (the TCPStore or FileStore "
            "your ranks share), or initialise the default group first"
        ) from e


def from_process_group(
    pg: Any = None,
    *,
    store: dist.Store | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    device: torch.device | str | None = None,
    topology: str = DEFAULT_TOPOLOGY,
) -> RefitGroup:
    """A :class:`~refit_app.transport.groups.RefitGroup` over ``pg`` (None: the default group) for the library and
    sessions.

    ``store``: the store every rank of ``pg`` shares, for phase reports and errors (None: the default group's).
    ``timeout_s``: the deadline of every phase gather; a collective's deadline is ``pg``'s own timeout.
    ``device``: where broadcast tensors live (None: the current CUDA device for NCCL, else the CPU).
    ``topology``: ``"tree"`` (``pg``'s own broadcast) or ``"chain"`` (gloo only: each consumer receives from the
    rank before it and forwards to the rank after, over ``pg``'s point-to-point send and receive, as
    ``group.topology=chain`` does; do not run sends and receives of your own on ``pg`` meanwhile). Every rank must
    pass the same: the ranks compare it through the store, and a difference raises ConfigError on every rank.
    Closing the returned group leaves ``pg`` and ``store`` to their owner. Call this on every rank of ``pg``, in the
    same order as any other wraps.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology={topology!r} is invalid: choose one of {', '.join(TOPOLOGIES)}")
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised: call init_process_group first, or use connect()")
    pg = dist.group.WORLD if pg is None else pg
    rank, world_size = dist.get_rank(pg), dist.get_world_size(pg)
    if world_size < 2:
        raise ValueError(f"a refit needs a producer and at least one consumer; this group has {world_size} rank(s)")
    backend = str(dist.get_backend(pg)).lower()
    if topology == "chain" and backend != "gloo":
        raise ValueError(
            f"topology='chain' relays over gloo, and this process group's backend is {backend} (NCCL "
            "pipelines its own broadcast); use topology='tree'"
        )
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    shared = dist.PrefixStore(f"refit/pg/{next(_WRAPS)}", store if store is not None else _default_store())
    spec = GroupSpec(
        backend="auto",
        host="process-group",
        port=None,
        world_size=world_size,
        rank=rank,
        timeout_s=timeout_s,
        topology=topology,
    )
    shared.set_timeout(timedelta(seconds=timeout_s))
    control_store = shared if rank == PRODUCER_RANK else DeadlineStore(shared, timeout_s)
    control = Control(control_store, rank, world_size, timeout_s, address=f"the {backend} process group's store")
    _agree_on_topology(control_store, rank, world_size, topology, timeout_s)
    if topology == "chain":
        group: Any = ChainBroadcastGroup(pg, rank, world_size, control)
    else:
        group = TorchBroadcastGroup(pg, torch.device(device), control)
    return RefitGroup(spec, backend, group, control, owns_group=False)


def _agree_on_topology(store: Any, rank: int, world_size: int, topology: str, timeout_s: float) -> None:
    """Every rank publishes its topology and reads everyone's, so all ranks see a difference alike. A rank that
    broadcasts along a tree while another relays along a chain would wait for messages that never come."""
    store.set(f"topology/{rank}", topology)
    seen = {}
    for r in range(world_size):
        try:
            seen[r] = store.get(f"topology/{r}").decode()
        except dist.DistError as e:
            raise PeerError(
                f"rank {r} did not wrap the process group within {timeout_s:g}s (from_process_group "
                "runs on every rank of the group)"
            ) from e
    if len(set(seen.values())) > 1:
        listed = some_of([f"rank {r} {t!r}" for r, t in sorted(seen.items())])
        raise ConfigError(
            f"from_process_group's topology differs between ranks ({listed}); pass the same on every rank"
        )
