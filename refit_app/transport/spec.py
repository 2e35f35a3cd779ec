"""Typed settings that the rest of the code takes as they are: each rule about a value is checked here, once,
when the settings object is made (from the config by :func:`refit_app.app.config.validate`, or by a library user).

Nothing here imports torch, so checking a config stays fast.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from refit_app.common.checks import Problems, is_int

BACKENDS = ("auto", "gloo", "nccl", "pynccl", "shm")
"""``auto`` resolves, at the rendezvous, to ``shm`` where every rank is on the producer's host (and at least one
has no CUDA GPU), to NCCL where every rank has a CUDA GPU, and to gloo otherwise."""
TOPOLOGIES = ("tree", "chain")
"""How a broadcast travels: ``tree``, the backend's own collective (gloo: a binomial tree, the whole buffer per hop;
NCCL: pipelined rings); ``chain``, each consumer relays every chunk to the next rank
(:mod:`refit_app.transport.chain`), gloo
only."""
DEFAULT_TOPOLOGY = "tree"
RELAY_BACKENDS = ("auto", "gloo")
"""The backends ``chain`` runs on: NCCL pipelines its own broadcast, and ``auto`` resolves to gloo under ``chain``."""
ON_CONSUMER_LOSS = ("fail", "continue")
"""What a session does when a consumer dies or misses a deadline: ``fail``, every rank stops with the reason (a
one-shot refit); ``continue``, the producer and the other consumers go on without it, and it may rejoin
(:mod:`refit_app.transport.elastic`)."""
DEFAULT_ON_CONSUMER_LOSS = "fail"
ELASTIC_BACKENDS = ("auto", "gloo")
"""The backends ``continue`` runs on: it rebuilds a gloo group for every change of members (an NCCL communicator
could be rebuilt as well, but no GPU has run it here); ``auto`` means gloo under ``continue``."""


def elastic_problem(spec: GroupSpec) -> str | None:
    """Why ``refit.on_consumer_loss=continue`` cannot run on ``spec``'s group, as one line; None where it can."""
    if spec.token is None:
        return (
            "refit.on_consumer_loss=continue needs group.token (or REFIT_APP_TOKEN) on every rank: without it any "
            "process that reaches the port could take a lost consumer's place"
        )
    if spec.backend not in ELASTIC_BACKENDS:
        return (
            "refit.on_consumer_loss=continue runs on gloo only (group.backend=auto or gloo), not "
            f"group.backend={spec.backend}"
        )
    if spec.topology != "tree":
        return (
            "refit.on_consumer_loss=continue needs group.topology=tree: in a chain every rank after a lost one is "
            "cut off with it, and the relay is not rebuilt; use group.topology=tree or refit.on_consumer_loss=fail"
        )
    return None


