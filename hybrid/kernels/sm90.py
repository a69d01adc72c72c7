"""Hopper prefill GEMM (cuda/qpn_sm90.cu): wgmma with the decoded QPN weights as A from registers.

Legend: M rows (tokens), N out, K in, BR weight rows and NT tokens per block (NT: the wgmma N),
Mp = M rounded up to NT,
Kp = K rounded up to 64, S K splits, KS 64-k steps per split.

    y = linear(x, w)          # x [M, K] fp16 on an sm_90 device, w a CUDA QPNWeight -> y [M, N] fp16
    plan(fmt, m, n, k, sms)   # the launch (kernel, grid, KS, shared memory), host-side only

Built by NVRTC for sm_90a (wgmma exists only there), cached like the QPN kernels (hybrid.kernels.build:
key = source, options, NVRTC version, target). `python -m hybrid.kernels.sm90 --compile-only` is the
CPU-only check: NVRTC 12 -> compute_90a PTX -> ptxas -arch=sm_90a -v, fails on spills or on wgmma
serialized by ptxas.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid.checkpoint.formats import QType
from hybrid.kernels.driver import ptr as _p

SOURCE_NAME = "qpn_sm90.cu"
ARCH = "90a"
THREADS = 256
TILES = ((128, 64), (128, 128), (128, 256), (256, 64), (256, 128))   # (BR weight rows, NT tokens)
# ring stages and blocks per SM per (format, BR, NT); must match the WGMMA(...) lines of cuda/qpn_sm90.cu
STAGES = {(2, 128, 64): 8, (2, 128, 128): 5, (2, 128, 256): 6, (2, 256, 64): 6, (2, 256, 128): 8,
          (8, 128, 64): 6, (8, 128, 128): 4, (8, 128, 256): 5, (8, 256, 64): 4, (8, 256, 128): 6}
MIN_BLOCKS = {(128, 64): 2, (128, 128): 2, (128, 256): 1, (256, 64): 2, (256, 128): 1}
# ring stages of the warp-specialized kernels (_w; one block per SM): as many as shared memory holds, <= 12
STAGES_W = {(2, 128, 64): 12, (2, 128, 128): 10, (2, 128, 256): 6, (2, 256, 64): 12, (2, 256, 128): 9,
            (8, 128, 64): 12, (8, 128, 128): 9, (8, 128, 256): 5, (8, 256, 64): 9, (8, 256, 128): 7}
MIN_KSTEPS = 4        # split-K: at least this many 64-k steps per split
MAX_SPLITS = 8
# The cost model (microseconds on the H200; plan() takes the (tile, splits, pipeline) of least cost
# and qpn.qpn_linear compares it with the gemmf / WMMA model): 2 launches + the pre-pass (bytes of x
# read and xp written) + waves x KS x the step time of one wave (all the blocks resident on an SM,
# one 64-k step) + split-K (partials written and summed by torch, its launches). Waves =
# ceil(blocks / (SMs x resident blocks)): a last partial wave costs a whole one, except that a last
# wave of a two-per-SM tile with at most one block per SM costs ALONE_RATE of one. Fit on the 300
# forced rows of H200 device call 0206 (tools/wgmma_bench.py at 60fa019 + working tree: 5 shapes x
# NVFP4/FP8 x M = 64, 128, 512 x 5 tiles x {per group, warp-specialized}; tools/wgmma_fit.py): rms
# error 5.2%, median 3.8%, worst 14%.
LAUNCH_US = 3.52
PERMUTE_US_PER_BYTE = 1.68e-7
SPLIT_US = 7.0
PART_US_PER_BYTE = 3.38e-7
ALONE_RATE = 0.68
# (format, BR, NT, pipe) -> microseconds of one wave-step; _s not in call 0206 (call 0140: 5-15% slower
# than the per-group pipeline): taken as 1.1 x ""
_STEP = {(2, 128, 64, ""): 0.713, (2, 128, 128, ""): 0.924, (2, 128, 256, ""): 0.966, (2, 256, 64, ""): 1.342,
         (2, 256, 128, ""): 1.121, (8, 128, 64, ""): 0.687, (8, 128, 128, ""): 0.920, (8, 128, 256, ""): 0.886,
         (8, 256, 64, ""): 1.177, (8, 256, 128, ""): 0.959,
         (2, 128, 64, "_w"): 0.771, (2, 128, 128, "_w"): 0.832, (2, 128, 256, "_w"): 0.911, (2, 256, 64, "_w"): 1.357,
         (2, 256, 128, "_w"): 1.396, (8, 128, 64, "_w"): 0.545, (8, 128, 128, "_w"): 0.595, (8, 128, 256, "_w"): 0.722,
         (8, 256, 64, "_w"): 0.889, (8, 256, 128, "_w"): 1.002}
STEP_US = {**_STEP, **{(f, br, nt, "_s"): 1.1 * v for (f, br, nt, p), v in _STEP.items() if p == ""}}
# pipelines: "" per group (decode a fragment, its wgmma, wait for the group before), "_s" per step (the
# step's 4 fragments, its wgmmas as one group, two register sets), "_w" per group, warp-specialized (a
# producer warpgroup (40 registers by setmaxnreg, consumers 232) fills the ring on empty/full mbarriers,
# no block barrier per step; blockDim 384, one block per SM); PIPE[0] is the one plan() takes
PIPES = ("", "_s", "_w")
PIPE: list[str | None] = [os.environ.get("HYBRID_WGMMA_PIPE") or None]   # forced pipeline (None: searched)
PLAN_PIPES = ("", "_w")    # the pipelines plan() searches when none is forced (both measured in call 0206)
KERNELS = tuple(["qpn_sm90_permute_x"] + [f"qpn{f}_wgmma_{br}x{nt}{p}" for f in (2, 8) for br, nt in TILES
                                          for p in PIPES])
# diagnostics, timing only (results wrong): no loads in the main loop (PIPES suffix + "_nold")
DIAG_KERNELS = tuple(f"qpn2_wgmma_{t}{p}_nold" for t in ("128x256", "256x128") for p in ("", "_s"))


def source() -> str:
    """cuda/qpn_sm90.cu with qpn.cu's device functions named on its `// QPN_SHARED:` line put in there."""
    from hybrid.kernels.build import with_shared

    return with_shared(Path(__file__).with_name(SOURCE_NAME).read_text(), SOURCE_NAME)


