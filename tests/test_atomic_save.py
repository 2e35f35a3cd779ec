"""A checkpoint directory is published all at once: a save killed at any step leaves the old checkpoint or the new
one, never a mix, and keeps the user's own files in the directory.

The kill comes from a subprocess that wraps the writer's steps (each shard's rename, the index, carrying the old
directory's files over, the directory switch, the removal of the old directory) to SIGKILL itself just before or
just after step N; N runs from 0 until a save completes, so every moment between two steps is tried once. One
subprocess imports torch once and forks a saver per kill point (a fresh interpreter each time cost the suite a
minute and a half on busy cores); the saver is a separate process all the same, killed as a crash would kill it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from mp_utils import STARTUP_LIMIT_S
from safetensors import safe_open

from refit_app.checkpoint import publish
from refit_app.checkpoint.layout import INDEX_FILE_NAME
from refit_app.checkpoint.reader import Checkpoint
from refit_app.checkpoint.writer import CheckpointWriter
from refit_app.core.meta import TensorMeta

SAVE_TIMEOUT_S = STARTUP_LIMIT_S
"""One save of a few KiB in a fresh interpreter: its start-up (torch) is nearly all of it, so the start-up limit."""
MAX_STEPS = 40
"""More kill points than the writer has steps: reaching it means a save never completes."""

_KILLING_SAVES = textwrap.dedent("""
    import os, shutil, signal, sys
    from refit_app.checkpoint import writer as io  # commit looks the steps up there
    sys.path.insert(0, sys.argv[2])
    from test_atomic_save import checkpoint_spec, save_version

    def killing_save(kill_at):
        events, in_commit = [0], [False]

        def step(fn):
            def wrapped(*args, **kwargs):
                if not in_commit[0]:
                    return fn(*args, **kwargs)
                for when in ("before", "after"):
                    if events[0] == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    events[0] += 1
                    if when == "before":
                        result = fn(*args, **kwargs)
                return result
            return wrapped

        commit = io.CheckpointWriter.commit
        def counted_commit(self):
            in_commit[0] = True
            return commit(self)
        io.CheckpointWriter.commit = counted_commit
        io.SafetensorsWriter.publish = step(io.SafetensorsWriter.publish)
        for name in ("write_atomic", "carry_over", "switch_dirs"):
            setattr(io, name, step(getattr(io, name)))
        shutil.rmtree = step(shutil.rmtree)
        save_version(sys.argv[1], "new")

    # One kill point per line on stdin; a forked saver per point; its end on stdout: "killed", "saved" or "failed".
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                killing_save(int(line))
            except BaseException:
                import traceback
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            print("killed", flush=True)
        else:
            print("saved" if os.waitstatus_to_exitcode(status) == 0 else "failed", flush=True)
