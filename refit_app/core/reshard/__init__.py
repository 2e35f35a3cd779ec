"""Sharded refits, one room in the core: K producer ranks that each hold only their shards send each of M consumer
ranks exactly the regions it needs, no tensor assembled on the way. Read in this order:

- :mod:`~refit_app.core.reshard.plan`: layouts (DTensor-style meshes and placements; the boxes consumers need) and
  the plan made from them, a pure function every rank computes alike, with its digest and the first difference
  between two ranks' layouts.
- :mod:`~refit_app.core.reshard.transfer`: the plan's bytes, packed per (source, destination) pair into rotating
  buffers over a point-to-point group, relayed along replica chains.
- :mod:`~refit_app.core.reshard.keyed_sum`: a check of the result that trusts neither: sums over each rank's part
  of a box that add up to the sum over the box, so producers and a consumer compare without a whole tensor.
"""
