"""Every environment variable refit_app reads, named once. Torch-free, so the config can use the names."""

NUM_BUFFERS_ENV = "NRL_REFIT_NUM_BUFFERS"
"""Buffers in flight (the spec's ``get_num_buffers``; the config's ``refit.num_buffers`` default)."""
DEFAULT_NUM_BUFFERS = 2
BUFFER_MEMORY_RATIO_ENV = "NRL_REFIT_BUFFER_MEMORY_RATIO"
"""Fraction of device (or host) memory for one packed buffer (the spec's ``get_target_packed_tensor_size``)."""
DEFAULT_BUFFER_MEMORY_RATIO = 0.02
