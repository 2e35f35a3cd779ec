"""Delta rounds, one room on the protocol layer: a session sends only the elements that changed since the last round.

A producer session with ``delta="on"`` or ``"auto"`` keeps an :class:`~refit_app.core.delta.image.Image` of the bytes
it sent last (one host copy of the sent model). Before each round every consumer says which round its tensors hold
(:meth:`~refit_app.protocol.delta.receive.ConsumerDelta.held`): 0 when it holds nothing it can vouch for by its bytes
(a fresh consumer, tensors written since by any means, another set of tensors). The round is a delta round only when
the manifest is unchanged and every consumer holds the round the snapshot holds; it then names that round as its
base. Otherwise it is dense, and the producer packs each tensor into the snapshot as it sends it (the copy it would
make into a send buffer anyway).

A delta round is a stream of records (:mod:`refit_app.core.delta.codec`, :mod:`refit_app.core.delta.stream`): each
tensor is compared with its snapshot slice block by block, hashed in the same pass where a consumer verifies, and its
changes are written to the stream while the chunks before them are on the wire. A consumer applies each record as it
arrives into the tensors it holds: its own (``targets``), the session's copy (``mirror``), or, for an engine that
applies changes through its own loader, hands the change itself (:class:`~refit_app.protocol.delta.types.TensorDelta`)
to its callback. With verification on, it then hashes every tensor in full, changed or not, and compares with the
producer's checksums of the full tensors: what is verified is the reconstructed model, not the payload.

``auto`` chooses each round's kind from what the rounds before it measured: a delta round, a dense round that fills
the snapshot, or a plain dense round that leaves it alone (:mod:`refit_app.protocol.delta.auto`).

Where to start reading: :mod:`~refit_app.protocol.delta.types` (what both sides share: the round's figures, the
stream's chunk size, a tensor's changes), :mod:`~refit_app.protocol.delta.send` (the producer's snapshot, comparison
and stream), :mod:`~refit_app.protocol.delta.receive` (a consumer's held round, mirror and records applied),
:mod:`~refit_app.protocol.delta.auto` (``delta="auto"``'s choice of each round's kind). Below them, in the core,
:mod:`refit_app.core.delta` holds the byte-level pieces: the record format and its codec, the image a side keeps and
the byte stream the records travel in. The sessions (:mod:`refit_app.protocol.producer_session`,
:mod:`refit_app.protocol.consumer_session`) are the only users outside the room.
"""