def ring_slot(fmt: int, br: int, nt: int) -> int:
    """Bytes of one ring slot: the x stage (NT x 64 fp16), the 8 warps' packed words (512 B per 16-row
    tile and chunk) and NVFP4 scales (64 B per tile) for BR / 128 tiles each."""
    cps, mw = (1 if fmt == 2 else 2), br // 128
    return nt * 128 + 8 * mw * cps * 512 + (8 * mw * 64 if fmt == 2 else 0)


def smem_bytes(fmt: int, br: int, nt: int, pipe: str = "") -> int:
    """Dynamic shared memory of qpn{fmt}_wgmma_{br}x{nt}{pipe}: the ring or the epilogue's fp32 staging,
    whichever is larger (8-byte aligned), then two mbarriers per ring stage (full; empty: _w only)."""
    st = (STAGES_W if pipe.endswith("_w") else STAGES)[(fmt, br, nt)]
    return (max(st * ring_slot(fmt, br, nt), nt * (br + 4) * 4) + 7) // 8 * 8 + 16 * st


@dataclass(frozen=True)
class Sm90Plan:
    """A launch of qpn{fmt}_wgmma_{BR}x{NT}: grid (Mp / NT, ceil(N / BR), splits), KS, padded sizes."""

    kernel: str
    tile: tuple[int, int]
    grid: tuple[int, int, int]
    ks: int
    mp: int
    kp: int
    smem: int
    us: float = 0.0   # modelled microseconds (cost_us)
    pipe: str = ""    # the pipeline (PIPES)

    @property
    def label(self) -> str:
        return self.kernel.split("_", 1)[1] + (f"/s{self.grid[2]}" if self.grid[2] > 1 else "")


def resident(tile: tuple[int, int], pipe: str) -> int:
    """Blocks per SM: MIN_BLOCKS of the tile (registers and shared memory), 1 for the warp-specialized."""
    return 1 if pipe.endswith("_w") else MIN_BLOCKS[tile]


