"""llama.cpp's `--cpu-moe` through llama-cpp-python: keep the expert tensors on the CPU, the rest on the GPU.

`llama_cpp.Llama` does not expose `llama_model_params.tensor_buft_overrides`; this module builds the
NULL-terminated array of {pattern, buffer type} itself (the CPU buffer type comes from libggml in the
package's lib folder, through ctypes) and hands it to `Llama` as part of the default model params it
starts from (`model_params_with`). The caller keeps the returned `BuftOverrides` alive as long as the
model lives. `LoadLog` collects llama.cpp's log during a load: which tensors an override moved and the
size of every model buffer (CPU_Mapped, CUDA0, ...), so a placement is checked, not assumed.
"""
from __future__ import annotations

import contextlib
import ctypes
import re
from dataclasses import dataclass, field
from pathlib import Path

from hybrid.errors import HybridError

# llama.cpp common/common.h LLM_FFN_EXPS_REGEX: the pattern `--cpu-moe` (and `-ot exps=CPU` in effect) uses.
EXPS_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
GGML_BACKEND_DEVICE_TYPE_CPU = 0
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


class _Override(ctypes.Structure):
    """struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }"""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _lib_dir() -> Path:
    from hybrid.baselines.llama_runner import require_llama_cpp

    return Path(require_llama_cpp().__file__).resolve().parent / "lib"


_LIBGGML = None


def libggml(lib_dir: Path | None = None) -> ctypes.CDLL:
    """libggml.so of the installed llama-cpp-python (its dependencies hold the backends), with the
    few ggml-backend functions used here declared."""
    global _LIBGGML
    if _LIBGGML is not None and lib_dir is None:
        return _LIBGGML
    path = (lib_dir or _lib_dir()) / "libggml.so"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise HybridError(f"{path}: cannot load libggml ({exc}); expected llama-cpp-python's lib folder") from exc
    p = ctypes.c_void_p
    for name, args, res in (("ggml_backend_dev_count", [], ctypes.c_size_t),
                            ("ggml_backend_dev_get", [ctypes.c_size_t], p),
                            ("ggml_backend_dev_by_type", [ctypes.c_int], p),
                            ("ggml_backend_dev_name", [p], ctypes.c_char_p),
                            ("ggml_backend_dev_description", [p], ctypes.c_char_p),
                            ("ggml_backend_dev_type", [p], ctypes.c_int),
                            ("ggml_backend_dev_memory", [p, ctypes.POINTER(ctypes.c_size_t),
                                                         ctypes.POINTER(ctypes.c_size_t)], None),
                            ("ggml_backend_dev_buffer_type", [p], p),
                            ("ggml_backend_buft_name", [p], ctypes.c_char_p)):
        try:
            fn = getattr(lib, name)
        except AttributeError as exc:
            raise HybridError(f"{path}: no symbol {name}; this libggml is too old for device queries") from exc
        fn.argtypes, fn.restype = args, res
    if lib_dir is None:
        _LIBGGML = lib
    return lib


def devices(lib: ctypes.CDLL | None = None) -> list[dict]:
    """ggml's backend devices: name, description, type, free/total memory in bytes."""
    lib = lib or libggml()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append({"name": lib.ggml_backend_dev_name(dev).decode(),
                    "description": lib.ggml_backend_dev_description(dev).decode(),
                    "type": DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "?"),
                    "free": free.value, "total": total.value})
    return out


def cpu_buffer_type(lib: ctypes.CDLL | None = None) -> int:
    """The CPU device's buffer type (the pointer `ggml_backend_cpu_buffer_type()` returns)."""
    lib = lib or libggml()
    dev = lib.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        raise HybridError("libggml has no CPU device registered; cannot place tensors on the CPU")
    buft = lib.ggml_backend_dev_buffer_type(dev)
    if not buft:
        raise HybridError("libggml's CPU device has no buffer type")
    return buft


