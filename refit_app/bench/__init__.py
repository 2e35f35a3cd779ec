"""Benchmark: the packed refit against the transport's own limit and against one broadcast per tensor.

``python -m refit_app.bench`` starts one producer and N consumers as spawned processes on this machine, joined in
one gloo group over loopback, and times four ways of moving the same synthetic model over that same group:

- ``refit``: one call of :func:`packed_broadcast_producer` / :func:`packed_broadcast_consumer`, the one-shot
  library path (the consumer drops each batch, like ``sink=discard``);
- ``session``: one steady-state round of :class:`~refit_app.protocol.session.ProducerSession` /
  :class:`~refit_app.protocol.session.ConsumerSession`, as ``python -m refit_app refit.rounds=N`` and an RL loop run
  them (the manifest went in an untimed first round; each timed round is the whole ``send()`` / ``receive()``:
  round header, data and the all-ranks "done");
- ``limit``: the same chunks, packed before the clock starts into buffers both sides hold already, all broadcast
  asynchronously back to back and then waited for. No packing strategy can beat it on the same group;
- ``per_tensor``: one synchronous broadcast per tensor into a freshly allocated tensor, as several RL frameworks do.

Modes alternate within a repetition (A B C A B C ...) so that machine noise hits all of them alike; one untimed
repetition warms every path first. Each list-valued flag is a sweep axis; every combination is one case. Results go
to ``<out>/bench.json`` (machine, backend, settings, per-rank times and memory), ``<out>/table.md`` and
``<out>/throughput.png`` (per case, each mode's throughput and the refit's fraction of the limit).

Across hosts: ``--rank R`` runs only rank R in this process, joining the producer at ``--host``/``--port`` (a
group of ``--world-size``, with ``REFIT_APP_TOKEN`` as on the application's ranks), so the limit is the one of the
link between real hosts. Rank 0's flags decide the cases; it prints and writes the results of every rank.

Memory: after the timed repetitions, ``--flat-refits`` consecutive refits (and as many session rounds) each
measure this rank's peak RSS above the RSS with the model alone, against ``num_buffers x max(target, largest
tensor)``.

Dense against delta (``--delta-shares 0.001 0.01 ...``): per case, one session pair per delta mode (``off``, ``on``,
``auto``) on the same group, consumers verifying every round (and with deltas patching a mirror); before each
repetition the producer's model (its own copy, as a trainer holds it) changes at the share, and each mode's round
is timed, the modes rotating within repetitions. Reported per share: each mode's round time and wire bytes per
round, dense/on (the speed-up) and auto/dense, in bench.json, ``table.md`` and ``delta.png``. Then
``--delta-rounds`` delta rounds of a fresh session measure each rank's RSS before and at the peak of every round:
what round 1 leaves held (one copy of the model) and whether it stays flat. With ``--delta-shares``, ``--modes`` and
``--flat-refits`` default to none, so such a run times only the comparison.

The modules, in import order: :mod:`.cases` (a case and its model), :mod:`.modes` (the four timed modes),
:mod:`.delta` (the changing model and the session pairs of the delta comparison), :mod:`.measure` (one rank's side
of a case), :mod:`.plot`, :mod:`.delta_report` and :mod:`.report` (summaries, bench.json, table.md, the plots),
:mod:`.spawned` (every rank on this machine) and :mod:`.ranks` (one rank of several hosts), :mod:`.cli` (flags and
``main``).
"""
