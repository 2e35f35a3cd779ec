"""refit_app as a user installs it: a wheel built from this checkout, installed (not editable) into a fresh virtual
environment, runs a refit from a directory outside the checkout through ``refit-app``, ``python -m refit_app`` and
the compose example.

The fresh environment gets refit_app from the wheel alone. Its dependencies (torch, Hydra, ...) are the test
environment's, made visible through a ``.pth`` file written after the install, so nothing is downloaded and the
wheel cannot be satisfied by the checkout's editable install (a ``.pth`` line adds a directory to ``sys.path`` but
does not run that directory's own ``.pth`` files, which is where the editable install lives).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from cli_utils import CLI_TIMEOUT_S, hermetic_env

pytestmark = [pytest.mark.install, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parent.parent
PROJECT_FILES = ("pyproject.toml", "README.md", "refit_app", "conf")
"""What a wheel is built from; copied out so that the build leaves nothing (build/, *.egg-info) in the checkout."""
BUILD_TIMEOUT_S = 300.0
"""Past this, building or installing the wheel has hung."""


def _run(args: list[str], cwd: Path, timeout_s: float = BUILD_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = hermetic_env(drop=("PYTHONPATH",))
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert result.returncode == 0, (
        f"`{' '.join(map(str, args))}` exited {result.returncode}\n--- stdout ---\n{result.stdout}\n"
        f"--- stderr ---\n{result.stderr}"
    )
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in PROJECT_FILES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, source / name)
    out = tmp_path_factory.mktemp("wheel")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(source),
        ],
        cwd=out,
    )
    (built,) = out.glob("refit_app-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed, and the test environment's packages beside it."""
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=root)
    python = root / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        cwd=root,
    )
    site = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).stdout.strip()
    )
    # Written after the install: pip must see an empty environment, never the test environment's refit_app.
    (site / "test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root


def test_the_wheel_ships_the_configs_and_every_subpackage(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    conf = sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "conf").rglob("*.yaml"))
    assert conf, "no configs in conf/"
    missing = [p for p in conf if f"refit_app/{p}" not in names]
    assert not missing, f"configs missing from the wheel: {missing}"
    packages = [p.parent.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "refit_app").rglob("__init__.py")]
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert not missing, f"packages missing from the wheel (list them in pyproject.toml): {missing}"


def test_the_installed_wheel_runs_outside_the_checkout(venv: Path, tmp_path: Path) -> None:
    python = venv / "bin" / "python"
    where_code = "import refit_app, refit_app.conf; print(refit_app.__file__); print(refit_app.conf.__file__)"
    where = _run([str(python), "-c", where_code], cwd=tmp_path).stdout.split()
    site = str(venv.resolve())
    assert all(path.startswith(site) for path in where), f"refit_app imported from outside the venv: {where}"

    # The console script and the module, each a default refit (role=local, synthetic tiny model, verified).
    for name, command in (("script", [str(venv / "bin" / "refit-app")]), ("module", [str(python), "-m", "refit_app"])):
        cwd = tmp_path / name
        cwd.mkdir()
        _run([*command, "refit.buffer_size_bytes=1MiB"], cwd=cwd, timeout_s=CLI_TIMEOUT_S)
        (path,) = cwd.glob("outputs/*/*_local/metrics.json")
        metrics = json.loads(path.read_text())
        assert (metrics["status"], metrics["verified"]) == ("ok", True), (name, metrics)

    # The compose example, as a user copies it out of the checkout.
    script = tmp_path / "compose_run.py"
    shutil.copy2(REPO_ROOT / "examples" / "compose_run.py", script)
    result = _run([str(python), str(script), "--output-dir", "out"], cwd=tmp_path, timeout_s=CLI_TIMEOUT_S)
    assert "consumer 1: sink=verify verified=True" in result.stdout, result.stdout
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["status"] == "ok"
