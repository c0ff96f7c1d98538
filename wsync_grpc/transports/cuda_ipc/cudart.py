"""The few CUDA runtime calls the CUDA IPC transport makes, through :mod:`ctypes` (no compiled extension).

PyTorch does not expose ``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle`` on memory it does not own (its own
``Storage._share_cuda_`` pickles the handle with its caching allocator's bookkeeping), so the transport calls the
runtime itself: the ``libcudart`` PyTorch already loaded into this process, found by its path in
``/proc/self/maps`` once ``torch.cuda`` is initialized (the way vLLM's ``cuda_wrapper`` finds it), so that its
calls share PyTorch's CUDA contexts. Where PyTorch's runtime is not a file of its own (linked statically), another
one: :data:`ENV_PATH` if set, the ``nvidia-cuda-runtime`` wheel's (``nvidia/cuda_runtime/lib``,
``nvidia/cu13/lib``), then ``ctypes.util.find_library("cudart")``; any runtime works on the same device's primary
context as PyTorch's does.

Every call names the device it works on (:class:`CudaRuntime.on_device`): the runtime's current device is per
thread, and a receiver runs on a thread of its own. Errors raise :class:`CudaError` with the runtime's own words
(``cudaGetErrorString``), once the thread's last error is reset (else PyTorch would raise it after its next kernel
launch). Nothing here is called unless an update names ``TRANSPORT_CUDA_IPC``: importing it needs
no GPU.

Units: sizes in bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from wsync_grpc.core.header import CUDA_IPC_HANDLE_BYTES

LIBRARY = "libcudart"
"""The start of the CUDA runtime library's file name (``libcudart.so.12``, ...)."""

MAPS_PATH = "/proc/self/maps"
"""Where Linux lists the files mapped into this process (the shared libraries loaded among them)."""

ENV_PATH = "WSYNC_CUDART_PATH"
"""An environment variable naming the ``libcudart`` to load where PyTorch's is not a file of its own."""

IPC_LAZY_ENABLE_PEER_ACCESS = 1
"""``cudaIpcMemLazyEnablePeerAccess`` (CUDA's ``driver_types.h``): the one flag ``cudaIpcOpenMemHandle`` takes."""


class CudaError(RuntimeError):
    """A CUDA runtime call failed, or the runtime cannot be found (the message says which, in CUDA's words)."""


class IpcMemHandle(ctypes.Structure):
    """``cudaIpcMemHandle_t``: ``char reserved[CUDA_IPC_HANDLE_SIZE]`` (64 bytes), passed by value."""

    _fields_ = [("reserved", ctypes.c_char * CUDA_IPC_HANDLE_BYTES)]


def loaded_library(maps: str, name: str = LIBRARY) -> str | None:
    """The path of the shared library mapped in ``maps`` (a ``/proc/<pid>/maps`` text) whose file name starts with
    ``name`` (``libcudart.so.12``, ``libcudart-1a2b3c4d.so.12``; not a static archive); ``None`` when none is.

    Where several are mapped, a copy another wheel vendors for itself (in a ``<package>.libs`` directory, auditwheel's
    convention: ``torchvision.libs/libcudart.faf08d9a.so.13``) comes after the others: PyTorch's own runtime (the
    ``nvidia-cuda-runtime`` wheel's, or ``torch/lib``'s) is the one whose per-thread state PyTorch reads."""
    found: list[str] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if not path.startswith("/") or path.endswith(" (deleted)"):
            continue
        file = Path(path).name
        if file.startswith(name) and ".so" in file and path not in found:
            found.append(path)
    found.sort(key=lambda p: Path(p).parent.name.endswith(".libs"))  # stable: maps order otherwise
    return found[0] if found else None


