"""The packed-broadcast core: pure planning and byte layout, buffer lifetimes, and the two sides' loops.

Read in this order; each module imports only the ones above it (and nothing else of refit_app but
:mod:`refit_app.common`):

- :mod:`~refit_app.core.defaults`: the library's defaults and the spec's environment helpers (torch-free at import).
- :mod:`~refit_app.core.chunks`: which tensors share a chunk and which chunks travel (pure, no torch).
- :mod:`~refit_app.core.meta`: ``TensorMeta``, what both sides know of a tensor before its bytes arrive.
- :mod:`~refit_app.core.wire`: the byte layout of a chunk; pack one tensor in, view one back out.
- :mod:`~refit_app.core.group`: the ``BroadcastGroup`` protocol, the one thing asked of a communicator.
- :mod:`~refit_app.core.buffers`: slots, streams and the host buffer pool; when a buffer may be reused.
- :mod:`~refit_app.core.producer` / :mod:`~refit_app.core.consumer`: each side's chunk-by-chunk loop.
- :mod:`~refit_app.core.plan`: ``PackedPlan``, a plan kept across rounds, and its fast paths.

One room here holds a feature of its own: :mod:`refit_app.core.delta`, the byte-level pieces of delta rounds (the
record format and its codec, the image of a model each side keeps, the byte stream records travel in); its
``__init__`` gives its reading order. So does :mod:`refit_app.core.reshard`, sharded refits (K producer ranks with
their shards to M consumer ranks with theirs: the plan and its per-pair transfer). A new transfer mode's byte-level
pieces go in a room of their own beside them.

The spec's API (``packed_broadcast_producer``, ``packed_broadcast_consumer`` and the environment helpers) is
:mod:`refit_app.packed_tensor`, a short orchestrator over these modules.
"""
