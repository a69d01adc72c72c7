"""Fit the wgmma GEMM's cost model (hybrid/kernels/sm90.py STEP_US, PERMUTE_US_PER_BYTE) on the rows
of tools/wgmma_bench.py, and show the model against every measured row.

    PYTHONPATH=. python3 tools/wgmma_fit.py BENCH.jsonl [--sms 132]

Step time of a (format, tile, pipe) = median over its forced rows of (measured - launches - pre-pass -
split-K) / (sm90.waves x KS); the pre-pass rate from the rows' permute timings. Prints the fitted values
as Python, then per row: measured, modelled now, modelled with the fit, and the relative errors.
"""
from __future__ import annotations

import argparse
import json
import statistics

from hybrid.kernels import sm90


def eff_waves(plan: dict, sms: int = 132) -> float:
    return sm90.waves(plan["blocks"], sms, sm90.resident(tuple(plan["tile"]), plan["pipe"]))


def fixed_us(rec: dict, plan: dict, permute_rate: float) -> float:
    m, n, k = rec["m"], rec["n"], rec["k"]
    us = 2 * sm90.LAUNCH_US + (m * k + plan["mp"] * plan["kp"]) * 2 * permute_rate
    if plan["splits"] > 1:
        us += sm90.SPLIT_US + plan["splits"] * m * n * 8 * sm90.PART_US_PER_BYTE
    return us


def table(rows: list[dict]) -> None:
    """Markdown: per row cuBLAS FP16, the gemmf / WMMA pick (before), the wgmma pick, the fastest
    wgmma kernel timed, and the ratios."""
    print("| shape | fmt | M | cuBLAS FP16 | before (kernel) | wgmma pick (kernel) | fastest wgmma (kernel) "
          "| pick / cuBLAS | pick / before |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tags = [k[len("wgmma_"):-len("_us")] for k in r if k.startswith("wgmma_") and k.endswith("_us")
                and not k.endswith("_nold_us")]
        if "pick" not in tags:
            continue
        best = min(tags, key=lambda t: r[f"wgmma_{t}_us"])
        pick = r["wgmma_pick_us"]
        print(f"| {r['shape']} | {r['format']} | {r['m']} | {r['cublas_us']:.1f} | {r['default_us']:.1f} "
              f"({r['default_kernel']}) | {pick:.1f} ({r['wgmma_pick_kernel']}) | {r[f'wgmma_{best}_us']:.1f} "
              f"({r[f'wgmma_{best}_kernel']}) | {pick / r['cublas_us']:.2f} | {pick / r['default_us']:.2f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("jsonl")
    ap.add_argument("--table", action="store_true", help="print the markdown table of the rows only")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in open(args.jsonl) if line.strip()]
    if args.table:
        table(rows)
        return 0
    # pre-pass: permute_us of a 256-token tiling = launch + bytes x rate
    rates = [(r["permute_us"] - sm90.LAUNCH_US) / ((r["m"] * r["k"] + -(-r["m"] // 256) * 256 * r["k"]) * 2)
             for r in rows if r.get("permute_us")]
    rate = statistics.median(rates) if rates else sm90.PERMUTE_US_PER_BYTE
    steps: dict[tuple, list[float]] = {}
    for r in rows:
        fmt = 2 if r["format"] == "nvfp4" else 8
        for key, plan in r.items():
            if not key.endswith("_plan") or key.startswith("wgmma_pick") or key.endswith("_nold_plan"):
                continue
            tag = key[len("wgmma_"):-len("_plan")]
            t = r[f"wgmma_{tag}_us"]
            steps.setdefault((fmt, *plan["tile"], plan["pipe"]), []).append(
                (t - fixed_us(r, plan, rate)) / (eff_waves(plan) * plan["ks"]))
    print(f"PERMUTE_US_PER_BYTE = {rate:.3g}")
    fit = {key: statistics.median(v) for key, v in sorted(steps.items())}
    print("STEP_US (fmt, BR, NT, pipe): median [min, max] of", {k: len(v) for k, v in steps.items()})
    for key, v in sorted(steps.items()):
        print(f"  {key}: {fit[key]:.3f}  [{min(v):.3f}, {max(v):.3f}]")
    print("\nrow: measured / modelled now / modelled with the fit (us)")
    worst = []
    for r in rows:
        fmt = 2 if r["format"] == "nvfp4" else 8
        for key, plan in r.items():
            if not key.endswith("_plan") or key.endswith("_nold_plan"):
                continue
            tag = key[len("wgmma_"):-len("_plan")]
            t = r[f"wgmma_{tag}_us"]
            step = fit.get((fmt, *plan["tile"], plan["pipe"]))
            if step is None:
                continue
            mod = fixed_us(r, plan, rate) + eff_waves(plan) * plan["ks"] * step
            worst.append(abs(mod / t - 1))
            print(f"  {r['shape']:14s} {r['format']:5s} M={r['m']:4d} {tag:10s} {t:8.1f} {plan['model_us']:8.1f} "
                  f"{mod:8.1f}  ({mod / t - 1:+.0%})  cuBLAS {r['cublas_us']:.1f} default {r['default_us']:.1f}")
    if worst:
        print(f"fit error: median {statistics.median(worst):.1%}, worst {max(worst):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
