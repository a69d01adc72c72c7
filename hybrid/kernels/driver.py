"""CUDA driver API through ctypes: load a PTX/CUBIN module into PyTorch's context and launch.

PyTorch owns the device memory and the streams; this module only loads modules and calls
cuLaunchKernel on torch's current stream, so no CUDA toolkit or extra Python package is needed.
"""
from __future__ import annotations

import ctypes
import functools

import torch


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
        self._dyn: dict[str, int] = {}

    def function(self, name: str) -> ctypes.c_void_p:
        fn = self._funcs.get(name)
        if fn is None:
            fn = ctypes.c_void_p()
            check(_cuda().cuModuleGetFunction(ctypes.byref(fn), self._handle, name.encode()),
                  f"cuModuleGetFunction({name})")
            self._funcs[name] = fn
        return fn

    def launch(self, name: str, grid: tuple[int, int, int], block: int, args: list,
               stream: torch.cuda.Stream | None = None, smem: int = 0) -> None:
        """args: ctypes scalars (c_void_p for pointers, c_int, c_float, c_longlong); smem: bytes of
        dynamic shared memory (over 48 KB the function's limit is raised once)."""
        fn = self.function(name)
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        if torch.cuda.current_device() != self.device.index:
            with torch.cuda.device(self.device):
                _ensure_context(self.device)
                self._launch(fn, name, grid, block, s, ptrs, self._smem(fn, name, smem))
        else:
            self._launch(fn, name, grid, block, s, ptrs, self._smem(fn, name, smem))

    def _smem(self, fn, name: str, smem: int) -> int:
        if smem > (48 << 10) and self._dyn.get(name, 0) < smem:
            check(_cuda().cuFuncSetAttribute(fn, 8, smem),  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                  f"cuFuncSetAttribute({name}, {smem} bytes of dynamic shared memory)")
            self._dyn[name] = smem
        return smem

    @staticmethod
    def _launch(fn, name, grid, block, stream, ptrs, smem: int = 0) -> None:
        check(_cuda().cuLaunchKernel(fn, grid[0], grid[1], grid[2], block, 1, 1, smem,
                                     ctypes.c_void_p(stream.cuda_stream), ptrs, None),
              f"cuLaunchKernel({name})")


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())
