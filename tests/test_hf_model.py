"""A transformers model on both sides of a refit: ModelSource (the trainer) into ModelSink (the engine), in process.

Batches reach the sink the way the packed broadcast hands them over: views into one receive buffer that is
overwritten after every call, so a sink that kept a view instead of copying would end up with garbage.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conditions import needs_transformers
from mp_utils import STARTUP_LIMIT_S
from tensor_utils import deliver

from refit_app.checkpoint.layout import SINGLE_FILE_NAME
from refit_app.checkpoint.reader import Checkpoint
from refit_app.common.errors import SinkError, SourceError, VerificationError
from refit_app.core.meta import TensorMeta
from refit_app.models.hf import ModelSink, ModelSource, write_tiny_llama
from refit_app.models.probe import decode_probe, encode_probe, logit_tolerance
from refit_app.protocol.manifest import Manifest

pytestmark = needs_transformers  # source=model / sink=model

PROBE_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Tiny Llama checkpoints by (dtype, tied)."""
    root = tmp_path_factory.mktemp("tiny-llama")
    return {
        (dtype, tied): write_tiny_llama(root / f"{dtype}-{tied}", seed=0, dtype=dtype, tie_word_embeddings=tied)
        for dtype in (torch.float32, torch.bfloat16)
        for tied in (True, False)
    }


def manifest_of(source: ModelSource) -> Manifest:
    return Manifest(source.manifest_tensors(), buffer_size_bytes=1 << 20, use_legacy_packing=False)


def refit(source: ModelSource, sink: ModelSink) -> dict:
    deliver(sink, list(source.tensors()))  # views into a reused buffer: a sink that kept one would read NaNs
    return sink.finish_round()


def connected(path, **source_kwargs) -> tuple[ModelSource, ModelSink]:
    source = ModelSource(path, **source_kwargs)
    sink = ModelSink()
    sink.begin(manifest_of(source), source.model_config())
    return source, sink


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


# ---------------------------------------------------------------------------------------------- the manifest


@pytest.mark.parametrize("tied", [True, False])
def test_manifest_has_the_checkpoints_names_shapes_and_dtypes(checkpoints, tied):
    path = checkpoints[(torch.float32, tied)]
    source = ModelSource(path)
    on_disk = {m.name: m for m in Checkpoint(path).metas()}
    metas = source.manifest_tensors()
    assert sorted(m.name for m in metas) == sorted(on_disk)
    for m in metas:
        assert (m.shape, m.dtype, m.shard) == (on_disk[m.name].shape, on_disk[m.name].dtype, SINGLE_FILE_NAME)
    assert [n for n, _ in source.tensors()] == [m.name for m in metas]
    # A trainer's order (module order), not the file's alphabetical one.
    assert metas[0].name == "model.embed_tokens.weight"
    assert source.metadata() == Checkpoint(path).metadata()
    assert json.loads(source.model_config()) == json.loads((path / "config.json").read_text())


def test_tied_weights_are_sent_once(checkpoints):
    tied = ModelSource(checkpoints[(torch.float32, True)])
    untied = ModelSource(checkpoints[(torch.float32, False)])
    tied_names = [m.name for m in tied.manifest_tensors()]
    untied_names = [m.name for m in untied.manifest_tensors()]
    assert tied.model.lm_head.weight is tied.model.model.embed_tokens.weight
    assert "lm_head.weight" not in tied_names and tied_names.count("model.embed_tokens.weight") == 1
    assert set(untied_names) - set(tied_names) == {"lm_head.weight"}


def test_source_loads_the_checkpoint_exactly_and_converts_dtype(checkpoints):
    path = checkpoints[(torch.float32, False)]
    on_disk = dict(Checkpoint(path).iter_tensors())
    source = ModelSource(path)
    assert source.dtype == torch.float32
    for name, t in source.tensors():
        assert torch.equal(t, on_disk[name]), name
    as_bf16 = ModelSource(path, dtype="bfloat16")
    assert {m.dtype for m in as_bf16.manifest_tensors()} == {torch.bfloat16}
    for name, t in as_bf16.tensors():
        assert torch.equal(t, on_disk[name].to(torch.bfloat16)), name
    assert ModelSource(checkpoints[(torch.bfloat16, False)]).dtype == torch.bfloat16  # the checkpoint's own


# ------------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize(
    ("checkpoint_dtype", "source_dtype", "tied"),
    [
        (torch.float32, None, True),
        (torch.float32, None, False),
        (torch.bfloat16, None, True),
        (torch.float32, torch.bfloat16, False),
    ],
)
def test_refit_gives_identical_weights_and_logits(checkpoints, checkpoint_dtype, source_dtype, tied):
    source, sink = connected(checkpoints[(checkpoint_dtype, tied)], dtype=source_dtype)
    assert refit(source, sink) == {"loaded_tensors": len(source.manifest_tensors())}
    assert_same_state(source.model, sink.model)
    assert (sink.model.lm_head.weight is sink.model.model.embed_tokens.weight) == tied
    probe = decode_probe(encode_probe(source.probe(PROBE_TOKENS)))
    assert sink.check(probe, PROBE_TOKENS) == {"max_abs_logit_diff": 0.0, "tokens_match": True}


