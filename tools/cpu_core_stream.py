"""One core's NVFP4 int16 kernel (cpu/i16.py, M = 1 and 8) on weights that sit in L2, in L3 and in DRAM, with
the software prefetch at several distances and hints, beside a read-only stream over the same DRAM bytes
(cpu/stream.py): whether the kernel's streamed rate is bound by its compute or by what one core keeps in flight.

    python tools/cpu_core_stream.py [--rows 768,16384,auto] [--pf 0,8192,16384,65536,16386] [--record FILE]

--rows: weight rows (K = 2048, 1152 bytes a row); `auto` = enough rows for 4x this machine's last-level cache
(at least 65536): the DRAM case (a 300 MiB L3 holds 65536 rows' 72 MiB).

--pf values are nvfp4_i16_tile_pf's pf argument: distance in bytes + hint in the low 2 bits (0 prefetcht0,
1 t1, 2 t2, 3 nta). One thread, no runner: a compiled loop over the tiles of one K = 2048 weight.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


K = 2048                                  # in-features of every weight measured


def dram_rows(l3: int, floor: int = 65536) -> int:
    """Rows of a K-wide NVFP4 weight of at least four times the last-level cache (l3 bytes), whole
    64-row tiles, at least floor."""
    from cpu import layout

    tile = layout.nvfp4_nbytes(layout.R, K)
    return max(floor, -(-4 * l3 // tile) * layout.R)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="768,16384,auto",
                   help="weight rows (K = 2048): L2-, L3- and DRAM-sized (auto: 4x the last-level cache)")
    p.add_argument("--pf", default="0,8192,16384,65536,16386", help="prefetch arguments for the largest weight")
    p.add_argument("--ms", default="1,8")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--record", default=None, metavar="FILE", help="append one JSON row per measurement")
    a = p.parse_args(argv)

    from numba import njit

    from cpu import layout
    from cpu.i16 import NO_LIMIT, PREFETCH, nvfp4_i16_tile_pf, quantize_rows
    from cpu.stream import UNIT, read_parallel
    from hybrid.baselines.report import git_sha
    from hybrid.bench.cpu_kernels import best_time, l3_bytes, machine

    @njit(nogil=True)
    def sweep(w, G, xq, xs, rows, m, acc, pf, calls):
        for _ in range(calls):
            for t in range(w.shape[0]):
                nvfp4_i16_tile_pf(w[t], G, xq, xs, rows, 0, m, acc, pf, NO_LIMIT, 0)

    k, rng = K, np.random.default_rng(6)
    x = rng.standard_normal((8, k)).astype(np.float32)
    xq, xs = np.empty((8, k), np.int16), np.empty((8, k // 16), np.float32)
    quantize_rows(x, 0, 8, xq, xs)
    rows, acc = np.arange(8, dtype=np.int64), np.zeros((8, layout.R), np.float32)
    meta = {"tool": "tools/cpu_core_stream.py", "command": " ".join(["python", *sys.argv]), "git_sha": git_sha(),
            "machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "threads": 1}
    sizes = [dram_rows(l3_bytes()) if v.strip() == "auto" else int(v) for v in a.rows.split(",")]
    out = open(a.record, "a") if a.record else None
    for n in sizes:
        w = layout.pack_nvfp4(rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
                              rng.integers(0x28, 0x50, (n, k // 16), dtype=np.uint8), int16=True)
        w = w.reshape(layout.num_tiles(n), -1)
        calls = max(1, (64 << 20) // w.nbytes)
        pfs = [int(v) for v in a.pf.split(",")] if n == max(sizes) else [PREFETCH]
        recs = []
        if n == max(sizes):
            flat = w.reshape(-1)
            t = best_time(lambda: read_parallel(flat, UNIT, 1), a.reps)
            recs.append({"what": "read", "gbs": flat.nbytes / t / 1e9})
        for m in (int(v) for v in a.ms.split(",")):
            for pf in pfs:
                sweep(w, k // 16, xq, xs, rows, m, acc, pf, 1)
                t = best_time(lambda: sweep(w, k // 16, xq, xs, rows, m, acc, pf, calls), a.reps)
                recs.append({"what": "kernel", "m": m, "pf": pf, "gbs": w.nbytes * calls / t / 1e9})
        for r in recs:
            r.update(meta, rows=n, weight_mib=round(w.nbytes / 2**20, 2), gbs=round(r["gbs"], 2))
            print(f"rows {n:6d} ({r['weight_mib']:7.2f} MiB) {r['what']:6s} M={r.get('m', '-')} "
                  f"pf={r.get('pf', '-')}: {r['gbs']:6.2f} GB/s", flush=True)
            if out:
                out.write(json.dumps(r, sort_keys=True) + "\n")
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
