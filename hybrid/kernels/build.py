"""Run-time build of the QPN kernels: NVRTC -> CUBIN (or PTX for the driver to JIT), cached on disk.

Cache key: sha256 of (source, options, NVRTC version) + target, in $HYBRID_CACHE_DIR or
~/.cache/hybrid/qpn. A device the local NVRTC cannot target natively (e.g. a GPU newer than the
NVRTC) gets PTX of the highest supported compute_XX, which the driver compiles at load.
Also the CPU-only check: compile every kernel for compute_XX, run ptxas -v, report registers/spills.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid.kernels.nvrtc import Nvrtc, NvrtcError, load_nvrtc, wheel_dir
from hybrid.switches import env_choice

SOURCE_NAME = "qpn.cu"
OPTIONS = ["-std=c++17", "-default-device", "--restrict"]

KERNELS = tuple(
    [f"qpn{f}_linear_mt{m}" for f in (2, 8) for m in (1, 2, 4)]
    + [f"qpn{f}_linear_mt1{v}" for f in (2, 8) for v in ("_u4", "_as", "_as4", "_t2", "_t2u1", "_tbu2", "_tb1u4")]
    + [f"qpn{f}_linear_mt2{v}" for f in (2, 8) for v in ("_tbu2", "_tb1u4")]
    + [f"qpn{f}_linear_mt4_tb1u4" for f in (2, 8)]
    + ["qpn2_linear_m1_as", "qpn2_linear_m1_as2"]
    + [f"qpn2_linear_{m}_{v}" for m in ("m1", "mp2") for v in ("tbu4", "tbu8", "tb2u4")]
    + ["qpn2_linear_mp4_tbu4", "qpn2_linear_mp4_tb2u4", "qpn2_linear_m1_seq"]
    + [f"qpn2_linear_mp{m}_as{t}" for m in (2, 4, 8) for t in ("", "2")]
    + [f"qpn{f}_gemm_{t}" for f in (2, 8) for t in ("128x128", "64x128", "64x64", "32x64")]
    + [f"qpn{f}_gemmf_{t}" for f in (2, 8) for t in ("128x128", "64x256", "64x128")]
    + ["qpn_moe_route"]
    + [f"qpn{f}_moe_{p}_mt{m}" for f in (2, 8) for p in ("gateup", "down") for m in (1, 4)]
    + [f"qpn{f}_moe_{p}_mt{m}_as" for f in (2, 8) for p in ("gateup", "down") for m in (1, 2)]
    + [f"qpn{f}_moe_down_mt1{v}_ord" for f in (2, 8) for v in ("", "_as")]
    + [f"qpn{f}_moe_gemm_{p}_{t}" for f in (2, 8) for p in ("gateup", "down") for t in ("64x128", "32x128")]
    + [f"qpn{f}_moe_gemmf_{p}" for f in (2, 8) for p in ("gateup_64x256", "down_64x128", "gateup_32x256",
                                                          "down_32x128")]
    + ["qpn2_stage_pack", "qpn_read"]
)


def source_path() -> Path:
    """The kernel source: hybrid/kernels/qpn.cu (a link to cuda/qpn.cu in a checkout)."""
    return Path(__file__).with_name(SOURCE_NAME)


def source() -> str:
    return source_path().read_text()


def device_functions(names: list[str], src: str | None = None) -> str:
    """The text of qpn.cu's device functions `names` (each `__device__ __forceinline__ ... name(...)
    {...}` through its closing brace at the start of a line, with a template line before it), in
    that order: the helpers another kernel source shares instead of copying them."""
    src = source() if src is None else src
    out = []
    for name in names:
        m = re.search(r"(template <[^>]*>\n)?__device__ __forceinline__ [\w ]+? " + re.escape(name) + r"\(.*?\n\}\n",
                      src, re.S)
        if m is None:
            raise ValueError(f"{SOURCE_NAME}: no device function {name!r}")
        out.append(m.group(0))
    return "".join(out)


def with_shared(src: str, what: str) -> str:
    """Another kernel source (`what`, for the error) with qpn.cu's device functions named on its
    `// QPN_SHARED: name ...` line put in after that line."""
    line = re.search(r"^// QPN_SHARED: (.*)$", src, re.M)
    if line is None:
        raise ValueError(f"{what}: no '// QPN_SHARED:' line")
    return src[:line.end()] + "\n" + device_functions(line.group(1).split()) + src[line.end():]


