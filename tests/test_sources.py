"""Weight sources (safetensors checkpoints, synthetic models) and size parsing."""

from __future__ import annotations

import pytest
import torch
from tensor_utils import tensor_checksum

from refit_app.checkpoint.layout import SINGLE_FILE_NAME
from refit_app.checkpoint.writer import CheckpointWriter, save_tensors
from refit_app.common.errors import ConfigError, SourceError
from refit_app.common.sizes import format_size, parse_size
from refit_app.core.meta import TensorMeta
from refit_app.core.wire import host_bytes as tensor_bytes
from refit_app.models.presets import LORA_RANK
from refit_app.models.sources import SafetensorsSource, SyntheticSource, make_source

MiB = 1024**2
GiB = 1024**3


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def assert_streams_like_manifest(source) -> list[tuple[str, torch.Tensor]]:
    metas = source.manifest_tensors()
    items = list(source.tensors())
    assert [n for n, _ in items] == [m.name for m in metas]
    for (_, t), m in zip(items, metas):
        assert tuple(t.shape) == m.shape and t.dtype == m.dtype, m.name
    return items


# ------------------------------------------------------------------------------------------ safetensors


def test_safetensors_source_minilm_directory(minilm_dir):
    source = make_source("refit_app.models.sources.SafetensorsSource", {"path": str(minilm_dir)})
    metas = source.manifest_tensors()
    assert len(metas) > 100
    assert {m.shard for m in metas} == {SINGLE_FILE_NAME}
    assert source.metadata() == {"format": "pt"}
    assert "104 tensors" in source.describe()
    assert_streams_like_manifest(source)


def test_single_file_under_any_name_saves_as_model_safetensors(tmp_path):
    path = save_tensors(tmp_path / "weights.safetensors", {"a": torch.ones(2), "b": torch.zeros((), dtype=torch.int8)})
    source = SafetensorsSource(str(path))
    assert source.manifest_tensors() == [
        TensorMeta("a", (2,), torch.float32, SINGLE_FILE_NAME),
        TensorMeta("b", (), torch.int8, SINGLE_FILE_NAME),
    ]


def test_sharded_directory_keeps_shard_names(tmp_path):
    metas = [
        TensorMeta("embed", (6, 2), torch.bfloat16, "model-00001-of-00002.safetensors"),
        TensorMeta("norm", (2,), torch.float32, "model-00001-of-00002.safetensors"),
        TensorMeta("head", (6, 2), torch.bfloat16, "model-00002-of-00002.safetensors"),
    ]
    writer = CheckpointWriter(tmp_path, metas, {"format": "pt"})
    writer.open()
    for m in metas:
        writer.write(m.name, torch.ones(m.shape, dtype=m.dtype))
    writer.commit()
    source = make_source("refit_app.models.sources.SafetensorsSource", {"path": str(tmp_path)})
    # Shards in order, each in the file's data order (the writer puts the widest dtype first).
    assert source.manifest_tensors() == [metas[1], metas[0], metas[2]]
    assert_streams_like_manifest(source)
    assert source.companion_files() == {}


def test_directory_source_sends_its_companion_files(minilm_dir, tmp_path):
    source = SafetensorsSource(str(minilm_dir))
    files = source.companion_files()
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt"} <= set(files)
    assert files["config.json"] == (minilm_dir / "config.json").read_text()
    assert "README.md" not in files and "modules.json" not in files
    assert SafetensorsSource(str(minilm_dir / SINGLE_FILE_NAME)).companion_files() == {}


def test_make_source_refuses_a_target_it_cannot_build(tmp_path):
    with pytest.raises(ConfigError, match="_target_='hdf5' is not a dotted path"):
        make_source("hdf5", {})
    with pytest.raises(ConfigError, match=r"_target_='no_such_module.Source': cannot import no_such_module"):
        make_source("no_such_module.Source", {})
    with pytest.raises(ConfigError, match=r"module refit_app.models.sources has no 'HDF5Source'"):
        make_source("refit_app.models.sources.HDF5Source", {})
    with pytest.raises(ConfigError, match=r"does not accept \{'path': .*'pth': 'x'\}"):
        make_source("refit_app.models.sources.SafetensorsSource", {"path": str(tmp_path), "pth": "x"})


# ------------------------------------------------------------------------------------------ synthetic


def test_tiny_is_the_small_default():
    source = make_source(
        "refit_app.models.sources.SyntheticSource",
        {"preset": "tiny", "size_bytes": None, "seed": 0, "dtype": "bfloat16"},
    )
    assert 6 * MiB < source.total_bytes < 10 * MiB
    assert all(m.shard is None for m in source.manifest_tensors())
    assert_streams_like_manifest(source)


def test_synthetic_is_deterministic_and_seeded():
    def checksums(seed: int) -> list[int]:
        return [tensor_checksum(t) for _, t in SyntheticSource("tiny", None, seed, torch.bfloat16).tensors()]

    first = checksums(3)
    assert checksums(3) == first
    assert checksums(4) != first
    big = [c for c, m in zip(first, SyntheticSource("tiny", None, 3, torch.bfloat16).manifest_tensors()) if m.numel > 1]
    assert len(set(big)) == len(big), "tensors of one model should not repeat each other"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, torch.int8, torch.bool, torch.complex64])
