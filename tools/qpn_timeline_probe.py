"""Probe (issue 5): where, inside one launch, the NVFP4 M = 1 kernel loses time against a plain read of the
same bytes -- per block %globaltimer marks (qpn.cu built with QPN_TIMELINE: entry, first weights landed,
stream done, exit, SM id), read back after every launch.

    PYTHONPATH=. HYBRID_CACHE_DIR=.qpncache python3 tools/qpn_timeline_probe.py --out $OUT/timeline.jsonl

Per series (qpn_linear at M = 1, or --m rows, on an NVFP4 weight of N = lm_head's rows x each of --scales,
K = 2048, and qpn_read over as many bytes), --reps launches queued behind a GPU sleep with copies rotated past the L2 as
hybrid-bench cuda-kernels times them; after each launch (outside its events) the marks are copied aside and
cleared. Per launch: the event time; the span from the first block's entry to the last block's exit; the first
weights' latency (first block's entry to the first landed weights, and the median over blocks of the first wave);
the blocks' durations and exit cost (stream done to exit); and a rate profile, each block's bytes spread evenly
over [first landed, stream done] in 0.25 us bins: the ramp (the span's start to the first bin at 90% of the
median bin's rate), the tail (the last such bin to the span's end), and the time each part costs over reading its
bytes at the run's read bandwidth. Rows: one per series (medians over launches), with the profile of the median
launch.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys

import numpy as np
import torch

from hybrid.bench.cuda_kernels import _clone_weight, copies_for, open_probe, random_qweight, time_ms
from hybrid.checkpoint.formats import QType
from hybrid.kernels import QPNWeight, build, qpn, qpn_linear
from hybrid.kernels.driver import _cuda, check

LM_N, K = 151936, 2048
TL_BLOCKS = 65536
BIN_NS = 250
DEFAULT_SOURCE = build.source


def timeline_source() -> str:
    return "#define QPN_TIMELINE 1\n" + DEFAULT_SOURCE()


def tl_global(mod) -> tuple[int, int]:
    ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
    check(_cuda().cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), mod._handle, b"qpn_tl"),
          "cuModuleGetGlobal(qpn_tl)")
    return ptr.value, size.value


def profile(marks: np.ndarray, nbytes: int, read_bw: float) -> dict:
    """marks [blocks, 5] (ns; rows with a zero entry mark dropped) -> the launch's figures."""
    m = marks[marks[:, 0] > 0].astype(np.int64)
    t0 = int(m[:, 0].min())
    m[:, :4] -= t0
    nb = len(m)
    span = int(m[:, 3].max())
    landed = m[:, 1] > 0
    first_wave = m[:, 0] <= 1000                       # blocks that entered within 1 us of the first
    per_block = nbytes / nb
    bins = np.zeros(span // BIN_NS + 1)
    for a, b in zip(np.where(landed, m[:, 1], m[:, 0]), np.maximum(m[:, 2], m[:, 0] + 1)):
        # spread this block's bytes evenly over [a, b)
        lo, hi = a / BIN_NS, b / BIN_NS
        i0, i1 = int(lo), int(hi)
        if i0 == i1:
            bins[i0] += per_block
            continue
        rate = per_block / (hi - lo)
        bins[i0] += rate * (i0 + 1 - lo)
        bins[i0 + 1:i1] += rate
        bins[i1] += rate * (hi - i1)
    rate_gbs = bins / BIN_NS                            # bytes per ns = GB/s
    steady = float(np.median(rate_gbs[rate_gbs > 0]))
    hot = np.nonzero(rate_gbs >= 0.9 * steady)[0]
    up, down = int(hot[0]) * BIN_NS, (int(hot[-1]) + 1) * BIN_NS
    ideal = lambda b: b / read_bw                       # ns at the run's read bandwidth (GB/s = bytes/ns)
    head_b, tail_b = bins[:hot[0]].sum(), bins[hot[-1] + 1:].sum()
    stamps = np.unique(m[:, :4][m[:, :4] > 0])
    return {
        "blocks": nb, "span_us": span / 1e3, "first_wave_blocks": int(first_wave.sum()),
        "last_entry_us": int(m[:, 0].max()) / 1e3,
        "first_landed_us": int(m[landed, 1].min()) / 1e3 if landed.any() else None,
        "first_wave_landed_us": float(np.median(m[first_wave & landed, 1] - m[first_wave & landed, 0])) / 1e3
        if (first_wave & landed).any() else None,
        "block_us_p10_50_90": [float(np.percentile(m[:, 3] - m[:, 0], q)) / 1e3 for q in (10, 50, 90)],
        "exit_us": float(np.median(m[:, 3] - m[:, 2])) / 1e3,
        "steady_gbs": steady, "steady_of_read": steady / read_bw,
        "ramp_us": up / 1e3, "ramp_loss_us": (up - ideal(head_b)) / 1e3,
        "tail_us": (span - down) / 1e3, "tail_loss_us": (span - down - ideal(tail_b)) / 1e3,
        "body_loss_us": ((down - up) - ideal(bins[hot[0]:hot[-1] + 1].sum())) / 1e3,
        "timer_step_ns": int(np.diff(stamps).min()) if len(stamps) > 1 else None,
        "rate_of_read_by_us": [round(float(rate_gbs[i:i + 4].mean()) / read_bw, 3)
                               for i in range(0, len(rate_gbs), 4)],
    }


def run_series(name, launch_fns, nbytes, mod, reps, read_bw, emit) -> None:
    """launch_fns: the rotated launches (one copy each). reps launches queued behind a sleep, each between its
    events, then its marks copied aside and cleared."""
    dev = torch.device("cuda", torch.cuda.current_device())
    tl_ptr, tl_size = tl_global(mod)
    save = torch.empty(reps, tl_size // 8, dtype=torch.int64, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    for f in launch_fns[:3]:
        f()
    check(_cuda().cuMemsetD8Async(ctypes.c_uint64(tl_ptr), 0, ctypes.c_size_t(tl_size), ctypes.c_void_p(stream)),
          "cuMemsetD8Async")
    torch.cuda.synchronize()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda._sleep(int(4e7))
    for r, (a, b) in enumerate(evs):
        a.record()
        launch_fns[r % len(launch_fns)]()
        b.record()
        check(_cuda().cuMemcpyDtoDAsync_v2(ctypes.c_uint64(save[r].data_ptr()), ctypes.c_uint64(tl_ptr),
                                           ctypes.c_size_t(tl_size), ctypes.c_void_p(stream)), "cuMemcpyDtoDAsync")
        check(_cuda().cuMemsetD8Async(ctypes.c_uint64(tl_ptr), 0, ctypes.c_size_t(tl_size),
                                      ctypes.c_void_p(stream)), "cuMemsetD8Async")
    torch.cuda.synchronize()
    marks = save.view(reps, -1, 5).cpu().numpy()
    ev_us = [a.elapsed_time(b) * 1e3 for a, b in evs]
    if not all((marks[r][:, 0] > 0).any() for r in range(reps)):   # a kernel without QPN_MARK: event times only
        emit({"series": name, "bytes": nbytes, "event_us": round(statistics.median(ev_us), 2), "marks": False})
        return
    profs = [profile(marks[r], nbytes, read_bw) for r in range(reps)]
    med = sorted(range(reps), key=lambda r: ev_us[r])[reps // 2]
    row = {"series": name, "bytes": nbytes, "event_us": round(statistics.median(ev_us), 2),
           "event_of_read": round(nbytes / (statistics.median(ev_us) * 1e3) / read_bw, 4)}
    for k, v in profs[0].items():
        if isinstance(v, (int, float)) and v is not None and k != "timer_step_ns":
            row[k] = round(statistics.median(p[k] for p in profs), 3)
    row["timer_step_ns"] = min(p["timer_step_ns"] or 1 << 40 for p in profs)
    row["block_us_p10_50_90"] = [round(statistics.median(p["block_us_p10_50_90"][i] for p in profs), 2)
                                 for i in range(3)]
    row["median_launch"] = {"event_us": round(ev_us[med], 2), **{k: profs[med][k] for k in
                            ("span_us", "ramp_us", "tail_us", "rate_of_read_by_us")}}
    emit(row)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="timeline.jsonl")
    ap.add_argument("--scales", default="1")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sha", default="unknown")
    ap.add_argument("--m", type=int, default=1, choices=range(1, 9), metavar="1..8",
                    help="rows of x (series named nvfp4_m<M>)")
    ap.add_argument("--variants", default="",
                    help="comma list of LINEAR_VARIANT choices also timed and marked at --m (e.g. _m1seq)")
    a = ap.parse_args()
    variants = [None] + [v for v in a.variants.split(",") if v]
    dev = torch.device("cuda", 0)
    emit, read_bw = open_probe("qpn_timeline_probe", a.sha, a.out)
    default_source = DEFAULT_SOURCE
    for sc in (float(s) for s in a.scales.split(",")):
        n = max(16, round(LM_N * sc / 16) * 16)
        base = QPNWeight.from_qweight(random_qweight(QType.NVFP4, n, K, dev), dev)
        ws = [base] + [_clone_weight(base) for _ in range(copies_for(base.nbytes) - 1)]
        bufs = [torch.empty(base.nbytes // 16 * 16, dtype=torch.uint8, device=dev) for _ in ws]
        x = torch.randn(a.m, K, device=dev, dtype=torch.float16)
        lin = [lambda w=w: qpn_linear(x, w) for w in ws]
        rd = [lambda b=b: qpn.read_bytes(b) for b in bufs]
        for tag, src in (("", default_source), ("@tl", timeline_source)):   # the marks' own cost: default build too
            build.source = src
            build.forget_modules()
            for v in variants:
                qpn.LINEAR_VARIANT[0] = v
                emit({"series": f"nvfp4_m{a.m}{v or ''}{tag}", "n": n,
                      "event_us": round(time_ms(lin, a.reps) * 1e3, 2)})
            qpn.LINEAR_VARIANT[0] = None
            emit({"series": f"read{tag}", "n": n, "event_us": round(time_ms(rd, a.reps) * 1e3, 2)})
        mod = qpn._module(dev)
        for v in variants:
            qpn.LINEAR_VARIANT[0] = v
            run_series(f"nvfp4_m{a.m}{v or ''} n={n}", lin, base.nbytes, mod, a.reps, read_bw, emit)
        qpn.LINEAR_VARIANT[0] = None
        run_series(f"read n={n}", rd, base.nbytes // 16 * 16, mod, a.reps, read_bw, emit)
        build.source = default_source
        build.forget_modules()
        del ws, bufs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
