"""Real checkpoints through a refit into ``sink=save``, and the saved directory opened by the reference libraries.

Two checkpoints that packages ship (all-MiniLM-L6-v2, a transformers BertModel with its tokenizer; fracast-0, a
time-series model that is not a transformers model) and a Llama that transformers writes here, single-file and
sharded. Each saved directory must load with ``from_pretrained`` (or ``safetensors`` where there is no transformers
model) identical tensor for tensor to the source, with its config and tokenizer files beside the weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conditions import needs_transformers
from mp_utils import gloo_spec, run_ranks
from safetensors import safe_open
from tensor_utils import raw_bytes

from refit_app.checkpoint.layout import MAX_COMPANION_FILE_BYTES, SINGLE_FILE_NAME
from refit_app.checkpoint.reader import read_companion_files
from refit_app.models.sinks import SaveSink
from refit_app.models.sources import SafetensorsSource
from refit_app.protocol.checksum import default_algorithm
from refit_app.protocol.manifest import Manifest
from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.groups import connect

BUFFER = 1 << 20
TIMEOUT_S = 60.0


def _reference_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint file or directory, read by the safetensors package alone."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if path.is_dir() and (path / SINGLE_FILE_NAME).is_file():
        files = [path / SINGLE_FILE_NAME]
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 (not a dict)
    return out


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert want, "no tensors to compare with: the test would not test"
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert (got[name].dtype, got[name].shape) == (t.dtype, t.shape), name
        assert raw_bytes(got[name]) == raw_bytes(t), f"{name} differs"


def save_through_sink(source: SafetensorsSource, out: Path, rounds: int = 2) -> dict:
    """What a consumer with ``sink=save`` does with this source's rounds, without the group: the manifest goes
    through its wire encoding (binary companion files included), the tensors through the sink."""
    manifest = Manifest(
        source.manifest_tensors(),
        BUFFER,
        False,
        metadata=source.metadata(),
        source=source.describe(),
        files=source.companion_files(),
    )
    manifest = Manifest.from_bytes(manifest.to_bytes())
    sink = SaveSink(str(out))
    sink.begin(manifest)
    for _ in range(rounds):
        for name, t in source.tensors():
            sink.consume([(name, t)])
        sink.finish(None)
    return sink.close()


# ------------------------------------------------------------------------------------------ companion files


def test_companion_files_of_a_model_directory(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tokenizer.model").write_bytes(b"\x00\xffsentencepiece")
    (tmp_path / "tokenizer.json").write_bytes(b"x" * (MAX_COMPANION_FILE_BYTES + 1))  # over the cap: left out
    (tmp_path / "README.md").write_text("not a companion file")
    files = read_companion_files(tmp_path)
    assert files == {"config.json": '{"model_type": "llama"}', "tokenizer.model": b"\x00\xffsentencepiece"}
    manifest = Manifest([], BUFFER, False, files=files)
    assert Manifest.from_bytes(manifest.to_bytes()).files == files


def test_companion_files_are_published_with_the_weights_only(tmp_path):
    from refit_app.checkpoint.writer import save_tensors

    src = tmp_path / "src"
    src.mkdir()
    save_tensors(src / SINGLE_FILE_NAME, {"w": torch.arange(6.0)})
    (src / "config.json").write_text("{}")
    (src / "tokenizer.model").write_bytes(b"\x80binary")
    source = SafetensorsSource(str(src))
    out = tmp_path / "out"
    sink = SaveSink(str(out))
    sink.begin(
        Manifest.from_bytes(
            Manifest(source.manifest_tensors(), BUFFER, False, files=source.companion_files()).to_bytes()
        )
    )
    # Before close: temporary files only, no config.json that would make the directory look loadable.
    assert all(p.name.startswith(".") for p in out.iterdir())
    sink.consume(list(source.tensors()))
    sink.finish(None)
    published = sink.close()
    assert sorted(published["saved_files"]) == ["config.json", SINGLE_FILE_NAME, "tokenizer.model"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", SINGLE_FILE_NAME, "tokenizer.model"]
    assert (out / "tokenizer.model").read_bytes() == b"\x80binary"

    aborted = SaveSink(str(tmp_path / "aborted"))
    aborted.begin(Manifest(source.manifest_tensors(), BUFFER, False, files=source.companion_files()))
    aborted.abort()
    assert list((tmp_path / "aborted").iterdir()) == []


@pytest.mark.parametrize("name", ["../config.json", ".hidden", "model.safetensors", "model.safetensors.index.json"])
def test_save_refuses_companion_names_that_escape_or_replace_weights(tmp_path, name):
    from refit_app.common.errors import SinkError

    sink = SaveSink(str(tmp_path / "out"))
    with pytest.raises(SinkError, match="refusing companion files"):
        sink.begin(Manifest([], BUFFER, False, files={name: "x"}))


# ------------------------------------------------------------------------------------------ real checkpoints


@needs_transformers
def test_minilm_saved_opens_with_from_pretrained(minilm_dir, tmp_path):
    import transformers

    out = tmp_path / "saved"
    save_through_sink(SafetensorsSource(str(minilm_dir)), out)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        assert (out / name).read_bytes() == (minilm_dir / name).read_bytes(), name
    _assert_identical(_reference_tensors(out / SINGLE_FILE_NAME), _reference_tensors(minilm_dir / SINGLE_FILE_NAME))

    model = transformers.AutoModel.from_pretrained(out)
    original = transformers.AutoModel.from_pretrained(minilm_dir)
    _assert_identical(dict(model.state_dict()), dict(original.state_dict()))
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (
        tokenizer("refit the weights")["input_ids"]
        == transformers.AutoTokenizer.from_pretrained(minilm_dir)("refit the weights")["input_ids"]
    )


def test_fracast_saved_loads_identical_with_safetensors(fracast_dir, tmp_path):
    out = tmp_path / "saved"
    source = SafetensorsSource(str(fracast_dir))
    assert "config.json" in source.companion_files()
    save_through_sink(source, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", SINGLE_FILE_NAME]
    assert (out / "config.json").read_bytes() == (fracast_dir / "config.json").read_bytes()
    _assert_identical(_reference_tensors(out), _reference_tensors(fracast_dir / SINGLE_FILE_NAME))
    with safe_open(out / SINGLE_FILE_NAME, framework="pt") as saved, \
            safe_open(fracast_dir / SINGLE_FILE_NAME, framework="pt") as original:  # fmt: skip
        assert saved.metadata() == original.metadata()


def test_fracast_int8_variant_mixed_dtypes(fracast_dir, tmp_path):
    path = fracast_dir / "model.int8.safetensors"
    out = tmp_path / "saved"
    save_through_sink(SafetensorsSource(str(path)), out, rounds=1)
    _assert_identical(_reference_tensors(out), _reference_tensors(path))
    assert {t.dtype for t in _reference_tensors(out).values()} == {torch.float32, torch.int8}


@needs_transformers
@pytest.mark.parametrize("sharded", [False, True])
def test_llama_saved_opens_with_from_pretrained(tmp_path, sharded):
    import transformers

    from refit_app.models.hf import write_tiny_llama

    src = write_tiny_llama(tmp_path / "src", seed=3, dtype=torch.bfloat16)
    if sharded:
        model = transformers.AutoModelForCausalLM.from_pretrained(src)
        src = tmp_path / "sharded"
        model.save_pretrained(src, max_shard_size="100KB")
        assert (src / "model.safetensors.index.json").is_file()
    out = tmp_path / "saved"
    save_through_sink(SafetensorsSource(str(src)), out)
    assert ((out / "model.safetensors.index.json").is_file()) == sharded
    saved = transformers.AutoModelForCausalLM.from_pretrained(out)
    original = transformers.AutoModelForCausalLM.from_pretrained(src)
    assert saved.dtype == torch.bfloat16
    _assert_identical(dict(saved.state_dict()), dict(original.state_dict()))


# ------------------------------------------------------------------------------------------ over a real group


def _refit_and_save(rank: int, world_size: int, port: int, path: str, out: str) -> object:
    with connect(gloo_spec(rank, world_size, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            source = SafetensorsSource(path)
            with ProducerSession(rg, buffer_size_bytes=BUFFER) as session:
                for _ in range(2):
                    r = session.send(
                        source.tensors(),
                        metas=source.manifest_tensors(),
                        metadata=source.metadata(),
                        files=source.companion_files(),
                        source=source.describe(),
                    )
            return session.manifest.checksum_algorithm, r.manifest_sent
        sink = SaveSink(out)
        session = ConsumerSession(rg, verify=True)
        verified = []
        while (
            r := session.receive(sink.consume, on_manifest=sink.begin, on_round_end=lambda r: sink.finish(r.checksums))
        ) is not None:
            verified.append(r.verified)
        return verified, sink.close()["saved_files"]


@needs_transformers
def test_minilm_refit_over_gloo_saves_a_loadable_directory(minilm_dir, tmp_path):
    import transformers

    out = tmp_path / "saved"
    (algorithm, second_manifest), (verified, saved_files) = run_ranks(
        _refit_and_save, 2, str(minilm_dir), str(out), timeout=120
    )
    assert algorithm == default_algorithm()
    assert second_manifest is False  # the files travel with the first round's manifest only
    assert verified == [True, True]
    assert "config.json" in saved_files and "tokenizer.json" in saved_files
    model = transformers.AutoModel.from_pretrained(out)
    _assert_identical(dict(model.state_dict()), dict(transformers.AutoModel.from_pretrained(minilm_dir).state_dict()))