def test_probe_survives_encoding(checkpoints):
    probe = ModelSource(checkpoints[(torch.bfloat16, True)]).probe(PROBE_TOKENS)
    back = decode_probe(encode_probe(probe))
    assert torch.equal(back.pop("logits"), probe["logits"])
    assert back == {k: v for k, v in probe.items() if k != "logits"}
    assert probe["logits"].shape == (PROBE_TOKENS, 256) and probe["logits"].dtype == torch.float32
    assert len(probe["next_tokens"]) == PROBE_TOKENS
    with pytest.raises(VerificationError, match="malformed"):
        decode_probe(encode_probe(probe)[:-4])


def test_rounds_train_and_every_round_matches(checkpoints):
    source, sink = connected(checkpoints[(torch.float32, True)], train_steps=2, batch_tokens=64, lr=1e-2)
    refit(source, sink)
    losses = []
    for round_index in range(1, 4):
        before = {n: t.clone() for n, t in source.tensors()}
        result = source.advance(round_index)
        assert set(result) == {"loss"} and isinstance(result["loss"], float)
        losses.append(result["loss"])
        changed = [n for n, t in source.tensors() if not torch.equal(t, before[n])]
        assert len(changed) == len(before)  # AdamW moves every parameter
        # Metadata once: later rounds only consume, into the model built in round 0.
        refit(source, sink)
        assert_same_state(source.model, sink.model)
        check = sink.check(source.probe(PROBE_TOKENS), PROBE_TOKENS)
        assert check == {"max_abs_logit_diff": 0.0, "tokens_match": True}
    assert len(set(losses)) == len(losses)
    assert sink.builds == 1
    again = ModelSource(checkpoints[(torch.float32, True)], train_steps=2, batch_tokens=64, lr=1e-2)
    assert [again.advance(r)["loss"] for r in range(1, 4)] == losses  # seeded: a rerun trains identically
    # The steps really train: the same round's batches again (same seed and round index) cost less now.
    assert again.advance(1)["loss"] < losses[0]


def test_mixed_precision_trains_in_fp32_and_sends_bf16_that_matches_every_round(checkpoints):
    source = ModelSource(checkpoints[(torch.float32, True)], dtype="float32", send_dtype="bfloat16", lr=1e-6)
    assert source.model.dtype == torch.float32
    assert {m.dtype for m in source.manifest_tensors()} == {torch.bfloat16}
    assert "bfloat16, trained in float32" in source.describe()
    sink = ModelSink()
    sink.begin(manifest_of(source), source.model_config())
    assert sink.model.dtype == torch.bfloat16  # the consumer builds in the manifest's dtype
    masters = dict(source.model.state_dict())
    shares = []
    for round_index in range(1, 5):
        if round_index > 1:
            before = {n: t.clone() for n, t in source.tensors()}
            source.advance(round_index)
            changed = sum(int((t.view(torch.int16) != before[n].view(torch.int16)).sum()) for n, t in source.tensors())
            shares.append(changed / sum(t.numel() for t in before.values()))
        for name, t in source.tensors():
            assert t.dtype == torch.bfloat16 and torch.equal(t, masters[name].to(torch.bfloat16)), name
        refit(source, sink)
        # The probe runs the weights as sent: the consumer's bf16 model gives the same logits, bit for bit.
        check = sink.check(decode_probe(encode_probe(source.probe(PROBE_TOKENS))), PROBE_TOKENS)
        assert check == {"max_abs_logit_diff": 0.0, "tokens_match": True}, round_index
    # Real AdamW steps at an RL learning rate move few bf16 elements (measured 4.3%, then 3.0%, 2.9%: Adam's first
    # step is lr on every element, later ones are smaller) and the fp32 masters all of them.
    assert all(0 < share < 0.10 for share in shares), shares
    assert sink.builds == 1


def test_send_dtype_equal_to_the_training_dtype_sends_the_model_itself(checkpoints):
    source = ModelSource(checkpoints[(torch.float32, False)], dtype="float32", send_dtype="float32")
    params = {n: p.data_ptr() for n, p in source.model.state_dict().items()}
    assert all(t.data_ptr() == params[n] for n, t in source.tensors())