def cache_dir() -> Path:
    """$HYBRID_CACHE_DIR, else ~/.cache/hybrid/qpn (or under $XDG_CACHE_HOME)."""
    env = os.environ.get("HYBRID_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybrid" / "qpn"


@dataclass(frozen=True)
class Target:
    """sm (e.g. 90) and whether to emit native CUBIN (True) or PTX for the driver JIT."""

    sm: int
    cubin: bool

    @property
    def arch_option(self) -> str:
        return f"--gpu-architecture={'sm' if self.cubin else 'compute'}_{self.sm}"

    @property
    def suffix(self) -> str:
        return f"sm_{self.sm}.cubin" if self.cubin else f"compute_{self.sm}.ptx"


def pick_target(nv: Nvrtc, sm: int, force_ptx: bool = False) -> Target:
    archs = nv.supported_archs()
    if sm in archs and not force_ptx:
        return Target(sm, cubin=True)
    lower = [a for a in archs if a <= sm]
    if not lower:
        raise NvrtcError(f"NVRTC {nv.version} at {nv.path} cannot target sm_{sm} "
                         f"(supports {archs}); for Volta use nvidia-cuda-nvrtc-cu12")
    return Target(max(lower) if sm not in archs else sm, cubin=False)


def compile_image(nv: Nvrtc, target: Target, src: str | None = None, use_cache: bool = True) -> bytes:
    """Compile (or fetch from the cache) the module image for target."""
    src = source() if src is None else src
    return cached_compile(nv, src, SOURCE_NAME, OPTIONS + [target.arch_option], target.suffix, target.cubin,
                          use_cache)


def cached_compile(nv: Nvrtc, src: str, name: str, opts: list[str], suffix: str, cubin: bool,
                   use_cache: bool = True) -> bytes:
    """NVRTC image of src (CUBIN or PTX), cached in cache_dir() under sha256(source, options, NVRTC
    version) + suffix; written through a temporary file, so a concurrent build never reads half a file."""
    key = hashlib.sha256("\0".join([src, *opts, str(nv.version)]).encode()).hexdigest()[:20]
    path = cache_dir() / f"{key}-{suffix}"
    if use_cache and path.exists():
        return path.read_bytes()
    image = nv.compile(src, name, opts, cubin=cubin)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(image)
        tmp.replace(path)
    return image


_MODULES: dict[tuple[int, int | None], object] = {}
L2_ENV = "HYBRID_QPN_L2"
L2_MODES = ("evict_first", "normal")


def l2_mode(sm: int) -> str:
    """HYBRID_QPN_L2: `evict_first` (default) gives the decode weight stream's loads an L2 evict-first policy on
    sm_80+ (qpn.cu; measured on the H200, results/runtime.md §32); `normal` builds without it. The mode a device
    of sm_<sm> builds with (`normal` below sm_80, which has no L2 policies). Read when a device's module is
    built (forget_modules() makes the next launch build again: an A/B of the setting in one process)."""
    mode = env_choice(L2_ENV, L2_MODES, "evict_first")
    return mode if sm >= 80 else "normal"


def unhinted_source() -> str:
    """qpn.cu with QPN_L2_NORMAL defined (HYBRID_QPN_L2=normal: no L2 policy on the weight stream)."""
    return "#define QPN_L2_NORMAL 1\n" + source()


def forget_modules() -> None:
    """Drop the loaded modules: the next launch on each device builds (or loads from the disk cache) again."""
    _MODULES.clear()


def module(device: torch.device, force_ptx_sm: int | None = None):
    """The loaded kernel module for a CUDA device (built on first use, HYBRID_QPN_L2 read then).

    force_ptx_sm: load PTX of compute_<sm> instead (tests: compute_70 PTX through the driver JIT).
    """
    from hybrid.kernels.driver import Module

    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, force_ptx_sm)
    mod = _MODULES.get(key)
    if mod is None:
        major, minor = torch.cuda.get_device_capability(index)
        sm = force_ptx_sm or major * 10 + minor
        # the unhinted source only where it differs (sm_80+): below, the default source is the same code, and
        # the prebuilt compute_70 PTX is keyed by its digest
        plain = l2_mode(sm) == "normal" and sm >= 80
        mod = Module(_image_for(sm, force_ptx_sm is not None, src=unhinted_source() if plain else None),
                     torch.device("cuda", index))
        mod.sm = sm
        _MODULES[key] = mod
    return mod


