"""The experiment-script path: ``compose`` a config and call :func:`refit_app.run`, in this process and through
``examples/compose_run.py`` as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_utils import COVER_STARTUP, local_metrics
from config_utils import compose_config
from omegaconf import OmegaConf

from refit_app import run
from refit_app.app.config import validate
from refit_app.app.runner import RESOLVED_CONFIG_FILE
from refit_app.common.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "compose_run.py"
MiB = 2**20


def test_run_composed_config_in_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(["refit.buffer_size_bytes=1MiB", "refit.num_buffers=1"])
    metrics = run(cfg)

    assert (metrics["role"], metrics["status"], metrics["verified"]) == ("local", "ok", True)
    assert metrics["buffer_size_bytes"] == MiB and metrics["num_buffers"] == 1
    assert metrics["num_chunks"] > 1 and metrics["bytes"] > 0
    (consumer,) = metrics["consumers"]
    assert consumer["verified"] is True and consumer["num_chunks"] == metrics["num_chunks"]
    # Outside @hydra.main and without output_dir, a run leaves nothing behind in the working directory.
    assert list(tmp_path.iterdir()) == []


def test_the_saved_config_is_the_one_the_run_used(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(["sink=discard"])
    metrics = run(cfg, output_dir="out")
    saved = OmegaConf.load(tmp_path / "out" / RESOLVED_CONFIG_FILE)
    # What the run resolved where the config said null: the library's buffer size, role=local's port and size.
    assert saved.refit.buffer_size_bytes == metrics["buffer_size_bytes"] > 0
    assert isinstance(saved.group.port, int) and saved.group.world_size == metrics["world_size"] == 2
    assert saved.refit.num_buffers == metrics["num_buffers"]  # the environment default, resolved
    # Given back, it is the same run's config, and a valid one.
    again = validate(OmegaConf.merge(cfg, saved))
    assert (again.refit.buffer_size_bytes, again.group.port) == (metrics["buffer_size_bytes"], saved.group.port)


def test_run_refuses_a_bad_composed_config():
    with pytest.raises(ConfigError, match=r"refit\.num_buffers=0 is invalid"):
        run(compose_config(["refit.num_buffers=0"]))


def test_example_script(cli, tmp_path):
    result = cli.script(EXAMPLE, "refit.num_buffers=3", "--output-dir", "out")
    assert result.returncode == 0, result.describe()
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert (metrics["status"], metrics["verified"], metrics["num_buffers"]) == ("ok", True, 3)
    assert metrics["buffer_size_bytes"] == MiB and metrics["num_chunks"] > 1
    # The figures it prints are the run's own.
    assert f"{metrics['num_tensors']} tensors / {metrics['num_chunks']} chunks" in result.stdout, result.describe()
    assert "consumer 1: sink=verify verified=True" in result.stdout, result.describe()
    assert (tmp_path / "out" / "config_resolved.yaml").is_file()


def test_example_script_reports_a_failed_refit(cli):
    result = cli.script(EXAMPLE, "refit.num_buffers=0")
    assert result.returncode == 1, result.describe()
    assert "refit.num_buffers=0 is invalid" in result.stderr, result.describe()
    assert "Traceback" not in result.stderr, result.describe()


CUSTOM_SINK_EXAMPLE = EXAMPLE.parent / "custom_sink.py"


def test_custom_sink_example_loads_into_the_scripts_own_module(cli):
    result = cli.script(CUSTOM_SINK_EXAMPLE)
    assert result.returncode == 0, result.describe()
    assert "loaded 4 tensors into the network; outputs match the trainer's: True" in result.stdout, result.describe()


def test_a_custom_sink_that_cannot_be_imported_is_one_line(cli):
    result = cli("sink=custom", "sink._target_=no_such_module.Sink", COVER_STARTUP)
    assert result.returncode == 1, result.describe()
    assert result.stderr_lines() == [
        "refit_app: error: _target_='no_such_module.Sink': cannot import no_such_module (No module named "
        "'no_such_module')"
    ], result.describe()


def test_a_custom_source_of_the_users_own(cli, tmp_path):
    (tmp_path / "my_source.py").write_text(
        "import torch\n"
        "from refit_app.core.meta import TensorMeta\n"
        "class Ones:\n"
        "    def __init__(self, n):\n"
        "        self.n = n\n"
        "    def describe(self):\n"
        "        return f'{self.n} ones'\n"
        "    def manifest_tensors(self):\n"
        "        return [TensorMeta('ones', (self.n,), torch.float32)]\n"
        "    def metadata(self):\n"
        "        return {}\n"
        "    def tensors(self):\n"
        "        yield 'ones', torch.ones(self.n)\n"
    )
    result = cli(
        "source=custom",
        "source._target_=my_source.Ones",
        "+source.n=1000",
        COVER_STARTUP,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 0, result.describe()
    metrics = local_metrics(tmp_path)
    assert (metrics["source"], metrics["bytes"], metrics["verified"]) == ("1000 ones", 4000, True)


SESSION_EXAMPLE = EXAMPLE.parent / "session_loop.py"
RL_LOOP_PAGE = EXAMPLE.parent.parent / "docs" / "rl-loop.md"


def test_session_example_runs_and_the_docs_show_the_file_itself(cli):
    # The page holds the file itself, between docs/hooks.py's markers (readable where the site is not built), and
    # tests/test_docs.py fails when that copy is stale; here: the copy is this file.
    assert SESSION_EXAMPLE.read_text().strip() in RL_LOOP_PAGE.read_text()
    result = cli.script(SESSION_EXAMPLE)
    assert result.returncode == 0, result.describe()
    assert "the engine serves the trainer's last weights: True" in result.stdout, result.describe()
    assert result.stdout.count("verified: True") == 3, result.describe()
