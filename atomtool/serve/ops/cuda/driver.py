"""The few CUDA driver calls our hand-written kernels need, through ctypes on ``libcuda``.

Why our own and not a library: torch exposes no way to launch a cubin with Hopper launch attributes (thread-block
clusters, programmatic dependent launch), Triton's launcher is generated per Triton kernel, and cuda-python /
cupy are not dependencies of ours; ``cuModuleLoadData`` + ``cuLaunchKernelEx`` on the process's current context
(the primary context torch made current) and torch's current stream are all that is needed. Launches on a
capturing stream are recorded into the CUDA graph like any other.

Errors raise :class:`CudaDriverError` with the driver's name for the code.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from atomtool.serve.ops.cuda.build import CudaBuildError, compile_cubin

#: CUlaunchAttributeID values (cuda.h)
_ATTR_CLUSTER_DIMENSION = 4
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
#: CUfunction_attribute values (cuda.h)
_FUNC_MAX_DYNAMIC_SHARED = 8
#: CUdevice_attribute values (cuda.h)
_DEV_MAX_SHARED_PER_BLOCK_OPTIN = 97


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed (message: the call, the CUresult code and the driver's name for it)."""


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("dims", ctypes.c_uint * 3), ("flag", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


_lib: ctypes.CDLL | None = None
_lock = threading.Lock()


def _cuda() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            try:
                _lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise CudaDriverError(f"cannot load the CUDA driver library libcuda.so.1: {e}") from e
        return _lib


def _check(res: int, what: str) -> None:
    if res != 0:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(res, ctypes.byref(name))
        raise CudaDriverError(f"{what} failed: CUresult {res} ({(name.value or b'?').decode()})")


@dataclass
class Kernel:
    """A kernel of a loaded cubin: ``launch(grid, block, shared, args, ...)`` queues it on torch's current stream.

    args are the kernel's parameters in order, each a ctypes scalar (``ctypes.c_void_p(tensor.data_ptr())``,
    ``ctypes.c_int(n)``, ...) matching the kernel's C signature exactly (the driver cannot check them).
    """

    module: ctypes.c_void_p
    function: ctypes.c_void_p
    name: str
    _shared_set: int = 0

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int, args: list,
               cluster: tuple[int, int, int] | None = None, pdl: bool = False) -> None:
        """Launch on the current stream. shared: dynamic shared-memory bytes; cluster: thread-block cluster
        dims (each must divide the grid's); pdl: programmatic dependent launch (the kernel calls
        ``griddepcontrol.wait`` before reading what earlier kernels wrote). Raises CudaDriverError."""
        lib = _cuda()
        if shared > 48 * 1024 and shared > self._shared_set:
            _check(lib.cuFuncSetAttribute(self.function, _FUNC_MAX_DYNAMIC_SHARED, ctypes.c_int(shared)),
                   f"cuFuncSetAttribute({self.name}, max dynamic shared memory {shared})")
            self._shared_set = shared
        attrs = (_Attr * 2)()
        n = 0
        if cluster is not None:
            attrs[n].id = _ATTR_CLUSTER_DIMENSION
            attrs[n].value.dims[0], attrs[n].value.dims[1], attrs[n].value.dims[2] = cluster
            n += 1
        if pdl:
            attrs[n].id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
            attrs[n].value.flag = 1
            n += 1
        cfg = _LaunchConfig()
        cfg.grid[:] = grid
        cfg.block[:] = block
        cfg.shared = shared
        cfg.stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        cfg.attrs = attrs
        cfg.num_attrs = n
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])  # kernelParams: arg addresses
        _check(lib.cuLaunchKernelEx(ctypes.byref(cfg), self.function, params, None), f"cuLaunchKernelEx({self.name})")


_SHARED_OPTIN: dict[int, int] = {}


def max_shared_optin(index: int) -> int:
    """Bytes of dynamic shared memory one block may opt into on CUDA device ``index`` (the driver's
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 232,448 on H100 / H200, 166,912 on A100, 101,376 on
    sm_86 / sm_89 / sm_120), cached per device. Raises CudaDriverError."""
    if index not in _SHARED_OPTIN:
        lib = _cuda()
        _check(lib.cuInit(0), "cuInit")
        dev, value = ctypes.c_int(), ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(index)), f"cuDeviceGet({index})")
        _check(lib.cuDeviceGetAttribute(ctypes.byref(value), _DEV_MAX_SHARED_PER_BLOCK_OPTIN, dev),
               "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)")
        _SHARED_OPTIN[index] = value.value
    return _SHARED_OPTIN[index]


