"""Defaults of the built-in sources and sinks, torch-free: the classes take them as keyword defaults and the
config schema (:mod:`refit_app.app.schema`) names them, so that a library user and ``python -m refit_app`` get
the same."""

FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")
"""Element types a synthetic model is generated in, or a model source is cast to (``source.dtype``)."""
DEFAULT_PRESET = "tiny"
DEFAULT_SYNTHETIC_DTYPE = "bfloat16"
SYNTHETIC_UPDATES = ("shuffle", "training")
"""How a synthetic model changes between rounds (``source.update``): shuffle, every element to new random values
(free); training, seeded Adam-sized steps on fp32 masters sent cast to ``source.dtype`` (~1% of bf16 elements)."""
DEFAULT_SYNTHETIC_UPDATE = "shuffle"
DEFAULT_SYNTHETIC_LR = 1e-6
"""Step size of ``source.update=training`` (``source.lr``): an RL learning rate, ~1% of bf16 elements per round."""
DEFAULT_SEED = 0
"""Seed of a synthetic model's values and of a model source's training batches."""
DEFAULT_PROBE_TOKENS = 16
"""Positions of the model probe compared after every round (``sink.probe_tokens``; 0: no check)."""
DEFAULT_TRAIN_STEPS = 1
DEFAULT_BATCH_TOKENS = 256
DEFAULT_LR = 1e-3