DERIVED_FIELDS = ("shm_ring_bytes",)
""":class:`GroupSpec` fields that no ``group.*`` key sets: the app derives them from its other settings."""
_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
PRODUCER_RANK = 0
DEFAULT_HOST = "127.0.0.1"
"""The producer's address when none is given: this machine, over loopback."""
DEFAULT_PORT = 29500
"""Rendezvous port of a producer and its consumers when ``group.port`` is null (``role=local`` picks a free one)."""
DEFAULT_TIMEOUT_S = 60.0
MIN_TIMEOUT_S = 0.001
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""group.timeout_s's bounds: below a millisecond c10d's clients round it to no deadline at all, and a deadline past a
week (or infinite) is a hang by another name."""
MAX_TIMEOUT_WORDS = "a week"
""":data:`MAX_TIMEOUT_S` in words, for the messages and the configuration reference that state the bounds."""
MAX_WORLD_SIZE = 1024
"""The most ranks a refit group may have. Every consumer holds a connection to the producer's store and, on gloo, to
its neighbours in the broadcast tree; far past a thousand a typo (an extra zero) is likelier than a deployment, and
it would otherwise wait a whole group.timeout_s for ranks that never come."""


@dataclass(frozen=True)
class GroupSpec:
    """Where and how to rendezvous; the producer is rank 0, consumers are ranks 1..world_size-1.

    Invalid values raise :class:`ConfigError` naming every offending ``group.*`` key at once.
    """

    backend: str = "auto"
    """``auto`` (:data:`BACKENDS` says what it picks), ``gloo``, ``nccl``, ``pynccl`` or ``shm`` (every rank on one
    host: broadcasts through shared memory, :mod:`refit_app.transport.shm`)."""
    host: str = DEFAULT_HOST
    """The producer's address; the producer's store listens on it alone (``0.0.0.0``: on every interface)."""
    port: int | None = DEFAULT_PORT
    """None only before ``role=local`` has picked a free port for its ranks."""
    world_size: int = 2
    rank: int = PRODUCER_RANK
    local_rank: int | None = None
    """This rank's index on its host, which picks its GPU (:func:`refit_app.app.devices.local_cuda_device`); None: the
    current CUDA device is kept."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Deadline for the rendezvous, for each collective and for each phase gather."""
    interface: str | None = None
    """The network interface (NIC name) gloo uses; None: the one on the route the rendezvous found."""
    topology: str = DEFAULT_TOPOLOGY
    """``tree`` or ``chain`` (:data:`TOPOLOGIES`); every rank must name the same one."""
    token: str | None = field(default=None, repr=False)
    """The shared secret every rank proves at check-in and signs control records with
    (:mod:`refit_app.transport.auth`); never
    shown. None: anyone who reaches the port can join, so only a loopback ``host`` is allowed without opting in."""
    run_id: str | None = None
    """This run's id: a consumer refuses a producer of another run. None: the producer makes one up and logs it, a
    consumer accepts any run."""
    allow_unauthenticated: bool = False
    """Opt in to a group without a token on a non-loopback address (a network where every host is trusted)."""
    shm_ring_bytes: int | None = None
    """The producer's shared-memory ring (``num_buffers x buffer_size_bytes``), checked against the host's memory
    before any rank commits to ``shm``: ``shm`` refuses a ring that would not fit, ``auto`` takes gloo instead.
    None: unknown here; the producer then checks each segment as it makes it."""

    def __post_init__(self) -> None:
        p = Problems()
        if self.backend not in BACKENDS:
            p.fail("group.backend", self.backend, "choose one of " + ", ".join(BACKENDS))
        if not (isinstance(self.host, str) and self.host.strip()):
            p.fail("group.host", self.host, "must be the producer's host name or IP address")
        if self.port is not None and not (is_int(self.port) and 1 <= self.port <= 65535):
            p.fail("group.port", self.port, "must be a port number in 1..65535")
        if not (is_int(self.world_size) and 2 <= self.world_size <= MAX_WORLD_SIZE):
            p.fail(
                "group.world_size",
                self.world_size,
                f"must be an integer in 2..{MAX_WORLD_SIZE} (the producer and at least one consumer)",
            )
        elif not (is_int(self.rank) and 0 <= self.rank < self.world_size):
            p.fail("group.rank", self.rank, f"must be in 0..{self.world_size - 1} (0 is the producer)")
        if self.local_rank is not None and not (is_int(self.local_rank) and self.local_rank >= 0):
            p.fail(
                "group.local_rank", self.local_rank, "must be an integer >= 0 (the rank's index on its host), or null"
            )
        if self.interface is not None and not (isinstance(self.interface, str) and self.interface.strip()):
            p.fail("group.interface", self.interface, "must be a network interface name such as eth0, or null")
        if self.topology not in TOPOLOGIES:
            p.fail("group.topology", self.topology, "choose one of " + ", ".join(TOPOLOGIES))
        elif self.topology == "chain" and self.backend not in RELAY_BACKENDS:
            why = (
                "moves every chunk once for all consumers already"
                if self.backend == "shm"
                else "already pipelines its broadcast on GPUs"
            )
            p.fail(
                "group.topology",
                self.topology,
                f"chain relays over gloo only, and group.backend={self.backend} {why}; use group.topology=tree or "
                "group.backend=gloo",
            )
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, (int, float))
            or not MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S
        ):
            p.fail(
                "group.timeout_s",
                self.timeout_s,
                f"must be a number of seconds from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} ({MAX_TIMEOUT_WORDS})",
            )
        if self.token is not None and not (isinstance(self.token, str) and self.token.strip()):
            p.fail(
                "group.token",
                "<hidden>",
                "must be a non-empty string (the same on every rank), or null; "
                "an empty REFIT_APP_TOKEN counts as given: unset it for no token",
            )
        if self.run_id is not None and not (isinstance(self.run_id, str) and _RUN_ID.fullmatch(self.run_id)):
            p.fail("group.run_id", self.run_id, "must be 1-64 letters, digits, '.', '_' or '-', or null")
        if not isinstance(self.allow_unauthenticated, bool):
            p.fail("group.allow_unauthenticated", self.allow_unauthenticated, "must be true or false")
        if self.shm_ring_bytes is not None and not (is_int(self.shm_ring_bytes) and self.shm_ring_bytes > 0):
            p.fail("shm_ring_bytes", self.shm_ring_bytes, "must be a number of bytes > 0, or None")
        p.raise_any()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_producer(self) -> bool:
        return self.rank == PRODUCER_RANK
