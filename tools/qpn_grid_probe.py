"""Probe: the M <= 8 QPN kernels' time against their launch shape (warps splitting K, tiles per warp).

    PYTHONPATH=. HYBRID_CACHE_DIR=.qpncache python3 tools/qpn_grid_probe.py --out $OUT/probe.jsonl

For each shape and kernel it launches the kernel directly with every valid KS (warps of a block
splitting K) and times it as hybrid-bench cuda-kernels does (CUDA events, median, weights rotated
past the L2), beside the launcher's own pick. Rows: shape, n, k, format, m, kernel, ks, grid
(blocks), waves (grid / resident blocks per wave from the occupancy API), t_us, eff_read.
A question this answers: how much of the M = 1 kernel's gap to the read bandwidth is the last,
partial wave of blocks (lm_head: 1187 blocks of which 528 fit at once on the H200).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys

import torch

from hybrid.bench.cuda_kernels import bandwidths, copies_for, random_qweight, time_ms, _clone_weight
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
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    read_bw, copy_bw = bandwidths()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    mod = qpn._module(dev)
    print(f"read {read_bw:.0f} GB/s copy {copy_bw:.0f} GB/s, {sms} SMs, sm_{mod.sm}", flush=True)
    out = open(a.out, "a")
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
                if fmt == 2 and m == 1:
                    names += ["qpn2_linear_m1_as", "qpn2_linear_m1_as2"]
                for name in names:
                    units = -(-tiles // 2) if name.endswith(qpn.PAIR_KERNELS) else tiles
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


if __name__ == "__main__":
    sys.exit(main())