def wheel_libraries(name: str = LIBRARY) -> list[str]:
    """The ``name`` libraries of the ``nvidia-cuda-runtime`` wheels installed beside PyTorch
    (``nvidia/cuda_runtime/lib/libcudart.so.12``, CUDA 13's ``nvidia/cu13/lib/libcudart.so.13``), newest first."""
    try:
        import nvidia  # type: ignore[import-not-found,import-untyped,unused-ignore]  # a namespace package
    except ImportError:
        return []
    found: list[str] = []
    for root in getattr(nvidia, "__path__", []):
        for pattern in (f"cuda_runtime/lib/{name}.so*", f"cu*/lib/{name}.so*"):
            found += sorted((str(p) for p in Path(root).glob(pattern)), reverse=True)
    return found


def library_candidates() -> list[str]:
    """Where this process's CUDA runtime may be, in the order :func:`runtime` tries them: the one loaded (see the
    module), :data:`ENV_PATH`, the wheels' (:func:`wheel_libraries`), ``find_library("cudart")``."""
    try:
        maps = Path(MAPS_PATH).read_text()
    except OSError:
        maps = ""
    candidates = [loaded_library(maps), os.environ.get(ENV_PATH) or None, *wheel_libraries()]
    candidates.append(ctypes.util.find_library("cudart"))
    return list(dict.fromkeys(c for c in candidates if c))