def test_synthetic_other_dtypes(dtype):
    source = SyntheticSource("tiny", 256 * 1024, seed=1, dtype=dtype)
    items = assert_streams_like_manifest(source)
    weights = [t for n, t in items if n.endswith("proj.weight")]
    assert any(bytes(tensor_bytes(t)).count(0) < len(tensor_bytes(t)) for t in weights), "all-zero weights"


def test_llama_8b_shapes():
    # fp8 halves the pool this test allocates; shapes do not depend on the dtype.
    metas = {m.name: m for m in SyntheticSource("llama-8b", None, 0, torch.float8_e4m3fn).manifest_tensors()}
    assert metas["model.embed_tokens.weight"].shape == (128256, 4096)
    assert metas["lm_head.weight"].shape == (128256, 4096)
    assert metas["model.norm.weight"].shape == (4096,)
    assert metas["model.layers.31.mlp.gate_proj.weight"].shape == (14336, 4096)
    assert metas["model.layers.31.mlp.down_proj.weight"].shape == (4096, 14336)
    assert metas["model.layers.0.self_attn.k_proj.weight"].shape == (1024, 4096)
    assert metas["model.layers.0.post_attention_layernorm.weight"].shape == (4096,)
    scale = metas["model.layers.0.self_attn.k_scale"]
    assert scale.shape == () and scale.dtype == torch.float32
    assert "model.layers.32.input_layernorm.weight" not in metas
    params = sum(m.numel for m in metas.values() if m.dtype != torch.float32)
    assert 8.0e9 < params < 8.1e9


def test_qwen_has_qkv_biases_and_tied_embeddings():
    metas = {m.name: m for m in SyntheticSource("qwen-0.5b", 8 * MiB, 0, torch.bfloat16).manifest_tensors()}
    assert "model.layers.0.self_attn.q_proj.bias" in metas
    assert "model.layers.0.self_attn.v_proj.bias" in metas
    assert "model.layers.0.self_attn.o_proj.bias" not in metas
    assert "lm_head.weight" not in metas


def test_lora_preset_has_thousands_of_small_matrices():
    source = SyntheticSource("lora", None, 0, torch.bfloat16)
    metas = source.manifest_tensors()
    assert len(metas) >= 2000
    assert all(m.name.endswith((".lora_A.weight", ".lora_B.weight")) for m in metas)
    assert all(LORA_RANK in m.shape and len(m.shape) == 2 for m in metas)
    assert all(8 * 1024 <= m.nbytes <= 100 * 1024 for m in metas)
    a, b = metas[0], metas[1]
    assert a.shape[0] == LORA_RANK and b.shape[1] == LORA_RANK


@pytest.mark.parametrize(
    ("preset", "size"),
    [("tiny", 64 * MiB), ("tiny", 100 * 1024), ("qwen-0.5b", 256 * MiB), ("lora", 4 * MiB), ("llama-8b", 64 * MiB)],
)
def test_synthetic_scales_to_size(preset, size):
    source = SyntheticSource(preset, size, 0, torch.bfloat16)
    assert abs(source.total_bytes - size) <= 0.1 * size, source.describe()


def test_two_gib_model_streams_in_small_memory():
    before = rss_bytes()
    source = SyntheticSource("llama-1b", 2 * GiB, 0, torch.bfloat16)
    seen = peak = 0
    for _, t in source.tensors():
        seen += t.numel() * t.element_size()
        float(t.reshape(-1)[-1])  # touch the data, as a packer would
        peak = max(peak, rss_bytes())
    assert seen > 1.8 * GiB
    # The pool is the largest tensor (the 0.5 GiB embedding) plus 16 MiB; 2 GiB of materialised tensors would show.
    assert peak - before < 1 * GiB, format_size(peak - before)


# ------------------------------------------------------------------------------------------ synthetic training


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _snapshot(source: SyntheticSource) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in source.tensors()}


def changed_share(before: dict[str, torch.Tensor], source: SyntheticSource) -> float:
    """Share of elements whose bytes differ from ``before``, over the tensors of the model's dtype."""
    changed = total = 0
    for name, t in source.tensors():
        if t.dtype != source.dtype:
            continue
        width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        changed += int((t.reshape(-1).view(width) != before[name].reshape(-1).view(width)).sum())
        total += t.numel()
    return changed / total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_training_starts_from_the_same_seeded_values(dtype):
    # The masters sit inside the rounding cells of today's values, so round 1 sends them unchanged.
    shuffled = dict(SyntheticSource("tiny", 256 * 1024, 2, dtype).tensors())
    trained = SyntheticSource("tiny", 256 * 1024, 2, dtype, update="training")
    for name, t in trained.tensors():
        assert torch.equal(_raw(t), _raw(shuffled[name])), name