def test_sink_rebuilds_only_when_the_config_changes(checkpoints):
    source, sink = connected(checkpoints[(torch.float32, True)])
    model = sink.model
    sink.begin(manifest_of(source), json.dumps(json.loads(source.model_config()), indent=4))  # same config
    assert sink.model is model and sink.builds == 1
    other = ModelSource(checkpoints[(torch.float32, False)])
    sink.begin(manifest_of(other), other.model_config())
    assert sink.builds == 2 and sink.model.lm_head.weight is not sink.model.model.embed_tokens.weight
    refit(other, sink)
    assert_same_state(other.model, sink.model)
    bf16 = ModelSource(checkpoints[(torch.float32, False)], dtype=torch.bfloat16)
    sink.begin(manifest_of(bf16), bf16.model_config())  # same config text, new dtype
    assert sink.builds == 3 and sink.model.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------------ errors


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_consume_rejects_unknown_names_and_wrong_shapes_naming_the_tensor(checkpoints):
    source, sink = connected(checkpoints[(torch.float32, True)])
    with pytest.raises(SinkError) as e:
        sink.consume([("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))])
    assert "'model.layers.9.mlp.up_proj.weight' is not in the manifest" in one_line_error(e)
    with pytest.raises(SinkError) as e:
        sink.consume([("model.norm.weight", torch.zeros(65))])
    assert "'model.norm.weight' is float32 [65]" in one_line_error(e) and "[64]" in one_line_error(e)
    with pytest.raises(SinkError) as e:
        sink.consume([("model.norm.weight", torch.zeros(64, dtype=torch.bfloat16))])
    assert "'model.norm.weight' is bfloat16 [64]" in one_line_error(e)
    name, t = next(iter(source.tensors()))
    sink.consume([(name, t)])
    with pytest.raises(SinkError) as e:
        sink.consume([(name, t)])
    assert f"{name!r} twice" in one_line_error(e)


def test_finish_round_names_what_never_arrived(checkpoints):
    source, sink = connected(checkpoints[(torch.float32, True)])
    items = list(source.tensors())
    sink.consume(items[:-2])
    with pytest.raises(SinkError) as e:
        sink.finish_round()
    assert "2 of 20 tensor(s) never arrived" in one_line_error(e) and items[-1][0] in str(e.value)
    assert refit(source, sink) == {"loaded_tensors": 20}  # the next round starts clean


def test_begin_rejects_a_manifest_that_does_not_fit_the_config(checkpoints):
    source = ModelSource(checkpoints[(torch.float32, True)])
    config = source.model_config()
    metas = source.manifest_tensors()
    sink = ModelSink()
    cases = {
        "missing from the manifest: 'model.norm.weight'": [m for m in metas if m.name != "model.norm.weight"],
        "not in the model: 'extra.weight'": [*metas, TensorMeta("extra.weight", (2,), torch.float32)],
        "'model.norm.weight' (float32 [65] in the manifest, float32 [64] in the model)": [
            TensorMeta(m.name, (65,), m.dtype) if m.name == "model.norm.weight" else m for m in metas
        ],
        "tied tensor(s) listed under several names: 'model.embed_tokens.weight' = 'lm_head.weight'": [
            *metas,
            TensorMeta("lm_head.weight", (256, 64), torch.float32),
        ],
    }
    for expected, tensors in cases.items():
        with pytest.raises(SinkError) as e:
            sink.begin(Manifest(tensors, 1 << 20, False), config)
        assert expected in one_line_error(e)
    with pytest.raises(SinkError, match="not valid JSON"):
        sink.begin(manifest_of(source), "{not json")


def test_check_catches_wrong_weights(checkpoints):
    source, sink = connected(checkpoints[(torch.float32, False)])
    refit(source, sink)
    with torch.no_grad():
        q = sink.model.model.layers[1].self_attn.q_proj.weight
        q.copy_(q.flip(0))  # rows in the wrong order, as a botched fused-qkv split would leave them
    probe = source.probe(PROBE_TOKENS)
    result = sink.check(probe, PROBE_TOKENS, strict=False)
    assert result["max_abs_logit_diff"] > logit_tolerance(torch.float32, float(probe["logits"].abs().max()))
    with pytest.raises(VerificationError) as e:
        sink.check(probe, PROBE_TOKENS)
    assert "exceeds the float32 tolerance" in one_line_error(e)
    with pytest.raises(VerificationError, match="probed 12 tokens"):
        sink.check(probe, PROBE_TOKENS + 1)


def test_source_refuses_a_checkpoint_that_does_not_fit_its_config(checkpoints, tmp_path):
    with pytest.raises(SourceError, match=r"has no config\.json"):
        ModelSource(tmp_path)
    src = checkpoints[(torch.float32, True)]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError) as e:
        ModelSource(tmp_path)
    assert "missing from the checkpoint: 'model.layers.2." in one_line_error(e)
    with pytest.raises(SourceError, match="train_steps=0"):
        ModelSource(src, train_steps=0)
    with pytest.raises(SourceError, match="dtype 'int8' is not a torch floating-point dtype"):
        ModelSource(src, send_dtype="int8")


def test_write_tiny_llama_is_deterministic(tmp_path):
    a = dict(Checkpoint(write_tiny_llama(tmp_path / "a", seed=3)).iter_tensors())
    b = dict(Checkpoint(write_tiny_llama(tmp_path / "b", seed=3)).iter_tensors())
    c = dict(Checkpoint(write_tiny_llama(tmp_path / "c", seed=4)).iter_tensors())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["head_dim"] >= 32 and config["num_hidden_layers"] == 2


def test_importing_the_module_does_not_import_transformers():
    code = "import sys, refit_app.models.hf; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=STARTUP_LIMIT_S).returncode == 0
