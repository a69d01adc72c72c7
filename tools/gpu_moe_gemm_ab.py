"""Kernel-level A/B of the MoE prefill paths of qpn_moe on one layer of Qwen3-30B-A3B shape (hidden 2048,
moe_intermediate 768, 128 experts all resident, top-8 routing): the mt4 grouped kernels (HYBRID_MOE_GEMM=0)
against the WMMA grouped GEMM ("1") and the sm_80+ register-fragment GEMM ("f"), per prompt size, NVFP4 and
FP8. The modes are alternated inside each round (same slots, same routing), each timed by CUDA events over
--reps calls; the median of --rounds rounds is reported with the spread. Writes $OUT/moe_gemm_ab.jsonl.

    HYBRID_CACHE_DIR=.qpncache HYBRID_GIT_SHA=<sha> PYTHONPATH=. python3 tools/gpu_moe_gemm_ab.py \\
        --tokens 32,64,128,256,512,1024,2048 --rounds 7
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def git_sha() -> str:
    sha = os.environ.get("HYBRID_GIT_SHA")
    if sha:
        return sha
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def random_slots(qtype, s, h, i, dev, gen):
    """Slots filled with random packed words; scales in a sane e4m3 range (the timing reads every byte)."""
    import torch
    from hybrid.kernels import QPNExpertSlots

    slots = QPNExpertSlots(s, h, i, qtype, dev)
    for name in ("w13", "w2"):
        t = getattr(slots, name)
        t.copy_(torch.randint(-2**31, 2**31 - 1, t.shape, dtype=torch.int32, device=dev, generator=gen))
    for name in ("s13", "s2"):
        t = getattr(slots, name)
        if t.dim() > 1:
            t.copy_(torch.randint(0x28, 0x38, t.shape, dtype=torch.uint8, device=dev, generator=gen))
    slots.gs.fill_(0.01)
    return slots


def routing(t, s, topk, skew, dev, gen):
    """top-k distinct slots per token from a Zipf-like popularity (skew 0 = uniform)."""
    import torch

    p = torch.arange(1, s + 1, dtype=torch.float32, device=dev).pow(-skew)
    ids = torch.multinomial(p.expand(t, s), topk, replacement=False, generator=gen).flatten().int()
    tok = torch.arange(t, dtype=torch.int32, device=dev).repeat_interleave(topk)
    rw = torch.rand(t * topk, device=dev, generator=gen)
    return ids, tok, rw


MODULES: dict = {}   # "" -> the tree's kernel module, "alt" -> one built from --alt-src (a mode's "+alt")


def use_module(mode, dev):
    """Put the module a mode runs on in hybrid.kernels.build's cache -> the mode without its "+alt"."""
    from hybrid.kernels import build

    name, _, alt = (mode or "0").partition("+")
    os.environ["HYBRID_MOE_MT2"] = "1" if name == "mt2" else "0"   # "mt2": the two-tile ring kernels at 9..16 tokens
    key = (dev.index, None)
    if not MODULES:
        MODULES[""] = build.module(dev)
    if alt and alt not in MODULES:
        raise SystemExit(f"error: mode {mode!r} needs --alt-src")
    build._MODULES[key] = MODULES[alt]
    return None if name == "0" else "auto" if name == "mt2" else name


