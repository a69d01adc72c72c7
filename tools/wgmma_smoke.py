"""One small launch of each wgmma kernel family on an sm_90 GPU, synchronized: exits 0 when every
result is right, 1 otherwise (run under `timeout`: a kernel that hangs shows as the timeout).

    PYTHONPATH=. timeout 30 python3 tools/wgmma_smoke.py [--pipes ,_s,_w]
"""
from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    from hybrid.checkpoint.formats import QType
    from hybrid.kernels import QPNWeight, sm90
    from tests.test_qpn_layout import fp8, nvfp4

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pipes", default=",".join(sm90.PIPES))
    args = ap.parse_args(argv)
    ok = True
    for qtype, make in ((QType.NVFP4, nvfp4), (QType.FP8, fp8)):
        qw = make(300, 1024, seed=1)
        w = QPNWeight.from_qweight(qw, "cuda")
        wref = qw.dequantize(torch.float64)
        x = torch.randn(100, 1024).half()
        ref = x.double() @ wref.t()
        for pipe in args.pipes.split(","):
            for tile in sm90.TILES:
                y = torch.full((100, 300), float("nan"), dtype=torch.float16, device="cuda")
                sm90.linear(x.cuda(), w, y, tile=tile, pipe=pipe)
                torch.cuda.synchronize()
                err = ((y.cpu().double() - ref).norm() / ref.norm()).item()
                good = err < 2e-3 and bool(torch.isfinite(y).all())
                ok &= good
                print(f"{qtype.value} {tile[0]}x{tile[1]}{pipe}: err {err:.1e} {'OK' if good else 'WRONG'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