class CudaRuntime:
    """The CUDA runtime library at ``path``, with the calls this transport makes.

    Args:
        path: the shared library (``libcudart.so.*``).

    Raises:
        OSError: it cannot be loaded.
        AttributeError: it lacks one of the calls (not a CUDA runtime).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        vp, err = ctypes.c_void_p, ctypes.c_int
        self._sigs = {
            "cudaGetErrorString": (ctypes.c_char_p, [err]),
            "cudaGetLastError": (err, []),
            "cudaGetDevice": (err, [ctypes.POINTER(ctypes.c_int)]),
            "cudaSetDevice": (err, [ctypes.c_int]),
            "cudaMalloc": (err, [ctypes.POINTER(vp), ctypes.c_size_t]),
            "cudaFree": (err, [vp]),
            "cudaIpcGetMemHandle": (err, [ctypes.POINTER(IpcMemHandle), vp]),
            "cudaIpcOpenMemHandle": (err, [ctypes.POINTER(vp), IpcMemHandle, ctypes.c_uint]),
            "cudaIpcCloseMemHandle": (err, [vp]),
        }
        self._f = {}
        for fname, (restype, argtypes) in self._sigs.items():
            f = getattr(lib, fname)
            f.restype, f.argtypes = restype, argtypes
            self._f[fname] = f

    def _check(self, result: int, call: str) -> None:
        """Raise :class:`CudaError` unless ``result`` is ``cudaSuccess``, first resetting this thread's last error
        (``cudaGetLastError``): the runtime keeps a failed call's error for the thread, and PyTorch's next check of
        it (after a kernel launch) would raise it as its own, far from here. An error that corrupted the context
        (sticky) stays: CUDA keeps that one whatever is reset."""
        if result != 0:
            self._f["cudaGetLastError"]()
            words = self._f["cudaGetErrorString"](result)
            raise CudaError(f"{call} failed: CUDA error {result} ({words.decode(errors='replace') if words else '?'})")

    def get_device(self) -> int:
        """This thread's current device (``cudaGetDevice``)."""
        d = ctypes.c_int()
        self._check(self._f["cudaGetDevice"](ctypes.byref(d)), "cudaGetDevice")
        return int(d.value)

    def set_device(self, index: int) -> None:
        """Make ``index`` this thread's current device (``cudaSetDevice``)."""
        self._check(self._f["cudaSetDevice"](index), f"cudaSetDevice({index})")

    @contextlib.contextmanager
    def on_device(self, index: int) -> Iterator[None]:
        """Run the block with ``index`` as this thread's current device, then give the thread its previous one back
        the way PyTorch does (``torch.cuda.device``: without creating a context on a device that has none, as a
        plain ``cudaSetDevice`` back to device 0 would in a fresh thread of a worker on another GPU). The block's
        device is also set through this runtime (``cudaSetDevice``): the same call where it is PyTorch's runtime,
        the one that counts where it is another."""
        import torch

        with torch.cuda.device(index):
            self.set_device(index)
            yield

    def malloc(self, nbytes: int) -> int:
        """A fresh allocation of ``nbytes`` bytes on the current device (``cudaMalloc``); its address."""
        p = ctypes.c_void_p()
        self._check(self._f["cudaMalloc"](ctypes.byref(p), nbytes), f"cudaMalloc({nbytes})")
        assert p.value is not None
        return int(p.value)

    def free(self, address: int) -> None:
        """Free an allocation of :meth:`malloc` (``cudaFree``; it waits for the device's work on it)."""
        self._check(self._f["cudaFree"](ctypes.c_void_p(address)), "cudaFree")

    def ipc_get_handle(self, address: int) -> bytes:
        """The ``cudaIpcMemHandle_t`` of the allocation starting at ``address`` (``cudaIpcGetMemHandle``): its
        :data:`~wsync_grpc.core.header.CUDA_IPC_HANDLE_BYTES` bytes."""
        h = IpcMemHandle()
        self._check(self._f["cudaIpcGetMemHandle"](ctypes.byref(h), ctypes.c_void_p(address)), "cudaIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(h), CUDA_IPC_HANDLE_BYTES)

    def ipc_open(self, handle: bytes) -> int:
        """Map another process's allocation by its handle on the current device (``cudaIpcOpenMemHandle`` with
        :data:`IPC_LAZY_ENABLE_PEER_ACCESS`); its address here.

        Raises:
            ValueError: ``handle`` is not :data:`~wsync_grpc.core.header.CUDA_IPC_HANDLE_BYTES` bytes.
            CudaError: the runtime refused it (e.g. a handle of this very process, or of a freed allocation).
        """
        if len(handle) != CUDA_IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle has {CUDA_IPC_HANDLE_BYTES} bytes, not {len(handle)}")
        h = IpcMemHandle()
        ctypes.memmove(ctypes.addressof(h), handle, CUDA_IPC_HANDLE_BYTES)
        p = ctypes.c_void_p()
        self._check(
            self._f["cudaIpcOpenMemHandle"](ctypes.byref(p), h, IPC_LAZY_ENABLE_PEER_ACCESS), "cudaIpcOpenMemHandle"
        )
        assert p.value is not None
        return int(p.value)

    def ipc_close(self, address: int) -> None:
        """Unmap what :meth:`ipc_open` mapped (``cudaIpcCloseMemHandle``)."""
        self._check(self._f["cudaIpcCloseMemHandle"](ctypes.c_void_p(address)), "cudaIpcCloseMemHandle")


_lock = threading.Lock()
_runtime: CudaRuntime | None = None


def runtime() -> CudaRuntime:
    """The process's CUDA runtime (loaded once): PyTorch's own ``libcudart``, found in :data:`MAPS_PATH` once
    ``torch.cuda`` is initialized; where PyTorch's is not a separate file, the first of :func:`library_candidates`
    that loads.

    Raises:
        CudaError: no CUDA device is usable by PyTorch here, or no runtime library can be loaded (the message names
            every path tried, and :data:`ENV_PATH`).
    """
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        import torch

        if not torch.cuda.is_available():
            raise CudaError("CUDA is not available in this process (torch.cuda.is_available() is false)")
        torch.cuda.init()  # type: ignore[no-untyped-call]  # loads PyTorch's libcudart, if it has one of its own
        tried: list[str] = []
        for path in library_candidates():
            try:
                _runtime = CudaRuntime(path)
            except (OSError, AttributeError) as e:
                tried.append(f"{path}: {e}")
                continue
            return _runtime
        raise CudaError(
            f"no CUDA runtime library ({LIBRARY}.so.*) is loaded in this process (PyTorch {torch.__version__}, CUDA "
            f"{torch.version.cuda}) and none could be loaded"
            + (f" ({'; '.join(tried)})" if tried else " (none found beside PyTorch, nor by find_library)")
            + f": set {ENV_PATH} to the path of the libcudart.so of PyTorch's CUDA version"
        )