""")


def checkpoint_spec(version: str) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, str]]:
    """Tensors, shard of each tensor, companion files: "old" in three shards, "new" in two others."""
    seed = 1 if version == "old" else 2
    g = torch.Generator().manual_seed(seed)
    tensors = {f"layers.{i}.w": torch.randn(4, 8, generator=g) for i in range(6)}
    shards = 3 if version == "old" else 2
    shard_of = {name: f"{version}-{i * shards // len(tensors)}.safetensors" for i, name in enumerate(tensors)}
    return tensors, shard_of, {"config.json": json.dumps({"version": version})}


def save_version(directory: str | Path, version: str) -> None:
    """Save :func:`checkpoint_spec`'s ``version`` into ``directory`` through refit_app's writer (the code under
    test: its commit is what the kill points wrap)."""
    tensors, shard_of, files = checkpoint_spec(version)
    metas = [TensorMeta(n, tuple(t.shape), t.dtype, shard_of[n]) for n, t in tensors.items()]
    writer = CheckpointWriter(directory, metas, {"format": "pt"}, files)
    writer.open()
    for name, t in tensors.items():
        writer.write(name, t)
    writer.commit()


def loaded_version(directory: Path) -> str:
    """ "old" or "new", from the weights (through the index and the safetensors package) and the config alike;
    fails on anything else: a mix, a missing file, an unloadable directory."""
    index = json.loads((directory / INDEX_FILE_NAME).read_text())
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(directory / shard, framework="pt") as f:
            got.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 (not a dict)
    assert {n for n, _ in Checkpoint(directory).iter_tensors()} == set(got)
    matches = []
    for version in ("old", "new"):
        tensors, shard_of, files = checkpoint_spec(version)
        if (
            index["weight_map"] == shard_of
            and set(got) == set(tensors)
            and all(torch.equal(got[n], t) for n, t in tensors.items())
        ):
            assert (directory / "config.json").read_text() == files["config.json"]
            weights = sorted(p.name for p in directory.glob("*.safetensors") if p.name.startswith(("old-", "new-")))
            assert weights == sorted(set(shard_of.values())), "old shards beside new ones"
            matches.append(version)
    assert len(matches) == 1, f"{directory} holds a mix of the old and the new checkpoint"
    return matches[0]


def user_files(directory: Path) -> dict[str, str]:
    return {
        "tokenizer.json": (directory / "tokenizer.json").read_text(),
        "notes/readme.txt": (directory / "notes" / "readme.txt").read_text(),
    }


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next line ``proc`` prints, or a failure after ``timeout_s`` (a reader thread: a pipe has no deadline)."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not got:
        pytest.fail(f"no answer from the saving process in {timeout_s} s")
    return got[0].strip()


def test_a_save_killed_at_every_step_leaves_old_or_new(tmp_path):
    target = tmp_path / "ckpt"
    save_version(target, "old")
    (target / "tokenizer.json").write_text('{"user": "file"}')
    (target / "notes").mkdir()
    (target / "notes" / "readme.txt").write_text("mine")
    mine = user_files(target)
    tests_dir = str(Path(__file__).parent)
    seen = []
    saver = subprocess.Popen(
        [sys.executable, "-c", _KILLING_SAVES, str(target), tests_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for kill_at in range(MAX_STEPS):
            print(kill_at, file=saver.stdin, flush=True)
            ended = read_line(saver, SAVE_TIMEOUT_S)
            if ended == "saved":
                break
            assert ended == "killed", f"the save at kill point {kill_at} ended {ended!r} (its traceback is above)"
            seen.append(loaded_version(target))
            assert user_files(target) == mine, f"killed at step {kill_at}"
        else:
            pytest.fail(f"the save never completed in {MAX_STEPS} steps")
    finally:
        saver.kill()
        saver.wait()
    # Every shard, the index, the carry-over, the switch (before and after) and the removal of the old directory.
    assert kill_at >= 12, kill_at
    # Old until the switch, new from the moment it happened: each kill point was really taken.
    assert seen == ["old"] * seen.count("old") + ["new"] * seen.count("new") and "old" in seen and "new" in seen
    assert loaded_version(target) == "new" and user_files(target) == mine
    # Each save removed what the killed one before it had left; the last left nothing.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_save_keeps_user_files_and_drops_only_old_weights(tmp_path):
    target = tmp_path / "ckpt"
    save_version(target, "old")
    (target / "tokenizer.json").write_text("t")
    (target / "extra.safetensors").write_bytes(b"not named by the index: the user's")
    save_version(target, "new")
    assert loaded_version(target) == "new"
    assert (target / "tokenizer.json").read_text() == "t"
    assert (target / "extra.safetensors").exists()
    assert not any(p.name.startswith("old-") for p in target.iterdir())


def test_without_directory_exchange_two_renames_publish_it(tmp_path, monkeypatch):
    monkeypatch.setattr(publish, "exchange_dirs", lambda a, b: False)
    target = tmp_path / "ckpt"
    save_version(target, "old")
    (target / "tokenizer.json").write_text("t")
    save_version(target, "new")
    assert loaded_version(target) == "new" and (target / "tokenizer.json").read_text() == "t"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_symlinked_directory_stays_a_link(tmp_path):
    real = tmp_path / "real"
    save_version(real, "old")
    link = tmp_path / "link"
    link.symlink_to(real)
    save_version(link, "new")
    assert link.is_symlink() and loaded_version(real) == "new"


def test_a_live_save_is_not_cleaned_away(tmp_path):
    tensors, shard_of, _ = checkpoint_spec("old")
    metas = [TensorMeta(n, tuple(t.shape), t.dtype, shard_of[n]) for n, t in tensors.items()]
    first = CheckpointWriter(tmp_path / "ckpt", metas)
    first.open()
    save_version(tmp_path / "ckpt", "new")  # another save into the same place meanwhile
    assert first.staging is not None and first.staging.is_dir()
    first.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("lost", ["before_the_lock", "while_locked_by_the_remover"])
def test_a_staging_directory_removed_before_its_lock_is_replaced(tmp_path, monkeypatch, lost):
    """Another save's clean-up may remove a new staging directory in the moment between its creation and its lock
    (it looks like a killed save's). The save then claims another one and completes; nothing is left beside it."""
    real_locked_dir = publish._locked_dir
    calls = []

    def racing_locked_dir(path):
        calls.append(path)
        if len(calls) == 1:
            if lost == "before_the_lock":
                path.rmdir()  # the remover got there first: our open finds nothing
                return real_locked_dir(path)
            fd = real_locked_dir(path)  # we opened and locked it, but the remover had removed it by then
            path.rmdir()
            return fd
        return real_locked_dir(path)

    monkeypatch.setattr(publish, "_locked_dir", racing_locked_dir)
    target = tmp_path / "ckpt"
    save_version(target, "new")
    assert len(calls) == 2 and calls[0] != calls[1]
    assert loaded_version(target) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
