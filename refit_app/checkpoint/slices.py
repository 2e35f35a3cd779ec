"""Slices of a sharded refit saved as checkpoints: each tensor-parallel consumer's directory holds, in an ordinary
``model.safetensors``, the part of every tensor it received (under the tensor's global name, shaped as its part),
and in the file's ``__metadata__`` under :data:`SLICES_KEY` which part that is::

    {"format": 1, "run": "5f0c...", "round": 3, "tp_rank": 1, "tp_size": 2,
     "tensors": {"model.layers.0.mlp.up_proj.weight": {"shape": [128, 64], "box": [[64, 128], [0, 64]]}, ...}}

``shape`` is the whole tensor's, ``box`` a ``[start, stop)`` pair per dim of it (``[]`` for a 0-dim tensor);
``run`` is the same in every directory one run wrote and ``round`` the round whose values the file holds, so a
reader can tell directories of one save apart from a mix. :func:`read_slices` reads one directory,
:func:`assemble_slices` puts the tensor-parallel ranks' directories back together into whole tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from refit_app.checkpoint.reader import Checkpoint
from refit_app.common.errors import SourceError

SLICES_KEY = "refit_app.slices"
"""The ``__metadata__`` key of a saved slice file: what each tensor in it is a part of (the module docstring)."""
SLICES_FORMAT = 1

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class SavedSlices:
    """One consumer's saved directory: its slices, each with its box and the whole tensor's shape."""

    path: Path
    run: str
    round: int
    tp_rank: int
    tp_size: int
    tensors: dict[str, tuple[torch.Tensor, Box, tuple[int, ...]]]
    """name -> (the slice, its box in the whole tensor, the whole tensor's shape)."""


def slices_metadata(
    parts: Iterable[tuple[str, Sequence[int], Box]], *, run: str, round_: int, tp_rank: int, tp_size: int
) -> dict[str, str]:
    """The ``__metadata__`` of a slice file: ``parts`` are (name, the whole tensor's shape, the slice's box)."""
    doc = {
        "format": SLICES_FORMAT,
        "run": run,
        "round": round_,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "tensors": {name: {"shape": list(shape), "box": [list(b) for b in box]} for name, shape, box in parts},
    }
    return {SLICES_KEY: json.dumps(doc, separators=(",", ":"))}


def read_slices(directory: str | os.PathLike) -> SavedSlices:
    """The slices saved in ``directory``. Raises SourceError where it holds no slice metadata, where a box does not
    lie inside its tensor's shape, or where a tensor's shape is not its box's."""
    ckpt = Checkpoint(directory)
    raw = ckpt.metadata().get(SLICES_KEY)
    if raw is None:
        raise SourceError(f"{directory} holds no {SLICES_KEY!r} metadata: not the slices of a sharded refit")
    try:
        doc = json.loads(raw)
        parts = {name: (tuple(e["shape"]), tuple((a, b) for a, b in e["box"])) for name, e in doc["tensors"].items()}
        head = (str(doc["run"]), int(doc["round"]), int(doc["tp_rank"]), int(doc["tp_size"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SourceError(f"{directory}: malformed {SLICES_KEY!r} metadata: {e}") from e
    tensors: dict[str, tuple[torch.Tensor, Box, tuple[int, ...]]] = {}
    problems, in_file = [], set()
    for name, t in ckpt.iter_tensors():
        in_file.add(name)
        shape, box = parts.get(name, (None, None))
        if box is not None and not _inside(box, shape):
            problems.append(f"{name!r}: box {list(box)} does not lie inside its shape {list(shape)}")
            continue
        if box is None or tuple(t.shape) != tuple(b - a for a, b in box):
            problems.append(f"{name!r} {list(t.shape)} is not its box {box}")
            continue
        tensors[name] = (t.clone(), box, shape)
    problems += [f"{name!r} is in the metadata but not in the file" for name in sorted(set(parts) - in_file)]
    if problems:
        raise SourceError(f"{directory}: {'; '.join(problems)}")
    run, round_, tp_rank, tp_size = head
    return SavedSlices(Path(directory), run, round_, tp_rank, tp_size, tensors)


def assemble_slices(directories: Iterable[str | os.PathLike]) -> dict[str, torch.Tensor]:
    """Whole tensors from the directories of every tensor-parallel rank of one save: each tensor's boxes must come
    from one run and round, cover it, and agree bit for bit where they overlap (a tensor every rank holds whole).
    Raises SourceError naming the first problem."""
    saved = sorted((read_slices(d) for d in directories), key=lambda s: s.tp_rank)
    if not saved:
        raise SourceError("no slice directories to assemble")
    first = saved[0]
    ranks = [s.tp_rank for s in saved]
    if ranks != list(range(first.tp_size)):
        raise SourceError(f"the directories hold tensor-parallel ranks {ranks}, not 0..{first.tp_size - 1}")
    for s in saved:
        if (s.run, s.round) != (first.run, first.round):
            raise SourceError(
                f"{s.path} is from run {s.run} round {s.round}, {first.path} from run {first.run} round {first.round}"
            )
    whole: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for s in saved:
        for name, (t, box, shape) in s.tensors.items():
            if name not in whole:
                whole[name] = torch.empty(shape, dtype=t.dtype)
                covered[name] = torch.zeros(shape, dtype=torch.bool)
            elif (tuple(whole[name].shape), whole[name].dtype) != (shape, t.dtype):
                raise SourceError(
                    f"{s.path}: tensor {name!r} is {t.dtype} of {list(shape)} here, {whole[name].dtype} of "
                    f"{list(whole[name].shape)} in another rank's directory"
                )
            region = tuple(slice(a, b) for a, b in box)
            seen = covered[name][region]
            if seen.any() and not _same_bits(whole[name][region][seen], t[seen]):
                raise SourceError(f"{s.path}: tensor {name!r} {list(box)} differs from another rank's copy")
            whole[name][region] = t
            covered[name][region] = True
    gaps = [name for name, c in covered.items() if not c.all()]
    if gaps:
        raise SourceError(f"the slices do not cover tensor(s) {', '.join(map(repr, gaps))}")
    return whole


def _inside(box: Box, shape: tuple[int, ...]) -> bool:
    return len(box) == len(shape) and all(0 <= a <= b <= n for (a, b), n in zip(box, shape))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