def _image_for(sm: int, force_ptx: bool, src: str | None = None, prebuilt=None) -> bytes:
    """Native CUBIN (or PTX) from NVRTC; if NVRTC is missing or cannot target sm, a PTX file
    prebuilt for this exact source (`hybrid-bench cuda-kernels --compile-only --emit DIR`), as written
    or gzipped beside it (`<name>.gz`: a fifth of the bytes, for trees that travel under a size limit).
    src/prebuilt: another kernel source and its prebuilt_path(sm) function (default: qpn.cu's)."""
    try:
        nv = load_nvrtc(12 if sm < 75 else None)
        return compile_image(nv, pick_target(nv, sm, force_ptx=force_ptx), src=src)
    except NvrtcError:
        pre = (prebuilt or prebuilt_path)(sm)
        if pre.exists():
            return pre.read_bytes()
        packed = pre.with_name(pre.name + ".gz")
        if packed.exists():
            return gzip.decompress(packed.read_bytes())
        raise


def prebuilt_path(sm: int, folder: Path | None = None) -> Path:
    digest = hashlib.sha256(source().encode()).hexdigest()[:16]
    return (folder or cache_dir()) / f"prebuilt-{digest}-compute_{sm}.ptx"


# ---------------------------------------------------------------------------- compile-only check
@dataclass(frozen=True)
class KernelReport:
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    smem: int


def ptxas_path() -> Path:
    d = wheel_dir("cuda_nvcc")
    cands = ([d / "bin" / "ptxas"] if d else []) + [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "ptxas"]
    for c in cands:
        if c.exists():
            return c
    raise NvrtcError("ptxas not found; install it with `pip install nvidia-cuda-nvcc-cu12`")


def include_options() -> list[str]:
    """Include paths of the pip wheels (the source needs none; passed for headers users add)."""
    out = []
    for pkg in ("cuda_runtime", "cuda_nvcc"):
        d = wheel_dir(pkg)
        if d and (d / "include").is_dir():
            out.append(f"--include-path={d / 'include'}")
    return out


def compile_check(sm: int, src: str | None = None, name: str = SOURCE_NAME) -> tuple[list[KernelReport], str]:
    """NVRTC -> PTX (compute_<sm>) -> ptxas -arch=sm_<sm> -v; per-kernel registers and spills.
    src/name: another kernel source (default: cuda/qpn.cu)."""
    nv = load_nvrtc(12)
    ptx = nv.compile(source() if src is None else src, name, OPTIONS + include_options()
                     + [f"--gpu-architecture=compute_{sm}"], cubin=False)
    stem = Path(name).stem
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / f"{stem}.ptx"
        p.write_bytes(ptx)
        res = subprocess.run([str(ptxas_path()), f"-arch=sm_{sm}", "-v", str(p), "-o",
                              str(Path(tmp) / f"{stem}.cubin")], capture_output=True, text=True)
    if res.returncode != 0:
        raise NvrtcError(f"ptxas failed for sm_{sm}:\n{res.stderr}")
    return parse_ptxas(res.stderr), ptx.decode()


def parse_ptxas(log: str) -> list[KernelReport]:
    reports, cur = [], None
    stack = stores = loads = 0
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line) or re.search(
            r"Function properties for (\w+)", line)
        if m:
            cur = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            stack, stores, loads = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            sm = re.search(r"(\d+) bytes smem", line)
            reports.append(KernelReport(cur, int(m.group(1)), stores, loads, stack,
                                        int(sm.group(1)) if sm else 0))
            stack = stores = loads = 0
    return reports
