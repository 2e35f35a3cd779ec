"""A real model on both sides of a refit: a transformers causal LM as the trainer (source) and as the engine (sink).

``ModelSource`` builds the model from a Hugging Face directory's ``config.json``, loads the checkpoint's weights,
sends what a trainer holds (parameters and persistent buffers, tied weights once, under the checkpoint's names)
and, between rounds, takes real AdamW steps. ``ModelSink`` builds the same architecture from the config text the
producer sends (no files on the consumer host) and copies every received tensor into its parameters as it
arrives, as an engine's ``load_weights`` does. After each round both run the same probe, and the consumer
compares logits and greedy tokens::

    producer (ModelSource)                          consumer (ModelSink)
    model_config(), manifest_tensors() --------->  begin(manifest, config_json)     (first round, or on change)
    tensors()  ------ packed broadcast ---------->  consume(batch) ...               (copy_ into parameters)
                                                    finish_round()                   (every tensor arrived)
    probe(probe_tokens) --- encode_probe() ------>  check(decode_probe(...), probe_tokens)
    advance(round_index)                            (next round: consume ... again, no begin)

transformers is imported inside the functions that need it (:mod:`~refit_app.models.hf.spec`): importing this package
costs nothing, and a run that uses neither ``source=model`` nor ``sink=model`` never loads transformers.

The modules: :mod:`~refit_app.models.hf.spec` (what is built from a config, and building it),
:mod:`~refit_app.models.hf.weights` (a model's weights by name, tied aliases resolved),
:mod:`~refit_app.models.hf.source` (the trainer), :mod:`~refit_app.models.hf.sink` (the engine) and
:mod:`~refit_app.models.hf.tiny` (a checkpoint for tests and examples).
"""

from refit_app.checkpoint.layout import CONFIG_FILE_NAME
from refit_app.models.hf.sink import ModelSink
from refit_app.models.hf.source import TRAIN_SEQ_LEN, ModelSource
from refit_app.models.hf.spec import TRANSFORMERS_REQUIREMENT, main_dtype, model_spec
from refit_app.models.hf.tiny import write_tiny_llama

__all__ = [
    "CONFIG_FILE_NAME",
    "TRAIN_SEQ_LEN",
    "TRANSFORMERS_REQUIREMENT",
    "ModelSink",
    "ModelSource",
    "main_dtype",
    "model_spec",
    "write_tiny_llama",
]
