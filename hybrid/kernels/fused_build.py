"""Build of the fused decode kernels (cuda/fused.cu, launched by hybrid.kernels.fused): NVRTC at run time,
cached like the QPN kernels (hybrid.kernels.build: cache key = source, options, NVRTC version, target),
a prebuilt compute_70 PTX for machines whose NVRTC cannot target Volta (CUDA 13), and the CPU-only
checks (registers, spills) of the sm_70 / sm_90 builds.

    python3 -m hybrid.kernels.fused_build --emit DIR     # compute_70 PTX; HYBRID_CACHE_DIR=DIR on the GPU machine
"""
from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path

import torch

KERNELS = ("fused_add_rms_norm", "fused_qk_rope_kv", "fused_route_topk", "fused_router_topk",
           "fused_add_rms_norm_e", "fused_add_norm_router_e", "fused_rope_attn_e", "fused_rope_attn_w",
           "fused_add_norm_router", "fused_decode_attn", "fused_rope_attn", "fused_embed_rows")


def _dev(d: torch.device) -> torch.device:
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def source() -> str:
    """cuda/fused.cu with qpn.cu's device functions named on its `// QPN_SHARED:` line put in there."""
    from hybrid.kernels.build import with_shared

    return with_shared(Path(__file__).with_name("fused.cu").read_text(), "fused.cu")


_MODULES: dict = {}
_FORCE_PTX: dict[int, int] = {}


def force_ptx(device, sm: int | None) -> None:
    """Tests: run this device's fused kernels from compute_<sm> PTX through the driver JIT."""
    d = _dev(torch.device(device))
    if sm is None:
        _FORCE_PTX.pop(d.index, None)
    else:
        _FORCE_PTX[d.index] = sm


def module(device: torch.device):
    """The loaded fused-kernel module for a CUDA device (built on first use)."""
    from hybrid.kernels.driver import Module

    forced = _FORCE_PTX.get(device.index)
    mod = _MODULES.get((device.index, forced))
    if mod is None:
        major, minor = torch.cuda.get_device_capability(device)
        sm = forced or major * 10 + minor
        mod = _MODULES[(device.index, forced)] = Module(image_for(sm, forced is not None), device)
        mod.sm = sm   # the target the kernels were built for (forced PTX: compute_<forced>)
    return mod


def image_for(sm: int, ptx: bool) -> bytes:
    """Native CUBIN (or PTX) from NVRTC, cached like the QPN kernels; if NVRTC is missing or cannot
    target sm (NVRTC 13 and sm_70), a PTX prebuilt for this exact source by `--emit` (below)."""
    from hybrid.kernels.build import _image_for

    return _image_for(sm, ptx, src=source(), prebuilt=prebuilt_path)


def prebuilt_path(sm: int, folder: Path | None = None) -> Path:
    """$HYBRID_CACHE_DIR (or ~/.cache/hybrid/qpn)/prebuilt-fused-<source digest>-compute_<sm>.ptx."""
    from hybrid.kernels.build import cache_dir

    return (folder or cache_dir()) / f"prebuilt-fused-{source_digest()}-compute_{sm}.ptx"


def emit_prebuilt(folder: Path, sms=(70,)) -> list[Path]:
    """Write compute_<sm> PTX of this source with NVRTC 12 (e.g. on a machine without a GPU) for a
    machine whose NVRTC cannot target sm (CUDA 13 and Volta): HYBRID_CACHE_DIR=folder there."""
    from hybrid.kernels.build import OPTIONS
    from hybrid.kernels.nvrtc import load_nvrtc

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for sm in sms:
        ptx = load_nvrtc(12).compile(source(), "fused.cu", OPTIONS + [f"--gpu-architecture=compute_{sm}"],
                                     cubin=False)
        out.append(prebuilt_path(sm, folder))
        out[-1].write_bytes(ptx)
    return out


def compile_check(sm: int):
    """CPU-only: NVRTC 12 -> PTX (compute_<sm>) -> ptxas -v; -> ([KernelReport], ptx text)."""
    from hybrid.kernels.build import compile_check as check

    return check(sm, source(), "fused.cu")


def native_check(sm: int, nv=None):
    """NVRTC (this machine's, or nv) -> CUBIN for sm_<sm> with ptxas' report taken from NVRTC's own log
    (no ptxas binary needed): [KernelReport] (registers, spills, stack)."""
    from hybrid.kernels.build import OPTIONS, parse_ptxas
    from hybrid.kernels.nvrtc import load_nvrtc

    nv = nv or load_nvrtc(12 if sm < 75 else None)
    lib, prog = nv.lib, ctypes.c_void_p()
    nv._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source().encode(), b"fused.cu", 0, None, None), "create")
    try:
        opts = OPTIONS + [f"--gpu-architecture=sm_{sm}", "--ptxas-options=-v"]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        nv._check(lib.nvrtcCompileProgram(prog, len(opts), arr), "compile of fused.cu", nv._log(prog))
        return parse_ptxas(nv._log(prog))
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def source_digest() -> str:
    return hashlib.sha256(source().encode()).hexdigest()[:16]




def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="fused kernels: prebuild PTX for machines whose NVRTC cannot "
                                             "target the arch (CUDA 13 and sm_70)")
    ap.add_argument("--emit", type=Path, required=True, help="folder (use it as HYBRID_CACHE_DIR there)")
    ap.add_argument("--arch", type=int, nargs="*", default=[70], help="compute capabilities (default 70)")
    args = ap.parse_args(argv)
    for path in emit_prebuilt(args.emit, args.arch):
        print(path)


if __name__ == "__main__":
    main()
