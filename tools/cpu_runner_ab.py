"""A/B of CpuExpertRunner variants (issue 4) in one process, on one Qwen3-30B-A3B NVFP4 expert set.

    python tools/cpu_runner_ab.py --threads 1,16 --ms 1,8 --variants phases,dataflow [--nohuge]

Variants are runner schedules (hybrid/experts/cpu_runner.py SCHEDULES) with optional prefixes:
'direct:' (the same kernel called from this thread without the runner: no submit/queue/sync
hand-off), 'join:' (the runner's sync() joins the call as one more part: join=True), 'pf<N><o|s|n>:' (dataflow's prefetch distance N bytes; near a unit's end on into the
bytes that follow / stop / into the part's next unit, claimed ahead: cpu/dataflow.py PF_*;
a suffix t1 / t2 / nta picks that prefetch instruction instead of prefetcht0),
and with --nohuge each again on a second store in 4 KiB pages ('4k:...').  'readcall' is no kernel:
each call's experts' bytes (contiguous) summed by the read probe on the pool, one parallel region
per call, from this thread: the stream with the per-call region start and end, without compute.  Every round measures the read-only stream
(cpu/stream.py) and each variant (order flipped every other round) the way hybrid-bench
cpu-kernels does (a sweep over all experts, top-8 per call, best of --reps sweeps); the table has
best and median GB/s over rounds and each round's ratio to the first variant.

The pool's wait policy (HYBRID_CPU_WAIT) is fixed per process, so `--waits passive,spin:100`
runs each round once per wait policy in a child process of its own (order flipped every other
round), with the given variants, and reports each wait's ratio to the first per round.  Each
runner thread, and this thread when a variant computes here ('direct:', 'readcall', the read
probe), leads its own OpenMP team of `threads` - 1 workers; with more libgomp threads than CPUs
libgomp spins only 100 pauses, so give a child one team: runner variants with --no-read, or
only 'direct:' / 'readcall' variants (--no-read too if they run fewer threads than the probe).
--record FILE appends one JSON row per (wait, variant, threads, M) with machine, command, git sha.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

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
    ap.add_argument("--waits", default=None, help="comma list of HYBRID_CPU_WAIT values, each in its own child "
                                                  "process per round (see the module doc)")
    ap.add_argument("--envs", default=None, metavar="'K=V K=V;K=V'",
                    help="like --waits, with each child's environment given as ';'-separated sets of K=V "
                         "(e.g. 'NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=;' for the haswell build vs the host's)")
    ap.add_argument("--record", default=None, metavar="FILE", help="append the table's rows to this JSONL file")
    ap.add_argument("--child-rounds", type=int, default=1, help="--waits/--envs: rounds inside each child")
    ap.add_argument("--result-line", action="store_true", help=argparse.SUPPRESS)   # child: print RESULT json
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--ms", default="1,8", help="comma list of tokens per expert")
    ap.add_argument("--variants", default="phases,dataflow", help="comma list of runner schedules")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="sweeps per measurement (best kept)")
    ap.add_argument("--nohuge", action="store_true", help="also every variant on a 4 KiB-page store")
    ap.add_argument("--l3x", type=float, default=2.0, help="expert set size in last-level caches")
    ap.add_argument("--budget", type=float, default=1e9,
                    help="stop after the round that passes this many s (--waits: before a round that would)")
    ap.add_argument("--cells", default=None, metavar="TxM,...",
                    help="measure only these (threads x tokens) cells, e.g. 16x1,16x8,1x1 (default: every pair)")
    ap.add_argument("--no-copy", action="store_true", help="skip copy and compute xN at the end")
    ap.add_argument("--check", action="store_true",
                    help="first: the int16 kernel (this build) against float64 at M = 1..8; stop if any error > 1e-3")
    ap.add_argument("--no-read", action="store_true",
                    help="skip the read probe (with spinning waiters its team would spin beside the runner's)")
    a = ap.parse_args()
    if a.waits or a.envs:
        return by_wait(a)
    t0 = time.time()
    wait = set_pool_wait()
    print("pool wait:", wait, flush=True)
    if a.check:
        import llvmlite.binding as ll

        from cpu.isa import HAS_VNNI, VNNI_TUNED
        from hybrid.bench.cpu_kernels import int16_kernel_errors

        errs = int16_kernel_errors()
        print(f"check (vnni {HAS_VNNI}, fast-dpwssd {VNNI_TUNED}, LLVM {'.'.join(map(str, ll.llvm_version_info))}): "
              "int16 kernel rel. error vs float64, M = 1..8: "
              + " ".join(f"{e:.2e}" for e in errs.values()), flush=True)
        if max(errs.values()) > 1e-3:
            raise SystemExit("check failed: error above 1e-3")
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
               CpuExpertRunner(store_of[v], threads=t, schedule=v.split(":")[-1], prefetch=prefetch_of(v),
                               join="join:" in v, inline_bytes=0)     # calls here are 8 experts: never inline
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
    report(res, vs[0], a, {"": wait})
    if a.result_line:
        print("RESULT " + json.dumps([[list(k), x] for k, x in res.items()]), flush=True)
    for r in runners.values():
        r.close()
    print(f"total {time.time() - t0:.1f} s")


def report(res: dict, first: str, a, waits: dict, **extra) -> None:
    """Print best / median / per round / ratio to `first` per round; --record appends JSON rows."""
    print(f"variant threads M: best median | GB/s per round | ratio to {first} per round")
    rows = []
    for (v, t, m), x in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        base = res.get((first, t, m))
        n = min(len(x), len(base or []))
        rat = [] if base is None else [x[i] / base[i] for i in range(n)]
        print(f"{v} {t} {m}: {max(x):.2f} {statistics.median(x):.2f} | {' '.join(f'{y:.2f}' for y in x)} | "
              f"{' '.join(f'{r:.2f}' for r in rat)}")
        rows.append(dict(extra, variant=v, threads=t, M=m, best_gbs=max(x), median_gbs=statistics.median(x), gbs=x,
                         ratio_to=first, ratios=rat, ratio_median=statistics.median(rat) if rat else None))
    for (v, t, m), x in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        one = res.get((v, t, 1))
        if m > 1 and one:                        # cost of one call at M over one at M = 1, per round
            c = [one[i] / x[i] for i in range(min(len(x), len(one)))]
            print(f"cost M={m} / M=1, {v} {t} threads: median {statistics.median(c):.2f} | "
                  f"{' '.join(f'{y:.2f}' for y in c)}")
            rows.append(dict(extra, variant=v, threads=t, M=m, cost_vs_m1=c, cost_vs_m1_median=statistics.median(c)))
    if a.record:
        from hybrid.baselines.report import append_jsonl, git_sha
        from hybrid.bench.cpu_kernels import machine

        info = dict(tool="tools/cpu_runner_ab.py", command="python " + " ".join(sys.argv), git=git_sha(dirty=False),
                    time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), machine=machine(), pool_wait=waits)
        append_jsonl(Path(a.record), [dict(info, **r) for r in rows])


def by_wait(a) -> None:
    """--waits: each round runs one child per wait policy (order flipped every other round)."""
    t0 = time.time()
    if a.envs is not None:                       # name -> extra environment of the child
        sets = {e.strip() or "(none)": dict(kv.split("=", 1) for kv in e.split()) for e in a.envs.split(";")}
    else:
        sets = {w.strip(): {"HYBRID_CPU_WAIT": w.strip()} for w in a.waits.split(",") if w.strip()}
    waits = list(sets)
    own = ("--waits", "--envs", "--rounds", "--record", "--budget", "--child-rounds")
    argv, skip = [], False
    for x in sys.argv[1:]:                       # the child's arguments: ours minus --waits/--envs/--rounds/...
        if skip:
            skip = False
        elif x in own:
            skip = True
        elif not x.startswith(tuple(o + "=" for o in own)):
            argv.append(x)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if a.envs is not None:                       # children keep this process's wait policy unless given
        env = dict(os.environ)
    res: dict = {}
    shown = {}
    longest = 0.0

    def stop(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)          # `timeout`: report what was measured
    try:
        for r in range(a.rounds):
            for w in (waits if r % 2 == 0 else waits[::-1]):
                if r and time.time() - t0 + longest > a.budget:     # this child would pass the budget
                    raise KeyboardInterrupt
                tc = time.time()
                out = subprocess.run([sys.executable, __file__, *argv, "--rounds", str(a.child_rounds), "--result-line"],
                                     env=dict(env, **sets[w]), capture_output=True, text=True)
                line = [x for x in out.stdout.splitlines() if x.startswith(("RESULT ", "pool wait:"))]
                if out.returncode != 0 or not line or not line[-1].startswith("RESULT "):
                    print(out.stdout[-2000:], out.stderr[-2000:], file=sys.stderr)
                    raise SystemExit(f"child with {w} failed (rc {out.returncode})")
                shown[w] = line[0][len("pool wait: "):] if line[0].startswith("pool wait:") else "?"
                for x in out.stdout.splitlines():
                    if x.startswith("check") and r == 0:
                        print(f"child {w}: {x}", flush=True)
                for k, x in json.loads(line[-1][len("RESULT "):]):
                    res.setdefault((f"{w}|{k[0]}", k[1], k[2]), []).extend(x)
                if r:                                 # round 0 may hold the cold compile
                    longest = max(longest, time.time() - tc)
            print(f"round {r} done {time.time() - t0:.1f} s", flush=True)
            if r == 0:
                longest = (time.time() - t0) / len(waits) / 2
    except KeyboardInterrupt:
        print(f"stopped at {time.time() - t0:.1f} s", flush=True)
    for w, s in shown.items():
        print(f"child {w}: pool wait {s}")
    first = waits[0]
    for v in sorted({k[0].split("|", 1)[1] for k in res}):
        print(f"--- {v}: ratio to {first}")   # rows here: variant = the wait policy
        report({(f"{k[0].split('|', 1)[0]}", k[1], k[2]): x for k, x in res.items() if k[0].split("|", 1)[1] == v},
               first, a, shown, kernel_variant=v)
    print(f"total {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
