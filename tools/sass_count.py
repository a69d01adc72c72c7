"""SASS instruction counts per kernel of the fused decode kernels (cuda/fused.cu) or the QPN kernels, CPU-only:
NVRTC 12 (the pip wheel) -> CUBIN for sm_<sm> -> `cuobjdump -sass` (the pip wheels nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm, CUDA 13: they read sm_90 CUBINs, not sm_70). What results/runtime.md §31's instruction counts came from: a kernel whose last
block runs once per launch fetches its code cold, so its length on the executed path costs time.

    pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm    # then:
    PYTHONPATH=. python3 tools/sass_count.py [--source fused|qpn|router-probe] [--sm 90] [--match router]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def cuobjdump() -> str:
    try:
        import nvidia.cu13
        cand = Path(list(nvidia.cu13.__path__)[0]) / "bin" / "cuobjdump"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if not found:
        raise SystemExit("error: cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    return found


def cubin(src: str, sm: int) -> bytes:
    from hybrid.kernels.build import OPTIONS
    from hybrid.kernels.nvrtc import load_nvrtc

    nv = load_nvrtc(12)
    lib, prog = nv.lib, ctypes.c_void_p()
    nv._check(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kernels.cu", 0, None, None), "create")
    try:
        opts = OPTIONS + [f"--gpu-architecture=sm_{sm}"]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        nv._check(lib.nvrtcCompileProgram(prog, len(opts), arr), "compile", nv._log(prog))
        n = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetCUBIN(prog, buf)
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def counts(sass: str) -> dict[str, int]:
    """Instructions per function of `cuobjdump -sass` output."""
    out, cur = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            cur = m.group(1)
            out[cur] = 0
            continue
        if cur and re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", line):
            out[cur] += 1
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", default="fused", choices=["fused", "qpn", "router-probe"])
    p.add_argument("--sm", type=int, default=90)
    p.add_argument("--match", default="", help="only kernels whose name contains this")
    a = p.parse_args(argv)
    from hybrid.kernels import build, fused_build

    if a.source == "qpn":
        src = build.source()
    elif a.source == "fused":
        src = fused_build.source()
    else:
        import gpu_router_probe
        src = gpu_router_probe.probe_source(fused_build.source())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin(src, a.sm))
        tool = cuobjdump()
        env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}")   # its nvdisasm
        run = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, env=env)
        if run.returncode:
            raise SystemExit(f"error: cuobjdump -sass: {run.stderr.strip()}")
        sass = run.stdout
    for name, n in sorted(counts(sass).items()):
        if a.match in name:
            print(f"{name:48s} {n:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
