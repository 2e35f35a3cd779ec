"""Refit sessions: many refits over one group, as a trainer and an engine do every training step.

A :class:`ProducerSession` sends a model's tensors once per round with :meth:`~ProducerSession.send`; each
:class:`ConsumerSession` takes them with :meth:`~ConsumerSession.receive`, as callbacks or as a lazy iterator. The
manifest (names, shapes, dtypes, settings, a model's config) goes over the group in the first round only; later
rounds carry data (and checksums where a consumer verifies) alone, until the tensor list changes: then both sides
see it in the round header, the producer sends a fresh manifest and every consumer accepts it (or refuses, and
every rank stops) before any tensor moves. With ``delta`` on, a round after the first can carry only the elements
that changed (:mod:`refit_app.protocol.delta.send`).

Every round, over the group::

    producer                                       consumers
    (delta on) which round each consumer holds <-- report held round (0: nothing it can vouch for)
    header [magic, round, flags, extra, base] ---> (END: the session is over; receive() returns None)
    (MANIFEST) manifest, gather "handshake" <----> accept: settings agree, on_manifest(manifest), ack
    packed broadcast of the data, or (DELTA) ---> unpack, consume(batch) ... / apply each record
    the delta stream against round ``base``
    (manifest.checksums) checksum trailer -------> verify (every tensor in full, also in a delta round)
    (extra bytes) extra payload (a model probe) -> on_round_end(round) (a model check, say)
    gather "done" <------------------------------> report "done" (or this round's error, naming the round)

At the start, the producer says whether it may send deltas and each consumer whether it verifies and how long a
probe it wants, so the producer computes checksums and probes only for a consumer that uses them. A failure on any
rank in round k ends every rank within the group's deadline, with that rank's reason and the round.

A consumer can also :meth:`~ConsumerSession.stage` a round: receive and verify it beside its tensors, which keep
serving the round before, then :meth:`~refit_app.protocol.staging.StagedRound.apply` it in a short pause
(:mod:`refit_app.protocol.staging`).

Code that drives rounds types its session as :class:`ProducerSessionLike` or :class:`ConsumerSessionLike`: the plain
sessions here and the elastic ones (:mod:`refit_app.protocol.elastic`) both satisfy them.
"""

from refit_app.protocol.consumer_session import ConsumerSession
from refit_app.protocol.delta.types import TensorDelta
from refit_app.protocol.producer_session import ProducerSession
from refit_app.protocol.rounds import Round
from refit_app.protocol.session_api import ConsumerSessionLike, ProducerSessionLike, SessionLike
from refit_app.protocol.staging import StagedRound

__all__ = [
    "ConsumerSession",
    "ConsumerSessionLike",
    "ProducerSession",
    "ProducerSessionLike",
    "Round",
    "SessionLike",
    "StagedRound",
    "TensorDelta",
]
