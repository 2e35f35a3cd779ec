"""Ray: actors a user already has become a refit group (:class:`~refit_app.integrations.ray.group.RayRefitGroup`).

The framework owns placement and the actors; this package takes their handles. The producer's actor names its
node's address and a free port there (:func:`~refit_app.integrations.ray.member.node_address`), every actor joins a
:func:`refit_app.transport.groups.connect` group (the token, the rendezvous and the deadlines of every other role)
and holds a session, and each refit is one ``send`` on the trainer and one ``receive`` on each engine, launched
together and awaited with a deadline. What runs inside an actor is in :mod:`~refit_app.integrations.ray.member`,
sent there through Ray's ``__ray_call__``, so the actor classes need no refit_app code of their own; what waits on
the driver is in :mod:`~refit_app.integrations.ray.calls`, and how it asks back an actor Ray restarts (for this
package's elastic groups and for ``role=ray`` alike) in :mod:`~refit_app.integrations.ray.restarts`.

Ray itself is imported by these modules (not by :mod:`~refit_app.integrations.ray.defaults`, which the
application's config reads), never by the rest of refit_app: install it with ``pip install 'refit_app[ray]'``.
"""

from typing import Any

_EXPORTS = {
    "RayRefitGroup": "refit_app.integrations.ray.group",
    "CallOutcome": "refit_app.integrations.ray.calls",
    "RayCallError": "refit_app.integrations.ray.calls",
    "wait_calls": "refit_app.integrations.ray.calls",
    "node_address": "refit_app.integrations.ray.member",
    "session": "refit_app.integrations.ray.member",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy: the application's config reads refit_app.integrations.ray.defaults, which must not import Ray.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
