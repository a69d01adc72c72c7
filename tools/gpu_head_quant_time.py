"""Load-time cost of `--lm-head nvfp4` (results/runtime.md §46): a 30B-A3B-sized BF16 head (151936 x 2048, N(0, 0.02))
quantized from host memory to NVFP4 on GPU 0 by hybrid.model.head.quantize_head, with the least-squared-error block
scales (what --lm-head nvfp4 does) and with amax, alternating; wall time (synchronized) and the relative error of
the first 16384 rows. One JSON line per run on stdout and in $OUT/headtime.jsonl (when $OUT is set).

    PYTHONPATH=. python3 tools/gpu_head_quant_time.py
"""
import json
import os
import time

import torch

from hybrid.checkpoint.formats import QType
from hybrid.checkpoint.qweight import QWeight
from hybrid.model import head

ROWS, COLS, CHECK = 151936, 2048, 16384


def main() -> None:
    data = (torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    w = QWeight(QType.BF16, (ROWS, COLS), data, name="lm_head")
    orig, dev, out = head.quantize_nvfp4, torch.device("cuda", 0), []
    try:
        for scales in ("mse", "amax", "mse", "amax"):
            head.quantize_nvfp4 = lambda x, gs, scales=None, _s=scales: orig(x, gs, scales=_s)  # noqa: E731
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            q = head.quantize_head(w, "nvfp4", device=dev)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            ref = data[:CHECK].to(dev).float()
            sub = QWeight(QType.NVFP4, (CHECK, COLS), q.data[:CHECK], q.scale[:CHECK], q.scale_2, name="x").dequantize()
            rec = {"check": "quantize_head_nvfp4", "scales": scales, "seconds": round(dt, 3),
                   "rel_err_first_16384_rows": round(float((sub - ref).norm() / ref.norm()), 5)}
            print(json.dumps(rec), flush=True)
            out.append(rec)
            del q
    finally:
        head.quantize_nvfp4 = orig
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "headtime.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in out)


if __name__ == "__main__":
    main()
