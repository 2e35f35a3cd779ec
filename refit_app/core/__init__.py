"""The packed-broadcast core: pure planning and byte layout, buffer lifetimes, and the two sides' loops.

Read in this order; each module imports only the ones above it (and nothing else of refit_app but
:mod:`refit_app.common`):

- :mod:`~refit_app.core.chunks`: which tensors share a chunk and which chunks travel (pure, no torch).
- :mod:`~refit_app.core.wire`: the byte layout of a chunk; pack one tensor in, view one back out.
- :mod:`~refit_app.core.group`: the ``BroadcastGroup`` protocol, the one thing asked of a communicator.
- :mod:`~refit_app.core.buffers`: slots, streams and the host buffer pool; when a buffer may be reused.
- :mod:`~refit_app.core.producer` / :mod:`~refit_app.core.consumer`: each side's chunk-by-chunk loop.
- :mod:`~refit_app.core.plan`: ``PackedPlan``, a plan kept across rounds, and its fast paths.

The spec's API (``packed_broadcast_producer``, ``packed_broadcast_consumer`` and the environment helpers) is
:mod:`refit_app.packed_tensor`, a short orchestrator over these modules.
"""
