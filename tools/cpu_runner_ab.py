"""A/B of CpuExpertRunner variants (issue 4) in one process, on one Qwen3-30B-A3B NVFP4 expert set.

    python tools/cpu_runner_ab.py --threads 1,16 --ms 1,8 --variants phases,dataflow [--nohuge]

Variants are runner schedules (hybrid/experts/cpu_runner.py SCHEDULES) with optional prefixes:
'direct:' (the same kernel called from this thread without the runner: no submit/queue/sync
hand-off), 'pf<N><o|s|n>:' (dataflow's prefetch distance N bytes; near a unit's end on into the
bytes that follow / stop / into the part's next unit, claimed ahead: cpu/dataflow.py PF_*;
a suffix t1 / t2 / nta picks that prefetch instruction instead of prefetcht0),
and with --nohuge each again on a second store in 4 KiB pages ('4k:...').  'readcall' is no kernel:
each call's experts' bytes (contiguous) summed by the read probe on the pool, one parallel region
per call, from this thread: the stream with the per-call region start and end, without compute.  Every round measures the read-only stream
(cpu/stream.py) and each variant (order flipped every other round) the way hybrid-bench
cpu-kernels does (a sweep over all experts, top-8 per call, best of --reps sweeps); the table has
best and median GB/s over rounds and each round's ratio to the first variant.  The pool's wait
policy is the process's (HYBRID_CPU_WAIT), so compare spin and passive in two runs; each runner
thread leads its own OpenMP team, and spinning teams would take cores from the one measured, so
with spin run one variant and --no-read.
"""
import argparse
import statistics
import time

import numpy as np

from hybrid.experts.cpu_runner import CpuExpertRunner, set_pool_wait


def prefetch_of(v: str):
    from cpu.dataflow import PF_NEXT, PF_ON, PF_STOP
    from cpu.i16 import PREFETCH

    for part in v.split(":")[:-1]:
        if part.startswith("pf"):                   # pf<N><o|s|n>[t1|t2|nta]
            hint = next((h for h, tag in ((1, "t1"), (2, "t2"), (3, "nta")) if part.endswith(tag)), 0)
            part = part[:len(part) - (0 if hint == 0 else 2 if hint < 3 else 3)]
            return int(part[2:-1]) + hint, {"o": PF_ON, "s": PF_STOP, "n": PF_NEXT}[part[-1]]
    return PREFETCH, PF_NEXT


