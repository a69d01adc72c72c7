"""A few eager launches of the one-token rope + attention (hybrid.kernels.fused.rope_attn) at one position, for a
profiler to pick one (32 query / 4 KV heads of 128, 8192 KV rows, keys = the graph bucket of position + 1):

    ncu --kernel-name fused_rope_attn_w --launch-skip 3 --launch-count 1 --section WarpStateStats \\
        python3 tools/gpu_attn_one.py 2000
"""
import sys

import torch

from hybrid.kernels import fused
from hybrid.model.layers import Rotary


def main(p: int) -> None:
    hq, hkv, d, cap, dev = 32, 4, 128, 8192, "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    qkv = torch.randn(1, (hq + 2 * hkv) * d, device=dev, generator=g).half()
    qn, kn = torch.ones(d, device=dev), torch.ones(d, device=dev)
    table = Rotary(d, 1e6).table(torch.device(dev), cap)
    ks = torch.randn(cap, hkv, d, device=dev, generator=g).half()
    vs = torch.randn(cap, hkv, d, device=dev, generator=g).half()
    keys = -(-(p + 1) // 256) * 256
    for _ in range(4):
        fused.rope_attn(qkv, qn, kn, table, ks, vs, hq, hkv, d, 1e-6, keys, pos=torch.tensor([p], device=dev))
    torch.cuda.synchronize()
    name, per_sm = fused.rope_attn_kernel(hq, hkv, d)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("plan", fused.attn_plan(keys, hkv, hq // hkv, d, sms, per_sm), name)


if __name__ == "__main__":
    main(int(sys.argv[1]))
