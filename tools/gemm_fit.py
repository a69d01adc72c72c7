"""The sm_80+ prefill picker (hybrid/kernels/qpn.py prefill_plan: gemmf_cost vs gemm_us) against the
rows of a prefill probe (tools/gemm_probe.sh: gemm.jsonl with the default, the WMMA pick [wmma] and
every gemmf tile forced [f<BM>x<BN>], each row's plan label in `kernel`).

    PYTHONPATH=. python3 tools/gemm_fit.py scratch/call3/gemm.jsonl [--sms 132] [--fit]

Prints the modelled-vs-measured error of every forced row (rms and worst of log(model / measured)),
then per (shape, format, M) the picker's plan now, its measured time where that plan was measured,
the best measured plan and the default of the probe's run, and the totals. --fit: first refit the
model's constants (least squares on log(model / measured) over the forced rows, scipy, from the
current values), print them to 3 significant digits for qpn.py, and use them below. CPU only."""
from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

from hybrid.kernels import qpn


def _parse(label: str) -> tuple[str, tuple[int, int], int]:
    """'gemmf_64x256/s4' -> ('gemmf', (64, 256), 4)."""
    name, _, s = label.partition("/s")
    fam, tile = name.split("_")
    bm, bn = (int(v) for v in tile.split("x"))
    return fam, (bm, bn), int(s) if s else 1


def _model(fam: str, fmt: int, m: int, n: int, k: int, tile, splits: int, sms: int) -> float:
    """Modelled us of one plan (gemmf_cost or gemm_us)."""
    nk = -(-k // 64)
    ks = -(-nk // splits)
    cost = qpn.gemmf_cost if fam == "gemmf" else qpn.gemm_us
    return cost(m, n, tile, sms, splits, ks, fmt)


# the model's constants (qpn module globals; dict entries as (name, key, key))
PARAMS = ([("GEMMF_STEP_US", t, f) for t in qpn.GEMMF_TILES for f in (2, 8)]
          + [("GEMMF_PAIR_RATE",), ("GEMMF_BLOCK_US",), ("GEMM_US_PER_BYTE", 2), ("GEMM_US_PER_BYTE", 8),
             ("GEMM_US_PAIR_RATE",), ("GEMM_BLOCK_US",), ("PREFILL_LAUNCH_US",), ("PREFILL_SPLIT_US",),
             ("PREFILL_PART_US",), ("PREFILL_TAIL_US",)])


def _get(p):
    v = getattr(qpn, p[0])
    for key in p[1:]:
        v = v[key]
    return v


def _set(p, value: float) -> None:
    if len(p) == 1:
        setattr(qpn, p[0], value)
        return
    d = getattr(qpn, p[0])
    for key in p[1:-1]:
        d = d[key]
    d[p[-1]] = value


def fit(points, sms: int) -> None:
    """Least squares on log(model / measured) over points [(fam, fmt, m, n, k, tile, splits, us)];
    leaves the fitted constants (3 significant digits) in qpn and prints them."""
    import numpy as np
    from scipy.optimize import least_squares

    meas = np.array([p[-1] for p in points])
    x0 = np.array([_get(p) for p in PARAMS], dtype=float)

    def resid(z):
        for p, v in zip(PARAMS, z * x0):
            _set(p, float(v))
        return np.log(np.array([_model(*p[:-1], sms) for p in points]) / meas)

    r = least_squares(resid, np.ones_like(x0), bounds=(1e-6, np.inf))
    for p, v in zip(PARAMS, r.x * x0):
        _set(p, float(f"{v:.3g}"))
        print(f"{'['.join([p[0]] + [f'{k!r}]' for k in p[1:]])} = {float(f'{v:.3g}')}")
    qpn.prefill_plan.cache_clear()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("jsonl")
    ap.add_argument("--sms", type=int, default=132, help="SMs of the probe's device (H200: 132)")
    ap.add_argument("--fit", action="store_true", help="refit the model's constants first (scipy)")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in open(args.jsonl) if line.strip()]
    points = []
    for r in rows:
        if r.get("kernel", "").startswith(("gemm_", "gemmf_")) and "[" in r["shape"]:
            fam, tile, splits = _parse(r["kernel"])
            points.append((fam, 2 if r["format"] == "nvfp4" else 8, r["m"], r["n"], r["k"], tile, splits, r["t_us"]))
    if args.fit:
        fit(points, args.sms)
    groups: dict = defaultdict(dict)
    errs = []
    for r in rows:
        if not r.get("kernel", "").startswith(("gemm_", "gemmf_")):
            continue
        base, _, tag = r["shape"].partition("[")
        fmt = 2 if r["format"] == "nvfp4" else 8
        fam, tile, splits = _parse(r["kernel"])
        key = (base, r["format"], r["m"])
        g = groups[key]
        g["nk"] = (r["n"], r["k"], fmt)
        if tag:
            g.setdefault("meas", {})[(fam, tile, splits)] = r["t_us"]
            errs.append(math.log(_model(fam, fmt, r["m"], r["n"], r["k"], tile, splits, args.sms) / r["t_us"]))
        else:
            g["default"] = ((fam, tile, splits), r["t_us"])
    print(f"model vs measured, {len(errs)} forced rows: rms {100 * math.sqrt(sum(e * e for e in errs) / len(errs)):.1f}%, "
          f"worst {100 * (math.exp(max(errs, key=abs)) - 1):+.1f}%")

    def lab(p):
        return f"{p[0]}_{p[1][0]}x{p[1][1]}" + (f"/s{p[2]}" if p[2] > 1 else "")

    print(f"| shape | fmt | M | picked now | its us (model) | measured best | us | default then | us | now / best |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    tot = [0.0, 0.0, 0.0]
    for (shape, f, m), g in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        n, k, fmt = g["nk"]
        meas = g.get("meas", {})
        if not meas:
            continue
        plan = qpn.prefill_plan(fmt, m, n, k, args.sms, 90)
        fam, tile, splits = _parse(plan.label)
        now = meas.get((fam, tile, splits))
        model = _model(fam, fmt, m, n, k, tile, splits, args.sms)
        best = min(meas, key=meas.get)
        dflt = g.get("default")
        ratio = f"{now / meas[best]:.3f}" if now else "unmeasured"
        print(f"| {shape} | {f} | {m} | {lab((fam, tile, splits))} | "
              f"{f'{now:.1f}' if now else '-'} ({model:.1f}) | {lab(best)} | {meas[best]:.1f} | "
              f"{lab(dflt[0]) if dflt else '-'} | {f'{dflt[1]:.1f}' if dflt else '-'} | {ratio} |")
        if now and dflt:
            tot[0] += now
            tot[1] += meas[best]
            tot[2] += dflt[1]
    print(f"\nsum over the rows whose pick was measured: picked now {tot[0]:.1f} us, measured best {tot[1]:.1f}, "
          f"default then {tot[2]:.1f} (now / best {tot[0] / max(tot[1], 1e-9):.3f}, "
          f"now / then {tot[0] / max(tot[2], 1e-9):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
