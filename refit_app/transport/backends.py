"""The collective backends behind refit_app's broadcast seam: gloo and NCCL through torch, and vLLM's
``PyNcclCommunicator``; which one a group uses, and how each reports a dead or stalled peer.

What a dead or stalled peer looks like, per backend:

- ``gloo``: a killed peer fails the collective at once ("connection closed"); a stalled one fails it after
  ``timeout_s``. Either way the wrapper raises :class:`PeerError`, preferring the reason a failing rank published.
- ``nccl``: the process group's timeout is ``timeout_s``; with ``TORCH_NCCL_BLOCKING_WAIT`` (set here unless the
  user set it) a work's ``wait()`` raises after it, and the run ends with the usual one-line error.
- ``pynccl``: vLLM's communicator has no watchdog, so every ``wait()`` polls the broadcast's CUDA event against
  ``timeout_s`` and raises :class:`PeerError` when it passes (kernels already stuck on the GPU stay stuck until the
  process exits).
- ``shm`` (every rank on one host, :mod:`refit_app.transport.shm`): a killed peer closes its Unix socket, which the
  other side sees at once; a stalled one fails every wait after ``timeout_s``. Either way :class:`PeerError`, the
  published reason preferred.

Which host a rank is on: each reports :func:`~refit_app.transport.shm.host_identity` (its kernel's boot id
and network namespace, hashed) at check-in, and the producer compares them (:func:`resolve_backend`).
"""

from __future__ import annotations

import importlib.util
import os
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from refit_app.common.errors import ConfigError, PeerError, one_line, some_of
from refit_app.packed_tensor import Work
from refit_app.transport.chain import ChainBroadcastGroup
from refit_app.transport.control import Control, Poller, ranks_text
from refit_app.transport.shm import (
    SHM_MEMORY_FIX,
    ShmConsumerGroup,
    ShmProducerGroup,
    host_identity,
    make_shm_group,
    shm_memory_problem,
    shm_supported,
)
from refit_app.transport.spec import DEFAULT_TOPOLOGY, PRODUCER_RANK, GroupSpec

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
"""gloo's network interface; when the user sets it, refit_app does not choose the device from the route."""
AUTO_SHM_ON_CUDA = False
"""Whether ``auto`` picks ``shm`` on one host where every rank has a GPU (CUDA IPC) rather than NCCL. Off until the
CUDA IPC path has run on GPUs (``tests/test_shm.py -m gpu``); ``group.backend=shm`` takes it explicitly."""
NCCL_BLOCKING_WAIT_ENV = "TORCH_NCCL_BLOCKING_WAIT"
"""Set to ``1`` (unless the user set it) before an NCCL group is built, so that a dead peer ends a wait with an
error after the group's timeout instead of the watchdog aborting the process."""


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

    def process_group(self) -> Any:
        """This group's gloo backend as a ``torch.distributed`` process group of its own ranks, unregistered (the
        default group stays the caller's): for point-to-point transfers and object gathers over the connected,
        authenticated group (a sharded refit, :mod:`refit_app.app.sharded`). Built as torch's own
        ``init_process_group`` builds one (a ProcessGroup with the backend registered for the CPU), which takes
        private methods: a torch without them gets a one-line error."""
        if self._backend is None or self.device.type != "cpu":
            raise ConfigError("a sharded refit runs over a connected gloo group (group.backend=gloo)")
        pg_type = dist.ProcessGroup
        try:
            pg = pg_type(dist.HashStore(), self._backend.rank(), self._backend.size())
            pg._set_default_backend(pg_type.BackendType.GLOO)
            pg._register_backend(torch.device("cpu"), pg_type.BackendType.GLOO, self._backend)
        except (AttributeError, TypeError) as e:
            raise ConfigError(
                f"this torch ({torch.__version__}) cannot wrap a gloo backend as a process group ({one_line(e)}); "
                "a sharded refit is tested with torch 2.13"
            ) from e
        return pg

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


_EVENT_POLL_START_S = 20e-6
_EVENT_POLL_MAX_S = 1e-3
"""Polling a pynccl broadcast's CUDA event: the first query after 20 us, then at most every millisecond (a query
costs microseconds)."""


class _EventWork:
    def __init__(self, event: Any, device: torch.device, control: Control) -> None:
        self._event = event
        self._device = device
        self._control = control

    def wait(self) -> None:
        # vLLM's communicator has no watchdog: bound the wait here or a dead peer hangs this rank forever.
        deadline = time.monotonic() + self._control.timeout_s
        # A chunk's broadcast takes microseconds to milliseconds on a GPU: the store's 5 ms first sleep would cost
        # more than the broadcast itself.
        poller = Poller(_EVENT_POLL_START_S, _EVENT_POLL_MAX_S)
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


BackendGroup = TorchBroadcastGroup | PyNcclBroadcastGroup | ChainBroadcastGroup | ShmProducerGroup | ShmConsumerGroup
"""The groups :func:`connect` builds; each satisfies :class:`refit_app.packed_tensor.BroadcastGroup`."""


