"""QPN kernels: NVFP4 (QPN2) and FP8 (QPN8) weight-only GEMV/GEMM on tensor cores.

Entry points (shapes: M rows, N out, K in, T tokens, H hidden, I intermediate, S slots,
A routed assignments):

    w = QPNWeight.from_qweight(qw, device)       # prepack once at load; w.nbytes
    y = qpn_linear(x, w)                         # x [M, K] fp16 -> y [M, N] fp16
    slots = QPNExpertSlots(S, H, I, qtype, device); slots.load(s, gate, up, down, stream)
    y = qpn_moe(x, slots, slot_ids, token_idx, route_w)   # [T, H] fp32
    packed = slots.pack_host(gate, up, down); slots.load_packed(s, packed, stream)  # pure copy

On CUDA tensors the kernels in cuda/qpn.cu run; on CPU tensors a torch reference does the same
math (dequantize one weight transiently, multiply in fp32), so CPU mode works everywhere.

How the kernels are built (README text)
---------------------------------------
The kernels are compiled at run time with NVRTC, the CUDA run-time compiler library, loaded
through ctypes, and launched through the driver API (libcuda) on PyTorch's current stream.
Why NVRTC rather than a torch C++/CUDA extension:
  * users need no CUDA toolkit, compiler or matching headers: libnvrtc ships as a pip wheel
    (nvidia-cuda-nvrtc-cu12), and the cu12x PyTorch wheels already depend on it; the kernel
    source includes no header at all;
  * one source serves every GPU: NVRTC builds native code for the card at hand (sm_70 on a
    V100, sm_90 on an H100/H200) and the architecture picks the MMA path at compile time
    (Volta mma.sync.m8n8k4, Turing m16n8k8, Ampere+ m16n8k16);
  * nothing is built at install time, so one wheel works with the cu126 (Volta) and cu128+
    PyTorch builds alike, where an extension would have to match torch's ABI and CUDA version;
  * binaries are cached by source hash, options, NVRTC version and arch under
    ~/.cache/hybrid/qpn ($HYBRID_CACHE_DIR overrides), so the first run pays ~10 s once.
CUDA 13 dropped sm_70: Volta users need NVRTC 12.x (nvidia-cuda-nvrtc-cu12). A CPU-only check
(`hybrid-bench cuda-kernels --compile-only --arch sm_70`) compiles every kernel with NVRTC 12 and
ptxas from the pip wheels and fails on any register spill.
Measured speed and efficiency (H200) with the machine, command and git sha: results/cuda_kernels.md.

The decode step's small ops (RMSNorm + residual, q/k norm + RoPE + KV write + one-token attention,
router GEMV + softmax / top-k) are fused kernels in cuda/fused.cu, built and cached the same way:
hybrid.kernels.fused, built by hybrid.kernels.fused_build (HYBRID_FUSED=0 turns them off in the model).
"""
from hybrid.kernels.qpn import QPNExpertSlots, QPNWeight, qpn_linear, qpn_moe

__all__ = ["QPNWeight", "QPNExpertSlots", "qpn_linear", "qpn_moe"]
