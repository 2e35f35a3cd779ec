"""Publishing a checkpoint directory as a whole: the staging directory a save writes into (named beside its
target, locked while its save lives), the swap that puts it in the target's place (one ``renameat2(RENAME_EXCHANGE)``
where the system has it, two renames elsewhere), the user's own files carried over from the old directory, and the
removal of what killed saves left behind. :class:`~refit_app.checkpoint.writer.CheckpointWriter` says how a save
uses them and what a reader, or a crash, can see.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import stat
import sys
from pathlib import Path

from refit_app.common.errors import SinkError

logger = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_STAGING_INFIX = ".refit-save-"
_STAGING_TRIES = 5
_OUR_TEMP_FILE = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")
"""Names :func:`~refit_app.common.files.create_temp` gives: a killed save's temporary files, never carried forward."""


def _staging_pattern(target: Path) -> re.Pattern[str]:
    return re.compile(rf"^\.{re.escape(target.name)}{re.escape(_STAGING_INFIX)}[0-9a-f]{{12}}$")


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap the directory entries ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where
    this system or file system cannot (no such call, or EINVAL/ENOTSUP from the file system)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28+, musl 1.2.5+
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def switch_dirs(staging: Path, target: Path) -> None:
    """Make ``staging`` the directory at ``target``; the previous one, if any, ends up at ``staging``'s name.

    One atomic step where ``target`` does not exist yet (a rename) or where the system can exchange two
    directories; elsewhere two renames, between which ``target`` is briefly missing (never a mix of old and new).
    """
    if not os.path.lexists(target):
        os.rename(staging, target)
        return
    if exchange_dirs(staging, target):
        return
    logger.warning("this system cannot exchange two directories in one step; replacing %s with two renames", target)
    aside = staging.with_name(f".{target.name}{_STAGING_INFIX}{secrets.token_hex(6)}")
    os.rename(target, aside)
    os.rename(staging, target)
    os.rename(aside, staging)


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link ``src`` at ``dst`` (free, same file system), or copy it where links are refused."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        if not stat.S_ISREG(os.lstat(src).st_mode):
            logger.warning("not carrying %s into the new checkpoint: not a regular file", src)
            return
        shutil.copy2(src, dst)


def carry_over(old: Path, new: Path, skip: set[str]) -> None:
    """Bring every entry of ``old`` that is not in ``skip`` into ``new``: the user's own files (a tokenizer, a
    README, a subdirectory) survive a save that replaces the directory holding them."""
    for entry in os.scandir(old):
        if entry.name in skip or _OUR_TEMP_FILE.match(entry.name):
            continue
        dst = new / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), dst)
        elif entry.is_dir():
            shutil.copytree(entry.path, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry.path, str(dst))


def _locked_dir(path: Path) -> int | None:
    """An open descriptor of the directory ``path`` holding its exclusive lock, or None if a live process holds
    it (a save in progress). The lock dies with its process, so a killed save's directory is free to take."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open directory ``fd`` is still the one at ``path`` (not removed, not replaced)."""
    try:
        here, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def remove_leftovers(target: Path) -> None:
    """Remove what saves into ``target`` that were killed left beside it: directories named as this module names
    its staging directories and locked by no live process."""
    pattern = _staging_pattern(target)
    try:
        names = [n for n in os.listdir(target.parent) if pattern.match(n)]
    except OSError:
        return
    for name in names:
        path = target.parent / name
        fd = _locked_dir(path)
        if fd is None:
            continue
        try:
            logger.info("removing %s, left by an interrupted save", path)
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)


def claim_staging(target: Path) -> tuple[Path, int]:
    """A new staging directory beside ``target``, locked by this process.

    Between its creation and its lock another save's :func:`remove_leftovers` may take it for a killed save's
    and remove it: the lock then fails, or holds a directory no longer at that path. Either way, try a new one.
    """
    for _ in range(_STAGING_TRIES):
        staging = target.parent / f".{target.name}{_STAGING_INFIX}{secrets.token_hex(6)}"
        try:
            staging.mkdir()
        except OSError as e:
            raise SinkError(
                f"cannot create a directory in {target.parent}: {e.strerror or e} (a checkpoint is "
                "written beside its directory and swapped in whole, so the parent must be "
                "writable)"
            ) from e
        fd = _locked_dir(staging)
        if fd is not None and _is_at(fd, staging):
            return staging, fd
        if fd is not None:
            os.close(fd)
        logger.info("%s was removed by another save before this one locked it; trying another", staging)
    raise SinkError(
        f"could not keep a staging directory beside {target} in {_STAGING_TRIES} tries: other "
        "processes removed each one; is another save running into the same place?"
    )
