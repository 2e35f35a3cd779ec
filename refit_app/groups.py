"""Process groups for a refit: a rendezvous with a deadline, a broadcast group and a control channel.

The producer (rank 0) hosts a ``TCPStore``. Before any process group exists, every consumer checks in on that
store: world size, rank and backend are compared there, so a misconfigured rank gets a one-line error and so does
the producer, instead of everyone waiting in a collective that can never complete. The same store then carries
the control channel (phase reports and the first error), which works for every backend.

Broadcast groups are built without ``torch.distributed.init_process_group``: a trainer that already owns the
default group can refit, and closing one group and connecting again in the same process needs no global cleanup.

What a dead or stalled peer looks like, per backend:

- ``gloo``: a killed peer fails the collective at once ("connection closed"); a stalled one fails it after
  ``timeout_s``. Either way the wrapper raises :class:`PeerError`, preferring the reason a failing rank published.
- ``nccl``: the process group's timeout is ``timeout_s``; torch's NCCL watchdog aborts a collective that exceeds
  it and, with the default ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, tears the process down with an error in the log.
- ``pynccl``: vLLM's communicator has no watchdog, so every ``wait()`` polls the broadcast's CUDA event against
  ``timeout_s`` and raises :class:`PeerError` when it passes (kernels already stuck on the GPU stay stuck until the
  process exits).

In every case :meth:`Control.gather` has the same deadline, so no rank waits forever at a phase boundary.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from refit_app.errors import ConfigError, PeerError, RefitError
from refit_app.packed_tensor import Work

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl", "pynccl")
PRODUCER_RANK = 0

ERROR_LINGER_S = 2.0
"""How long a failed producer keeps its store open so consumers can read why it failed."""
_CLOSE_WAIT_S = 10.0
"""How long a successful producer waits for consumers to leave; they are one poll away from done by then."""
_EXPLAIN_WAIT_S = 1.0
"""How long a rank whose collective broke waits for the failing rank to publish the root cause."""
_SHORT_STORE_TIMEOUT_S = 2.0
"""Store timeout for best-effort calls made while failing; a stalled producer must not stall them."""
_STORE_CALL_MIN_S = 1.0
"""Least time a consumer's store call gets before the store counts as lost, however little of a deadline is left:
a live producer answers in milliseconds, a loaded one may not answer in the last 0.1 s of a gather."""
_POLL_START_S = 0.005
_POLL_MAX_S = 0.1

_K_PRODUCER = "refit/rdzv/producer"
_K_OUTCOME = "refit/rdzv/outcome"
_K_LEFT = "refit/left"
_K_ERROR = "refit/ctl/error"


def _k_claim(rank: int) -> str:
    return f"refit/rdzv/claim/{rank}"


def _k_checkin(rank: int) -> str:
    return f"refit/rdzv/rank/{rank}"


def _k_report(phase: str, seq: int, rank: int) -> str:
    return f"refit/ctl/{phase}/{seq}/{rank}"


@dataclass
class GroupSpec:
    """Where and how to rendezvous; the producer is rank 0, consumers are ranks 1..world_size-1."""

    backend: str = "auto"
    """``auto`` (NCCL if every rank has a CUDA GPU, else gloo), ``gloo``, ``nccl`` or ``pynccl``."""
    host: str = "127.0.0.1"
    """The producer's address; the producer listens on every interface."""
    port: int = 29500
    world_size: int = 2
    rank: int = 0
    timeout_s: float = 60.0
    """Deadline for the rendezvous, for each collective and for each phase gather."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class _Poller:
    """Backoff sleeps for store polling: quick answers for fast peers, little load for slow ones."""

    def __init__(self) -> None:
        self._delay = _POLL_START_S

    def sleep(self, deadline: float) -> None:
        time.sleep(max(0.0, min(self._delay, deadline - time.monotonic())))
        self._delay = min(self._delay * 2, _POLL_MAX_S)


class _DeadlineStore:
    """A consumer's client of the producer's store in which every call ends by the store's timeout.

    torch's TCPStore client waits for a reply without a deadline: while the producer is stopped (SIGSTOP, a
    debugger, a frozen host) its server accepts requests but never answers, and check, get, set, add and
    compare_set block forever, whatever ``set_timeout`` says. Each call runs on a daemon thread instead; one
    that outlives the timeout marks the store lost (its thread stays blocked until the process exits) and every
    later call fails at once, as the ``DistStoreError`` any other store failure raises.
    """

    def __init__(self, store: dist.Store, timeout_s: float) -> None:
        self._store = store
        self._timeout_s = timeout_s
        self._lost: str | None = None

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
        self._store.set_timeout(timeout)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def _call(self, name: str, *args: Any) -> Any:
        if self._lost is not None:
            raise dist.DistStoreError(self._lost)
        outcome: list[tuple[bool, Any]] = []

        def call() -> None:
            try:
                outcome.append((True, getattr(self._store, name)(*args)))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                outcome.append((False, e))

        worker = threading.Thread(target=call, name=f"refit-store-{name}", daemon=True)
        worker.start()
        limit = max(self._timeout_s, _STORE_CALL_MIN_S)
        worker.join(limit)
        if not outcome:
            self._lost = f"the producer's store did not answer within {limit:g}s"
            raise dist.DistStoreError(self._lost)
        ok, value = outcome[0]
        if not ok:
            raise value
        return value


def _one_line(exc: BaseException) -> str:
    """The useful part of a c10d/gloo message: no source location, no advice boilerplate, one line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(" This is typically caused")[0].strip()


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


