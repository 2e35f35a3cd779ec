"""A built model's weights by name, with tied aliases resolved, as the trainer sends them and the engine loads them:
both check a checkpoint or a manifest against the model with :meth:`NamedWeights.coverage_problems`."""

from __future__ import annotations

from collections.abc import Collection

import torch

from refit_app.common.errors import some_of
from refit_app.core.meta import dtype_to_str


class NamedWeights:
    """A model's parameters and persistent buffers by name, with tied aliases resolved to one tensor.

    ``names`` lists one name per distinct tensor in module order: the alias found in ``preferred`` (the
    checkpoint's or the manifest's spelling) when there is one, else the module's first name for it.
    """

    def __init__(self, model: torch.nn.Module, preferred: Collection[str] = ()):
        preferred = set(preferred)
        groups: dict[int, list[str]] = {}
        self._tensor: dict[str, torch.Tensor] = {}
        # keep_vars: the Parameter objects themselves, so tied names (one object) group together and copy_
        # writes into the live model.
        for name, t in model.state_dict(keep_vars=True).items():
            groups.setdefault(id(t), []).append(name)
            self._tensor[name] = t
        self.names: list[str] = []
        self._canonical: dict[str, str] = {}
        self._aliases: dict[str, list[str]] = {}
        for aliases in groups.values():
            name = next((a for a in aliases if a in preferred), aliases[0])
            self.names.append(name)
            self._aliases[name] = aliases
            for a in aliases:
                self._canonical[a] = name

    def canonical(self, name: str) -> str | None:
        return self._canonical.get(name)

    def aliases(self, canonical: str) -> list[str]:
        return self._aliases[canonical]

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensor[name]

    def coverage_problems(
        self, incoming: dict[str, tuple[tuple[int, ...], torch.dtype | None]], what: str
    ) -> list[str]:
        """What is wrong with loading ``incoming`` (name -> shape, dtype or None for any) into this model."""
        unknown = [repr(n) for n in incoming if n not in self._canonical]
        wrong = []
        for n, (shape, dtype) in incoming.items():
            if n in self._canonical:
                t = self._tensor[n]
                if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
                    got = f"{dtype_to_str(dtype)} " if dtype is not None else ""
                    wrong.append(
                        f"{n!r} ({got}{list(shape)} in the {what}, "
                        f"{dtype_to_str(t.dtype)} {list(t.shape)} in the model)"
                    )
        missing, twice = [], []
        for name in self.names:
            present = [a for a in self._aliases[name] if a in incoming]
            if not present:
                missing.append(repr(name))
            elif len(present) > 1:
                twice.append(" = ".join(map(repr, present)))
        problems = []
        if unknown:
            problems.append(f"{len(unknown)} tensor(s) in the {what} are not in the model: {some_of(unknown)}")
        if wrong:
            problems.append(f"{len(wrong)} tensor(s) with the wrong shape or dtype: {some_of(wrong)}")
        if missing:
            problems.append(f"{len(missing)} model tensor(s) missing from the {what}: {some_of(missing)}")
        if twice:
            problems.append(f"{len(twice)} tied tensor(s) listed under several names: {some_of(twice)}")
        return problems