def has_cuda() -> bool:
    return torch.cuda.is_available() and dist.is_nccl_available()


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_backend_here(backend: str) -> None:
    """Refuse a backend this machine cannot run before anyone waits on it, naming everything it lacks at once."""
    vllm_hint = "vLLM: pip install 'refit_app[vllm]'"
    if backend in ("nccl", "pynccl") and not has_cuda():
        also = f" (it also needs {vllm_hint})" if backend == "pynccl" and not has_vllm() else ""
        raise ConfigError(f"group.backend={backend} needs a CUDA GPU on every rank; use gloo{also}")
    if backend == "pynccl" and not has_vllm():
        raise ConfigError(f"group.backend=pynccl needs {vllm_hint}")
    if backend == "shm" and (why := shm_supported()) is not None:
        raise ConfigError(f"group.backend=shm cannot run here: {why}; use gloo")


def capabilities(spec: GroupSpec) -> dict[str, Any]:
    """What a rank reports at check-in: its group settings that all ranks must share, and what this host has
    (``host``: who it can share memory with, None where it cannot share memory at all)."""
    host = host_identity() if shm_supported() is None else None
    return {"backend": spec.backend, "topology": spec.topology, "cuda": has_cuda(), "vllm": has_vllm(), "host": host}


def _elsewhere(infos: dict[int, dict[str, Any]]) -> list[int]:
    """The ranks that cannot share memory with the producer (another host, another network namespace, a rank that
    reports no host)."""
    here = infos.get(PRODUCER_RANK, {}).get("host")
    return [r for r, info in sorted(infos.items()) if not here or info.get("host") != here]


def shm_ring_problem(spec: GroupSpec) -> str | None:
    """Why the producer's ring (``spec.shm_ring_bytes``) would not fit this host's memory; None: it fits, or its
    size is not known here."""
    if spec.shm_ring_bytes is None:
        return None
    return shm_memory_problem(spec.shm_ring_bytes)


def resolve_backend(infos: dict[int, dict[str, Any]], ring_problem: str | None = None) -> str:
    """One backend for every rank, or a ConfigError naming the ranks that disagree (on the backend or on
    ``group.topology``) or lack what it needs. ``auto``: ``shm`` where every rank reports the producer's host
    (unless every rank has a GPU: NCCL, see :data:`AUTO_SHM_ON_CUDA`), NCCL where every rank has a GPU, else gloo;
    gloo under ``topology=chain``. A rank on another host keeps every rank on the socket path.

    ``ring_problem``: why the producer's ring of host memory would not fit (:func:`shm_ring_problem`); ``shm``
    on the host is then refused and ``auto`` takes gloo. Decided here, before any rank has allocated a segment.

    Also valid on a partial set of ranks: adding ranks can only add problems, so the producer calls it as
    each consumer checks in and stops at the first conflict instead of waiting for the rest.
    """
    # A rank that reports no topology predates the setting and broadcasts along the tree.
    topologies = {r: info.get("topology", DEFAULT_TOPOLOGY) for r, info in sorted(infos.items())}
    if len(set(topologies.values())) > 1:
        listed = some_of([f"rank {r} {t!r}" for r, t in topologies.items()])
        raise ConfigError(f"group.topology differs between ranks ({listed}); set the same group.topology on every rank")
    explicit = {r: info["backend"] for r, info in sorted(infos.items()) if info["backend"] != "auto"}
    if len(set(explicit.values())) > 1:
        listed = some_of([f"rank {r} {b!r}" for r, b in explicit.items()])
        raise ConfigError(
            f"group.backend differs between ranks ({listed}); set the same group.backend on every rank, "
            "or 'auto' on all but one"
        )
    elsewhere = _elsewhere(infos)
    if explicit:
        backend = next(iter(explicit.values()))
    else:
        relay = "chain" in topologies.values()  # chain runs on gloo only (GroupSpec refuses an explicit NCCL)
        gpus = all(info["cuda"] for info in infos.values())
        if not relay and not elsewhere and (AUTO_SHM_ON_CUDA or not gpus) and (gpus or ring_problem is None):
            backend = "shm"
        else:
            backend = "nccl" if not relay and gpus else "gloo"
    if backend == "shm" and elsewhere:
        raise ConfigError(
            f"group.backend=shm needs every rank on the producer's host, but {ranks_text(elsewhere)} "
            f"{'is' if len(elsewhere) == 1 else 'are'} elsewhere (another machine or network namespace, or no "
            "shared memory there); use gloo, or auto to choose"
        )
    no_gpu = [r for r, info in sorted(infos.items()) if not info["cuda"]]
    # With a GPU on every rank the segments are device memory (CUDA IPC), which torch bounds itself.
    if backend == "shm" and ring_problem is not None and no_gpu:
        raise ConfigError(
            f"group.backend=shm: the producer's ring of shared segments (num_buffers x buffer_size_bytes): "
            f"{ring_problem}; {SHM_MEMORY_FIX}"
        )
    if backend in ("nccl", "pynccl") and no_gpu:
        raise ConfigError(
            f"group.backend={backend} needs a CUDA GPU on every rank, but {ranks_text(no_gpu)} has none; use gloo"
        )
    no_vllm = [r for r, info in sorted(infos.items()) if not info["vllm"]]
    if backend == "pynccl" and no_vllm:
        raise ConfigError(
            f"group.backend=pynccl needs vLLM on every rank, but {ranks_text(no_vllm)} lacks it: "
            "pip install 'refit_app[vllm]'"
        )
    return backend