class Control:
    """Backend-agnostic control channel over the producer's store: phase reports and the first error.

    Collectives only say *that* a peer went away; this channel carries *why*, so every rank can fail with
    the reason from the rank that failed first.
    """

    def __init__(
        self, store: dist.Store | _DeadlineStore, rank: int, world_size: int, timeout_s: float, address: str
    ) -> None:
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._address = address
        self._reported: dict[str, int] = {}
        self.failed = False
        """Set once this rank published, reported or observed an error; ``RefitGroup.close`` then lingers."""
        self._explained = False

    @contextmanager
    def _short_timeout(self) -> Iterator[None]:
        self._store.set_timeout(timedelta(seconds=_SHORT_STORE_TIMEOUT_S))
        try:
            yield
        finally:
            self._store.set_timeout(timedelta(seconds=self.timeout_s))

    def publish_error(self, rank: int, message: str, *, phase: str | None = None) -> None:
        """Record ``message`` as the refit's failure unless another rank's failure was recorded first.

        ``phase`` ties the failure to a phase gather, which then raises its own error type for it.
        """
        self.failed = True
        payload = json.dumps({"rank": rank, "message": message, "phase": phase})
        try:
            with self._short_timeout():
                self._store.compare_set(_K_ERROR, "", payload)
        except dist.DistError as e:
            # The producer's store is gone; peers will see the broken collective instead of the reason.
            logger.warning("rank %d: could not publish its error to %s: %s", self.rank, self._address, _one_line(e))

    def _read_error(self) -> tuple[str, str | None] | None:
        """The first published failure as ``("rank N failed: ...", phase)``, or None."""
        if not self._store.check([_K_ERROR]):
            return None
        doc = json.loads(self._store.get(_K_ERROR))
        self.failed = True
        return f"rank {doc['rank']} failed: {doc['message']}", doc.get("phase")

    def error(self) -> str | None:
        """The first published failure as ``"rank N failed: ..."``, or None; does not wait."""
        found = self._read_error()
        return None if found is None else found[0]

    def _raise_if_failed(self, phase: str, error_type: type[RefitError]) -> None:
        found = self._read_error()
        if found is not None:
            # A failure from another phase (a sink error while we still wait for the handshake) stops us
            # just the same, but it is not, say, a handshake disagreement.
            raise (error_type if found[1] == phase else PeerError)(found[0])

    def report(self, phase: str, error: str | None = None) -> None:
        """Tell every rank this one reached ``phase`` (``error=None``) or failed in it (and why).

        Reporting a failure never raises: the caller is about to raise the failure itself, and a lost
        store must not replace it.
        """
        if error is not None:
            self.publish_error(self.rank, error, phase=phase)
        seq = self._reported.get(phase, 0)
        self._reported[phase] = seq + 1
        try:
            self._store.set(_k_report(phase, seq, self.rank), json.dumps({"error": error}))
        except dist.DistError as e:
            if error is None:
                raise PeerError(
                    f"lost the control connection to the producer at {self._address} while reporting {phase} "
                    f"({_one_line(e)}); rank {PRODUCER_RANK} may have died"
                ) from e
            logger.debug("rank %d: could not report its failure in %s: %s", self.rank, phase, _one_line(e))

    def gather(
        self, phase: str, *, timeout_s: float | None = None, error_type: type[RefitError] = PeerError
    ) -> None:
        """Wait until every rank reported its latest ``phase``; raise if any rank failed or missed the deadline.

        Returns as soon as all reports are in. Raises at the first published error, without waiting for
        the remaining ranks, so a failure anywhere stops everyone promptly: ``error_type`` when a rank
        reported that error for this ``phase``, :class:`PeerError` otherwise.
        """
        seq = self._reported.get(phase, 0) - 1
        if seq < 0:
            raise ValueError(f"gather({phase!r}) before report({phase!r}) on rank {self.rank}")
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        keys = [_k_report(phase, seq, r) for r in range(self.world_size)]
        poller = _Poller()
        try:
            while True:
                # A blocked store call must not outlive the deadline (a SIGSTOPped producer holds the store).
                self._store.set_timeout(timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
                self._raise_if_failed(phase, error_type)
                if self._store.check(keys):
                    # report() publishes before it reports, so a failure in this phase is visible by now
                    # even if it landed after the check above.
                    self._raise_if_failed(phase, error_type)
                    return
                if time.monotonic() >= deadline:
                    missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
                    self.failed = True
                    raise PeerError(
                        f"{_ranks_text(missing)} did not report {phase} within {limit:g}s; "
                        "it may have died or stalled"
                    )
                poller.sleep(deadline)
        except dist.DistError as e:
            self.failed = True
            raise PeerError(
                f"lost the control connection to the producer at {self._address} while waiting for {phase} "
                f"({_one_line(e)}); rank {PRODUCER_RANK} may have died"
            ) from e
        finally:
            self._store.set_timeout(timedelta(seconds=self.timeout_s))

    def explain(self, exc: BaseException) -> str:
        """One line for a failed collective, preferring the root cause a failing rank published.

        The rank whose sink or source failed publishes its reason just before its sockets close; the others
        see only "connection reset", so wait a moment for that reason before falling back to the symptom.
        """
        self.failed = True
        text = _one_line(exc)
        # Only the first broken collective waits: the others in flight (one per buffer) broke for the same
        # reason, and a wait for each would push this rank's exit further past the deadline.
        deadline = time.monotonic() + (0.0 if self._explained else _EXPLAIN_WAIT_S)
        self._explained = True
        poller = _Poller()
        try:
            with self._short_timeout():
                while True:
                    published = self.error()
                    if published is not None:
                        return published
                    if time.monotonic() >= deadline:
                        break
                    poller.sleep(deadline)
        except dist.DistError:
            if self.rank != PRODUCER_RANK:
                return (
                    f"lost the producer (rank {PRODUCER_RANK}) at {self._address}; it may have died or stalled "
                    f"({text})"
                )
        lower = text.lower()
        if "timed out" in lower or "timeout" in lower:
            return f"no progress from a peer within {self.timeout_s:g}s; a rank may have stalled or died ({text})"
        if any(s in lower for s in ("connection reset", "connection closed", "broken pipe", "connection refused")):
            return f"lost the connection to a peer; a rank may have died ({text})"
        return text

    def _leave(self) -> None:
        """A consumer is done with the store, so the producer may close it without breaking a late read."""
        try:
            with self._short_timeout():
                self._store.add(_K_LEFT, 1)
        except dist.DistError as e:
            logger.debug("rank %d: producer store already gone at leave: %s", self.rank, _one_line(e))

    def _wait_for_consumers_to_leave(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        poller = _Poller()
        while self._store.add(_K_LEFT, 0) < self.world_size - 1 and time.monotonic() < deadline:
            poller.sleep(deadline)


class _TorchWork:
    def __init__(self, work: Any, control: Control) -> None:
        # The only reference to the backend's work object: see TorchBroadcastGroup.shutdown.
        self._work = work
        self._control = control

    def wait(self) -> None:
        if self._work is None:
            raise PeerError("the refit group was closed before this broadcast finished")
        try:
            self._work.wait()
        except RuntimeError as e:
            raise PeerError(self._control.explain(e)) from e


class TorchBroadcastGroup:
    """A gloo or NCCL backend used directly; errors surface as :class:`PeerError` with the root cause."""

    def __init__(self, backend: Any, device: torch.device, control: Control) -> None:
        self._backend = backend
        self.device = device
        self._control = control
        self._works: weakref.WeakSet[_TorchWork] = weakref.WeakSet()

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        try:
            work = _TorchWork(self._backend.broadcast([tensor], opts), self._control)
        except RuntimeError as e:
            raise PeerError(self._control.explain(e)) from e
        self._works.add(work)
        return work

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.broadcast_async(tensor, src).wait()

    def shutdown(self, *, abort: bool) -> None:
        # abort() drops in-flight NCCL work so peers blocked on us fail now; shutdown() finishes it.
        # Neither closes gloo's sockets: only destroying the backend does, and every work object keeps it
        # alive. Work wrappers are often still referenced (a caller's in-flight list, a traceback), so cut
        # their link to the backend's work; otherwise peers blocked on this rank wait for their timeout.
        stop = getattr(self._backend, "abort" if abort else "shutdown", None)
        if stop is not None:
            stop()
        for work in list(self._works):
            work._work = None
        self._backend = None


class _EventWork:
    def __init__(self, event: Any, device: torch.device, control: Control) -> None:
        self._event = event
        self._device = device
        self._control = control

    def wait(self) -> None:
        # vLLM's communicator has no watchdog: bound the wait here or a dead peer hangs this rank forever.
        deadline = time.monotonic() + self._control.timeout_s
        poller = _Poller()
        while not self._event.query():
            if time.monotonic() >= deadline:
                published = self._control.error()
                raise PeerError(
                    published
                    or f"a pynccl broadcast did not complete within {self._control.timeout_s:g}s; "
                    "a rank may have died or stalled"
                )
            poller.sleep(deadline)
        torch.cuda.current_stream(self._device).wait_event(self._event)


class PyNcclBroadcastGroup:
    """vLLM's ``PyNcclCommunicator`` behind the same seam, with a deadline on every wait."""

    def __init__(self, comm: Any, device: torch.device, control: Control) -> None:
        self._comm = comm
        self.device = device
        self._control = control
        # One cached side stream: fresh streams per call strand allocator memory (vLLM gh-52950).
        self._stream = torch.cuda.Stream(device=device)

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> Work:
        # The buffer was packed on the current stream; sending before that finishes sends stale bytes.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            self._comm.broadcast(tensor, src, stream=self._stream)
        except RuntimeError as e:
            raise PeerError(self._control.explain(e)) from e
        # The caller may drop its reference before the side stream is done with the memory.
        tensor.record_stream(self._stream)
        done = torch.cuda.Event()
        done.record(self._stream)
        return _EventWork(done, self.device, self._control)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.broadcast_async(tensor, src).wait()

    def shutdown(self, *, abort: bool) -> None:
        del abort  # the communicator has no abort; dropping it is all vLLM offers
        self._comm = None


BackendGroup = TorchBroadcastGroup | PyNcclBroadcastGroup
"""The groups :func:`connect` builds; each satisfies :class:`refit_app.packed_tensor.BroadcastGroup`."""


class RefitGroup:
    """A connected rank: ``group`` moves tensors, ``control`` moves phase reports and errors."""

    def __init__(self, spec: GroupSpec, backend: str, group: BackendGroup, control: Control) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.backend = backend
        self.group = group
        self.control = control
        self._closed = False

    @property
    def is_producer(self) -> bool:
        return self.rank == PRODUCER_RANK

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
            if failed or not self.is_producer:
                self._shutdown_group(abort=failed)
            if self.is_producer:
                self.control._wait_for_consumers_to_leave(ERROR_LINGER_S if failed else _CLOSE_WAIT_S)
                if not failed:
                    self._shutdown_group(abort=False)
            else:
                self.control._leave()
        finally:
            # With the backend gone, this is the last reference: dropping it stops the producer's store
            # server and frees the port.
            self.control._store = None
        logger.info("rank %d: left the refit group at %s", self.rank, self.spec.address)

    def _shutdown_group(self, *, abort: bool) -> None:
        try:
            self.group.shutdown(abort=abort)
        except RuntimeError as e:
            # Teardown must not replace the error that brought us here; the sockets close with the process.
            logger.warning("rank %d: %s group teardown failed: %s", self.rank, self.backend, _one_line(e))

    def __enter__(self) -> RefitGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc is not None:
                # A failure the caller did not report still has to reach the peers, or they see only a
                # reset; publish_error keeps an earlier rank's report if there is one.
                self.control.publish_error(self.rank, _one_line(exc))
        finally:
            self.close()


def _validate(spec: GroupSpec) -> None:
    problems = []
    if spec.backend not in BACKENDS:
        problems.append(f"group.backend={spec.backend!r} is not one of {', '.join(BACKENDS)}")
    if not 1 <= spec.port <= 65535:
        problems.append(f"group.port={spec.port} is out of range; use 1-65535")
    if spec.world_size < 2:
        problems.append(
            f"group.world_size={spec.world_size} is too small; a refit needs the producer and at least one "
            "consumer (2 or more)"
        )
    if not spec.timeout_s > 0:
        problems.append(f"group.timeout_s={spec.timeout_s} must be positive")
    if not spec.host:
        problems.append("group.host is empty; give the producer's host name or IP address")
    if problems:
        raise ConfigError("; ".join(problems))


def _has_cuda() -> bool:
    return torch.cuda.is_available() and dist.is_nccl_available()


def _has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _check_backend_here(backend: str) -> None:
    """Refuse a backend this machine cannot run before anyone waits on it, naming everything it lacks at once."""
    vllm_hint = "vLLM: pip install 'refit_app[vllm]'"
    if backend in ("nccl", "pynccl") and not _has_cuda():
        also = f" (it also needs {vllm_hint})" if backend == "pynccl" and not _has_vllm() else ""
        raise ConfigError(f"group.backend={backend} needs a CUDA GPU on every rank; use gloo{also}")
    if backend == "pynccl" and not _has_vllm():
        raise ConfigError(f"group.backend=pynccl needs {vllm_hint}")


def _capabilities(backend: str) -> dict[str, Any]:
    return {"backend": backend, "cuda": _has_cuda(), "vllm": _has_vllm()}


def _resolve_backend(infos: dict[int, dict[str, Any]]) -> str:
    """One backend for every rank, or a ConfigError naming the ranks that disagree or lack what it needs.

    Also valid on a partial set of ranks: adding ranks can only add problems, so the producer calls it as
    each consumer checks in and stops at the first conflict instead of waiting for the rest.
    """
    explicit = {r: info["backend"] for r, info in sorted(infos.items()) if info["backend"] != "auto"}
    if len(set(explicit.values())) > 1:
        listed = ", ".join(f"rank {r} {b!r}" for r, b in explicit.items())
        raise ConfigError(
            f"group.backend differs between ranks ({listed}); set the same group.backend on every rank, "
            "or 'auto' on all but one"
        )
    if explicit:
        backend = next(iter(explicit.values()))
    else:
        backend = "nccl" if all(info["cuda"] for info in infos.values()) else "gloo"
    no_gpu = [r for r, info in sorted(infos.items()) if not info["cuda"]]
    if backend in ("nccl", "pynccl") and no_gpu:
        raise ConfigError(
            f"group.backend={backend} needs a CUDA GPU on every rank, but {_ranks_text(no_gpu)} has none; use gloo"
        )
    no_vllm = [r for r, info in sorted(infos.items()) if not info["vllm"]]
    if backend == "pynccl" and no_vllm:
        raise ConfigError(
            f"group.backend=pynccl needs vLLM on every rank, but {_ranks_text(no_vllm)} lacks it: "
            "pip install 'refit_app[vllm]'"
        )
    return backend


_ERROR_TYPES: dict[str, type[RefitError]] = {"ConfigError": ConfigError, "PeerError": PeerError}


def _outcome_error(doc: dict[str, Any]) -> RefitError:
    return _ERROR_TYPES.get(doc["kind"], PeerError)(doc["message"])


def _fail_rendezvous(store: dist.Store, exc: RefitError) -> RefitError:
    """Make ``exc`` the rendezvous outcome so every rank stops with it; return what to raise here.

    If the rendezvous already failed, that earlier failure is the root cause and wins. If it already
    succeeded without this rank (a late duplicate, say), the others are not disturbed.
    """
    payload = json.dumps({"ok": False, "kind": type(exc).__name__, "message": str(exc)})
    current = store.compare_set(_K_OUTCOME, "", payload).decode()
    doc = json.loads(current)
    if current == payload or doc["ok"]:
        return exc
    return _outcome_error(doc)


def _start_store(spec: GroupSpec) -> dist.TCPStore:
    try:
        return dist.TCPStore(
            spec.host,
            spec.port,
            world_size=None,
            is_master=True,
            timeout=timedelta(seconds=spec.timeout_s),
            wait_for_workers=False,
        )
    except dist.DistError as e:
        if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
            raise ConfigError(
                f"group.port={spec.port} is already in use on this host; choose a free group.port "
                "(and give consumers the same one) or stop the process holding it"
            ) from e
        raise ConfigError(f"cannot listen on group.port={spec.port}: {_one_line(e)}") from e


def _join_store(spec: GroupSpec, deadline: float) -> dist.TCPStore:
    # Probe with a plain socket first: a TCPStore client retrying a closed port floods stderr with C++
    # stack traces, and a consumer routinely starts before its producer.
    unreachable = PeerError(
        f"could not reach the producer at {spec.address} within {spec.timeout_s:g}s; start the producer "
        "(group.rank=0) or check group.host and group.port"
    )
    poller = _Poller()
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((spec.host, spec.port), timeout=max(0.05, min(remaining, 2.0))):
                break
        except socket.gaierror as e:
            raise ConfigError(
                f"group.host={spec.host!r} cannot be resolved ({e.strerror}); give the producer's host name "
                "or IP address"
            ) from e
        except OSError:
            if time.monotonic() >= deadline:
                raise unreachable from None
            poller.sleep(deadline)
    try:
        store = dist.TCPStore(
            spec.host,
            spec.port,
            is_master=False,
            timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.1)),
        )
    except dist.DistError as e:
        raise unreachable from e
    store.set_timeout(timedelta(seconds=spec.timeout_s))
    return store


