"""Probe: the M <= 8 QPN kernels' time against their launch shape (warps splitting K, tiles per warp).

    PYTHONPATH=. HYBRID_CACHE_DIR=.qpncache python3 tools/qpn_grid_probe.py --out $OUT/probe.jsonl

For each shape and kernel it launches the kernel directly with every valid KS (warps of a block
splitting K) and times it as hybrid-bench cuda-kernels does (CUDA events, median, weights rotated
past the L2), beside the launcher's own pick. Rows: shape, n, k, format, m, kernel, ks, grid
(blocks), waves (grid / resident blocks per wave from the occupancy API), t_us, eff_read.
A question this answers: how much of the M = 1 kernel's gap to the read bandwidth is the last,
partial wave of blocks (lm_head: 1187 blocks of which 528 fit at once on the H200).
--moe: instead, the grouped MoE kernels (8 experts of a Qwen3-30B-A3B layer, qpn_moe) with the
gate|up and down launches' KS forced to every pair (kernel "moe:<ks gateup>/<ks down>").
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys

import torch

from hybrid.bench.cuda_kernels import (_clone_weight, bandwidths, copies_for, moe_slot_sets, random_qweight,
                                       time_ms)
from hybrid.checkpoint.formats import QType
from hybrid.kernels import QPNWeight, qpn_linear
from hybrid.kernels import layout, qpn
from hybrid.kernels.qpn import THREADS, WARPS, _p

SHAPES = {"lm_head": (151936, 2048), "lm_head_2w": (135168, 2048), "dense_up": (25600, 5120),
          "dense_down": (5120, 25600), "q_proj": (4096, 2048)}


def occupancy(mod, name: str) -> int:
    """Resident blocks per SM of kernel name (256 threads, static shared memory)."""
    from hybrid.kernels.driver import _cuda

    fn = mod.function(name)
    n = ctypes.c_int()
    _cuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), fn, THREADS, ctypes.c_size_t(0))
    return n.value


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--sha", default="unknown")
    ap.add_argument("--moe", action="store_true", help="probe the grouped MoE kernels instead")
    ap.add_argument("--extra", default="", help="comma list of more M <= 8 kernel names to probe (e.g. variants "
                                                 "added to cuda/qpn.cu for a measurement; '_t2' in a name: two tiles per warp)")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    read_bw, copy_bw = bandwidths()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    mod = qpn._module(dev)
    print(f"read {read_bw:.0f} GB/s copy {copy_bw:.0f} GB/s, {sms} SMs, sm_{mod.sm}", flush=True)
    out = open(a.out, "a")
    if a.moe:
        return probe_moe(a, out, read_bw, copy_bw, dev)
    for shape in a.shapes.split(","):
        n, k = SHAPES[shape]
        for qt in (QType.NVFP4, QType.FP8):
            fmt = 2 if qt is QType.NVFP4 else 8
            qw = random_qweight(qt, n, k, dev)
            base = QPNWeight.from_qweight(qw, dev)
            ws = [base] + [_clone_weight(base) for _ in range(copies_for(base.nbytes) - 1)]
            tiles, chunks = -(-n // 16), k // layout.CHUNK[qt]
            for m in (1, 8):
                x = torch.randn(m, k, device=dev, dtype=torch.float16)
                t = time_ms([lambda w=w: qpn_linear(x, w) for w in ws], a.reps)
                rows = [dict(kernel="pick", ks=None, grid=None, waves=None, t_us=t * 1e3)]
                names = [f"qpn{fmt}_linear_mt1", f"qpn{fmt}_linear_mt1_t2u1"]
                names += [nm for nm in a.extra.split(",") if nm and nm.startswith(f"qpn{fmt}_")]
                if fmt == 2 and m == 1:
                    names += ["qpn2_linear_m1_as", "qpn2_linear_m1_as2"]
                for name in names:
                    units = -(-tiles // qpn.tiles_per_warp(name))
                    per_sm = occupancy(mod, name)
                    for ks in (1, 2, 4, 8):
                        if chunks // ks < 2:
                            continue
                        grid = -(-units // (WARPS // ks))
                        y = torch.empty(m, n, dtype=torch.float16, device=dev)

                        def go(w, name=name, grid=grid, ks=ks, y=y):
                            mod.launch(name, (grid, 1, 1), THREADS,
                                       [_p(w.words), _p(w.scales), ctypes.c_float(w.gscale), _p(x), _p(y),
                                        ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(ks),
                                        ctypes.c_int(1)])
                        go(base)
                        ref = qpn_linear(x, base)
                        ok = bool(torch.allclose(y.float(), ref.float(), rtol=1e-2, atol=1e-2))
                        t = time_ms([lambda w=w: go(w) for w in ws], a.reps)
                        rows.append(dict(kernel=name, ks=ks, grid=grid, waves=round(grid / (per_sm * sms), 3),
                                         per_sm=per_sm, t_us=t * 1e3, same_as_pick=ok))
                for r in rows:
                    r.update(shape=shape, n=n, k=k, format=qt.value, m=m, bytes=base.nbytes,
                             eff_read=base.nbytes / (r["t_us"] * 1e-6) / 1e9 / read_bw, read_bw=read_bw,
                             copy_bw=copy_bw, gpu=torch.cuda.get_device_name(dev), git_sha=a.sha,
                             command="tools/qpn_grid_probe.py")
                    out.write(json.dumps(r) + "\n")
                    print(f"{shape:11s} {qt.value:5s} M={m} {r['kernel']:24s} ks={r['ks']} grid={r['grid']} "
                          f"waves={r['waves']} {r['t_us']:8.1f} us {100 * r['eff_read']:5.1f}%"
                          f"{'' if r.get('same_as_pick', True) else '  MISMATCH'}", flush=True)
            del ws
            torch.cuda.empty_cache()
    return 0


def probe_moe(a, out, read_bw, copy_bw, dev, h=2048, i=768, topk=8) -> int:
    from hybrid.kernels import qpn_moe

    for qt in (QType.NVFP4, QType.FP8):
        sets = moe_slot_sets(qt, h, i, topk, dev)
        nbytes = topk * sets[0].nbytes_per_slot
        for t in (1, 4, 8):
            x = torch.randn(t, h, device=dev, dtype=torch.float16)
            ids = torch.stack([torch.randperm(topk, device=dev) for _ in range(t)]).int().flatten()
            tok = torch.arange(t, device=dev, dtype=torch.int32).repeat_interleave(topk)
            rw = torch.rand(t * topk, device=dev)
            orig = qpn._pick_ks
            calls = []
            qpn._pick_ks = lambda u, c, s: calls.append(orig(u, c, s)) or calls[-1]
            qpn_moe(x, sets[0], ids, tok, rw)
            qpn._pick_ks = orig
            ref = qpn_moe(x, sets[0], ids, tok, rw)
            t0 = time_ms([lambda sl=sl: qpn_moe(x, sl, ids, tok, rw) for sl in sets], a.reps)
            rows = [dict(kernel=f"pick:{calls[0]}/{calls[1]}", t_us=t0 * 1e3)]
            for kg in (1, 2, 4, 8):
                for kd in (1, 2, 4, 8):
                    def forced(u, c, s, seq=(kg, kd)):   # gate|up first, then down, every call
                        calls.append(0)
                        return seq[(len(calls) - 1) % 2]
                    qpn._pick_ks = forced
                    try:
                        calls.clear()
                        y = qpn_moe(x, sets[0], ids, tok, rw)
                        ok = bool(torch.allclose(y, ref, rtol=1e-3, atol=1e-3))
                        tt = time_ms([lambda sl=sl: (calls.clear(), qpn_moe(x, sl, ids, tok, rw)) for sl in sets],
                                     a.reps)
                    finally:
                        qpn._pick_ks = orig
                    rows.append(dict(kernel=f"moe:{kg}/{kd}", t_us=tt * 1e3, same_as_pick=ok))
            for r in rows:
                r.update(shape="moe_8_experts", n=h, k=i, format=qt.value, m=t, bytes=nbytes,
                         eff_read=nbytes / (r["t_us"] * 1e-6) / 1e9 / read_bw, read_bw=read_bw, copy_bw=copy_bw,
                         gpu=torch.cuda.get_device_name(dev), git_sha=a.sha, command="tools/qpn_grid_probe.py --moe")
                out.write(json.dumps(r) + "\n")
                print(f"moe {qt.value:5s} T={t} {r['kernel']:12s} {r['t_us']:7.1f} us {100 * r['eff_read']:5.1f}%"
                      f"{'' if r.get('same_as_pick', True) else '  MISMATCH'}", flush=True)
        del sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
