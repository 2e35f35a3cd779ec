"""Delta rounds' byte-level pieces, one room in the core: what changed in a tensor's bytes and how a round carries
it. Each module imports only the core modules outside this room and the ones above it in this list:

- :mod:`~refit_app.core.delta.codec`: the wire format of one record (its docstring states it), and finding,
  encoding, decoding and applying changed elements (in C where ``_delta_kernel.c`` was built, else numpy).
- :mod:`~refit_app.core.delta.image`: a model's bytes kept whole in one host buffer (the producer's snapshot, a
  consumer's mirror), and a dense round sent from or received into it.
- :mod:`~refit_app.core.delta.stream`: a byte stream over a group through rotating buffers, which a delta round's
  records travel in (its size is known only at its end, so no chunk plan fits it).

The sessions' side of delta rounds (which round is a delta, the snapshot's upkeep, ``delta="auto"``) is
:mod:`refit_app.protocol.delta`.
"""
