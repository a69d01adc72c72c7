"""hybrid-bench cuda-kernels: QPN kernel build check (CPU-only) and GPU timing vs cuBLAS FP16.

Efficiency = bytes that must move (packed weights + scales, read once) / kernel time, as a % of
the device read bandwidth measured in the same run (a large read-only reduction); copy bandwidth
is reported beside it. Kernel time: CUDA events around each launch, queued behind a GPU sleep so
host overhead is excluded, median over launches that rotate among enough weight copies that
nothing is served from L2.
Legend: M rows (tokens), N out, K in.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from pathlib import Path

from hybrid.cli.common import int_at_least

HELP = "QPN CUDA kernels: --compile-only register/spill check (no GPU), or timing vs cuBLAS FP16"

# Qwen3-30B-A3B (hidden 2048, 32 q heads x 128, 4 kv heads x 128, expert 768) and a dense 32B class.
SHAPES = [  # name, N, K
    ("q_proj", 4096, 2048), ("k_proj", 512, 2048), ("v_proj", 512, 2048), ("o_proj", 2048, 4096),
    ("expert_gate_up", 768, 2048), ("expert_down", 2048, 768), ("lm_head", 151936, 2048),
    ("dense_up", 25600, 5120), ("dense_down", 5120, 25600),
]
MS = [1, 2, 4, 8, 16, 64, 128, 512]
ROTATE_BYTES = 256 << 20  # > 4x the H200's 60 MB L2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile-only", action="store_true",
                   help="compile every kernel with NVRTC 12 + ptxas (pip wheels), no GPU; fail on spills")
    p.add_argument("--arch", action="append", default=None,
                   help="sm_XX target(s) for --compile-only (repeatable; default sm_70 and sm_90)")
    p.add_argument("--emit", type=Path, default=None,
                   help="with --compile-only: also write the PTX as prebuilt files into this folder")
    p.add_argument("--out", type=Path, default=Path("results/cuda_kernels"),
                   help="timing: write OUT.md and append OUT.jsonl")
    p.add_argument("--formats", default="nvfp4,fp8", help="timing: comma list of nvfp4, fp8")
    p.add_argument("--m", default=",".join(map(str, MS)), help="timing: comma list of M values")
    p.add_argument("--shapes", default="all", help="timing: comma list of shape names or 'all'")
    p.add_argument("--reps", type=int_at_least(1), default=40, help="timed launches per measurement")
    p.add_argument("--prefill-variants", default="",
                   help="timing: comma list of prefill kernel choices (qpn.PREFILL_VARIANT: wmma, mt, "
                        "<BM>x<BN>, f<BM>x<BN>) also timed, forced, on the selected shapes at the "
                        "selected M > 16; rows tagged shape[choice] (A/B of the prefill GEMMs)")
    p.add_argument("--git-sha", default=None, help="git sha to record (default: git rev-parse HEAD)")
    p.add_argument("--command", default=None, help="command line to record (default: argv)")
    p.add_argument("--from-jsonl", type=Path, default=None,
                   help="no GPU: re-render OUT.md from the records of one stored run (--git-sha, "
                        "default the last run in the file)")
    p.add_argument("--promote", default=None, metavar="NEW:OLD",
                   help="with --from-jsonl: rows tagged [NEW] are the current default kernels; their "
                        "untagged twins are shown tagged [OLD]")
    p.add_argument("--note", default="", help="with --from-jsonl: a paragraph to add under the header")


def run(args) -> int:
    if args.from_jsonl:
        return render(args)
    if args.compile_only:
        return compile_only([_sm(a) for a in (args.arch or ["sm_70", "sm_90"])], args.emit)
    return bench(args)


def _sm(arch: str) -> int:
    try:
        return int(arch.lower().replace("sm_", "").replace("compute_", ""))
    except ValueError:
        from hybrid.errors import HybridError
        raise HybridError(f"--arch: expected sm_XX (e.g. sm_70), got {arch!r}") from None


# ---------------------------------------------------------------------------- compile-only
def compile_only(sms: list[int], emit: Path | None) -> int:
    from hybrid.kernels.build import compile_check, prebuilt_path
    from hybrid.kernels.nvrtc import load_nvrtc

    nv = load_nvrtc(12)
    print(f"NVRTC {nv.version[0]}.{nv.version[1]} ({nv.path})")
    bad = 0
    for sm in sms:
        reports, ptx = compile_check(sm)
        mmas = sorted({ln.split()[0] for ln in ptx.splitlines() if "mma.sync" in ln})
        print(f"\nsm_{sm}: {len(reports)} kernels, MMA: {', '.join(mmas) or 'none'}")
        print(f"{'kernel':28s} {'regs':>5s} {'spill st':>9s} {'spill ld':>9s} {'stack':>6s} {'smem':>6s}")
        for r in sorted(reports, key=lambda r: r.name):
            flag = "  SPILL" if r.spill_stores or r.spill_loads else ""
            print(f"{r.name:28s} {r.registers:5d} {r.spill_stores:9d} {r.spill_loads:9d} "
                  f"{r.stack:6d} {r.smem:6d}{flag}")
            bad += bool(flag)
        if emit:
            emit.mkdir(parents=True, exist_ok=True)
            prebuilt_path(sm, emit).write_text(ptx)
    print(f"\n{'FAIL: ' + str(bad) + ' kernel(s) spill' if bad else 'OK: no spills'}")
    rc = 1 if bad else 0
    if 90 in sms:   # the sm_90a wgmma prefill module (cuda/qpn_sm90.cu): spills or serialized wgmma fail it
        from hybrid.kernels import sm90

        print()
        rc = sm90.main(["--compile-only"]) or rc
    return rc


# ---------------------------------------------------------------------------- timing helpers
_NEXT = [0]


def _next(fns):
    _NEXT[0] += 1
    return fns[_NEXT[0] % len(fns)]


def time_ms(fns, reps: int) -> float:
    """Median GPU time of one call, calls rotating over fns (continuing across measurements, so a
    copy is reused only after the others' bytes went by), queued behind a GPU sleep."""
    import torch

    for _ in range(min(len(fns), 3)):
        _next(fns)()
    torch.cuda.synchronize()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(reps)]
    torch.cuda._sleep(int(4e7))
    for a, b in evs:
        a.record()
        _next(fns)()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in evs)


