"""CUDA driver API through ctypes: load a PTX/CUBIN module into PyTorch's context and launch.

PyTorch owns the device memory and the streams; this module only loads modules and calls
cuLaunchKernel (cuLaunchKernelEx for a programmatic dependent launch) on torch's current stream, so no
CUDA toolkit or extra Python package is needed.
"""
from __future__ import annotations

import ctypes
import functools
import os
from contextlib import nullcontext

import torch


CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
# Every kernel's preferred shared-memory carveout (% of the SM's maximum; -1 the driver's choice), set on sm_90+
# where the decode kernels go out as programmatic dependent launches: a kernel's blocks then start beside the
# previous kernel's, which they can only do where the SM's shared-memory configuration holds both. At the driver's
# choice an SM running one block of the 2000-key attention (35 KB) had no room for the o_proj GEMV's blocks
# (36 KB), so that GEMV's launch and weight ramp waited for the attention's end; at 100 they overlap it (H200,
# synth 30B-A3B decode at a 2000-token prompt 410.0-411.0 vs 395.5-396.4 tok/s, at 32 tokens 473.6-476.1 vs
# 473.1-476.0; results/runtime.md §37). Below sm_90 (no dependent launches) the driver's choice stays.
# HYBRID_SMEM_CARVEOUT overrides it on any card (-1 = the driver's choice; A/B runs).
CARVEOUT_ENV = "HYBRID_SMEM_CARVEOUT"
CARVEOUT_SM90 = 100
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (here its first int)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig of cuLaunchKernelEx."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


def _pdl_config(grid, block: int, smem: int, stream) -> LaunchConfig:
    """A launch whose grid may start while the previous kernel in the stream finishes (programmatic
    dependent launch, sm_90+): the kernel waits for it with griddepcontrol.wait itself."""
    attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    cfg = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(block, 1, 1), smem,
                       ctypes.c_void_p(stream.cuda_stream), ctypes.pointer(attr), 1)
    cfg._keep = attr      # the attribute lives as long as the config
    return cfg


class DriverError(RuntimeError):
    """A CUDA driver call failed."""


@functools.lru_cache(maxsize=None)
def _cuda() -> ctypes.CDLL:
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise DriverError("libcuda (the NVIDIA driver) not found")


def check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _cuda().cuGetErrorString(rc, ctypes.byref(msg))
        raise DriverError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")


