"""Quantize a GGUF through llama-cpp-python's `llama_model_quantize` (llama.cpp's own quantizer).

Parameters start from `llama_model_quantize_default_params()`; a non-zero return code or a missing
output is an error. IQ types whose quality depends on an importance matrix can take one
(see `hybrid.baselines.imatrix`); IQ3_S / IQ4_XS do not *require* one in llama.cpp (only IQ1/IQ2
and IQ3_XXS do), so without it they quantize with a uniform importance.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from hybrid.errors import HybridError

# User-facing type name -> llama_cpp LLAMA_FTYPE_MOSTLY_* attribute.
TYPES = ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q4_0", "Q3_K_M",
         "Q3_K_S", "Q3_K_L", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ3_S", "IQ3_M", "IQ3_XS", "IQ3_XXS",
         "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "MXFP4_MOE")
# NVFP4 is absent on purpose: the bundled llama.cpp loads NVFP4 but its quantizer refuses the
# ftype ("invalid output file type 39"); NVFP4 GGUFs come from gguf_export re-packing hybrid's weights.
NEEDS_IMATRIX = ("IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS")


def _llama_cpp():
    from hybrid.baselines.llama_runner import require_llama_cpp

    return require_llama_cpp()


def ftype_of(name: str) -> int:
    """llama_ftype value for a type name such as 'Q4_K_M'."""
    llama_cpp = _llama_cpp()

    key = name.upper()
    if key not in TYPES or not hasattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{key}"):
        raise HybridError(f"--type {name!r}; expected one of {', '.join(TYPES)}")
    return int(getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{key}"))


def _imatrix_array(imatrix: dict[str, "object"]):
    """NULL-terminated llama_model_imatrix_data[] over float32 arrays (kept alive by the caller)."""
    import numpy as np

    llama_cpp = _llama_cpp()

    arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in imatrix.items()}
    entries = (llama_cpp.llama_model_imatrix_data * (len(arrays) + 1))()
    names = []
    for i, (k, a) in enumerate(arrays.items()):
        names.append(k.encode())
        entries[i].name = names[-1]
        entries[i].data = a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entries[i].size = a.size
    entries[len(arrays)].name = None
    return entries, (arrays, names)


def quantize_gguf(src: str | Path, dst: str | Path, qtype: str, pure: bool = False,
                  imatrix: dict | None = None, nthread: int = 0, verbose: bool = False) -> Path:
    """Quantize GGUF `src` to `dst` as `qtype` (e.g. Q4_K_M). pure: every tensor of that one type.

    imatrix: {gguf tensor name: float32 [K] or [E*K]} importance (mean squared activations)."""
    llama_cpp = _llama_cpp()

    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise HybridError(f"{src}: input GGUF not found")
    if qtype.upper() in NEEDS_IMATRIX and not imatrix:
        raise HybridError(f"--type {qtype}: llama.cpp requires an importance matrix for this type")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype_of(qtype)
    params.pure = bool(pure)
    params.nthread = int(nthread)
    keep = None
    if imatrix:
        entries, keep = _imatrix_array(imatrix)
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.unlink()
    from llama_cpp._utils import suppress_stdout_stderr

    with suppress_stdout_stderr(disable=verbose):
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    del keep
    if rc != 0 or not dst.exists() or dst.stat().st_size == 0:
        raise HybridError(f"llama_model_quantize {src} -> {dst} as {qtype} failed (rc={rc}); "
                          "run with --verbose to see llama.cpp's log")
    return dst
