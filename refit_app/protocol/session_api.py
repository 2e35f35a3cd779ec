"""The session API that callers type against: :class:`ProducerSessionLike` and :class:`ConsumerSessionLike`.

A plain :class:`~refit_app.protocol.session.ProducerSession` / :class:`~refit_app.protocol.session.ConsumerSession`
and an elastic one (:mod:`refit_app.protocol.elastic`, which runs a plain session per generation) both satisfy them,
so code that drives rounds (the app's roles, a Ray actor) works with either without knowing which it holds.
``isinstance`` checks that the members are there (not their signatures)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import torch

from refit_app.core.meta import TensorMeta
from refit_app.protocol.manifest import Manifest
from refit_app.protocol.rounds import Round
from refit_app.protocol.session_base import Batch


@runtime_checkable
class SessionLike(Protocol):
    """What both ends of a session offer, plain or elastic."""

    @property
    def rounds(self) -> int:
        """Rounds completed (the producer) or received (a consumer)."""
        ...

    @property
    def closed(self) -> bool:
        """Whether the session is over on this side."""
        ...

    @property
    def manifest(self) -> Manifest | None:
        """The manifest in force (None before the first round)."""
        ...

    @property
    def num_chunks(self) -> int:
        """Chunks of the manifest in force."""
        ...

    def close(self) -> None:
        """End the session on this side (the producer's ends it for every rank)."""
        ...

    def __enter__(self) -> Any: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


@runtime_checkable
class ProducerSessionLike(SessionLike, Protocol):
    """The trainer's end: :meth:`send` once per step."""

    @property
    def probe_tokens(self) -> int:
        """The longest model probe a consumer asked for (0: none)."""
        ...

    @property
    def checksums_needed(self) -> bool:
        """Whether some consumer verifies (the producer then sends checksums)."""
        ...

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        metas: list[TensorMeta] | None = None,
        metadata: dict[str, str] | None = None,
        files: dict[str, str | bytes] | None = None,
        source: str = "",
        extra: bytes = b"",
    ) -> Round:
        """Send one round to every consumer; returns once every consumer has it."""
        ...


@runtime_checkable
class ConsumerSessionLike(SessionLike, Protocol):
    """An engine's end: :meth:`receive` one round at a time until the producer ends the session."""

    @property
    def last_round(self) -> Round | None:
        """The round received last."""
        ...

    def receive(
        self,
        post_unpack_func: Callable[[Batch], None] | None = None,
        return_iterator: bool = False,
        *,
        on_manifest: Callable[[Manifest], None] | None = None,
        on_round_end: Callable[[Round], dict[str, Any] | None] | None = None,
        targets: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]] | None = None,
    ) -> Round | Iterator[tuple[str, Any]] | None:
        """Receive one round; None once the producer has ended the session."""
        ...