def current(device: torch.device):
    """A scope in which `device` is torch's current CUDA device (nothing for a CPU device). The eager
    layer loops enter it per layer or segment, so a second card's launches find their card current and
    skip launch()'s switch (a device change and a context check per kernel)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _ensure_context(device: torch.device) -> None:
    """Make torch's primary context of this device current on this thread."""
    torch.cuda.init()
    with torch.cuda.device(device):
        torch.cuda.current_stream(device)  # forces the runtime to bind its context
        ctx = ctypes.c_void_p()
        check(_cuda().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            check(_cuda().cuDeviceGet(ctypes.byref(dev), device.index or 0), "cuDeviceGet")
            check(_cuda().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            check(_cuda().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def carveout(default: int | None) -> int | None:
    """A kernel's preferred shared-memory carveout (None: the driver's choice): $HYBRID_SMEM_CARVEOUT, read at every
    launch (A/B runs switch it between sessions), else `default` (a module's: CARVEOUT_SM90 on sm_90+)."""
    v = os.environ.get(CARVEOUT_ENV)
    if not v:
        return default
    try:
        c = int(v)
    except ValueError:
        c = -2
    if not -1 <= c <= 100:
        from hybrid.errors import HybridError

        raise HybridError(f"{CARVEOUT_ENV}={v!r}: expected a percentage 0..100, or -1 for the driver's choice")
    return c


class Module:
    """A loaded module; kernels by name; launch(name, grid, block, args, stream)."""

    def __init__(self, image: bytes, device: torch.device):
        self.device = device
        with torch.cuda.device(device):
            _ensure_context(device)
            self._handle = ctypes.c_void_p()
            buf = ctypes.create_string_buffer(image + (b"" if image.endswith(b"\0") else b"\0"))
            check(_cuda().cuModuleLoadData(ctypes.byref(self._handle), buf), "cuModuleLoadData")
        self._funcs: dict[str, ctypes.c_void_p] = {}
        self._smem: dict[str, int] = {}                 # dynamic shared memory limits raised (launch's smem)
        self._occupancy: dict[tuple, int] = {}
        self._carve: dict[str, int] = {}                # preferred carveouts set (carveout())
        self._carve_default = CARVEOUT_SM90 if torch.cuda.get_device_capability(device) >= (9, 0) else None

    def function(self, name: str) -> ctypes.c_void_p:
        fn = self._funcs.get(name)
        if fn is None:
            fn = ctypes.c_void_p()
            check(_cuda().cuModuleGetFunction(ctypes.byref(fn), self._handle, name.encode()),
                  f"cuModuleGetFunction({name})")
            self._funcs[name] = fn
        carve = self.carveout()
        if carve is not None and self._carve.get(name) != carve:
            check(_cuda().cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, carve),
                  f"cuFuncSetAttribute({name}, carveout {carve})")
            self._carve[name] = carve
        return fn

    def carveout(self) -> int | None:
        """The preferred shared-memory carveout this module's kernels launch with (carveout())."""
        return carveout(self._carve_default)

    def occupancy(self, name: str, block: int, smem: int = 0) -> int:
        """Resident blocks per SM of kernel name at block threads and smem bytes of dynamic shared memory."""
        key = (name, block, smem, self.carveout())
        n = self._occupancy.get(key)
        if n is None:
            c = ctypes.c_int()
            with torch.cuda.device(self.device):
                check(_cuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    ctypes.byref(c), self._with_smem(name, smem), block, ctypes.c_size_t(smem)),
                    f"cuOccupancyMaxActiveBlocksPerMultiprocessor({name})")
            n = self._occupancy[key] = max(1, c.value)
        return n

    def launch(self, name: str, grid: tuple[int, int, int], block: int, args: list,
               stream: torch.cuda.Stream | None = None, smem: int = 0, pdl: bool = False) -> None:
        """args: ctypes scalars (c_void_p for pointers, c_int, c_float, c_longlong); smem: bytes of dynamic
        shared memory (the function's limit raised to it once); pdl: a programmatic dependent launch (the
        kernel must griddepcontrol.wait before it reads what the previous kernel wrote; sm_90+ only)."""
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        if torch.cuda.current_device() != self.device.index:
            with torch.cuda.device(self.device):   # another card's kernel: its context current for every driver call
                _ensure_context(self.device)
                self._launch(self._with_smem(name, smem), name, grid, block, s, ptrs, smem, pdl)
        else:
            self._launch(self._with_smem(name, smem), name, grid, block, s, ptrs, smem, pdl)

    def _with_smem(self, name: str, smem: int) -> ctypes.c_void_p:
        """function(name), its dynamic shared memory limit raised to smem where it is below."""
        fn = self.function(name)
        if smem and self._smem.get(name, 0) < smem:
            check(_cuda().cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                  f"cuFuncSetAttribute({name}, {smem} B)")
            self._smem[name] = smem
        return fn

    @staticmethod
    def _launch(fn, name, grid, block, stream, ptrs, smem: int = 0, pdl: bool = False) -> None:
        if pdl:
            cfg = _pdl_config(grid, block, smem, stream)
            check(_cuda().cuLaunchKernelEx(ctypes.byref(cfg), fn, ptrs, None), f"cuLaunchKernelEx({name})")
            return
        check(_cuda().cuLaunchKernel(fn, grid[0], grid[1], grid[2], block, 1, 1, smem,
                                     ctypes.c_void_p(stream.cuda_stream), ptrs, None),
              f"cuLaunchKernel({name})")


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    """A kernel argument: t's device address, or a null pointer for None (an argument the kernel leaves unused)."""
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def mapped_ptr(host_ptr: int, device: torch.device) -> int:
    """The address at which `device`'s kernels read host memory registered as mapped (cudaHostRegisterMapped):
    the host address itself under unified addressing, unless the device cannot use host pointers for registered
    memory (cuMemHostGetDevicePointer tells)."""
    with torch.cuda.device(device):
        _ensure_context(device)
        dptr = ctypes.c_uint64()
        check(_cuda().cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(host_ptr), 0),
              "cuMemHostGetDevicePointer")
    return int(dptr.value)


def grow_workspace(store: dict, dev: torch.device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel family's per-device scratch kept in store[dev]: fp32 partials (>= floats) and int32 counters (>=
    counters; zero, and left zero by every launch of the kernels that use them). Grow-only: a larger request
    replaces both with buffers at least as large as before, the older ones kept alive (captured graphs may point
    at them). Launches on one device are ordered on one stream (as the runtime's are)."""
    part, cnt, old = store.get(dev, (None, None, []))
    if part is None or part.numel() < floats or cnt.numel() < counters:
        old = old + [part, cnt]
        part = torch.empty(max(floats, 0 if part is None else part.numel()), dtype=torch.float32, device=dev)
        cnt = torch.zeros(max(counters, 0 if cnt is None else cnt.numel()), dtype=torch.int32, device=dev)
        store[dev] = (part, cnt, old)
    return part, cnt