def _producer_checkin(store: dist.Store, spec: GroupSpec, deadline: float) -> str:
    store.set(_K_PRODUCER, json.dumps({"world_size": spec.world_size, "backend": spec.backend}))
    infos = {PRODUCER_RANK: _capabilities(spec.backend)}
    pending = list(range(1, spec.world_size))
    logger.info(
        "rank 0: waiting up to %gs for %d consumer(s) at port %d (group.host of the consumers: this host's address)",
        spec.timeout_s, len(pending), spec.port,
    )
    poller = _Poller()
    while pending:
        if store.check([_K_OUTCOME]):
            raise _outcome_error(json.loads(store.get(_K_OUTCOME)))
        for rank in list(pending):
            if store.check([_k_checkin(rank)]):
                infos[rank] = json.loads(store.get(_k_checkin(rank)))
                pending.remove(rank)
                logger.info("rank 0: consumer rank %d checked in", rank)
                try:
                    _resolve_backend(infos)
                except ConfigError as e:
                    raise _fail_rendezvous(store, e) from None
        if not pending:
            break
        if time.monotonic() >= deadline:
            raise _fail_rendezvous(
                store,
                PeerError(
                    f"{_ranks_text(pending)} did not join the producer at {spec.address} within "
                    f"{spec.timeout_s:g}s; start every consumer with this group.host/group.port and "
                    f"group.world_size={spec.world_size}"
                ),
            )
        poller.sleep(deadline)
    try:
        backend = _resolve_backend(infos)
    except ConfigError as e:
        raise _fail_rendezvous(store, e) from None
    ready = json.dumps({"ok": True, "backend": backend})
    current = store.compare_set(_K_OUTCOME, "", ready).decode()
    if current != ready:
        raise _outcome_error(json.loads(current))
    return backend