class ReadCall:
    """Per call: the read probe over the listed (consecutive) experts' slots, on `threads` parts."""

    def __init__(self, store, threads):
        self.s, self.t = store, threads

    def submit(self, layer, ids, rows, wts, x):
        from cpu.stream import UNIT, read_parallel

        gu, _, _ = self.s.slots(layer, ids)
        a = self.s.arena.array[gu.min(): gu.max() + self.s.slot_nbytes]
        return read_parallel(a[: a.shape[0] // 8 * 8], UNIT, self.t)

    def sync(self, h):
        return h

    def close(self):
        pass


class Direct:
    """The runner's submit/sync surface, computed at once on this thread (no hand-off)."""

    def __init__(self, store, threads, schedule, prefetch):
        import numba

        from hybrid.experts.cpu_runner import _group, schedule_kernel
        self.s, self.t, self.fn, self.group = store, threads, schedule_kernel(schedule, prefetch), _group
        numba.set_num_threads(min(max(threads, numba.get_num_threads()), numba.config.NUMBA_NUM_THREADS))

    def submit(self, layer, ids, rows, wts, x):
        s = self.s
        ids, rows, ptr, w = self.group(ids, rows, wts, x.shape[0])
        gu, dn, scl = s.slots(layer, ids)
        out = np.zeros_like(x)
        self.fn(s.qkind, s.arena.array, gu, dn, scl, x, rows, ptr, w, out, s.hidden, s.inter, s.R, self.t)
        return out

    def sync(self, out):
        return out

    def close(self):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--ms", default="1,8", help="comma list of tokens per expert")
    ap.add_argument("--variants", default="phases,dataflow", help="comma list of runner schedules")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="sweeps per measurement (best kept)")
    ap.add_argument("--nohuge", action="store_true", help="also every variant on a 4 KiB-page store")
    ap.add_argument("--l3x", type=float, default=2.0, help="expert set size in last-level caches")
    ap.add_argument("--budget", type=float, default=1e9, help="stop after the round that passes this many s")
    ap.add_argument("--cells", default=None, metavar="TxM,...",
                    help="measure only these (threads x tokens) cells, e.g. 16x1,16x8,1x1 (default: every pair)")
    ap.add_argument("--no-copy", action="store_true", help="skip copy and compute xN at the end")
    ap.add_argument("--no-read", action="store_true",
                    help="skip the read probe (with spinning waiters its team would spin beside the runner's)")
    a = ap.parse_args()
    t0 = time.time()
    print("pool wait:", set_pool_wait(), flush=True)
    from hybrid.bench.cpu_kernels import SHAPES, TOPK, build_store, compute_scaling, copy_gbs, l3_bytes, ours_gbs, read_gbs
    from hybrid.checkpoint.formats import QType

    H, I = SHAPES["qwen3-30b-a3b"]
    n = max(2 * TOPK, int(a.l3x * l3_bytes() // (3 * H * I * 0.5625)) // TOPK * TOPK)
    stores = {"": build_store(H, I, QType.NVFP4, n)}
    if a.nohuge:
        from hybrid.experts import store as st
        real = st.allocate
        st.allocate = lambda nbytes, hugepages="auto": real(nbytes, "off")
        stores["4k:"] = build_store(H, I, QType.NVFP4, n)
        st.allocate = real
    print(f"{n} experts, {stores[''].nbytes / 1e6:.0f} MB, backing {[s.backing for s in stores.values()]}, "
          f"{time.time() - t0:.1f} s", flush=True)
    threads = [int(t) for t in a.threads.split(",")]
    ms = [int(m) for m in a.ms.split(",")]
    cells = None if a.cells is None else {tuple(int(v) for v in c.split("x")) for c in a.cells.split(",")}
    if cells is not None:
        threads = sorted({t for t, _ in cells}, reverse=True)
        ms = sorted({m for _, m in cells})
    vs = [p + v for p in stores for v in a.variants.split(",")]
    store_of = {v: stores["4k:" if v.startswith("4k:") else ""] for v in vs}
    runners = {(v, t): ReadCall(store_of[v], t) if v.endswith("readcall") else
               CpuExpertRunner(store_of[v], threads=t, schedule=v.split(":")[-1], prefetch=prefetch_of(v))
               if "direct:" not in v else Direct(store_of[v], t, v.split(":")[-1], prefetch_of(v))
               for v in vs for t in threads}
    print(f"runners ready {time.time() - t0:.1f} s", flush=True)
    res: dict = {}
    for r in range(a.rounds):
        for t in threads:
            if not a.no_read:
                res.setdefault(("read", t, 0), []).append(read_gbs(stores[""].arena.array, t, a.reps))
            for m in ms:
                if cells is not None and (t, m) not in cells:
                    continue
                for v in (vs if r % 2 == 0 else vs[::-1]):
                    res.setdefault((v, t, m), []).append(ours_gbs(store_of[v], runners[(v, t)], m, a.reps))
        print(f"round {r} done {time.time() - t0:.1f} s", flush=True)
        if time.time() - t0 > a.budget:
            break
    for t in threads if not a.no_copy else []:
        if t > 1:
            print(f"copy {t} threads {copy_gbs(t, 2 * l3_bytes(), a.reps):.2f} GB/s (read + write), "
                  f"compute x{t} {compute_scaling(t, 3):.2f}", flush=True)
    print(f"variant threads M: best median | GB/s per round | ratio to {vs[0]} per round")
    for (v, t, m), x in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        base = res.get((vs[0], t, m))
        rat = "" if base is None else " ".join(f"{x[i] / base[i]:.2f}" for i in range(len(x)))
        print(f"{v} {t} {m}: {max(x):.2f} {statistics.median(x):.2f} | {' '.join(f'{y:.2f}' for y in x)} | {rat}")
    for r in runners.values():
        r.close()
    print(f"total {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
