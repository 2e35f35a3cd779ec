"""``python -m refit_app.bench``: the packed refit against the transport's own limit and one broadcast per
tensor, on this machine's ranks or one rank per host (``--rank``)."""