def _wait_key(store: dist.Store, key: str, deadline: float, late: RefitError, spec: GroupSpec) -> None:
    try:
        store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
    except dist.DistError as e:
        if time.monotonic() >= deadline or "timeout" in str(e).lower():
            raise late from e
        raise PeerError(
            f"lost the producer at {spec.address} during the rendezvous ({_one_line(e)}); it may have died"
        ) from e


def _consumer_checkin(store: dist.Store, spec: GroupSpec, deadline: float) -> str:
    _wait_key(
        store,
        _K_PRODUCER,
        deadline,
        PeerError(
            f"the process at {spec.address} did not start a refit rendezvous within {spec.timeout_s:g}s; "
            "is group.port the refit producer's?"
        ),
        spec,
    )
    producer = json.loads(store.get(_K_PRODUCER))
    producer_size = int(producer["world_size"])
    if producer_size != spec.world_size:
        raise _fail_rendezvous(
            store,
            ConfigError(
                f"group.world_size differs: the producer has {producer_size}, consumer rank {spec.rank} has "
                f"{spec.world_size}; set the same group.world_size on every rank"
            ),
        )
    if not 1 <= spec.rank < producer_size:
        raise _fail_rendezvous(
            store,
            ConfigError(
                f"group.rank={spec.rank} is out of range for group.world_size={producer_size}; consumers take "
                f"ranks 1..{producer_size - 1} (rank 0 is the producer)"
            ),
        )
    if store.add(_k_claim(spec.rank), 1) > 1:
        raise _fail_rendezvous(
            store,
            ConfigError(
                f"group.rank={spec.rank} is claimed by two consumers; give each consumer its own group.rank "
                f"in 1..{producer_size - 1}"
            ),
        )
    store.set(_k_checkin(spec.rank), json.dumps(_capabilities(spec.backend)))
    _wait_key(
        store,
        _K_OUTCOME,
        deadline,
        PeerError(
            f"the producer at {spec.address} did not complete the rendezvous within {spec.timeout_s:g}s; "
            "another consumer may be missing"
        ),
        spec,
    )
    outcome = json.loads(store.get(_K_OUTCOME))
    if not outcome["ok"]:
        raise _outcome_error(outcome)
    return str(outcome["backend"])