def bandwidths() -> tuple[float, float]:
    """(read GB/s of a 2 GiB fp32 sum, copy GB/s counting read + write of 1 GiB), medians."""
    import torch

    big = torch.rand(512 << 20, device="cuda")  # 2 GiB
    t = time_ms([lambda: big.sum()], 10)
    read = big.numel() * 4 / t / 1e6
    src, dst = big[: 256 << 20], torch.empty(256 << 20, device="cuda")
    t = time_ms([lambda: dst.copy_(src)], 10)
    copy = 2 * src.numel() * 4 / t / 1e6
    del big, dst
    torch.cuda.empty_cache()
    return read, copy


def open_probe(tool: str, sha: str, out: str):
    """A probe tool's record stream (tools/qpn_*_probe.py): the run's read and copy bandwidths measured, a header
    record (tool, command line, sha, GPU, machine, bandwidths) printed and appended to `out`; -> (emit, read GB/s),
    emit(record) printing and appending one more."""
    import os

    import torch

    read_bw, copy_bw = bandwidths()
    f = open(out, "a")

    def emit(r: dict) -> None:
        print(json.dumps(r), flush=True)
        f.write(json.dumps(r) + "\n")
        f.flush()

    emit({"what": tool, "git_sha": sha, "gpu": torch.cuda.get_device_name(0),
          "command": " ".join([f"tools/{tool}.py", *sys.argv[1:]]),
          "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores",
          "read_gbs": round(read_bw, 1), "copy_gbs": round(copy_bw, 1)})
    return emit, read_bw


