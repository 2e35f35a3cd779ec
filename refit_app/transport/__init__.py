"""Moving bytes between ranks: where and how a group forms (:mod:`~refit_app.transport.spec`), who may join
(:mod:`~refit_app.transport.auth`), the control records in the store (:mod:`~refit_app.transport.records`), the
rendezvous and its store, the control channel (phase reports, the first error), the collective backends behind the
core's ``BroadcastGroup`` seam, the chain relay, and a connected :class:`~refit_app.transport.groups.RefitGroup`
(built by :func:`~refit_app.transport.groups.connect`, or from a trainer's own process group by
:func:`~refit_app.transport.process_group.from_process_group`).

Rooms: :mod:`refit_app.transport.shm` (``group.backend=shm``, shared memory between ranks on one host: a package,
start at its ``__init__``) and :mod:`refit_app.transport.elastic` (the generations of an elastic session's group).
A backend that fits in a wrapper goes in :mod:`~refit_app.transport.backends`; one that needs several modules gets a
package here, as ``shm`` does, which ``backends`` picks by name.

Imports only :mod:`refit_app.common`, :mod:`refit_app.core` and :mod:`refit_app.packed_tensor`.
"""

from typing import Any

_EXPORTS = {
    "GroupSpec": "refit_app.transport.spec",
    "RefitGroup": "refit_app.transport.groups",
    "connect": "refit_app.transport.groups",
    "from_process_group": "refit_app.transport.process_group",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy: the settings are torch-free and the config imports them; the groups need torch.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
