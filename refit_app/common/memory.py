"""How much memory this process can still take, for allocations that the kernel makes in full at once and that
nothing else bounds (``group.backend=shm``'s segments): past it, the OOM killer ends a process of its choice,
often not the one that asked. Reads ``/proc`` and ``/sys`` only, so a config check can use it without torch."""

from __future__ import annotations

from pathlib import Path

from refit_app.common.sizes import format_size

MEMORY_FRACTION = 0.8
"""The share of the available memory (:func:`available_memory`) that such allocations may take. MemAvailable is the
kernel's estimate of what can be had without swapping, part of it page cache that is slow to reclaim, and the ranks
allocate more afterwards (consumers the weights they receive, the producer its next update): a fifth stays free for
them rather than leaving the OOM killer to choose a victim."""
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1_NO_LIMIT = 1 << 60
"""cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages), not as ``max``."""


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    """A cgroup file's number; None where it is absent, unreadable or ``max`` (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_room(root: Path = _CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The least memory left under any memory limit on this process (limit minus usage: cgroup v2 for its cgroup
    and every ancestor, which limits its children too, and v1's memory controller); None where none is set or
    readable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rooms: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy
            here = root / path.lstrip("/")
            for d in [here, *here.parents]:
                if d == root.parent:
                    break
                limit, used = _read_int(d / "memory.max"), _read_int(d / "memory.current")
                if limit is not None and used is not None:
                    rooms.append(limit - used)
        elif "memory" in controllers.split(","):
            d = root / "memory" / path.lstrip("/")
            limit, used = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
            if limit is not None and used is not None and limit < _V1_NO_LIMIT:
                rooms.append(limit - used)
    return max(0, min(rooms)) if rooms else None


def available_memory() -> tuple[int, str] | None:
    """The memory this process can still take and what bounds it (``MemAvailable``, or its cgroup's limit); None
    where neither can be read (callers then skip their check)."""
    found = ((_meminfo_available(), "MemAvailable"), (cgroup_room(), "its cgroup's limit"))
    known = [(n, what) for n, what in found if n is not None]
    return min(known) if known else None


def memory_problem(nbytes: int, committed: int = 0) -> str | None:
    """Why allocating ``nbytes`` more, on top of ``committed`` bytes the caller holds already, risks the OOM killer
    (None: it fits). What the caller holds is no longer available, so it counts on both sides: together they may
    take :data:`MEMORY_FRACTION` of what was there for them."""
    found = available_memory()
    if found is None:
        return None
    available, bound = found
    if committed + nbytes <= int((available + committed) * MEMORY_FRACTION):
        return None
    held = f" on top of the {format_size(committed)} held already" if committed else ""
    return (
        f"{format_size(nbytes)}{held} would not fit in the {format_size(available)} this process can still take "
        f"({bound}; at most {MEMORY_FRACTION:.0%} of it is used)"
    )