def _make_pynccl_group(store: dist.Store, spec: GroupSpec, control: Control) -> PyNcclBroadcastGroup:
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
    except ImportError as e:
        raise ConfigError(f"group.backend=pynccl needs vLLM: pip install 'refit_app[vllm]' (import failed: {e})") from e
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


def gloo_devices(spec: GroupSpec, address: str | None) -> list[Any]:
    """The network devices this rank's gloo connections use, opened here, before any peer is involved: a rank that
    cannot open them fails on its own, at once, with a :class:`ConfigError` (where a group's peers would otherwise
    wait a whole deadline for it and fail without knowing why).

    ``group.interface`` (a NIC name) wins, then the user's ``GLOO_SOCKET_IFNAME`` (one device per comma-separated
    name, as torch does); otherwise the address on the route the rendezvous found (``address``), since gloo's
    default, the address the host name resolves to, is often 127.0.0.1 in containers, VMs and network namespaces,
    where a mesh across hosts then cannot form; torch's default without a route.
    """
    env = os.environ.get(GLOO_IFNAME_ENV, "")
    if spec.interface:
        where, wanted = f"group.interface={spec.interface}", [("interface", spec.interface)]
    elif env:
        where, wanted = f"{GLOO_IFNAME_ENV}={env}", [("interface", name) for name in env.split(",") if name]
    elif address:
        where, wanted = f"the route's address {address}", [("hostname", address)]
    else:
        where, wanted = "the host name's address", []
    try:
        if not wanted:
            return [dist.ProcessGroupGloo.create_default_device()]
        return [dist.ProcessGroupGloo.create_device(**{kind: value}) for kind, value in wanted]
    except RuntimeError as e:
        raise ConfigError(
            f"this rank cannot open a gloo socket on {where} ({one_line(e)}); set group.interface (or "
            f"{GLOO_IFNAME_ENV}) to a network interface of this host"
        ) from e


def make_group(
    backend: str, store: dist.Store, spec: GroupSpec, control: Control, *, address: str | None = None
) -> BackendGroup:
    """This rank's broadcast group; ``address``: this rank's address on the route between producer and consumers."""
    timeout = timedelta(seconds=spec.timeout_s)
    if backend == "shm":
        return make_shm_group(store, spec, control)
    if backend == "gloo":
        prefixed = dist.PrefixStore("refit/gloo", store)
        options = dist.ProcessGroupGloo._Options()
        options._devices = gloo_devices(spec, address)
        options._timeout = timeout
        pg = dist.ProcessGroupGloo(prefixed, spec.rank, spec.world_size, options)
        if spec.topology == "chain":
            return ChainBroadcastGroup(pg, spec.rank, spec.world_size, control)
        return TorchBroadcastGroup(pg, torch.device("cpu"), control)
    if backend == "nccl":
        # Without blocking wait an NCCL work's wait() only orders streams, and a dead peer is caught by torch's
        # watchdog, which aborts the process with a multi-line report. With it, wait() raises after the group's
        # timeout and the run ends with the usual one-line error. Read when the group is built; a user's
        # explicit setting wins.
        os.environ.setdefault(NCCL_BLOCKING_WAIT_ENV, "1")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("refit/nccl", store), spec.rank, spec.world_size, options)
        return TorchBroadcastGroup(pg, torch.device("cuda", torch.cuda.current_device()), control)
    return _make_pynccl_group(store, spec, control)


def masked_gloo_error(e: ValueError) -> RuntimeError | None:
    """gloo's error where torch's exception logger replaced it: a collective over an unregistered process group
    (:meth:`TorchBroadcastGroup.process_group`: ``all_gather_object``, ``barrier``) that fails raises, from the
    logger's own look-up of the group, a ValueError that it "is not initialized in the world group map", with gloo's
    RuntimeError (the lost peer) as its context. Nested collectives (``all_gather_object`` over ``all_gather``,
    where the caller has a default process group of its own: a trainer's) mask it once per level."""
    cause: BaseException | None = e
    while isinstance(cause, ValueError) and "world group map" in str(cause):
        cause = cause.__context__
    return cause if cause is not e and isinstance(cause, RuntimeError) else None
