"""Where the router kernel's in-model time goes (results/runtime.md §29.1: fused_add_norm_router_e takes ~12 us per
layer in the decode graph against ~8 us after an o_proj-shaped linear in tools/gpu_fused_kernels_ab.py, cause not
found). The decode of the 30B-A3B-shaped synthetic checkpoint (tools/gpu_miss_graph_ab.py's sessions) with the
router's launch replaced, per session, by a probe copy of the kernel (HYBRID_ROUTER_PROBE, read when a session
captures its graphs):

    off        the kernel as shipped
    nolast     no fence, no counter, no last block: block 0 writes a fixed routing (experts 0..k-1, weights 1/k,
               their slots) and its MoE plan; every block zeroes the MoE output as shipped
    emptylast  fence and counter as shipped; the last block writes that fixed routing (no softmax, no ranks)
    stamps     as shipped, with clock64() read by the last block's thread 0 between its phases (PHASES: the norm
               and logits, the arrival, the zeroing, the routing with the MoE plan), summed with the launch count into
               a module global that the tool reads after each session (a record's "stamps": mean cycles per launch)

nolast and emptylast route every token to experts 0..k-1, so their greedy ids differ from `off`'s and the MoE
kernels read the same few experts; the figures to read are the router's GPU time per step (cuda_calls_per_step.gpu,
the profiler's kernel times) and the GPU time of the other kernels beside it: off - nolast is what the chain after
the logits (fence, counter, the last block) costs inside the model, off - emptylast the last block's softmax, top-k
and lookups. The probe kernels exist only in this process (fused_build.source is wrapped, the launch renamed);
hybrid's kernels are unchanged. results/runtime.md §30-§31 has what it found (§31: the last block's routing was
the gap; the probes `wide`, `twice`, `block`, `pf` used there are in this file's history, commits a415ef2-11338e3;
§32: `acqrel`, the arrival as one acq_rel atomic, shipped in arrive_last, its probe removed).

    HYBRID_CACHE_DIR=.qpncache PYTHONPATH=. python3 tools/gpu_router_probe.py \\
        --order synth_one_gpu_cap16 --modes "off;nolast;emptylast;off;nolast;emptylast" --budget-s 400

Writes $OUT/router_probe.jsonl (gpu_miss_graph_ab.py's records, with this tool's name) and gpu_check.log.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ENV = "HYBRID_ROUTER_PROBE"
KERNEL = "fused_add_norm_router_e"
SUFFIX = {"off": "", "nolast": "_nolast", "emptylast": "_emptylast", "stamps": "_stamps"}
# the stamps probe's phases (SM cycles of the last block's thread 0, summed over launches in probe_stamps)
PHASES = ("body", "arrive", "zero", "routing")

# block 0 (nolast) or the last block (emptylast): the routing of experts 0..k-1 for each token, as topk_warp
# writes it (ids, weights, slots, the host's route row), and the MoE plan from those slots (route_plan_warp), by warp 0
_FIXED = """
  if (threadIdx.x < 32) {
    int s = -1;
    if (threadIdx.x < T * k) {
      const int id = threadIdx.x % k;
      s = slots ? slot_table[id] : -1;
      ids[threadIdx.x] = id;
      weights[threadIdx.x] = 1.f / k;
      if (slots) slots[threadIdx.x] = s;
      if (route_row) {                      // the row the host reads: ids, then weights, per token
        const int t = threadIdx.x / k, r = threadIdx.x % k;
        route_row[(size_t)t * 2 * k + r] = (float)id;
        route_row[(size_t)t * 2 * k + k + r] = 1.f / k;
      }
    }
    if (offsets != nullptr && slots != nullptr && T * k <= 32) route_plan_warp(s, T * k, S, offsets, perm, active);
  }
"""
_ZERO = """  for (int j = 4 * (blockIdx.x * 128 + threadIdx.x); j < nzero; j += 4 * 128 * gridDim.x)   // the MoE output
    *(float4*)(zero + j) = make_float4(0.f, 0.f, 0.f, 0.f);
"""


def probe_source(src: str) -> str:
    """fused.cu with the probe copies of fused_add_norm_router_e appended after it (see module doc)."""
    start = src.index(f'extern "C" __global__ void __launch_bounds__(128)\n    {KERNEL}(')
    end = src.index("\n}\n", start) + 3
    kern = src[start:end]
    body_end = kern.index("  const bool is_last = arrive_last(")
    tail = kern.index("  if (!is_last) return;\n") + len("  if (!is_last) return;\n")
    reset = kern.index("  if (threadIdx.x == 0) *counter = 0;")
    if _ZERO not in kern:
        raise ValueError(f"{KERNEL}: its MoE-output zeroing loop is not where the probe expects it")
    nolast = (kern[:body_end].replace(f"{KERNEL}(", f"{KERNEL}_nolast(") + _ZERO
              + "  if (blockIdx.x != 0) return;\n" + _FIXED + "}\n")
    empty = kern[:tail].replace(f"{KERNEL}(", f"{KERNEL}_emptylast(") + _FIXED + kern[reset:]
    if kern.count("arrive_last(") != 1:
        raise ValueError(f"{KERNEL}: expected one arrive_last call")
    return (src[:end] + "\n" + nolast + "\n" + empty + "\n" + stamps_source(kern)
            + src[end:])


def stamps_source(kern: str) -> str:
    """The stamps probe: the kernel copied with `STAMP(n)` (thread 0 notes clock64() in shared pst[n]) at the
    ends of the phases; the last block's thread 0 adds the differences to probe_stamps."""
    k = kern.replace(f"{KERNEL}(", f"{KERNEL}_stamps(")
    marks = [("  __shared__ int last;\n", "  __shared__ int last;\n  __shared__ long long pst[8];\n  STAMP(0)\n"),
             ("  const bool is_last = arrive_last(", "  STAMP(1)\n  const bool is_last = arrive_last("),
             ("gridDim.x, &last);\n", "gridDim.x, &last);\n  STAMP(2)\n"),
             ("  if (!is_last) return;\n", "  if (!is_last) return;\n  STAMP(3)\n"),
             ("  if (threadIdx.x == 0) *counter = 0;\n", """  __syncthreads();
  if (threadIdx.x == 0) {
    STAMP(4)
    for (int n = 0; n < 4; ++n) atomicAdd(&probe_stamps[n], (unsigned long long)(pst[n + 1] - pst[n]));
    atomicAdd(&probe_stamps[7], 1ull);
    *counter = 0;
  }
""")]
    for old, new in marks:
        if k.count(old) != 1:
            raise ValueError(f"the stamps probe: {old.strip()!r} is not where the probe expects it")
        k = k.replace(old, new)
    head = ("__device__ unsigned long long probe_stamps[8];\n"
            "#define STAMP(n) if (threadIdx.x == 0) pst[n] = clock64();\n")
    return head + k


