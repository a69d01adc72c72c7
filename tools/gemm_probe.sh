#!/usr/bin/env bash
# The sm_80+ prefill GEMM (qpn{2,8}_gemmf_*, issue 5) on a GPU: correctness first, then old vs new.
# From the repo root on the device (~3-4 min; everything under $OUT):
#   OUT=/some/dir bash tools/gemm_probe.sh GIT_SHA
# 1. tests/test_qpn_cuda.py -k prefill: every prefill path (gemmf tiles forced and picked, the WMMA
#    GEMM, the 8-row-tile kernels; native build and compute_70 PTX), split-K, tile edges;
# 2. hybrid-bench cuda-kernels at M = 64, 128, 512 on six shapes: the default (prefill_plan: gemmf
#    or the WMMA GEMM by the H200 cost model), the WMMA GEMM's pick ([wmma]) and each gemmf tile
#    forced, beside cuBLAS FP16;
# 3. a summary table (us; x = cuBLAS time / ours) from the benchmark's JSONL;
# 4. $OUT/fit.md: tools/gemm_fit.py on the rows (the cost model's error, the picks against the
#    measured best); refit on the dev VM with `tools/gemm_fit.py $OUT/gemm.jsonl --fit` (scipy).
set -u
: "${OUT:?set OUT}"
export PYTHONPATH=. HYBRID_CACHE_DIR="${HYBRID_CACHE_DIR:-.qpncache}"
SHA="${1:-unknown}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
echo "== tests"
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_qpn_cuda.py -k prefill \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -n 25 "$OUT/tests.log"
echo "== bench"
timeout 240 python3 -m hybrid.cli.bench cuda-kernels \
  --shapes lm_head,dense_up,dense_down,q_proj,o_proj,expert_gate_up --m 64,128,512 --reps 20 \
  --prefill-variants wmma,f128x128,f64x256,f64x128 --git-sha "$SHA" \
  --command "OUT=... bash tools/gemm_probe.sh $SHA" --out "$OUT/gemm" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -v "^\[\|^$" "$OUT/bench.log" | head -n 3
python3 - "$OUT/gemm.jsonl" <<'PY'
import json, sys
from collections import defaultdict
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
cols = ["", "wmma", "f128x128", "f64x256", "f64x128"]
tab = defaultdict(dict)
for r in rows:
    base, _, tag = r["shape"].partition("[")
    key = (base, r["format"], r["m"])
    tab[key][tag.rstrip("]")] = r
    tab[key].setdefault("cublas", []).append(r["cublas_t_us"])
print(f"{'shape':15s} {'fmt':5s} {'M':>4s} {'cuBLAS':>8s} | default (kernel)            | "
      + " | ".join(f"{c:>14s}" for c in cols[1:]))
for (s, f, m), d in sorted(tab.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
    cb = sorted(d["cublas"])[len(d["cublas"]) // 2]
    def cell(c):
        r = d.get(c)
        return f"{r['t_us']:7.1f} x{cb / r['t_us']:4.2f}" if r else " " * 13
    dk = d.get("", {}).get("kernel", "")
    print(f"{s:15s} {f:5s} {m:4d} {cb:8.1f} | {cell('')} {dk:13s} | "
          + " | ".join(f"{cell(c):>14s}" for c in cols[1:]))
PY
python3 tools/gemm_fit.py "$OUT/gemm.jsonl" > "$OUT/fit.md" 2>&1
echo "fit rc=$?"; head -n 1 "$OUT/fit.md"; tail -n 1 "$OUT/fit.md"
