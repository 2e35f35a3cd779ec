"""``group.backend=shm`` where every rank has a GPU: the producer's segments are device memory that consumers
open through CUDA IPC handles and copy from, device to device (the same ring, messages and lifetime rule as host
memory, :mod:`refit_app.transport.shm`).

The segments are allocated with ``cudaMalloc`` directly, not through torch's caching allocator: an IPC handle names
a whole allocation, and a caching-allocator block shares one with other tensors (torch's own sharing of CUDA
tensors adds reference-counting files for that, which a SIGKILL can leave behind in ``/dev/shm``). A handle is 64
bytes the producer sends in the segment's first publication to each consumer (instead of a descriptor); the memory
is freed when the last tensor over it goes, here and in every consumer (each closes its handle then). Order: the
producer synchronizes the stream that packed a chunk before publishing it, a consumer synchronizes its copy before
it releases the publication, so no event crosses processes. Consumers copy (no views handed out): an engine wants
its weights in memory of its own.

Written against the CUDA runtime's documented API (``cudaMalloc``, ``cudaIpcGetMemHandle``,
``cudaIpcOpenMemHandle``); its tests are marked ``gpu`` (``tests/test_shm_gpu.py``) and wait for a GPU.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from refit_app.transport.shm.segments import RingSegment

HOST = torch.device("cpu")
"""The device of a shared-memory group in host memory."""
_IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


@functools.cache
def cudart() -> Any:
    """The CUDA runtime that torch loaded into this process (so that both see the same context and devices)."""
    torch.cuda.init()
    paths = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if line.strip() else ""
            if "libcudart" in path and path not in paths:
                paths.append(path)
    for path in paths or ["libcudart.so", "libcudart.so.12"]:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name, args in (
            ("cudaMalloc", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]),
            ("cudaFree", [ctypes.c_void_p]),
            ("cudaIpcGetMemHandle", [ctypes.POINTER(_Handle), ctypes.c_void_p]),
            ("cudaIpcOpenMemHandle", [ctypes.POINTER(ctypes.c_void_p), _Handle, ctypes.c_uint]),
            ("cudaIpcCloseMemHandle", [ctypes.c_void_p]),
            ("cudaGetErrorString", [ctypes.c_int]),
        ):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_char_p if name == "cudaGetErrorString" else ctypes.c_int
        return lib
    raise RuntimeError("group.backend=shm on GPUs needs the CUDA runtime (libcudart), which this process lacks")


def _check(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"{what} failed: {cudart().cudaGetErrorString(code).decode()} (CUDA error {code})")


class _DeviceMemory:
    """Device bytes that torch sees as a uint8 tensor (``__cuda_array_interface__``); torch keeps this object alive
    for as long as a tensor over it lives, and ``release`` runs when the last one goes."""

    def __init__(self, pointer: int, nbytes: int, device: torch.device, release: Any) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 3}
        self._pointer, self._device, self._release = pointer, device, release

    def __del__(self) -> None:
        try:
            with torch.cuda.device(self._device):
                self._release(ctypes.c_void_p(self._pointer))
        except Exception:  # interpreter teardown, a context already gone: the process's exit frees it
            pass

    def tensor(self) -> torch.Tensor:
        return torch.as_tensor(self, device=self._device)


class CudaSegment(RingSegment):
    """A producer's segment of device memory and its CUDA IPC handle (to pass to consumers)."""

    def __init__(self, seg_id: int, nbytes: int, device: torch.device) -> None:
        super().__init__(seg_id)
        lib = cudart()
        self.nbytes = max(1, nbytes)
        pointer = ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(lib.cudaMalloc(ctypes.byref(pointer), self.nbytes), "cudaMalloc")
            memory = _DeviceMemory(pointer.value, self.nbytes, device, lib.cudaFree)
            handle = _Handle()
            _check(lib.cudaIpcGetMemHandle(ctypes.byref(handle), pointer), "cudaIpcGetMemHandle")
        self.handle = bytes(handle.reserved)
        self.fd = None
        self.tensor = memory.tensor()
        self.address = self.tensor.data_ptr()

    def close(self) -> None:
        """Nothing to give up but this reference: the memory goes with the last tensor over it."""


def map_cuda_segment(handle: bytes, nbytes: int, device: torch.device) -> torch.Tensor:
    """A consumer's view of the producer's device memory behind ``handle``, opened on ``device`` (peer access
    enabled where it is another GPU); closed when the last tensor over it goes."""
    if len(handle) != _IPC_HANDLE_BYTES:
        raise ValueError(f"the producer passed a CUDA IPC handle of {len(handle)} bytes, not {_IPC_HANDLE_BYTES}")
    lib = cudart()
    pointer = ctypes.c_void_p()
    with torch.cuda.device(device):
        _check(
            lib.cudaIpcOpenMemHandle(ctypes.byref(pointer), _Handle(handle), _LAZY_ENABLE_PEER_ACCESS),
            "cudaIpcOpenMemHandle",
        )
    return _DeviceMemory(pointer.value, nbytes, device, lib.cudaIpcCloseMemHandle).tensor()


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` for 1-D uint8 tensors on any devices: one memmove on the host (no intra-op threads), a copy
    on the current stream, then synchronized, where a GPU is involved (a consumer releases only what it has read;
    a producer publishes only what it has written)."""
    n = src.numel()
    if not n:
        return
    if dst.device.type == "cpu" and src.device.type == "cpu":
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
        return
    dst.copy_(src)
    torch.cuda.current_stream(dst.device if dst.device.type == "cuda" else src.device).synchronize()
