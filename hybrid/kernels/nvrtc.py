"""NVRTC through ctypes: CUDA C++ source -> PTX or CUBIN, with no CUDA toolkit installed.

libnvrtc is found, in order: $HYBRID_NVRTC (a file), the pip wheels (nvidia-cuda-nvrtc-cu12 ships
nvidia/cuda_nvrtc/lib/libnvrtc.so.12, which the cu12x PyTorch wheels already depend on; CUDA 13
wheels ship nvidia/cu13/lib/libnvrtc.so.13), $CUDA_HOME/lib64, then the system loader.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import sys
from dataclasses import dataclass
from pathlib import Path


class NvrtcError(RuntimeError):
    """NVRTC is missing or failed to compile; the message carries the compiler log."""


def _candidates() -> list[str]:
    out: list[str] = []
    env = os.environ.get("HYBRID_NVRTC")
    if env:
        out.append(env)
    for base in sys.path:
        for pat in ("nvidia/cuda_nvrtc/lib/libnvrtc.so.*", "nvidia/cu1*/lib/libnvrtc.so.*",
                    "nvidia/cuda_nvrtc/bin/nvrtc64_*.dll"):
            out += sorted(p for p in glob.glob(os.path.join(base, pat)) if "alt" not in p
                          and "builtins" not in p)
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    out += sorted(glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*")))
    found = ctypes.util.find_library("nvrtc")
    if found:
        out.append(found)
    out += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    return out


@dataclass(frozen=True)
class Nvrtc:
    lib: ctypes.CDLL
    path: str
    version: tuple[int, int]

    def supported_archs(self) -> list[int]:
        n = ctypes.c_int()
        self._check(self.lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "archs")
        arr = (ctypes.c_int * n.value)()
        self._check(self.lib.nvrtcGetSupportedArchs(arr), "archs")
        return list(arr)

    def _check(self, rc: int, what: str, log: str = "") -> None:
        if rc != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            msg = self.lib.nvrtcGetErrorString(rc).decode()
            raise NvrtcError(f"NVRTC {what} failed ({msg}){': ' + log if log else ''}")

    def compile(self, source: str, name: str, options: list[str], cubin: bool) -> bytes:
        """Compile source; returns PTX (text bytes, NUL-terminated stripped) or a CUBIN image."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                                0, None, None), "create")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            rc = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            self._check(rc, f"compile of {name}", self._log(prog))
            size = ctypes.c_size_t()
            getsize, get = ((self.lib.nvrtcGetCUBINSize, self.lib.nvrtcGetCUBIN) if cubin
                            else (self.lib.nvrtcGetPTXSize, self.lib.nvrtcGetPTX))
            self._check(getsize(prog, ctypes.byref(size)), "size")
            buf = ctypes.create_string_buffer(size.value)
            self._check(get(prog, buf), "output")
            data = buf.raw
            return data if cubin else data.rstrip(b"\0")
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def _log(self, prog) -> str:
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, buf)
        return buf.value.decode(errors="replace")


@functools.lru_cache(maxsize=None)
def load_nvrtc(prefer_major: int | None = None) -> Nvrtc:
    """Load libnvrtc (optionally preferring one major version, e.g. 12 for sm_70)."""
    tried = []
    libs = []
    for cand in _candidates():
        try:
            lib = ctypes.CDLL(cand)
        except OSError as exc:
            tried.append(f"{cand}: {exc}")
            continue
        major, minor = ctypes.c_int(), ctypes.c_int()
        if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
            continue
        libs.append(Nvrtc(lib, cand, (major.value, minor.value)))
        if prefer_major is None or major.value == prefer_major:
            return libs[-1]
    if libs:
        return libs[0]
    raise NvrtcError("libnvrtc not found; install it with `pip install nvidia-cuda-nvrtc-cu12` "
                     "(or set HYBRID_NVRTC=/path/to/libnvrtc.so)")


def wheel_dir(package: str) -> Path | None:
    """Folder of an nvidia-* pip wheel package (e.g. 'cuda_nvcc'), or None."""
    for base in sys.path:
        p = Path(base) / "nvidia" / package
        if p.is_dir():
            return p
    return None
