"""A connected refit group: :func:`connect` rendezvouses and returns a :class:`RefitGroup`, whose ``group`` moves
tensors (any :class:`~refit_app.packed_tensor.BroadcastGroup` call works on it) and whose ``control`` carries phase
reports and the first error. Closing it tears both down in the order that lets every peer fail promptly.

Broadcast groups are built without ``torch.distributed.init_process_group``: a trainer that already owns the
default group can refit, and closing one group and connecting again in the same process needs no global cleanup.
Everything in :func:`connect` shares one deadline of ``spec.timeout_s``; so does every phase gather afterwards.

The pieces: :mod:`refit_app.transport.rendezvous` (the store and the check-in), :mod:`refit_app.transport.control`
(phase reports,
errors, the deadline store), :mod:`refit_app.transport.records` (the control records in the store, signed),
:mod:`refit_app.transport.signed_store` (the store as gloo sees it, signed),
:mod:`refit_app.transport.backends` (gloo, NCCL, pynccl behind one seam).
"""

from __future__ import annotations

import logging
import time
from types import TracebackType

import torch.distributed as dist

from refit_app.common.errors import ConfigError, PeerError, one_line
from refit_app.transport.auth import check_exposure
from refit_app.transport.backends import BackendGroup, check_backend_here, make_group
from refit_app.transport.control import Control, DeadlineStore
from refit_app.transport.records import RunStore
from refit_app.transport.rendezvous import (
    announce,
    await_producer,
    consumer_checkin,
    join_store,
    producer_checkin,
    run_store,
    start_store,
)
from refit_app.transport.signed_store import backend_store
from refit_app.transport.spec import PRODUCER_RANK, GroupSpec

__all__ = ["ERROR_LINGER_S", "GroupSpec", "RefitGroup", "connect"]

logger = logging.getLogger(__name__)

ERROR_LINGER_S = 2.0
"""How long a failed producer keeps its store open so consumers can read why it failed."""
_CLOSE_WAIT_S = 10.0
"""How long a successful producer waits for consumers to leave; they are one poll away from done by then."""


class RefitGroup:
    """A connected rank: ``group`` moves tensors, ``control`` moves phase reports and errors."""

    def __init__(
        self,
        spec: GroupSpec,
        backend: str,
        group: BackendGroup,
        control: Control,
        *,
        owns_group: bool = True,
        store: dist.Store | None = None,
    ) -> None:
        self.spec = spec
        self.owns_group = owns_group
        """False for a wrapped process group of the caller's
        (:func:`refit_app.transport.process_group.from_process_group`):
        closing leaves it as it is."""
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.backend = backend
        self.group = group
        self.control = control
        self._store = store
        self._closed = False

    @property
    def is_producer(self) -> bool:
        return self.rank == PRODUCER_RANK

    def store(self, prefix: str) -> dist.Store:
        """The run's store under ``prefix``, every value signed with the run's key as the group's own set-up records
        are: for a process group of the caller's among this run's ranks, set up as safely as this one (a sharded
        refit's trainer: ``init_process_group`` over its producers). Only a group :func:`connect` made has one."""
        if self._store is None:
            raise ValueError("this refit group was not made by connect(): it has no run store to lend")
        return dist.PrefixStore(f"refit/{prefix}", self._store)

    def close(self) -> None:
        """Tear down the group and the store connection; safe to call twice.

        On success the producer keeps its store until every consumer has left, so a consumer still in its
        last gather does not see the store vanish. On failure the group goes first, so peers blocked in a
        collective fail now, and the producer lingers up to ``ERROR_LINGER_S`` so they can read why.
        """
        if self._closed:
            return
        self._closed = True
        failed = self.control.failed
        try:
            if self.owns_group and (failed or not self.is_producer):
                self._shutdown_group(abort=failed)
            if self.is_producer:
                self.control.wait_for_consumers_to_leave(ERROR_LINGER_S if failed else _CLOSE_WAIT_S)
                if self.owns_group and not failed:
                    self._shutdown_group(abort=False)
            else:
                self.control.leave()
        finally:
            # With the backend gone, this is the last reference: dropping it stops the producer's store
            # server and frees the port.
            self.control.release()
        # control.rank: the rank number the user gave (an elastic generation numbers its group by members).
        logger.info("rank %d: left the refit group at %s", self.control.rank, self.spec.address)

    def abandon(self) -> None:
        """Drop the group after a failure without the leave-taking of :meth:`close`: its sockets close now, so that
        members still blocked in one of its collectives fail at once instead of at their deadline (an elastic
        session's generation that failed). Never raises; :meth:`close` does nothing after it."""
        self.control.failed = True
        try:
            self.group.shutdown(abort=True)
        except RuntimeError as e:
            logger.debug("rank %d: teardown of an abandoned group: %s", self.control.rank, one_line(e))
        if not self.is_producer:
            self.control.leave()  # ends the producer's linger early where it ends the session
        self._closed = True

    def _shutdown_group(self, *, abort: bool) -> None:
        try:
            self.group.shutdown(abort=abort)
        except RuntimeError as e:
            # Teardown must not replace the error that brought us here; the sockets close with the process.
            logger.warning("rank %d: %s group teardown failed: %s", self.rank, self.backend, one_line(e))

    def __enter__(self) -> RefitGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc is not None:
                # A failure the caller did not report still has to reach the peers, or they see only a
                # reset; publish_error keeps an earlier rank's report if there is one.
                self.control.publish_error(self.rank, one_line(exc))
        finally:
            self.close()