def _make_pynccl_group(store: dist.Store, spec: GroupSpec, control: Control) -> PyNcclBroadcastGroup:
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
    except ImportError as e:
        raise ConfigError(
            f"group.backend=pynccl needs vLLM: pip install 'refit_app[vllm]' (import failed: {e})"
        ) from e
    device = torch.device("cuda", torch.cuda.current_device())
    # Built on our store rather than StatelessProcessGroup.create, so it needs no second port and the
    # control channel and check-in already cover it.
    metadata_group = StatelessProcessGroup(
        rank=spec.rank, world_size=spec.world_size, store=dist.PrefixStore("refit/pynccl", store), socket=None
    )
    comm = PyNcclCommunicator(metadata_group, device=device)
    if not getattr(comm, "available", True) or getattr(comm, "disabled", False):
        # A disabled communicator returns from broadcast() without moving a byte.
        raise ConfigError(
            "vLLM's PyNcclCommunicator came up disabled (NCCL library not loaded, or a vLLM version that "
            "disables it by default); broadcasts would silently do nothing. Use group.backend=nccl"
        )
    return PyNcclBroadcastGroup(comm, device, control)


def _make_group(backend: str, store: dist.Store, spec: GroupSpec, control: Control) -> BackendGroup:
    timeout = timedelta(seconds=spec.timeout_s)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(dist.PrefixStore("refit/gloo", store), spec.rank, spec.world_size, timeout)
        return TorchBroadcastGroup(pg, torch.device("cpu"), control)
    if backend == "nccl":
        # Without blocking wait an NCCL work's wait() only orders streams, and a dead peer is caught by torch's
        # watchdog, which aborts the process with a multi-line report. With it, wait() raises after the group's
        # timeout and the run ends with the usual one-line error. Read when the group is built; a user's
        # explicit setting wins.
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("refit/nccl", store), spec.rank, spec.world_size, options)
        return TorchBroadcastGroup(pg, torch.device("cuda", torch.cuda.current_device()), control)
    return _make_pynccl_group(store, spec, control)


