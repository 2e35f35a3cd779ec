"""Namespace hosts (``scripts/netns_hosts.sh``) for the tests and scripts that run ranks on them: making and removing
the hosts, ``python -m refit_app`` in one of them, what crossed a host's link, and stopping every process left in a
namespace by its own process ids (never by a name, which would reach other people's processes on the machine).

Imports only the standard library: ``scripts/ray_link.py`` uses it too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

NETNS_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "netns_hosts.sh"
STOP_GRACE_S = 10.0
"""How long the processes left in a namespace get to end after SIGTERM, before SIGKILL."""


def hosts_sh(*args: str) -> subprocess.CompletedProcess:
    """``scripts/netns_hosts.sh *args``."""
    return subprocess.run([str(NETNS_SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False)


def listed_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@contextmanager
def namespace_hosts(prefix: str) -> Iterator[Callable[..., list[str]]]:
    """``make(n, rate="none")`` creates the hosts ``prefix1..n`` (10.77.0.1..n) and returns their names; every
    host made goes at the end, its processes killed first (``netns_hosts.sh down``)."""
    made = False

    def make(n: int, rate: str = "none") -> list[str]:
        nonlocal made
        made = True
        result = hosts_sh("up", str(n), rate, prefix)
        if result.returncode != 0:
            raise RuntimeError(f"netns_hosts.sh up {n} {rate} {prefix} failed: {result.stderr.strip()}")
        return [f"{prefix}{k}" for k in range(1, n + 1)]

    try:
        yield make
    finally:
        if made:
            hosts_sh("down", prefix)


class Rank:
    """``python -m refit_app`` in one namespace host, its output in files (a full pipe would stall it)."""

    def __init__(self, ns: str, cwd: Path, name: str, *overrides: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.out = cwd / f"{name}.out"
        self.err = cwd / f"{name}.err"
        self.started = time.monotonic()
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    sys.executable,
                    "-m",
                    "refit_app",
                    *overrides,
                    f"hydra.run.dir={cwd / name}",
                ],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def wait_for(self, pattern: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} never printed {pattern!r}:\n{self.text()[-3000:]}")
            time.sleep(0.05)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} still running after {timeout_s:g}s:\n{self.text()[-3000:]}") from None

    def error_lines(self) -> list[str]:
        return [line for line in self.err.read_text().splitlines() if line.startswith("refit_app: error:")]

    def metrics(self) -> dict:
        return json.loads((self.out.parent / self.name / "metrics.json").read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)


def rx_bytes(ns: str) -> int:
    """The bytes host ``ns`` has received on its link (eth0) since it was made."""
    out = subprocess.run(
        ["ip", "-n", ns, "-j", "-s", "link", "show", "dev", "eth0"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def namespace_pids(ns: str) -> list[int]:
    """The processes in network namespace ``ns`` (as ``ip netns pids``); none where it does not exist."""
    try:
        target = os.stat(f"/run/netns/{ns}")
    except OSError:
        return []
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                st = os.stat(f"/proc/{entry.name}/ns/net")
            except OSError:  # gone, or a zombie
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                pids.append(int(entry.name))
    return pids


def _signal_in(ns_stat: os.stat_result, pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid`` only if it is (still) in the namespace: a pidfd pins the process, so a pid reused by
    another process in between is never signalled."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
        if (st.st_dev, st.st_ino) == (ns_stat.st_dev, ns_stat.st_ino):
            signal.pidfd_send_signal(fd, sig)
    except OSError:
        pass
    finally:
        os.close(fd)


def stop_namespace_processes(
    namespaces: list[str], grace_s: float = STOP_GRACE_S, last: str | None = None
) -> list[str]:
    """End every process in ``namespaces``, one namespace after the other: SIGTERM (to the processes whose command
    line contains ``last`` only once the others have ended: a server its clients need until they go), then SIGKILL
    to what is left ``grace_s`` after the first SIGTERM. Returns the command lines of any process still there 10 s
    after that (none, unless one hangs in the kernel)."""
    left = []
    for ns in namespaces:
        try:
            ns_stat = os.stat(f"/run/netns/{ns}")
        except OSError:
            continue
        deadline = time.monotonic() + grace_s
        for stage in (lambda pid: last is None or last not in _cmdline(pid), lambda pid: True):
            for pid in filter(stage, namespace_pids(ns)):
                _signal_in(ns_stat, pid, signal.SIGTERM)
            while [pid for pid in namespace_pids(ns) if stage(pid)] and time.monotonic() < deadline:
                time.sleep(0.1)
        for pid in namespace_pids(ns):
            _signal_in(ns_stat, pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while namespace_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.1)
        left += [_cmdline(pid) for pid in namespace_pids(ns)]
    return left


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return f"pid {pid} (gone)"