def random_qweight(qtype, n: int, k: int, device):
    """Random valid packed weight straight on the device (no NaN codes, realistic scales)."""
    import torch

    from hybrid.checkpoint.formats import QType
    from hybrid.checkpoint.qweight import QWeight

    g = torch.Generator(device=device).manual_seed(n * 7 + k)
    if qtype is QType.NVFP4:
        data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=g)
        sc = torch.randint(0x28, 0x60, (n, k // 16), dtype=torch.uint8, device=device, generator=g)
        return QWeight(qtype, (n, k), data, sc.view(torch.float8_e4m3fn),
                       torch.tensor(1e-3, device=device))
    b = torch.randint(0, 0x7E, (n, k), dtype=torch.uint8, device=device, generator=g)
    b |= torch.randint(0, 2, (n, k), dtype=torch.uint8, device=device, generator=g) << 7
    return QWeight(qtype, (n, k), b.view(torch.float8_e4m3fn), torch.tensor(1e-2, device=device))


def read_us(nbytes: int, reps: int) -> float:
    """Median us of qpn_read over nbytes (copies rotated past the L2): what a kernel that only streams
    that many bytes takes in one launch, the reference for a kernel reading them (a launch's fixed
    cost, ramp and tail, weighs on a 175 MB read; tools/qpn_size_probe.py)."""
    import torch

    from hybrid.kernels import qpn

    size = max(16, -(-nbytes // 16) * 16)
    bufs = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(copies_for(nbytes))]
    t = time_ms([lambda b=b: qpn.read_bytes(b) for b in bufs], reps)
    del bufs
    return t * 1e3


def copies_for(nbytes: int) -> int:
    return max(2, min(512, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


# ---------------------------------------------------------------------------- measurements
def bench_linear(name, n, k, qtype, ms, reps, read_bw):
    """Our kernel vs cuBLAS FP16 (x @ W^T) vs dequantize-then-matmul, for each M."""
    import torch

    from hybrid.kernels import QPNWeight, qpn_linear

    dev = torch.device("cuda", torch.cuda.current_device())
    qw = random_qweight(qtype, n, k, dev)
    base = QPNWeight.from_qweight(qw, dev)
    ws = [base] + [_clone_weight(base) for _ in range(copies_for(base.nbytes) - 1)]
    wd = _gpu_dequant(qw).half()
    dense = [wd] + [wd.clone() for _ in range(copies_for(wd.numel() * 2) - 1)]
    out = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        t = time_ms([lambda w=w: qpn_linear(x, w) for w in ws], reps)
        tc = time_ms([lambda d=d: x @ d.t() for d in dense], reps)
        rec = dict(shape=name, n=n, k=k, format=qtype.value, m=m, bytes=base.nbytes, t_us=t * 1e3,
                   eff_read=base.nbytes / t / 1e6 / read_bw, cublas_t_us=tc * 1e3,
                   cublas_eff_read=wd.numel() * 2 / tc / 1e6 / read_bw, speedup_vs_cublas=tc / t)
        if m == 1:
            td = time_ms([lambda: x @ _gpu_dequant(qw).half().t()], max(5, reps // 8))
            rec.update(dequant_matmul_t_us=td * 1e3, speedup_vs_dequant=td / t,
                       read_t_us=read_us(base.nbytes, reps), cublas_read_t_us=read_us(wd.numel() * 2, reps))
        out.append(rec)
        print(_line(rec), flush=True)
    del ws, dense
    torch.cuda.empty_cache()
    return out


def bench_variants(fmts, reps, read_bw):
    """The other M <= 8 kernels beside the default, same run: '' (register pipeline, 2 chunks per
    stage), '_u4' (4 chunks per stage), '_as4' (4-stage cp.async ring; sm_80+), '_m1' / '_m1x2' (the
    M = 1 NVFP4 kernel with one or two tiles per warp; sm_80+), '_t2' / '_t2u1' (two tiles per warp,
    register pipeline of 2 / 1 chunks per stage), '_tb1u4' / '_tbu2' (one / two tiles per warp through a
    bulk-copy ring; sm_90+), the MoE kernels
    without the ring (''), at M = 64, 128, 512 the 8-row-tile kernels ([mt]) that the tiled
    GEMM replaced, each tile of the tiled GEMM forced ([BMxBN], NVFP4, M = 128, 512), and the
    picked tile with 1 and 4 K splits forced ([s1], [s4]; NVFP4 q_proj, o_proj, dense_down, M = 64,
    128, 512)."""
    from hybrid.checkpoint.formats import QType
    from hybrid.kernels import qpn

    out = []
    sm = torch_sm()
    for v in ("", "_u4", "_as", "_as4", "_m1", "_m1x2", "_t2", "_t2u1", "_tb1u4", "_tbu2"):
        m1 = v.startswith("_m1")   # the M = 1 NVFP4 kernels, one or two tiles per warp (sm_80+)
        if (sm < 80) if m1 else qpn.variant(v, sm) != v or (v in qpn.TB_KERNELS and sm < 90):
            continue  # not on this device
        try:
            qpn.LINEAR_VARIANT[0] = v
            for qtype in fmts:
                if m1 and qtype is not QType.NVFP4:
                    continue
                for name, n, k in SHAPES:
                    if name in ("lm_head", "dense_up", "dense_down", "q_proj", "o_proj", "expert_gate_up"):
                        for r in bench_linear(name, n, k, qtype, [1] if m1 else [1, 8], reps, read_bw):
                            out.append({**r, "shape": f"{name}[{v or 'reg'}]"})
        finally:
            qpn.LINEAR_VARIANT[0] = None
    try:  # prefill: the 8-row-tile kernels the tiled GEMM replaced (A/B in one run)
        qpn.PREFILL_VARIANT[0] = "mt"
        for qtype in fmts:
            for name, n, k in SHAPES:
                if name in ("q_proj", "o_proj", "lm_head", "dense_up", "dense_down"):
                    for r in bench_linear(name, n, k, qtype, [64, 128, 512], reps, read_bw):
                        out.append({**r, "shape": f"{name}[mt]", "kernel": f"mt{qpn._mt(r['m'], sm)}"})
        for bm, bn in qpn.GEMM_TILES:  # every tile of the tiled GEMM forced (tunes gemm_tile)
            qpn.PREFILL_VARIANT[0] = f"{bm}x{bn}"
            for name, n, k in SHAPES:
                if name in ("q_proj", "lm_head") and QType.NVFP4 in fmts:
                    for r in bench_linear(name, n, k, QType.NVFP4, [128, 512], reps, read_bw):
                        plan = qpn.prefill_plan(2, r["m"], n, k, torch_sms(), sm, f"{bm}x{bn}")
                        out.append({**r, "shape": f"{name}[{bm}x{bn}]", "kernel": plan.label})
        qpn.PREFILL_VARIANT[0] = None
        for sp in (1, 4):  # the picked tile with K splits forced (tunes gemm_splits; s1 = unsplit)
            qpn.PREFILL_SPLIT[0] = sp
            for name, n, k in SHAPES:
                if name in ("q_proj", "o_proj", "dense_down") and QType.NVFP4 in fmts:
                    for r in bench_linear(name, n, k, QType.NVFP4, [64, 128, 512], reps, read_bw):
                        plan = qpn.prefill_plan(2, r["m"], n, k, torch_sms(), sm, None, sp)
                        out.append({**r, "shape": f"{name}[s{sp}]", "kernel": plan.label})
    finally:
        qpn.PREFILL_VARIANT[0] = None
        qpn.PREFILL_SPLIT[0] = None
    if qpn.variant(None, sm) != "":
        try:
            qpn.MOE_VARIANT[0] = ""
            for qtype in fmts:
                out += [{**r, "shape": r["shape"] + "[reg]"} for r in bench_moe(qtype, [1, 8], reps, read_bw)]
        finally:
            qpn.MOE_VARIANT[0] = None
    return out


def bench_prefill_variants(fmts, shapes, ms, choices, reps, read_bw):
    """Each prefill kernel choice forced (qpn.PREFILL_VARIANT) on the given shapes and M, rows
    tagged shape[choice], their kernel the launch's plan label (or mt<MT>)."""
    from hybrid.kernels import qpn

    out = []
    sm, sms = torch_sm(), torch_sms()
    try:
        for choice in choices:
            qpn.prefill_plan(2, 64, 64, 64, sms, sm, choice)  # an unknown choice fails here, once
            qpn.PREFILL_VARIANT[0] = choice
            for qtype in fmts:
                fmt = 2 if qtype.value == "nvfp4" else 8
                for name, n, k in shapes:
                    for r in bench_linear(name, n, k, qtype, ms, reps, read_bw):
                        plan = qpn.prefill_plan(fmt, r["m"], n, k, sms, sm, choice)
                        kern = plan.label if plan else f"mt{qpn._mt(r['m'], sm)}"
                        out.append({**r, "shape": f"{name}[{choice}]", "kernel": kern})
    finally:
        qpn.PREFILL_VARIANT[0] = None
    return out


def torch_sms() -> int:
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def torch_sm() -> int:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def _clone_weight(w):
    from dataclasses import replace

    return replace(w, words=w.words.clone(), scales=w.scales.clone())


def _gpu_dequant(qw):
    """Dequantize on the GPU with torch ops (the 'dequantize then FP16 matmul' path we refuse)."""
    import torch

    from hybrid.checkpoint.formats import E2M1_TABLE, GROUP, QType

    if qw.qtype is QType.FP8:
        return qw.data.float() * qw.scale.float()
    n, k = qw.shape
    table = torch.from_numpy(E2M1_TABLE).to(qw.data.device)
    codes = torch.stack((qw.data & 0x0F, qw.data >> 4), dim=-1).view(n, k // GROUP, GROUP)
    return (table[codes.long()] * qw.scale.float().unsqueeze(-1) * qw.scale_2.float()).view(n, k)


def moe_slot_sets(qtype, h: int, i: int, topk: int, dev) -> list:
    """Enough copies of topk random experts in QPN slots that rotating over them defeats the L2."""
    from hybrid.kernels import QPNExpertSlots

    sets = []
    for _ in range(copies_for(topk * 3 * i * h // 2)):
        sl = QPNExpertSlots(topk, h, i, qtype, dev)
        for s in range(topk):
            sl.load(s, random_qweight(qtype, i, h, dev), random_qweight(qtype, i, h, dev),
                    random_qweight(qtype, h, i, dev))
        sets.append(sl)
    return sets


def bench_moe(qtype, ts, reps, read_bw, h=2048, i=768, topk=8):
    """All 8 selected experts of one Qwen3-30B-A3B layer through qpn_moe vs batched cuBLAS FP16."""
    import torch

    from hybrid.kernels import qpn_moe

    dev = torch.device("cuda", torch.cuda.current_device())
    sets = moe_slot_sets(qtype, h, i, topk, dev)
    nbytes = topk * sets[0].nbytes_per_slot
    w13 = torch.randn(topk, 2 * i, h, device=dev, dtype=torch.float16) * 0.02
    w2 = torch.randn(topk, h, i, device=dev, dtype=torch.float16) * 0.02
    out = []
    for t in ts:
        x = torch.randn(t, h, device=dev, dtype=torch.float16)
        ids = torch.stack([torch.randperm(topk, device=dev)[:topk] for _ in range(t)]).int().flatten()
        tok = torch.arange(t, device=dev, dtype=torch.int32).repeat_interleave(topk)
        rw = torch.rand(t * topk, device=dev)
        tq = time_ms([lambda sl=sl: qpn_moe(x, sl, ids, tok, rw) for sl in sets], reps)
        tc = time_ms([lambda: _cublas_moe(x, w13, w2, i)], reps)
        rec = dict(shape="moe_8_experts", n=h, k=i, format=qtype.value, m=t, bytes=nbytes,
                   t_us=tq * 1e3, eff_read=nbytes / tq / 1e6 / read_bw, cublas_t_us=tc * 1e3,
                   cublas_eff_read=(w13.numel() + w2.numel()) * 2 / tc / 1e6 / read_bw,
                   speedup_vs_cublas=tc / tq)
        out.append(rec)
        print(_line(rec), flush=True)
    del sets
    torch.cuda.empty_cache()
    return out


def _cublas_moe(x, w13, w2, i):
    """Each token through all 8 experts (decode: every token uses the layer's 8 experts)."""
    import torch
    import torch.nn.functional as F

    xe = x.unsqueeze(0).expand(w13.shape[0], -1, -1)               # [E, T, H]
    gu = torch.bmm(xe, w13.transpose(1, 2))                         # [E, T, 2I]
    hmid = F.silu(gu[..., :i]) * gu[..., i:]
    return torch.bmm(hmid, w2.transpose(1, 2)).sum(0)               # [T, H]


def _line(r) -> str:
    extra = f" dequant+mm x{r['speedup_vs_dequant']:.1f}" if "speedup_vs_dequant" in r else ""
    return (f"{r['shape']:15s} {r['format']:5s} M={r['m']:4d} {r['t_us']:9.1f} us "
            f"{100 * r['eff_read']:5.1f}% | cuBLAS {r['cublas_t_us']:9.1f} us "
            f"{100 * r['cublas_eff_read']:5.1f}% | x{r['speedup_vs_cublas']:.2f}{extra}")


# ---------------------------------------------------------------------------- report
def bench(args) -> int:
    import torch

    from hybrid.checkpoint.formats import QType
    from hybrid.errors import HybridError

    if not torch.cuda.is_available():
        raise HybridError("hybrid-bench cuda-kernels needs a CUDA GPU (use --compile-only without one)")
    fmts = [QType(f.strip()) for f in args.formats.split(",")]
    ms = [int(m) for m in args.m.split(",")]
    shapes = SHAPES if args.shapes == "all" else [s for s in SHAPES if s[0] in args.shapes.split(",")]
    env = _environment(args)
    read_bw, copy_bw = bandwidths()
    env.update(read_gbs=read_bw, copy_gbs=copy_bw)
    print(f"{env['gpu']}: read {read_bw:.0f} GB/s, copy {copy_bw:.0f} GB/s", flush=True)
    recs = []
    for qtype in fmts:
        for name, n, k in shapes:
            recs += bench_linear(name, n, k, qtype, ms, args.reps, read_bw)
        if args.shapes == "all" or "moe" in args.shapes:
            recs += bench_moe(qtype, [m for m in ms if m <= 16], args.reps, read_bw)
    from hybrid.hardware import sm_clocks
    from hybrid.kernels import qpn

    env["clocks"] = sm_clocks(torch.cuda.current_device())   # right after the timings (not always their clock)

    def kernel(r):
        fmt = 2 if r["format"] == "nvfp4" else 8
        if r["shape"] == "moe_8_experts":   # bench_moe: every token to the same 8 experts in 8 slots
            mt, sfx, plan = qpn.moe_path(r["m"], 8 * r["m"], 8, fmt, env["sm"], r["n"], r["k"])
            if plan:
                return "moe_" + plan[0].split("_moe_")[1]
            return ("moe" if mt == 1 else "moe_mt2") + (sfx or " reg")
        kind, what = qpn.linear_route(mod, fmt, r["m"], r["n"], r["k"], sms)   # what qpn_linear launched
        if kind == "wgmma":
            from hybrid.kernels import sm90

            return sm90.plan(fmt, r["m"], r["n"], r["k"], sms).label
        return what.label if kind == "gemm" else "m1_seq" if kind == "seq" else what.split("linear_")[1]

    sms, mod = torch_sms(), qpn._module(torch.device("cuda", torch.cuda.current_device()))
    recs = [{**r, "kernel": kernel(r)} for r in recs]
    recs += bench_prefill_variants(fmts, shapes, [m for m in ms if m > qpn.PREFILL_MIN],
                                   [v for v in args.prefill_variants.split(",") if v], args.reps,
                                   read_bw)
    if args.shapes == "all":
        recs += bench_variants(fmts, args.reps, read_bw)
    write_results(args.out, env, recs)
    return 0


def render(args) -> int:
    """Re-render the markdown of one stored run (history of the other runs listed below it)."""
    from hybrid.errors import HybridError

    if not args.from_jsonl.exists():
        raise HybridError(f"--from-jsonl: {args.from_jsonl} not found")
    allr = [json.loads(line) for line in args.from_jsonl.read_text().splitlines() if line.strip()]
    allr = [r for r in allr if {"git_sha", "shape", "m"} <= r.keys()]   # kernel rows, not the file's other records
    if not allr:
        raise HybridError(f"--from-jsonl: no kernel timing rows in {args.from_jsonl}")
    sha = args.git_sha or allr[-1]["git_sha"]
    recs = [r for r in allr if r["git_sha"] == sha]
    if not recs:
        raise HybridError(f"--git-sha: no records of {sha} in {args.from_jsonl}")
    env = {k: recs[0].get(k) for k in ("gpu", "sm", "torch", "nvrtc", "driver", "clocks", "git_sha", "command",
                                       "read_gbs", "copy_gbs")}
    if args.promote:
        recs = promote(recs, *args.promote.split(":"))
    text = markdown(env, recs, args.note) + history(allr, sha)
    args.out.with_suffix(".md").write_text(text)
    print(f"wrote {args.out.with_suffix('.md')}")
    return 0


def promote(recs: list[dict], new: str, old: str) -> list[dict]:
    """Rows tagged [new] become untagged (they ran today's default kernel); their untagged twins
    become [old]. Each row gets a 'kernel' note saying which kernel of today's source it ran."""
    tagged = {(r["shape"][: -len(new) - 2], r["format"], r["m"]) for r in recs
              if r["shape"].endswith(f"[{new}]")}
    out = []
    for r in recs:
        if r["shape"].endswith(f"[{new}]"):
            out.append({**r, "shape": r["shape"][: -len(new) - 2], "kernel": "default"})
        elif (r["shape"], r["format"], r["m"]) in tagged:
            out.append({**r, "shape": f"{r['shape']}[{old}]", "kernel": f"_{old}"})
        elif r["m"] <= 8 and r["shape"] != "moe_8_experts":
            out.append({**r, "kernel": f"_{old}"})
        else:
            out.append({**r, "kernel": "default"})
    order = {name: i for i, (name, _, _) in enumerate(SHAPES + [("moe_8_experts", 0, 0)])}
    return sorted(out, key=lambda r: ("[" in r["shape"], r["format"] != "nvfp4",
                                      order.get(r["shape"].split("[")[0], 99), r["m"]))


def history(allr: list[dict], sha: str) -> str:
    rows = [r for r in allr if r["git_sha"] != sha and r["m"] == 1 and "[" not in r["shape"]
            and r["shape"] in ("lm_head", "dense_up", "dense_down", "moe_8_experts")]
    if not rows:
        return ""
    lines = ["", "## Earlier runs (M = 1, same GPU kind; see the JSONL for every row)", "",
             "| git sha | shape | fmt | ours us | ours eff | cuBLAS eff |", "|---|---|---|---|---|---|"]
    lines += [f"| `{r['git_sha'][:10]}` | {r['shape']} | {r['format']} | {r['t_us']:.1f} | "
              f"{100 * r['eff_read']:.1f}% | {100 * r['cublas_eff_read']:.1f}% |" for r in rows]
    return "\n".join(lines) + "\n"


def _environment(args) -> dict:
    import torch

    from hybrid.baselines.report import git_sha
    from hybrid.hardware import driver_version
    from hybrid.kernels.build import module
    from hybrid.kernels.nvrtc import load_nvrtc

    sha = git_sha(short=False, dirty=False) if args.git_sha is None else args.git_sha
    dev = torch.device("cuda", torch.cuda.current_device())
    mod = module(dev)
    nv = load_nvrtc()
    return dict(gpu=torch.cuda.get_device_name(dev), sm=mod.sm, torch=torch.__version__,
                nvrtc=f"{nv.version[0]}.{nv.version[1]}", driver=driver_version(), host=platform.node(), git_sha=sha,
                command=args.command or " ".join(["hybrid-bench", "cuda-kernels", *sys.argv[2:]]))


def write_results(out: Path, env: dict, recs: list[dict]) -> None:
    from hybrid.baselines.report import append_jsonl

    append_jsonl(out.with_suffix(".jsonl"), [{**env, **r} for r in recs])
    out.with_suffix(".md").write_text(markdown(env, recs))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.jsonl')}")


def _clock_text(clocks: dict | None) -> str:
    if not clocks:
        return ""
    reasons = clocks.get("clock_event_reasons")
    return (f"; SM clock after the timings {clocks['sm_clock_mhz']} of {clocks['sm_clock_max_mhz']} MHz"
            + (f" (clock event reasons {reasons})" if reasons else ""))


def markdown(env: dict, recs: list[dict], note: str = "") -> str:
    lines = [f"# QPN CUDA kernels on {env['gpu']}", "", *([note, ""] if note else []),
             f"- command: `{env['command']}`", f"- git sha: `{env['git_sha']}`",
             f"- torch {env['torch']}, NVRTC {env['nvrtc']}, driver {env.get('driver') or 'not recorded'}, "
             f"native sm_{env['sm']}" + _clock_text(env.get("clocks")),
             f"- measured read bandwidth {env['read_gbs']:.0f} GB/s (2 GiB fp32 sum), "
             f"copy {env['copy_gbs']:.0f} GB/s (read + write)",
             "- eff = packed bytes (weights + scales) / median kernel time / read bandwidth; "
             "cuBLAS = torch FP16 matmul on pre-dequantized weights (FP16 bytes); "
             "x = cuBLAS time / our time; read us = a kernel that only reads as many bytes as ours (qpn_read; M = 1 rows), "
             "of read = that time / ours (1.00: as fast as a plain read of the same bytes)", "",
             "| shape | N | K | fmt | M | ours us | ours eff | cuBLAS us | cuBLAS eff | x vs cuBLAS "
             "| x vs dequant+matmul | read us | of read | kernel |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        dq = f"{r['speedup_vs_dequant']:.1f}" if "speedup_vs_dequant" in r else ""
        rd = f"{r['read_t_us']:.1f} | {r['read_t_us'] / r['t_us']:.2f}" if "read_t_us" in r else " | "
        lines.append(f"| {r['shape']} | {r['n']} | {r['k']} | {r['format']} | {r['m']} | "
                     f"{r['t_us']:.1f} | {100 * r['eff_read']:.1f}% | {r['cublas_t_us']:.1f} | "
                     f"{100 * r['cublas_eff_read']:.1f}% | {r['speedup_vs_cublas']:.2f} | {dq} | {rd} | "
                     f"{r.get('kernel', '')} |")
    return "\n".join(lines + [""] + targets(recs)) + "\n"


LARGE = ("lm_head", "dense_up", "dense_down")


def targets(recs: list[dict]) -> list[str]:
    """The issue's targets, checked against these records (met / not met, with the numbers)."""
    out = ["## Targets", ""]
    recs = [r for r in recs if "[" not in r["shape"]]  # the default kernels only
    worse = [r for r in recs if r["eff_read"] < r["cublas_eff_read"]]
    m1 = [r for r in recs if r["m"] == 1 and "[" not in r["shape"]]
    out.append(f"- efficiency >= cuBLAS FP16 on every shape and M: {'met' if not worse else 'NOT met'} "
               f"({len(recs) - len(worse)} of {len(recs)} rows at or above). At M = 1: "
               + "; ".join(f"{r['shape']} {r['format']} {100 * r['eff_read']:.0f}% vs "
                           f"{100 * r['cublas_eff_read']:.0f}% (x{r['speedup_vs_cublas']:.2f} speed)"
                           for r in m1))
    rd = [r for r in m1 if "read_t_us" in r]
    if rd:
        out.append("- the same at M = 1 against a plain read of each one's own bytes (qpn_read over as many "
                   "bytes, one launch; time of that read / kernel time): "
                   + "; ".join(f"{r['shape']} {r['format']} ours {r['read_t_us'] / r['t_us']:.2f} vs cuBLAS "
                               f"{r['cublas_read_t_us'] / r['cublas_t_us']:.2f}" for r in rd))
    lm = [r for r in recs if r["shape"] == "lm_head" and r["format"] == "nvfp4" and r["m"] == 1]
    if lm:
        e = 100 * lm[0]["eff_read"]
        ceil = (f"; a plain read of its {lm[0]['bytes'] / 1e6:.0f} MB in one launch: "   # same bytes, read bandwidth
                f"{100 * lm[0]['eff_read'] * lm[0]['t_us'] / lm[0]['read_t_us']:.1f}%" if "read_t_us" in lm[0] else "")
        out.append(f"- NVFP4 M=1 lm_head >= 85%: {'met' if e >= 85 else 'NOT met'} ({e:.1f}%{ceil})")
    ratios = []
    for r in recs:
        if r["m"] == 8:
            one = [q for q in recs if q["m"] == 1 and q["shape"] == r["shape"] and q["format"] == r["format"]]
            if one:
                ratios.append((r["t_us"] / one[0]["t_us"], f"{r['shape']} {r['format']}"))
    bad = [f"{n} x{x:.2f}" for x, n in ratios if x > 1.10]
    if ratios:
        out.append(f"- M=8 within 10% of M=1: {'met' if not bad else 'NOT met'} (worst x"
                   f"{max(x for x, _ in ratios):.2f}{'; ' + '; '.join(bad) if bad else ''})")
    pre = [(r["t_us"] / r["cublas_t_us"], f"{r['shape']} {r['format']} M={r['m']}")
           for r in recs if r["m"] >= 64 and r["shape"] != "moe_8_experts"]
    if pre:
        slow = [f"{n} x{x:.2f}" for x, n in sorted(pre, reverse=True) if x > 1.5]
        out.append(f"- prefill (M >= 64) within 1.5x of cuBLAS FP16 time: "
                   f"{'met' if not slow else 'NOT met'} ({len(pre) - len(slow)} of {len(pre)} rows"
                   f"{'; ' + '; '.join(slow) if slow else ''})")
    dq = [r for r in recs if r["m"] == 1 and r["shape"] in LARGE and "speedup_vs_dequant" in r]
    if dq:
        lo = min(r["speedup_vs_dequant"] for r in dq)
        out.append(f"- >= 3x faster than dequantize-then-FP16-matmul at M=1 on large shapes: "
                   f"{'met' if lo >= 3 else 'NOT met'} (lowest x{lo:.1f})")
    return out
