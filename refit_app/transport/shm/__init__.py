"""Shared memory (``group.backend=shm``), one room: ranks on one host move broadcasts through shared memory, not a
socket.

The producer packs each chunk straight into a ring of shared segments (:meth:`ShmProducerGroup.slot_buffer`, which
the core's :class:`~refit_app.core.buffers.Slot` asks for its buffer), and a broadcast only tells every consumer,
over its Unix socket (:mod:`refit_app.transport.shm.link`), where the bytes lie. One copy in, however many
consumers, and no per-consumer send of the data. A consumer either hands views of the segment out
(:meth:`ShmConsumerGroup.receive_view_async`, which the packed broadcast's receiver uses: no copy at all) or copies
the bytes into a tensor of its own (:meth:`broadcast_async`, for everything else: headers, manifests, delta
streams, a mirror). Every other broadcast (a tensor that is not in the ring) is copied into a staging segment once,
or for up to 64 KiB sent inside the message.

Buffer lifetime, across processes: the producer writes a segment again only once every consumer has answered its
last publication, ``RELEASE`` (done with it: nothing handed out from it is referenced, see
:func:`~refit_app.core.buffers.is_shared`) or ``KEEP`` (views of it are still held: the segment leaves the ring,
which takes a spare or a fresh one, and comes back as a spare once the consumer says ``FREE``). A consumer releases
what it no longer holds at every wait and at every step of the receiver; it answers ``KEEP`` only when the
producer asked (``NEED``) and it is about to block: a consumer that keeps tensors costs memory, never a hang and
never a changed value.

Faults: every wait has the group's deadline (``group.timeout_s``); a peer that dies closes its socket, which the
other side sees at once. A lost consumer fails the producer in one place (:meth:`ShmProducerGroup._lost`), and
the producer's closing sockets then fail every other consumer, each preferring the reason a failing rank published.

Where to start reading: :mod:`~refit_app.transport.shm.producer` (the producer's group and :func:`make_shm_group`,
which connects either side), then :mod:`~refit_app.transport.shm.consumer` (a consumer's group), the messages and the
handshake on the socket in :mod:`~refit_app.transport.shm.link`, the memory itself in
:mod:`~refit_app.transport.shm.segments` (host memory files, the host identity, the memory check) and
:mod:`~refit_app.transport.shm.cuda` (device memory shared by CUDA IPC handle).
:mod:`refit_app.transport.backends` picks this transport; code outside the room imports only what this module
exports.
"""

from refit_app.transport.shm.consumer import CudaShmConsumerGroup, ShmConsumerGroup
from refit_app.transport.shm.producer import ShmProducerGroup, make_shm_group
from refit_app.transport.shm.segments import SHM_MEMORY_FIX, host_identity, shm_memory_problem, shm_supported

__all__ = [
    "SHM_MEMORY_FIX",
    "CudaShmConsumerGroup",
    "ShmConsumerGroup",
    "ShmProducerGroup",
    "host_identity",
    "make_shm_group",
    "shm_memory_problem",
    "shm_supported",
]