def connect(spec: GroupSpec) -> RefitGroup:
    """Rendezvous as ``spec.rank`` and return a connected group, or raise a one-line RefitError.

    Everything here shares one deadline of ``spec.timeout_s``. ``backend="auto"`` is resolved by the
    producer from what every rank reported (NCCL if all have a CUDA GPU, else gloo), so ranks cannot
    disagree; ranks that name a backend explicitly must name the same one.
    """
    _validate(spec)
    _check_backend_here(spec.backend)
    deadline = time.monotonic() + spec.timeout_s
    producer = spec.rank == PRODUCER_RANK
    store = _start_store(spec) if producer else _join_store(spec, deadline)
    # The producer's own client talks to a server thread in its own process, which cannot stall apart from it.
    control_store = store if producer else _DeadlineStore(store, spec.timeout_s)
    control = Control(control_store, spec.rank, spec.world_size, spec.timeout_s, spec.address)
    try:
        try:
            backend = (_producer_checkin if producer else _consumer_checkin)(store, spec, deadline)
        except dist.DistError as e:
            raise PeerError(
                f"lost the producer at {spec.address} during the rendezvous ({_one_line(e)}); it may have died"
            ) from e
        try:
            group = _make_group(backend, store, spec, control)
        except RuntimeError as e:
            message = f"could not set up the {backend} group at {spec.address}: {_one_line(e)}"
            control.publish_error(spec.rank, message)
            raise PeerError(message) from e
    except BaseException:
        control.failed = True
        if producer:
            control._wait_for_consumers_to_leave(ERROR_LINGER_S)
        else:
            control._leave()
        raise
    logger.info(
        "rank %d: joined the refit group at %s (world size %d, backend %s)",
        spec.rank,
        spec.address,
        spec.world_size,
        backend,
    )
    return RefitGroup(spec, backend, group, control)