def check_pattern(pattern: str) -> str:
    """A regular expression llama.cpp can compile (ECMAScript; checked with Python's re, which agrees
    on the plain patterns used here); raises HybridError naming the pattern."""
    if not isinstance(pattern, str) or not pattern:
        raise HybridError(f"cpu_experts pattern {pattern!r}: expected a non-empty regular expression")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise HybridError(f"cpu_experts pattern {pattern!r}: not a valid regular expression ({exc})") from exc
    return pattern


@dataclass
class BuftOverrides:
    """A NULL-terminated `llama_model_tensor_buft_override` array; keep it alive with the model."""

    patterns: list[bytes]
    array: ctypes.Array

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


def cpu_overrides(patterns: list[str], lib: ctypes.CDLL | None = None) -> BuftOverrides:
    """Every tensor whose name matches one of `patterns` (std::regex_search) goes to the CPU buffer type."""
    buft = cpu_buffer_type(lib)
    raw = [check_pattern(p).encode() for p in patterns]
    arr = (_Override * (len(raw) + 1))()
    for i, p in enumerate(raw):
        arr[i].pattern, arr[i].buft = p, buft
    arr[len(raw)].pattern, arr[len(raw)].buft = None, None
    return BuftOverrides(raw, arr)


@contextlib.contextmanager
def model_params_with(overrides: BuftOverrides | None, extra_bufts: bool = True):
    """While open, `llama_model_default_params()` (what `llama_cpp.Llama` starts from) carries
    `overrides` and, with extra_bufts False, `use_extra_bufts = False` (no repacked or AMX weight
    buffers); Llama sets its own fields on top and leaves these two alone."""
    if overrides is None and extra_bufts:
        yield
        return
    import llama_cpp.llama_cpp as C

    default = C.llama_model_default_params

    def with_overrides():
        params = default()
        if overrides is not None:
            params.tensor_buft_overrides = overrides.address
        if not extra_bufts:
            params.use_extra_bufts = False
        return params

    C.llama_model_default_params = with_overrides
    try:
        yield
    finally:
        C.llama_model_default_params = default


_OVERRIDDEN = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)")
_BUFFER = re.compile(r"(\S+) model buffer size\s*=\s*([\d.]+) MiB")


@dataclass
class LoadLog:
    """llama.cpp's log lines during one load (every level), and what they say about placement."""

    lines: list[str] = field(default_factory=list)

    @property
    def overridden(self) -> dict[str, str]:
        """tensor name -> buffer type, for every tensor an override placed."""
        return {m.group(1): m.group(2) for m in map(_OVERRIDDEN.search, self.lines) if m}

    @property
    def model_buffers_mib(self) -> dict[str, float]:
        """buffer name (CPU_Mapped, CUDA0, CUDA_Host, ...) -> MiB of weights, summed."""
        out: dict[str, float] = {}
        for m in filter(None, map(_BUFFER.search, self.lines)):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def errors(self) -> list[str]:
        return [ln for ln in self.lines if "error" in ln.lower() or "failed" in ln.lower()]


@contextlib.contextmanager
def capture_log(echo: bool = False):
    """Route llama.cpp/ggml logging into a LoadLog while open; llama-cpp-python's logger after."""
    import sys

    import llama_cpp
    import llama_cpp._logger as lg

    log = LoadLog()
    partial: list[str] = []

    @llama_cpp.llama_log_callback
    def cb(level, text, user_data):
        s = text.decode("utf-8", "replace")
        if echo:
            print(s, end="", file=sys.stderr)
        partial.append(s)
        if s.endswith("\n"):
            log.lines.append("".join(partial).rstrip("\n"))
            partial.clear()

    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))
    try:
        yield log
    finally:
        llama_cpp.llama_log_set(lg.llama_log_callback, ctypes.c_void_p(0))
        if partial:
            log.lines.append("".join(partial))