def stamps_recorder(base):
    """record(rec) passing rec to base, with a stamps session's phases (mean cycles per launch since the last
    read of probe_stamps) added as rec["stamps"]."""
    seen = [0] * 8

    def record(rec: dict) -> None:
        if (rec.get("env") or {}).get(ENV) == "stamps":
            from hybrid.kernels import fused_build

            now = read_stamps(fused_build.module(torch_device()))
            d = [a - b for a, b in zip(now, seen)]
            seen[:] = now
            if d[7]:
                rec = {**rec, "stamps": {"launches": d[7], "cycles": dict(zip(PHASES, (round(x / d[7], 1)
                                                                                      for x in d)))}}
        base(rec)
    return record


def torch_device():
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def read_stamps(module) -> list[int]:
    """probe_stamps of a loaded fused module (driver.Module): 4 phase sums, three zeros, the launch count."""
    import ctypes

    from hybrid.kernels import driver

    dptr, size = ctypes.c_uint64(), ctypes.c_size_t()
    driver.check(driver._cuda().cuModuleGetGlobal_v2(ctypes.byref(dptr), ctypes.byref(size), module._handle,
                                                    b"probe_stamps"), "cuModuleGetGlobal(probe_stamps)")
    out = (ctypes.c_uint64 * 8)()
    driver.check(driver._cuda().cuMemcpyDtoH_v2(out, dptr, ctypes.c_size_t(64)), "cuMemcpyDtoH(probe_stamps)")
    return list(out)


def probe_name(name: str, mode: str | None = None) -> str:
    """The kernel a launch of `name` runs under HYBRID_ROUTER_PROBE (mode; default: the environment's)."""
    mode = (os.environ.get(ENV, "off") if mode is None else mode).strip() or "off"
    if mode not in SUFFIX:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(SUFFIX)}")
    return name + SUFFIX[mode] if name == KERNEL else name


def install() -> None:
    """Wrap fused_build.source (the probes compiled into the fused module, under another cache key) and
    driver.Module.launch (the router's launch renamed per probe_name), before any fused module is built."""
    from hybrid.kernels import driver, fused_build

    if getattr(fused_build.source, "probe", False):
        return
    shipped = fused_build.source

    def source() -> str:
        return probe_source(shipped())

    source.probe = True
    fused_build.source = source
    launch = driver.Module.launch

    def probe_launch(self, name, grid, block, args, *rest, **kw):
        return launch(self, probe_name(name), grid, block, args, *rest, **kw)

    driver.Module.launch = probe_launch


def main() -> int:
    import gpu_miss_graph_ab as ab
    import gpu_runtime_check as rc
    import gpu_two_cards as tc

    p = argparse.ArgumentParser(description="decode sessions with the router kernel swapped for a probe copy "
                                            "(off, nolast, emptylast, stamps; see the module docstring)")
    p.add_argument("--synth", type=Path, default=Path("/tmp/synth30"))
    p.add_argument("--skew", type=float, default=0.25)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--budget-s", type=float, default=400, help="stop starting new sessions after this")
    p.add_argument("--profile", default="h200")
    p.add_argument("--order", default="synth_one_gpu_cap16", help="configuration labels (gpu_two_cards.configs)")
    p.add_argument("--modes", default="off;nolast;emptylast;off;nolast;emptylast")
    a = p.parse_args()
    modes = [m.strip() for m in a.modes.split(";") if m.strip()]
    bad = [m for m in modes if m not in SUFFIX]
    if not modes or bad:
        print(f"--modes {a.modes}: expected ';'-separated values of {', '.join(SUFFIX)}", file=sys.stderr)
        return 2
    install()
    ab.OUT.mkdir(parents=True, exist_ok=True)
    base = rc.recorder("tools/gpu_router_probe.py", "router_probe.jsonl",
                       ("env", "decode_tok_s", "cuda_calls_per_step", "ids_equal_first", "stamps", "skipped",
                        "error"))
    record = stamps_recorder(base)
    ab.record = rc.record = tc.record = record
    deadline = rc.T0 + a.budget_s
    parts = [("synth_write", lambda: rc.make_synth(a.synth, a.skew, False)),
             ("probe_runs", lambda: ab.runs(a.synth, deadline, a.tokens, a.profile, 1024, a.order, modes,
                                            False, ENV))]
    rc.run_parts(parts, deadline, ab.record, rc.log)
    rc.log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