def rows_aligned(t: torch.Tensor) -> bool:
    """16-byte vector loads at every row start of ``t``: a contiguous last dim, the base address and every
    leading stride a multiple of 16 bytes (the check our kernels' ``uint4`` / ``cp.async`` 16-byte loads need)."""
    elems = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and all(s % elems == 0 for s in t.stride()[:-1]) and t.stride(-1) == 1


def device_guard(device: torch.device):
    """A context making ``device`` current for a launch: ``torch.cuda.device(device)``, or nothing when it already
    is (the usual case: skips ~10 us of host time per launch outside CUDA graphs). A kernel launches in the
    context its module was loaded into, so the device must be current."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return contextlib.nullcontext() if index == torch.cuda.current_device() else torch.cuda.device(index)


class OptionalKernel:
    """A kernel of one of our ``.cu`` files that stands in for a Triton one where it can: built (nvcc) and loaded at
    first use per (device, defines) for ``sm_XY`` of the device. :meth:`ready` says whether it serves on a
    device: a CUDA (not ROCm) device of compute capability 8.0 or newer, ``env`` not ``0``, and the build and
    load done; a failure warns once per device (naming ``what``) and the caller keeps its Triton kernel."""

    def __init__(self, source: str, function: str, what: str, env: str) -> None:
        self.source, self.function, self.what, self.env = source, function, what, env
        self._kernels: dict[tuple[int, tuple], Kernel] = {}
        self._failed: dict[int, str] = {}

    def enabled(self, device: torch.device) -> bool:
        """The checks before any CUDA call: a CUDA device (not ROCm) and ``env`` not ``0``."""
        return (device.type == "cuda" and torch.version.hip is None
                and os.environ.get(self.env, "1") not in ("", "0"))

    def ready(self, device: torch.device, defines: tuple[tuple[str, int], ...], shared: int = 0) -> bool:
        """Whether the kernel serves on ``device`` with ``defines`` (building and loading it the first time);
        ``shared``: the dynamic shared memory it launches with, which must fit the device's per-block opt-in
        limit (:func:`max_shared_optin`; a kernel sized for Hopper does not fit an sm_86 / sm_89: no warning,
        the Triton kernel serves there)."""
        if not self.enabled(device):
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        if (index, defines) in self._kernels:
            return True
        if index in self._failed or torch.cuda.get_device_capability(index) < (8, 0):
            return False
        major, minor = torch.cuda.get_device_capability(index)
        try:
            if shared > max_shared_optin(index):
                return False
            cubin = compile_cubin(self.source, f"sm_{major}{minor}", defines)
            with torch.cuda.device(index):
                self._kernels[(index, defines)] = load_kernel(cubin, self.function)
        except (CudaBuildError, CudaDriverError) as e:
            self._failed[index] = str(e)
            warnings.warn(f"CUDA {self.what} kernel unavailable, using the Triton kernel: {e}", RuntimeWarning,
                          stacklevel=3)
            return False
        return True

    def get(self, device: torch.device, defines: tuple[tuple[str, int], ...]) -> Kernel:
        """The loaded kernel (:meth:`ready` must have said True for these). Raises KeyError otherwise."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        return self._kernels[(index, defines)]


def load_kernel(cubin: bytes, name: str) -> Kernel:
    """Load ``cubin`` into the current CUDA context (torch's primary context of the current device; torch is
    initialized first) and return its ``extern "C"`` kernel ``name``. Raises CudaDriverError."""
    torch.cuda.init()
    torch.cuda.current_stream()  # makes torch's context current on this thread
    lib = _cuda()
    mod = ctypes.c_void_p()
    _check(lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(cubin)), "cuModuleLoadData")
    fn = ctypes.c_void_p()
    _check(lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), f"cuModuleGetFunction({name})")
    return Kernel(mod, fn, name)