def time_mode(mode, x, slots, ids, tok, rw, reps):
    import torch
    from hybrid.kernels import qpn

    qpn.MOE_GEMM[0] = use_module(mode, x.device)
    qpn.qpn_moe(x, slots, ids, tok, rw)      # warm (module build, first launch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        qpn.qpn_moe(x, slots, ids, tok, rw)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps * 1000.0   # us per call


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="32,64,128,256,512,1024,2048")
    p.add_argument("--modes", default="0,1,f", help="comma list of HYBRID_MOE_GEMM values (0, 1, f, auto, or mt2: "
                   "auto with HYBRID_MOE_MT2=1); "
                   "a value + \"+alt\" runs it on the kernels of --alt-src")
    p.add_argument("--alt-src", default=None, help="another qpn.cu (e.g. the previous commit's) for the +alt modes")
    p.add_argument("--qtypes", default="nvfp4,fp8")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--skew", default="0.25", help="comma list of Zipf exponents of the experts' popularity")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=120)
    p.add_argument("--min-rows", type=int, default=None, help="override the fewest rows of every qpn.MOE_GEMM_RULES")
    p.add_argument("--bm64-rows", type=int, default=None, help="override the BM = 64 rows of every MOE_GEMM_RULES "
                   "(0: never BM 64)")
    a = p.parse_args(argv)

    import torch
    from hybrid.checkpoint.formats import QType
    from hybrid.kernels import qpn

    out = Path(os.environ.get("OUT", "scratch/out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    modes = a.modes.split(",")
    if a.alt_src:
        from hybrid.kernels import build
        from hybrid.kernels.driver import Module

        MODULES[""] = build.module(dev)
        MODULES["alt"] = Module(build._image_for(MODULES[""].sm, False, src=Path(a.alt_src).read_text()), dev)
        MODULES["alt"].sm = MODULES[""].sm
    meta = {"tool": "tools/gpu_moe_gemm_ab.py", "git_sha": git_sha(), "gpu": torch.cuda.get_device_name(dev),
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv)}
    deadline = time.monotonic() + a.budget_s
    old = qpn.MOE_GEMM[0]
    for key, (least, bm64) in list(qpn.MOE_GEMM_RULES.items()):
        qpn.MOE_GEMM_RULES[key] = (least if a.min_rows is None else a.min_rows,
                                   bm64 if a.bm64_rows is None else (a.bm64_rows or None))
    meta["rules"] = {f"{k[0]}{k[1]}": v for k, v in qpn.MOE_GEMM_RULES.items()}
    with open(out / "moe_gemm_ab.jsonl", "a") as f:
        for qname in a.qtypes.split(","):
            qtype = QType.NVFP4 if qname == "nvfp4" else QType.FP8
            slots = random_slots(qtype, a.experts, a.hidden, a.inter, dev, gen)
            for t, skew in [(int(v), float(k)) for v in a.tokens.split(",") for k in a.skew.split(",")]:
                if time.monotonic() > deadline:
                    print(f"budget spent: {qname} T={t} and after not run", flush=True)
                    break
                ids, tok, rw = routing(t, a.experts, a.topk, skew, dev, gen)
                busiest = int(torch.bincount(ids.long(), minlength=a.experts).max())
                x = (torch.randn(t, a.hidden, device=dev, generator=gen) * 0.5).half()
                per = {m: [] for m in modes}
                ys = {}
                for r in range(a.rounds):
                    order = modes if r % 2 == 0 else modes[::-1]
                    for m in order:
                        per[m].append(time_mode(m, x, slots, ids, tok, rw, a.reps))
                for m in modes:
                    qpn.MOE_GEMM[0] = use_module(m, dev)
                    ys[m] = qpn.qpn_moe(x, slots, ids, tok, rw).double()
                plan = {}
                for m in modes:
                    qpn.MOE_GEMM[0] = use_module(m, dev)
                    plan[str(m)] = qpn.moe_gemm_plan(len(ids), a.experts, 2 if qtype is QType.NVFP4 else 8,
                                                     qpn._module(dev).sm, a.hidden, a.inter)
                qpn.MOE_GEMM[0] = old
                use_module("0", dev)
                ref = ys[modes[0]]
                for m in modes:
                    us = per[m]
                    rel = ((ys[m] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                    # weight bytes read once per active expert (packed words + scales), for a GB/s figure
                    active = int(torch.unique(ids).numel())
                    rec = dict(meta, qtype=qname, tokens=t, skew=skew, rows_busiest=busiest,
                               rows_mean=len(ids) / a.experts, mode=m,
                               kernel=("mt2_as" if m.startswith("mt2") and 8 < t <= 16
                                       else (plan[str(m)] or ["mt4"])[0]),
                               us_median=round(statistics.median(us), 1), us_min=round(min(us), 1),
                               us_max=round(max(us), 1), rounds=a.rounds, reps=a.reps, active_experts=active,
                               weight_gbs=round(active * slots.nbytes_per_slot / (statistics.median(us) * 1e3), 1),
                               rel_vs_mode0=rel)
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    print(f"{qname:5s} T={t:5d} skew {skew} busiest {busiest:5d} mode={rec['mode']} "
                          f"{rec['kernel']:32s} "
                          f"{rec['us_median']:9.1f} us (min {rec['us_min']}, max {rec['us_max']}) "
                          f"{rec['weight_gbs']:7.1f} GB/s  rel {rel:.1e}", flush=True)
            del slots
    return 0


if __name__ == "__main__":
    sys.exit(main())
