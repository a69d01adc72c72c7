"""Diagnose the sm_90a wgmma GEMM's operand layouts on an sm_90 GPU with one-hot activations.

    PYTHONPATH=. python3 tools/wgmma_diag.py [--format nvfp4|fp8] [--tile 128x64]

x = the first 64 rows of the identity (x[m, k] = 1 if k == m), K = 64 (one 64-k step): y[m, n] must be
W[n, m]. For every token m the column k of W whose values y[m, :] holds, and for every out feature n
the row of W that y[:, n] holds, are printed where they differ from m and n (a wrong k-slot
permutation, B descriptor or accumulator mapping shows as a pattern), with the relative error.
"""
from __future__ import annotations

import argparse

import torch


def diag(fmt: str, tile: tuple[int, int], pipe: str) -> bool:
    from hybrid.checkpoint.formats import QType
    from hybrid.kernels import QPNWeight, sm90
    from tests.test_qpn_layout import fp8, nvfp4

    br, nt = tile
    n, k, m = br, 64, 64
    qw = (nvfp4 if fmt == "nvfp4" else fp8)(n, k, seed=3)
    w = QPNWeight.from_qweight(qw, "cuda")
    wd = qw.dequantize(torch.float32)                         # [N, K]
    x = torch.eye(m, k, dtype=torch.float16)
    y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    sm90.linear(x.cuda(), w, y, tile=tile, pipe=pipe)
    torch.cuda.synchronize()
    y = y.float().cpu()
    ref = wd.t()[:m]                                          # y[m, n] = W[n, m]
    err = ((y - ref).norm() / ref.norm()).item()
    ok = err < 2e-3 and torch.isfinite(y).all().item()
    print(f"{fmt} tile {br}x{nt}{pipe}: relative error {err:.2e}, NaN {int(torch.isnan(y).sum())} of {y.numel()}"
          f" -> {'OK' if ok else 'WRONG'}")
    if ok:
        return True
    yf = torch.nan_to_num(y, nan=1e9)
    kmap = [int(((wd.t() - yf[i][None, :]).abs().sum(1)).argmin()) for i in range(m)]   # token i holds W[:, kmap]
    nmap = [int(((wd[:, :m] - yf[:, j][None, :]).abs().sum(1)).argmin()) for j in range(n)]  # feature j holds W[nmap]
    print("  token -> W column (where != token):", [(i, c) for i, c in enumerate(kmap) if c != i][:40])
    print("  feature -> W row (where != feature):", [(j, r) for j, r in enumerate(nmap) if r != j][:40])
    print("  y[0:4, 0:8]  :", [[round(v, 3) for v in row] for row in y[:4, :8].tolist()])
    print("  ref[0:4, 0:8]:", [[round(v, 3) for v in row] for row in ref[:4, :8].tolist()])
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--format", default="nvfp4,fp8")
    ap.add_argument("--tile", default="all", help="<BR>x<NT> or all")
    args = ap.parse_args(argv)
    from hybrid.kernels import sm90

    tiles = sm90.TILES if args.tile == "all" else [tuple(int(v) for v in args.tile.split("x"))]
    ok = True
    for fmt in args.format.split(","):
        for tile in tiles:
            for pipe in sm90.PIPES:
                ok &= diag(fmt, tile, pipe)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
