"""Probe (issue 5, "M = 8 within 10% of M = 1"): the M <= 8 linear kernel variants at M = 2..8 beside the
default M = 1 launch of the same weight, in one process, rounds alternating so drift falls on all alike.

    PYTHONPATH=. HYBRID_CACHE_DIR=.qpncache python3 tools/qpn_m8_probe.py --out $OUT/m8.jsonl \
        --variants default,_t2u1,_t2 --shapes lm_head,dense_down --rounds 2

Per (shape, format): the weight and its copies are built once (rotated past the L2, as hybrid-bench
cuda-kernels times), then each round times M = 1 with the default kernel and every variant at each --m
(CUDA events, median of --reps). Rows: shape, format, variant, m, round, t_us, eff_read (of a 2 GiB fp32
sum's rate measured in the run), ratio (this time over the same round's default M = 1 time). Summary
rows: the median over rounds per (shape, format, variant, m).
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch

from hybrid.bench.cuda_kernels import SHAPES, _clone_weight, copies_for, open_probe, random_qweight, time_ms
from hybrid.checkpoint.formats import QType
from hybrid.kernels import QPNWeight, build, qpn, qpn_linear


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="m8.jsonl")
    ap.add_argument("--variants", default="default,_t2u1,_t2",
                    help="comma list of LINEAR_VARIANT choices ('default' = the launcher's pick; a '+mt' suffix also "
                         "sets PREFILL_VARIANT 'mt': M > 16 through the 8-row-tile kernels)")
    ap.add_argument("--shapes", default="lm_head,dense_down,dense_up,q_proj,o_proj")
    ap.add_argument("--formats", default="nvfp4,fp8")
    ap.add_argument("--m", default="8", help="comma list of M timed per variant")
    ap.add_argument("--alt-source", default="",
                    help="other qpn.cu files, comma-separated: every cell is also timed with the kernels built from "
                         "each, each round alternating the builds (variant labels get '@alt', or '@alt1', '@alt2', ... "
                         "with several; ratios against the same build's M = 1): an A/B of kernel changes in one process")
    ap.add_argument("--moe", action="store_true",
                    help="also time the 8 selected experts of a Qwen3-30B-A3B layer (qpn_moe, the default "
                         "kernels) at each --m and M = 1, per build (shape 'moe_8_experts')")
    ap.add_argument("--moe-env", default="",
                    help="VAR=v1,v2,...: time the MoE layer once per value of that environment variable (read "
                         "at each launch, e.g. HYBRID_PDL=0,1), labelled default/VAR=v")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sha", default="unknown")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    emit, read_bw = open_probe("qpn_m8_probe", a.sha, a.out)
    tree_source = build.source
    alts = [f for f in a.alt_source.split(",") if f]
    builds = [("", None)] + [("@alt" if len(alts) == 1 else f"@alt{i + 1}", open(f).read()) for i, f in enumerate(alts)]

    def use_source(text: str | None) -> None:   # the kernels of the tree's qpn.cu, or of text
        build.source = tree_source if text is None else (lambda: text)
        build.forget_modules()

    dims = {name: (n, k) for name, n, k in SHAPES}
    variants = [None if v == "default" else v for v in a.variants.split(",")]
    ms = [int(m) for m in a.m.split(",")]
    for shape in filter(None, a.shapes.split(",")):
        n, k = dims[shape]
        for fmt in a.formats.split(","):
            qt = QType(fmt)
            base = QPNWeight.from_qweight(random_qweight(qt, n, k, dev), dev)
            ws = [base] + [_clone_weight(base) for _ in range(copies_for(base.nbytes) - 1)]
            xs = {m: torch.randn(m, k, device=dev, dtype=torch.float16) for m in {1, *ms}}
            ratios: dict[tuple, list[float]] = {}   # (label, m) -> per round
            times: dict[tuple, list[float]] = {}
            for rnd, (tag, text) in itertools.product(range(a.rounds), builds):
                use_source(text)
                t1 = time_ms([lambda w=w: qpn_linear(xs[1], w) for w in ws], a.reps)
                cells = [(None, 1, t1)]
                for v in variants:
                    qpn.LINEAR_VARIANT[0] = (v or "").removesuffix("+mt") or None
                    qpn.PREFILL_VARIANT[0] = "mt" if v and v.endswith("+mt") else None
                    try:
                        for m in ms:
                            cells.append((v, m, time_ms([lambda w=w, x=xs[m]: qpn_linear(x, w) for w in ws], a.reps)))
                    finally:
                        qpn.LINEAR_VARIANT[0] = qpn.PREFILL_VARIANT[0] = None
                for v, m, t in cells:
                    label = (v or "default") + tag
                    r = {"shape": shape, "format": fmt, "variant": label, "m": m, "round": rnd,
                         "t_us": round(t * 1e3, 2), "eff_read": round(base.nbytes / (t * 1e-3) / 1e9 / read_bw, 4),
                         "ratio": round(t / t1, 4)}
                    ratios.setdefault((label, m), []).append(r["ratio"])
                    times.setdefault((label, m), []).append(r["t_us"])
                    emit(r)
            use_source(None)
            for (label, m), vals in ratios.items():
                emit({"summary": True, "shape": shape, "format": fmt, "variant": label, "m": m,
                      "t_us": statistics.median(times[(label, m)]), "ratio": statistics.median(vals)})
            del ws, base
            torch.cuda.empty_cache()
    if a.moe:
        for fmt in a.formats.split(","):
            moe_cells(a, QType(fmt), ms, builds, use_source, read_bw, emit)
    return 0


def moe_cells(a, qt, ms, builds, use_source, read_bw, emit) -> None:
    """qpn_moe over the 8 experts of one layer (slot copies rotated past the L2), per build and round."""
    from hybrid.bench.cuda_kernels import moe_slot_sets
    from hybrid.kernels import qpn_moe

    dev = torch.device("cuda", 0)
    h, i, topk = 2048, 768, 8
    sets = moe_slot_sets(qt, h, i, topk, dev)
    nbytes = topk * sets[0].nbytes_per_slot
    var, _, vals = a.moe_env.partition("=")
    envs = [(f"/{var}={v}", v) for v in vals.split(",")] if var else [("", None)]
    old_env = os.environ.get(var) if var else None
    got: dict[tuple, list[float]] = {}
    for rnd, (tag, text), (etag, val) in itertools.product(range(a.rounds), builds, envs):
        use_source(text)
        if var:
            os.environ[var] = val
        for m in sorted({1, *ms}):
            x = torch.randn(m, h, device=dev, dtype=torch.float16)
            ids = torch.stack([torch.randperm(topk, device=dev) for _ in range(m)]).int().flatten()
            tok = torch.arange(m, device=dev, dtype=torch.int32).repeat_interleave(topk)
            rw = torch.rand(m * topk, device=dev)
            t = time_ms([lambda sl=sl: qpn_moe(x, sl, ids, tok, rw) for sl in sets], a.reps)
            label = "default" + tag + etag
            r = {"shape": "moe_8_experts", "format": qt.value, "variant": label, "m": m, "round": rnd,
                 "t_us": round(t * 1e3, 2), "eff_read": round(nbytes / (t * 1e-3) / 1e9 / read_bw, 4)}
            got.setdefault((label, m), []).append(r["t_us"])
            emit(r)
    if var:
        os.environ.pop(var) if old_env is None else os.environ.__setitem__(var, old_env)
    use_source(None)
    for (label, m), ts in got.items():
        emit({"summary": True, "shape": "moe_8_experts", "format": qt.value, "variant": label, "m": m,
              "t_us": statistics.median(ts)})
    del sets
    torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