def waves(blocks: int, sms: int, res: int) -> float:
    """Waves of `blocks` at `res` per SM, a last partial wave whole, or ALONE_RATE where it leaves one
    block per SM of a two-per-SM tile."""
    full, rem = divmod(blocks, sms * res)
    return full + (0.0 if rem == 0 else ALONE_RATE if res == 2 and rem <= sms else 1.0)


def cost_us(fmt: int, m: int, n: int, k: int, sms: int, tile: tuple[int, int], splits: int, ks: int,
            pipe: str = "") -> float:
    """Modelled microseconds of one linear() on the H200 (see STEP_US)."""
    br, nt = tile
    mp, kp = -(-m // nt) * nt, -(-k // 64) * 64
    blocks = (mp // nt) * -(-n // br) * splits
    us = 2 * LAUNCH_US + (m * k + mp * kp) * 2 * PERMUTE_US_PER_BYTE
    us += waves(blocks, sms, resident(tile, pipe)) * ks * STEP_US[(fmt, br, nt, pipe)]
    if splits > 1:
        us += SPLIT_US + splits * m * n * 8 * PART_US_PER_BYTE
    return us


def _splits(nk: int, force: int | None) -> list[tuple[int, int]]:
    """(splits, KS) candidates: every distinct split count of at least MIN_KSTEPS steps (at most
    MAX_SPLITS), or the forced count (clamped to 1..steps)."""
    if force is not None:
        ks = -(-nk // max(1, min(int(force), nk)))
        return [(-(-nk // ks), ks)]
    out = {}
    for want in range(1, max(1, min(MAX_SPLITS, nk // MIN_KSTEPS)) + 1):
        ks = -(-nk // want)
        out[-(-nk // ks)] = ks
    return sorted(out.items())


@functools.lru_cache(maxsize=4096)   # ~0.2 ms of model search per new (shape, M)
def plan(fmt: int, m: int, n: int, k: int, sms: int, tile: tuple[int, int] | None = None,
         splits: int | None = None, pipe: str | None = None) -> Sm90Plan:
    """The launch for M rows, N out, K in on a device with `sms` SMs: of the TILES (BR, NT), their
    split counts and PLAN_PIPES, the one of least cost_us (ties: the first listed, fewer splits).
    tile (BR, NT) / splits / pipe (PIPES; default PIPE[0] if set): forced (benchmark, tests)."""
    if fmt not in (2, 8) or m < 1 or n < 1 or k < 1 or k % (64 if fmt == 2 else 32):
        raise ValueError(f"sm90 plan: bad shape fmt={fmt} M={m} N={n} K={k}")
    if tile is not None and tuple(tile) not in TILES:
        raise ValueError(f"sm90 plan: tile (BR, NT) must be one of {TILES}, got {tile}")
    pipe = PIPE[0] if pipe is None else pipe
    if pipe is not None and pipe not in PIPES:
        raise ValueError(f"sm90 plan: pipe must be one of {PIPES}, got {pipe!r}")
    kp = -(-k // 64) * 64
    best = None
    for pp in PLAN_PIPES if pipe is None else (pipe,):
        for t in [tuple(tile)] if tile is not None else TILES:
            for sp, ks in _splits(kp // 64, splits):
                us = cost_us(fmt, m, n, k, sms, t, sp, ks, pp)
                if best is None or us < best[0]:
                    best = (us, t, sp, ks, pp)
    us, (br, nt), sp, ks, pipe = best
    mp = -(-m // nt) * nt
    return Sm90Plan(f"qpn{fmt}_wgmma_{br}x{nt}{pipe}", (br, nt), (mp // nt, -(-n // br), sp), ks, mp, kp,
                    smem_bytes(fmt, br, nt, pipe), us, pipe)


def permute_x(x: torch.Tensor, mp: int, kp: int) -> torch.Tensor:
    """xp [Mp, Kp] with xp[m, 16 G + s] = x[m, 16 G + perm(s)], perm(s) = 4 (s / 2 % 4) + 2 (s / 8) + s % 2
    (the packed layout's k-slot order), zeros past M, K (torch; the kernel's values, row-major)."""
    m, k = x.shape
    xp = torch.zeros(mp, kp, dtype=x.dtype, device=x.device)
    xp[:m, :k].view(m, k // 16, 2, 4, 2).copy_(x.reshape(m, k // 16, 4, 2, 2).transpose(2, 3))
    return xp


def block_x(xp: torch.Tensor, nt: int) -> torch.Tensor:
    """xp [Mp, Kp] -> the layout qpn_sm90_permute_x writes (flat fp16): [Mp / NT][Kp / 64] stages of
    NT x 64 in core-matrix order [NT / 8][k-octet 8][token % 8][8 k] (one bulk copy per stage)."""
    mp, kp = xp.shape
    v = xp.view(mp // nt, nt // 8, 8, kp // 64, 8, 8)        # tile, token/8, token%8, stage, k8, e
    return v.permute(0, 3, 1, 4, 2, 5).reshape(-1)


def k_slot_perm() -> list[int]:
    """perm(s) for s = 0..15: the element of a 16-group that k-slot s of the MMA holds."""
    return [4 * (s // 2 % 4) + 2 * (s // 8) + s % 2 for s in range(16)]


# ---------------------------------------------------------------------------- build
def options() -> list[str]:
    from hybrid.kernels.build import OPTIONS

    return OPTIONS + [f"--gpu-architecture=sm_{ARCH}"]


def image(use_cache: bool = True) -> bytes:
    """The sm_90a CUBIN (NVRTC), cached in hybrid.kernels.build.cache_dir() by source, options, version."""
    from hybrid.kernels.build import cached_compile
    from hybrid.kernels.nvrtc import NvrtcError, load_nvrtc

    nv = load_nvrtc()
    if 90 not in nv.supported_archs():
        raise NvrtcError(f"NVRTC {nv.version} at {nv.path} cannot target sm_90a")
    return cached_compile(nv, source(), SOURCE_NAME, options(), f"sm_{ARCH}.cubin", True, use_cache)


_MODULES: dict[int, object] = {}


def module(device: torch.device):
    """The loaded sm_90a module of a CUDA device (built on first use); ValueError off sm_90."""
    from hybrid.kernels.driver import Module

    index = device.index if device.index is not None else torch.cuda.current_device()
    mod = _MODULES.get(index)
    if mod is None:
        cap = torch.cuda.get_device_capability(index)
        if cap != (9, 0):
            raise ValueError(f"the wgmma prefill GEMM needs an sm_90 GPU, got sm_{cap[0]}{cap[1]}")
        mod = _MODULES[index] = Module(image(), torch.device("cuda", index))
    return mod


def block_threads(kernel: str) -> int:
    """blockDim of a kernel: 384 for the warp-specialized ones (_w: a producer warpgroup), else 256."""
    return THREADS + 128 if kernel.endswith("_w") else THREADS


def launch(mod, name: str, grid: tuple[int, int, int], smem: int, args: list) -> None:
    """The kernel's launch on torch's current stream with `smem` bytes of dynamic shared memory (the
    function's limit raised once: driver.Module.launch)."""
    mod.launch(name, grid, block_threads(name), args, smem=smem)


# ---------------------------------------------------------------------------- launcher
def linear(x: torch.Tensor, w, y: torch.Tensor, tile: tuple[int, int] | None = None,
           splits: int | None = None, pipe: str | None = None, diag: str = "") -> torch.Tensor:
    """y[M, N] fp16 = x[M, K] . W^T on an sm_90 device (checked by qpn.qpn_linear: shapes, dtypes,
    device, alignment). A pre-pass writes the permuted activations xp [Mp, Kp]; split-K sums fp32
    partials [S, M, N] in split order (torch) and scales by the folded global scale. diag "_nold": the
    timing-only diagnostic kernels (DIAG_KERNELS; wrong results)."""
    (m, n), k = y.shape, x.shape[1]
    fmt = 2 if w.qtype is QType.NVFP4 else 8
    mod = module(w.device)
    sms = torch.cuda.get_device_properties(w.device).multi_processor_count
    pl = plan(fmt, m, n, k, sms, tile, splits, pipe)
    xp = torch.empty(pl.mp, pl.kp, dtype=torch.float16, device=x.device)
    groups = pl.mp * pl.kp // 16
    launch(mod, "qpn_sm90_permute_x", (-(-groups // THREADS), 1, 1), 0,
           [_p(x), _p(xp), ctypes.c_int(m), ctypes.c_int(k), ctypes.c_int(pl.mp), ctypes.c_int(pl.kp),
            ctypes.c_int(pl.tile[1])])
    part = torch.empty(pl.grid[2], m, n, dtype=torch.float32, device=x.device) if pl.grid[2] > 1 else None
    launch(mod, pl.kernel + diag, pl.grid, pl.smem,
           [_p(w.words), _p(w.scales), ctypes.c_float(w.gscale), _p(xp), _p(y),
            _p(part), ctypes.c_int(m), ctypes.c_int(n),
            ctypes.c_int(k), ctypes.c_int(pl.kp), ctypes.c_int(pl.ks)])
    if part is not None:
        y.copy_(part.sum(0).mul_(w.gscale))
    return y


# ---------------------------------------------------------------------------- compile-only check
def compile_check():
    """CPU-only: NVRTC 12 -> compute_90a PTX -> ptxas -arch=sm_90a -v.
    -> ([KernelReport], ptx text, ptxas log)."""
    from hybrid.kernels.build import OPTIONS, include_options, parse_ptxas, ptxas_path
    from hybrid.kernels.nvrtc import NvrtcError, load_nvrtc

    nv = load_nvrtc(12)
    ptx = nv.compile(source(), SOURCE_NAME, OPTIONS + include_options() + [f"--gpu-architecture=compute_{ARCH}"],
                     cubin=False)
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "qpn_sm90.ptx"
        p.write_bytes(ptx)
        res = subprocess.run([str(ptxas_path()), f"-arch=sm_{ARCH}", "-v", str(p), "-o",
                              str(Path(tmp) / "qpn_sm90.cubin")], capture_output=True, text=True)
    if res.returncode != 0:
        raise NvrtcError(f"ptxas failed for sm_{ARCH}:\n{res.stderr}")
    return parse_ptxas(res.stderr), ptx.decode(), res.stderr


def native_check(nv=None) -> tuple[list, str]:
    """This machine's NVRTC straight to the sm_90a CUBIN with ptxas' report from NVRTC's own log (no
    ptxas binary needed; the GPU machine's toolchain): ([KernelReport], log)."""
    from hybrid.kernels.build import parse_ptxas
    from hybrid.kernels.nvrtc import load_nvrtc

    nv = nv or load_nvrtc()
    lib, prog = nv.lib, ctypes.c_void_p()
    nv._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source().encode(), SOURCE_NAME.encode(), 0, None, None),
              "create")
    try:
        opts = options() + ["--ptxas-options=-v"]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        nv._check(lib.nvrtcCompileProgram(prog, len(opts), arr), f"compile of {SOURCE_NAME}", nv._log(prog))
        log = nv._log(prog)
        return parse_ptxas(log), log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="wgmma prefill GEMM (cuda/qpn_sm90.cu): CPU-only build check")
    ap.add_argument("--compile-only", action="store_true", required=True,
                    help="compile for sm_90a with NVRTC 12 + ptxas (pip wheels); fail on spills or "
                         "serialized wgmma")
    ap.add_argument("--native", action="store_true",
                    help="with this machine's NVRTC straight to CUBIN (ptxas report from its log)")
    args = ap.parse_args(argv)
    if args.native:
        reports, log = native_check()
    else:
        reports, _, log = compile_check()
    print(f"sm_{ARCH}: {len(reports)} kernels")
    print(f"{'kernel':24s} {'regs':>5s} {'spill st':>9s} {'spill ld':>9s} {'smem(dyn)':>10s}")
    bad = 0
    for r in sorted(reports, key=lambda r: r.name):
        t = re.match(r"qpn(\d)_wgmma_(\d+)x(\d+)", r.name)
        dyn = smem_bytes(*map(int, t.groups()), "_w" if r.name.endswith("_w") else "") if t else 0
        flag = "  SPILL" if r.spill_stores or r.spill_loads else ""
        bad += bool(flag)
        print(f"{r.name:24s} {r.registers:5d} {r.spill_stores:9d} {r.spill_loads:9d} {dyn:10d}{flag}")
    serial = [ln for ln in log.splitlines() if "wgmma" in ln.lower() and "serialize" in ln.lower()]
    for ln in serial:
        print(ln)
    bad += len(serial)
    print("OK: no spills, wgmma not serialized" if not bad else f"FAIL: {bad} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