def _lost_producer(spec: GroupSpec, e: Exception) -> PeerError:
    return PeerError(f"lost the producer at {spec.address} during the rendezvous ({one_line(e)}); it may have died")


def connect(spec: GroupSpec) -> RefitGroup:
    """Rendezvous as ``spec.rank`` and return a connected group, or raise a one-line RefitError.

    Everything here shares one deadline of ``spec.timeout_s``. ``backend="auto"`` is resolved by the
    producer from what every rank reported (NCCL if all have a CUDA GPU, else gloo), so ranks cannot
    disagree; ranks that name a backend explicitly must name the same one.
    """
    if spec.port is None:
        raise ValueError("GroupSpec.port is None: pick a port (role=local does it for its ranks)")
    check_backend_here(spec.backend)
    check_exposure(spec.host, spec.port, spec.rank, spec.token, spec.allow_unauthenticated)
    deadline = time.monotonic() + spec.timeout_s
    producer = spec.rank == PRODUCER_RANK
    if producer:
        store, route = start_store(spec), None
        auth, producer_size = announce(store, spec), spec.world_size
    else:
        store, route = join_store(spec, deadline)
        try:
            auth, producer_size = await_producer(store, spec, deadline)
        except dist.DistError as e:
            raise _lost_producer(spec, e) from e
    # Everything after the greeting (control records, the backend's own keys) under this run's prefix.
    rstore = run_store(store, auth)
    # The producer's own client talks to a server thread in its own process, which cannot stall apart from it.
    control_store = rstore if producer else DeadlineStore(rstore, spec.timeout_s)
    control = Control(control_store, spec.rank, spec.world_size, spec.timeout_s, spec.address, auth)
    # The check-in's records: on the producer's store under public keys (the greeting, the check-in areas), and
    # under the run's prefix at keys only its ranks can name.
    public, run = RunStore(store, auth, spec.address, hide_keys=False), RunStore(rstore, auth, spec.address)
    try:
        try:
            if producer:
                backend, address = producer_checkin(public, run, spec, deadline)
            else:
                backend, address = consumer_checkin(public, run, spec, producer_size, deadline, route)
        except dist.DistError as e:
            raise _lost_producer(spec, e) from e
        try:
            group = make_group(backend, backend_store(rstore, auth, backend), spec, control, address=address)
        except (RuntimeError, ConfigError) as e:  # ConfigError: this rank's own gloo socket (gloo_devices)
            message = f"could not set up the {backend} group at {spec.address}: {one_line(e)}"
            control.publish_error(spec.rank, message)
            raise PeerError(message) from e
    except BaseException:
        control.failed = True
        if producer:
            control.wait_for_consumers_to_leave(ERROR_LINGER_S)
        else:
            control.leave()
        raise
    logger.info(
        "rank %d: joined the refit group at %s (world size %d, backend %s)",
        spec.rank,
        spec.address,
        spec.world_size,
        backend,
    )
    return RefitGroup(spec, backend, group, control, store=backend_store(rstore, auth, "gloo"))
