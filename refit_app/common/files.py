"""Writing files so that a reader, or a crash, never sees one half-written: the one way this project does it."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def create_temp(final: Path) -> tuple[int, Path]:
    """A new, open, hidden ``.<name>.<random>.tmp`` beside ``final`` (same file system, so a rename is atomic).

    Not ``tempfile.mkstemp``: its 0600 mode would survive the rename and hide the file from, say, an inference
    server running as another user; ``os.open`` applies the umask like any other saved file.
    """
    while True:
        tmp = final.parent / f".{final.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def fsync_dir(directory: Path) -> None:
    """Make renames in ``directory`` durable: without it a crash can lose the new directory entry."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes, *, durable: bool = False) -> None:
    """Replace ``path`` with ``data`` in one step. ``durable`` also survives a power loss (fsync of the file and
    of its directory): for checkpoints, not for logs and summaries that a rerun rewrites anyway."""
    path = Path(path)
    fd, tmp = create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