def test_training_rounds_are_deterministic_and_seeded():
    def round_4(seed: int, path: tuple[int, ...]) -> dict[str, torch.Tensor]:
        source = SyntheticSource("tiny", None, seed, torch.bfloat16, update="training")
        for k in path:
            source.advance(k)
        return _snapshot(source)

    stepwise = round_4(0, (2, 3, 4))
    # A consumer's copy or a re-run that jumps to round 4 takes the same steps: the state is a function of the round.
    for name, t in round_4(0, (4,)).items():
        assert torch.equal(_raw(t), _raw(stepwise[name])), name
    other_seed = round_4(1, (2, 3, 4))
    assert not torch.equal(other_seed["lm_head.weight"], stepwise["lm_head.weight"])


def test_training_changes_about_one_percent_of_bf16_elements_per_round():
    # Measured 0.96% a round at lr 1e-6 on every preset (the values, not the shapes, set it); the range leaves
    # room for a change of seed, not for a change of mechanism (shuffle changes ~100%, on-grid masters ~0%).
    source = SyntheticSource("tiny", None, 0, torch.bfloat16, update="training", lr=1e-6)
    shares = []
    for k in (2, 3, 4, 5):
        before = _snapshot(source)
        source.advance(k)
        shares.append(changed_share(before, source))
    assert all(0.007 < share < 0.013 for share in shares), shares
    # Stationary from round 2: the masters start spread over their cells, so the share does not creep up.
    assert max(shares) - min(shares) < 0.001, shares
    faster = SyntheticSource("tiny", None, 0, torch.bfloat16, update="training", lr=1e-5)
    before = _snapshot(faster)
    faster.advance(2)
    assert 0.04 < changed_share(before, faster) < 0.10  # measured 6.5%


def test_training_in_float32_changes_every_element_and_keeps_the_scales():
    source = SyntheticSource("tiny", None, 0, torch.float32, update="training")
    before = _snapshot(source)
    source.advance(2)
    # fp32 sends the masters: a step changes an element unless it is under half an fp32 step (a tiny minority).
    assert changed_share(before, source) > 0.95
    scales = [n for n, t in source.tensors() if n.endswith(("k_scale", "v_scale"))]
    assert scales and all(torch.equal(dict(source.tensors())[n], before[n]) for n in scales)


def test_training_steps_into_the_same_buffers_every_round():
    source = SyntheticSource("tiny", None, 0, torch.bfloat16, update="training")
    first = {n: t.data_ptr() for n, t in source.tensors()}
    before = _snapshot(source)
    source.advance(2)
    assert {n: t.data_ptr() for n, t in source.tensors()} == first  # in place: no model allocated per round
    assert changed_share(before, source) > 0


def test_training_refuses_going_back_a_dtype_without_rounding_and_an_unknown_update():
    source = SyntheticSource("tiny", None, 0, torch.bfloat16, update="training")
    source.advance(3)
    with pytest.raises(SourceError) as e:
        source.advance(2)
    assert str(e.value) == "synthetic training-like steps only go forward: round 2 asked after round 3"
    with pytest.raises(SourceError, match="update='training' needs a floating-point dtype"):
        SyntheticSource("tiny", None, 0, torch.int8, update="training")
    with pytest.raises(SourceError, match="update='adam' is not one of shuffle, training"):
        SyntheticSource("tiny", None, 0, torch.bfloat16, update="adam")


def test_shuffle_is_the_default_and_changes_every_tensor():
    source = SyntheticSource("tiny", None, 0, torch.bfloat16)
    assert source.update == "shuffle" and "training" not in source.describe()
    before = _snapshot(source)
    source.advance(2)
    assert changed_share(before, source) > 0.99


# ------------------------------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * GiB),
        ("256MiB", 256 * MiB),
        ("64MB", 64_000_000),
        ("1048576", 1048576),
        (1048576, 1048576),
        ("1.5GiB", 3 * GiB // 2),
        ("4 KiB", 4096),
        ("1tib", 1024**4),
        ("10B", 10),
        ("2KB", 2000),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["12XB", "", "-5", "0", 0, -1, "0MiB", "1.5", "GiB", "1e9", True, 2.5, "0.1B"])
def test_parse_size_refuses(text):
    with pytest.raises(ConfigError) as excinfo:
        parse_size(text, "refit.buffer_size_bytes")
    message = str(excinfo.value)
    assert message.startswith("refit.buffer_size_bytes: ")
    assert "use an integer number of bytes or a size like 256MiB, 1GiB, 64MB" in message


def test_parse_size_message_quotes_value():
    with pytest.raises(ConfigError, match="'12XB' is not a size"):
        parse_size("12XB")


@pytest.mark.parametrize(
    ("n", "text"), [(256 * MiB, "256 MiB"), (3 * GiB // 2, "1.5 GiB"), (1000, "1000 B"), (90868376, "86.66 MiB")]
)
def test_format_size(n, text):
    assert format_size(n) == text
