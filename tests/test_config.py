"""The real conf/ composed for every option, every bad value refused with its message, and the one-line error
wrapper run as a real Hydra application in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from importlib import resources
from pathlib import Path

import pytest
from cli_utils import hermetic_env
from config_utils import compose_config, refused, settings
from hydra.errors import ConfigCompositionException
from mp_utils import STARTUP_LIMIT_S
from omegaconf import OmegaConf

from refit_app.app.config import SinkSpec, SourceSpec, validate
from refit_app.app.schema import CONF_MODULE, CONFIG_NAME
from refit_app.core.defaults import NUM_BUFFERS_ENV
from refit_app.transport.spec import DEFAULT_PORT, GroupSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV = NUM_BUFFERS_ENV


@pytest.fixture(autouse=True)
def _no_env_num_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    # The developer's shell must not decide what these tests see.
    monkeypatch.delenv(ENV, raising=False)


# --- every group option composes to the documented values and types ------------------------------------------


def test_the_config_package_is_the_top_level_conf() -> None:
    # pyproject.toml maps the package refit_app.conf to conf/: an editable install reads the checkout's files.
    assert Path(str(resources.files(CONF_MODULE))) == REPO_ROOT / "conf"
    assert resources.files(CONF_MODULE).joinpath(f"{CONFIG_NAME}.yaml").is_file()


def test_defaults_are_a_local_synthetic_verified_refit() -> None:
    cfg = compose_config([])
    assert OmegaConf.to_container(cfg.refit, resolve=True) == {
        "buffer_size_bytes": None,
        "num_buffers": 2,
        "use_legacy_packing": False,
        "rounds": None,
        "delta": "off",
        "on_consumer_loss": "fail",
        "debug": {"corrupt_chunk": None, "die_in_round": None, "die_rank": 1},
    }
    s = validate(cfg)
    assert s.role == "local"
    assert s.group == GroupSpec(backend="auto", host="127.0.0.1", port=None, world_size=2, rank=0, timeout_s=60.0)
    assert (s.refit.buffer_size_bytes, s.refit.num_buffers) == (None, 2)
    assert (s.refit.use_legacy_packing, s.refit.corrupt_chunk, s.refit.rounds) == (False, None, 1)
    assert type(s.refit.num_buffers) is int and type(s.group.timeout_s) is float
    assert s.source == SourceSpec(
        "refit_app.models.sources.SyntheticSource",
        {"preset": "tiny", "size_bytes": None, "seed": 0, "dtype": "bfloat16", "update": "shuffle", "lr": 1e-6},
    )
    assert (s.sink, s.sink_name) == (SinkSpec("refit_app.models.sinks.VerifySink", {}), "verify")


@pytest.mark.parametrize(
    ("role", "rank", "world_size", "port", "num_consumers"),
    [
        ("local", 0, 2, None, 1),
        ("producer", 0, 2, DEFAULT_PORT, 1),
        ("consumer", 1, 2, DEFAULT_PORT, 1),
    ],
)
def test_each_role(role: str, rank: int, world_size: int, port: int | None, num_consumers: int) -> None:
    s = settings(f"role={role}")
    assert (s.role, s.rank, s.group.world_size, s.group.port) == (role, rank, world_size, port)


def test_local_world_size_follows_num_consumers() -> None:
    assert settings("role.num_consumers=3").group.world_size == 4
    assert settings("role.num_consumers=3", "group.world_size=4").group.world_size == 4


def test_two_host_group_settings() -> None:
    s = settings(
        "role=consumer",
        "group.world_size=4",
        "group.rank=3",
        "group.host=10.0.0.7",
        "group.port=30000",
        "group.backend=gloo",
        "group.timeout_s=5",
    )
    assert s.group == GroupSpec(backend="gloo", host="10.0.0.7", port=30000, world_size=4, rank=3, timeout_s=5.0)


def test_synthetic_source_params() -> None:
    s = settings(
        "source.preset=lora",
        "source.size=2GiB",
        "source.seed=7",
        "source.dtype=float32",
        "source.update=training",
        "source.lr=3e-6",
    )
    assert s.source.params == {
        "preset": "lora",
        "size_bytes": 2 * 1024**3,
        "seed": 7,
        "dtype": "float32",
        "update": "training",
        "lr": 3e-6,
    }


def test_model_source_params(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    s = settings("source=model", f"source.path={tmp_path}", "source.dtype=float32", "source.send_dtype=bfloat16")
    assert (s.source.params["dtype"], s.source.params["send_dtype"], s.source.params["lr"]) == (
        "float32",
        "bfloat16",
        1e-3,
    )
    assert settings("source=model", f"source.path={tmp_path}").source.params["send_dtype"] is None


def test_safetensors_source(tmp_path: Path) -> None:
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"")
    s = settings("source=safetensors", f"source.path={checkpoint}")
    assert s.source == SourceSpec("refit_app.models.sources.SafetensorsSource", {"path": str(checkpoint)})


@pytest.mark.parametrize(
    ("overrides", "kind", "path"),
    [
        ([], "verify", None),
        (["sink=discard"], "discard", None),
        (["sink=save", "sink.path=out/ckpt"], "save", "out/ckpt"),
    ],
)
def test_each_sink(overrides: list[str], kind: str, path: str | None) -> None:
    s = settings(*overrides)
    assert s.sink_name == kind
    assert s.sink.params == ({} if path is None else {"path": path})


@pytest.mark.parametrize(("text", "expected"), [("1048576", 1048576), ("256MiB", 256 * 1024**2), ("64MB", 64 * 10**6)])
def test_buffer_size_int_or_size_string(text: str, expected: int) -> None:
    s = settings(f"refit.buffer_size_bytes={text}")
    assert s.refit.buffer_size_bytes == expected
    assert type(s.refit.buffer_size_bytes) is int


def test_debug_corrupt_chunk() -> None:
    assert settings("role=consumer", "refit.debug.corrupt_chunk=3").refit.corrupt_chunk == 3


# --- NRL_REFIT_NUM_BUFFERS ------------------------------------------------------------------------------------


def test_num_buffers_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "3")
    cfg = compose_config([])
    assert settings().refit.num_buffers == 3
    assert OmegaConf.to_container(cfg, resolve=True)["refit"]["num_buffers"] == 3
    # An explicit value wins over the environment.
    assert settings("refit.num_buffers=5").refit.num_buffers == 5


# --- adopt the producer's settings vs insist on one's own ------------------------------------------------------


def test_consumer_defaults_adopt_the_producers_settings() -> None:
    s = settings("role=consumer")
    assert (s.refit.buffer_size_bytes, s.refit.use_legacy_packing) == (None, None)


@pytest.mark.parametrize("legacy", ["true", "false"])
def test_consumer_explicit_settings_are_kept(legacy: str) -> None:
    s = settings("role=consumer", "refit.buffer_size_bytes=64MiB", f"refit.use_legacy_packing={legacy}")
    assert (s.refit.buffer_size_bytes, s.refit.use_legacy_packing) == (64 * 1024**2, legacy == "true")


@pytest.mark.parametrize("role", ["local", "producer", "consumer"])
def test_rounds_default_to_one_on_a_producer_and_to_the_producers_on_a_consumer(role: str) -> None:
    assert settings(f"role={role}").refit.rounds == (None if role == "consumer" else 1)
    assert settings(f"role={role}", "refit.rounds=4").refit.rounds == 4


def test_producer_packing_default_is_bounded_and_may_be_null() -> None:
    assert settings("role=producer").refit.use_legacy_packing is False
    assert settings("role=producer", "refit.use_legacy_packing=true").refit.use_legacy_packing is True
    assert settings("role=producer", "refit.use_legacy_packing=null").refit.use_legacy_packing is None


# --- output directories ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "suffix"),
    [
        ([], "_local"),
        (["role=producer"], "_producer"),
        (["role=consumer"], "_consumer1"),
        (["role=consumer", "group.world_size=3", "group.rank=2"], "_consumer2"),
        (["role=producer", "group.producers=2", "group.world_size=3", "group.rank=1"], "_producer1"),
    ],
)
def test_output_dirs_name_role_and_rank(overrides: list[str], suffix: str) -> None:
    cfg = compose_config(overrides, return_hydra_config=True)
    run_dir, sweep_dir = cfg.hydra.run.dir, cfg.hydra.sweep.dir
    assert run_dir.startswith("outputs/") and run_dir.endswith(suffix)
    assert sweep_dir.startswith("outputs/multirun/") and sweep_dir.endswith(suffix)
    assert OmegaConf.to_container(cfg.hydra.sweep)["subdir"] == "${hydra.job.num}"
    assert cfg.hydra.job.chdir is False
    assert cfg.hydra.callbacks.sweep_summary._target_ == "refit_app.app.sweep_summary.SweepSummary"


# --- bad values: refused before anything starts, naming key, value and what is allowed ------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["refit.num_buffers=0"], "refit.num_buffers=0 is invalid: must be an integer >= 1"),
        (["refit.buffer_size_bytes=12XB"], "refit.buffer_size_bytes: '12XB' is not a size"),
        (["refit.buffer_size_bytes=0"], "refit.buffer_size_bytes: '0' is not a size"),
        (["refit.buffer_size_bytes=-5"], "refit.buffer_size_bytes: '-5' is not a size"),
        (["group.port=0"], "group.port=0 is invalid: must be a port number in 1..65535"),
        (["role=producer", "group.port=65536"], "group.port=65536 is invalid: must be a port number in 1..65535"),
        (["role=producer", "group.world_size=1"], "group.world_size=1 is invalid: must be an integer in 2..1024"),
        (["role=consumer", "group.world_size=1"], "group.world_size=1 is invalid: must be an integer in 2..1024"),
        (["role=consumer", "group.rank=2"], "group.rank=2 is invalid: a consumer's rank must be in 1..1"),
        (["role=consumer", "group.rank=0"], "group.rank=0 is invalid: a consumer's rank must be in 1..1"),
        (["role=producer", "group.rank=1"], "group.rank=1 is invalid: the producer is rank 0"),
        (["group.rank=1"], "group.rank=1 is invalid: role=local assigns ranks itself"),
        (["group.world_size=3"], "group.world_size=3 is invalid: role=local runs 1 producer + role.num_consumers=1"),
        (["role.num_consumers=0"], "role.num_consumers=0 is invalid: must be an integer in 1..1023"),
        (["group.timeout_s=0"], "group.timeout_s=0.0 is invalid: must be a number of seconds from 0.001 to 604800"),
        (["group.timeout_s=-1"], "group.timeout_s=-1.0 is invalid: must be a number of seconds from 0.001 to"),
        (["group.timeout_s=inf"], "group.timeout_s=inf is invalid: must be a number of seconds from 0.001 to"),
        (["group.timeout_s=1e300"], "group.timeout_s=1e+300 is invalid: must be a number of seconds from 0.001"),
        (["group.backend=mpi"], "group.backend='mpi' is invalid: choose one of auto, gloo, nccl, pynccl"),
        (["group.host="], "group.host='' is invalid: must be the producer's host name or IP address"),
        (
            ["source.preset=gpt-5"],
            "source.preset='gpt-5' is invalid: choose one of tiny, llama-1b, llama-8b, qwen-0.5b, lora",
        ),
        (["source.dtype=int3"], "source.dtype='int3' is invalid: choose one of bfloat16, float16, float32, float64"),
        (["source.size=lots"], "source.size: 'lots' is not a size"),
        (["source.seed=-1"], "source.seed=-1 is invalid: must be an integer in 0..9223372036854775807"),
        (["source.update=adam"], "source.update='adam' is invalid: choose one of shuffle, training"),
        (["source.lr=0"], "source.lr=0.0 is invalid: must be a number > 0"),
        (["source.lr=-1e-6"], "source.lr=-1e-06 is invalid: must be a number > 0"),
        (["source.lr=inf"], "source.lr=inf is invalid: must be a number > 0"),
        (["source=model", "source.lr=nan"], "source.lr=nan is invalid: must be a number > 0"),
        (
            ["source=model", "source.send_dtype=int8"],
            "source.send_dtype='int8' is invalid: choose one of bfloat16, float16, float32, float64 (or null: as "
            "trained)",
        ),
        (["source=safetensors"], "source.path is required: add source.path=<value> to the command line"),
        (["source=safetensors", "source.path=/no/such/model"], "source.path='/no/such/model' is invalid: no such"),
        (["sink=save"], "sink.path is required: add sink.path=<value> to the command line"),
        (["sink=vllm", "sink.prefix_cache=drop"], "sink.prefix_cache='drop' is invalid: choose one of reset, keep"),
        (["sink=vllm", "sink.serve_requests=7"], "sink.serve_requests=7 is invalid: must be an integer in 0..6"),
        (
            ["sink=vllm", "sink.staged=true", "refit.on_consumer_loss=continue", "group.token=t"],
            "refit.on_consumer_loss='continue' is invalid: sink.staged=true stages in one session: leave it fail",
        ),
        (
            ["sink=vllm", "sink.staged=true", "refit.debug.corrupt_chunk=1"],
            "refit.debug.corrupt_chunk=1 is invalid: sink.staged=true stages rounds the sink never consumes chunk",
        ),
        (
            ["sink=vllm", "sink.staged=true", "group.tp_size=2", "source=model", "source.path=."],
            "group.tp_size=2 is invalid: sink.staged=true stages a one-producer refit into one engine so far",
        ),
        (["refit.debug.corrupt_chunk=-1"], "refit.debug.corrupt_chunk=-1 is invalid: must be null or a chunk index"),
        (["role.name=producer"], "role.name='producer' is invalid: choose the role with role=producer"),
        (["sink.kind=save"], "sink.kind='save' is invalid: choose the sink with sink=save"),
        (["~role"], "no role chosen: add role=<option>, choose one of local, producer, consumer"),
        (["+refit.buffer_sz=1"], "unknown key 'refit.buffer_sz'; keys under refit: buffer_size_bytes, num_buffers"),
        (["group.producers=0"], "group.producers=0 is invalid: must be an integer in 1..1023"),
        (["group.producers=25", "group.tp_size=1000"], "consumers are 1025 ranks, more than 1024"),
        (["group.tp_size=2", "role=ray", "group.world_size=2"], "group.world_size=2 is invalid: role=ray runs group"),
        (["group.producers=2", "sink=vllm"], "a sharded refit into sink=vllm needs a trainer to build the engine's"),
        (
            ["group.producers=2", "role=ray", "sink=vllm"],
            "role='ray' is invalid: a sharded refit into sink=vllm runs under role=local, or role=producer and",
        ),
        (
            ["group.producers=2", "role=consumer", "group.rank=2", "group.world_size=4", "sink=vllm"],
            "group.world_size=4 is invalid: group.producers=2 + group.replicas=1 engine process(es) of group.tp_size=1",
        ),
        (["group.tp_size=2", "sink=model"], "group.tp_size=2 is invalid: a sharded refit into sink=model builds the"),
        (["group.producers=2", "sink=model"], "a sharded refit into sink=model needs a trainer to build the model"),
        (
            ["group.producers=2", "source=safetensors", "source.path=."],
            "a sharded refit reads source=synthetic or source=model only so far, not source=safetensors",
        ),
        (
            ["group.producers=2", "source=model", "source.path=.", "source.device=cuda:0"],
            "source.device='cuda:0' is invalid: a sharded refit trains source=model on the CPU (FSDP2, gloo) so far",
        ),
        (["group.tp_size=2", "group.topology=chain"], "group.topology='chain' is invalid: a sharded refit takes no"),
        (
            ["group.producers=2", "refit.on_consumer_loss=continue", "sink=vllm"],
            "a sharded refit with refit.on_consumer_loss=continue feeds sink=verify, discard, model or save only",
        ),
        (
            ["group.producers=2", "refit.on_consumer_loss=continue", "refit.debug.corrupt_chunk=0"],
            "refit.debug.corrupt_chunk=0 is invalid: a sharded refit with refit.on_consumer_loss=continue injects "
            "refit.debug.die_in_round only so far",
        ),
        (
            ["role=producer", "group.producers=2", "group.world_size=3", "refit.on_consumer_loss=continue"],
            "refit.on_consumer_loss=continue needs group.token",
        ),
        (["group.tp_size=2", "group.backend=shm"], "group.backend='shm' is invalid: a sharded refit runs over gloo"),
        (["group.producers=2", "role.num_consumers=2"], "role.num_consumers=2 is invalid: a sharded refit has"),
        (["group.producers=2", "group.world_size=4"], "group.world_size=4 is invalid: role=local runs group.producers"),
        (
            ["role=producer", "group.producers=2", "group.tp_size=2"],
            "group.world_size=2 is invalid: group.producers=2 + group.tp_size=2 x group.replicas=1 consumers are 4 "
            "ranks; give group.world_size=4 on every rank",
        ),
        (
            ["role=producer", "group.producers=2", "group.world_size=3", "group.rank=2"],
            "group.rank=2 is invalid: a producer of group.producers=2 + group.tp_size=1 x group.replicas=1 consumers "
            "is one of ranks 0..1",
        ),
        (
            ["role=consumer", "group.producers=2", "group.world_size=3", "group.rank=1"],
            "group.rank=1 is invalid: a consumer of group.producers=2",
        ),
    ],
)
def test_bad_values_are_refused(overrides: list[str], message: str) -> None:
    assert message in refused(*overrides)


def test_a_sharded_refit_goes_on_without_a_lost_consumer_where_asked() -> None:
    s = settings("group.producers=2", "group.tp_size=2", "group.replicas=2", "refit.on_consumer_loss=continue")
    assert s.refit.elastic and s.sharded is not None and s.group.world_size == 6
    # Every role, sink=save too; role=auto is a producer or a consumer by its rank.
    auto = ("role=auto", "group.world_size=4", "group.host=h", "group.token=t", "sink=save", "sink.path=/tmp/x")
    for rank, role in ((1, "producer"), (3, "consumer")):
        s = settings(
            "group.producers=2", "group.tp_size=2", "refit.on_consumer_loss=continue", *auto, f"group.rank={rank}"
        )
        assert (s.role, s.rank, s.refit.elastic) == (role, rank, True)


@pytest.mark.parametrize(
    ("overrides", "layout", "world_size", "rank"),
    [
        ([], None, 2, 0),
        (["group.producers=2", "group.tp_size=2"], (2, 2, 1), 4, 0),
        (["group.tp_size=2", "group.replicas=3"], (1, 2, 3), 7, 0),
        (["role=producer", "group.producers=3", "group.world_size=4", "group.rank=2"], (3, 1, 1), 4, 2),
        (["role=consumer", "group.tp_size=2", "group.world_size=3", "group.rank=1"], (1, 2, 1), 3, 1),
    ],
)
def test_a_sharded_layout_sets_the_world(overrides: list[str], layout: tuple | None, world_size: int, rank: int):
    s = settings(*overrides)
    got = None if s.sharded is None else (s.sharded.producers, s.sharded.tp_size, s.sharded.replicas)
    assert (got, s.group.world_size, s.group.rank) == (layout, world_size, rank)


def test_only_the_role_that_reads_a_path_requires_it() -> None:
    assert settings("role=consumer", "source=safetensors").source is None
    assert settings("role=producer", "sink=save").sink is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("abc", f"refit.num_buffers: environment variable {ENV}='abc' is invalid: must be an integer >= 1"),
        ("0", f"refit.num_buffers=0 is invalid: must be an integer >= 1 (from environment variable {ENV})"),
    ],
)
def test_bad_num_buffers_from_environment(monkeypatch: pytest.MonkeyPatch, value: str, message: str) -> None:
    monkeypatch.setenv(ENV, value)
    assert refused() == message


def test_every_bad_key_is_listed_at_once() -> None:
    message = refused("refit.num_buffers=0", "group.port=0", "source.dtype=int3")
    assert message.count(" is invalid: ") == 3
    for key in ("refit.num_buffers=0", "group.port=0", "source.dtype='int3'"):
        assert key in message


@pytest.mark.parametrize("override", ["refit.buffer_sz=1", "role=foo", "refit.num_buffers=abc", "group.port=x"])
def test_hydra_refuses_unknown_keys_options_and_types_while_composing(override: str) -> None:
    with pytest.raises(ConfigCompositionException):
        compose_config([override])


# --- the one-line error wrapper, as a real Hydra application --------------------------------------------------

APP = textwrap.dedent(
    """
    import os
    import sys
    import warnings

    import hydra

    from refit_app.app.cli import run_with_one_line_errors
    from refit_app.app.config import validate
    from refit_app.app.schema import CONF_PATH
    from refit_app.common.errors import SinkError


    @hydra.main(version_base="1.3", config_path=CONF_PATH, config_name="config")
    def main(cfg):
        settings = validate(cfg)
        warnings.warn(f"validated num_buffers={settings.refit.num_buffers}")
        failure = os.environ.get("TEST_APP_FAILURE")
        if failure == "refit":
            raise SinkError("sink.path='/ro' is not writable: choose a directory you can write to")
        if failure == "bug":
            {}["no such key"]
        if failure == "interrupt":
            raise KeyboardInterrupt
        # Progress output asks stderr whether it is a terminal; the wrapper must still answer like one.
        print(f"OK num_buffers={settings.refit.num_buffers} stderr_fd={sys.stderr.fileno()}")


    if __name__ == "__main__":
        run_with_one_line_errors(main)
    """
)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("app") / "app.py"
    path.write_text(APP)
    return path


def run_app(app: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = hermetic_env()
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")]))
    environment.update(env)
    # cwd: Hydra's outputs/ land beside the script, not in the repository.
    return subprocess.run(
        [sys.executable, str(app), *args],
        cwd=app.parent,
        env=environment,
        capture_output=True,
        text=True,
        timeout=STARTUP_LIMIT_S,
    )


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (
            ["refit.buffer_sz=1"],
            {},
            "unknown key 'refit.buffer_sz' (value '1'); keys under refit: buffer_size_bytes, num_buffers, "
            "use_legacy_packing, rounds, delta, on_consumer_loss, debug",
        ),
        (
            ["role=consumer", "role.num_consumers=2"],
            {},
            "unknown key 'role.num_consumers' (value '2'); keys under role: name, output_name",
        ),
        (["role=foo"], {}, "role=foo is not an option; choose one of auto, consumer, local, producer, ray"),
        (["refit.num_buffers=abc"], {}, "refit.num_buffers=abc is invalid: must be an integer"),
        (["refit.use_legacy_packing=maybe"], {}, "refit.use_legacy_packing=maybe is invalid: must be true or false"),
        (["refit.num_buffers=0"], {}, "refit.num_buffers=0 is invalid: must be an integer >= 1"),
        ([], {ENV: "abc"}, f"refit.num_buffers: environment variable {ENV}='abc' is invalid: must be an integer >= 1"),
        (
            ["refit.buffer_size_bytes=12XB"],
            {},
            "refit.buffer_size_bytes: '12XB' is not a size; use an integer number of bytes or a size like 256MiB, "
            "1GiB, 64MB",
        ),
        (["refit.num_buffers=["], {}, "cannot parse the command line: no viable alternative at input '['"),
        (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
    ],
)
def test_a_failure_is_one_line(app: Path, args: list[str], env: dict[str, str], line: str) -> None:
    result = run_app(app, *args, **env)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"refit_app: error: {line}"]
    assert "OK" not in result.stdout


@pytest.mark.parametrize(
    ("failure", "line"),
    [
        ("refit", "sink.path='/ro' is not writable: choose a directory you can write to"),
        ("bug", "KeyError: 'no such key'"),
    ],
)
def test_a_failure_in_the_task_is_one_line_after_its_warnings(app: Path, failure: str, line: str) -> None:
    result = run_app(app, TEST_APP_FAILURE=failure)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert "UserWarning: validated num_buffers=2" in result.stderr
    assert lines[-1] == f"refit_app: error: {line}"
    assert "Traceback" not in result.stderr and "Error executing job" not in result.stderr
    assert sum(line.startswith("refit_app: error:") for line in lines) == 1


def test_success_passes_stderr_through(app: Path) -> None:
    result = run_app(app, "refit.num_buffers=3")
    assert result.returncode == 0, result.stderr
    assert "OK num_buffers=3 stderr_fd=2" in result.stdout
    assert "UserWarning: validated num_buffers=3" in result.stderr
    assert "error" not in result.stderr


def test_interrupt_is_one_line(app: Path) -> None:
    result = run_app(app, TEST_APP_FAILURE="interrupt")
    assert result.returncode == 130
    assert result.stderr.splitlines()[-1] == "refit_app: error: interrupted by SIGINT"
    assert "Traceback" not in result.stderr


def test_multirun_failure_is_one_line_after_every_job_ran(app: Path) -> None:
    result = run_app(app, "-m", "refit.num_buffers=0,4")
    assert result.returncode == 1
    assert "OK num_buffers=4" in result.stdout
    lines = result.stderr.splitlines()
    assert lines[-1] == "refit_app: error: refit.num_buffers=0 is invalid: must be an integer >= 1"
    assert "Traceback" not in result.stderr and "Error executing job" not in result.stderr


def test_full_error_shows_the_traceback(app: Path) -> None:
    result = run_app(app, "refit.num_buffers=0", HYDRA_FULL_ERROR="1")
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "refit_app.common.errors.ConfigError: refit.num_buffers=0 is invalid" in result.stderr
    assert "refit_app: error:" not in result.stderr


@pytest.mark.parametrize(
    ("overrides", "world_size", "engines"),
    [
        (["role=local", "sink=vllm", "source=model", "source.path={model}"], 3, True),
        (["role=consumer", "group.rank=2", "group.world_size=3", "sink=vllm"], 3, True),
        (["role=producer", "group.rank=1", "group.world_size=3"], 3, True),  # the engine process counted, not workers
        (["role=producer", "group.rank=1", "group.world_size=4"], 4, False),
    ],
)
def test_a_sharded_refit_into_an_engine_counts_one_process_per_replica(
    overrides: list[str], world_size: int, engines: bool, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text("{}")
    s = settings("group.producers=2", "group.tp_size=2", *[o.format(model=tmp_path) for o in overrides])
    assert s.sharded is not None and (s.group.world_size, s.sharded.engines) == (world_size, engines)
    assert s.sharded == replace(s.sharded, engines=not engines)  # not part of the layout the ranks compare
