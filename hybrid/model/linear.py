"""The one linear interface every weight goes through: y = x @ W^T (+ b).

W is a QWeight in its storage format. On CUDA the QPN kernels read it packed
(hybrid.kernels.qpn_linear); elsewhere the reference path dequantizes this one weight
transiently, so no dequantized copy of the model ever exists. A dense (BF16/F32) weight used on
CUDA is converted once to the activation dtype (fp16; exact for bf16 values in fp16's range) in
place of the stored one, instead of at every call.
"""
from __future__ import annotations

import torch

from hybrid.checkpoint.formats import DENSE_DTYPES, QType
from hybrid.checkpoint.qweight import QWeight


class Linear:
    """A Linear layer over a stored weight. x: [T, K] -> [T, N]."""

    def __init__(self, weight: QWeight, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self._kernel_weight = None  # prepacked QPN weight when on CUDA

    @property
    def device(self) -> torch.device:
        return self.weight.data.device

    def to(self, device) -> "Linear":
        bias = None if self.bias is None else self.bias.to(device)
        return Linear(self.weight.to(device), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.weight.qtype.is_quantized:
            y = self._cuda(x)
        elif x.is_cuda:
            y = x @ self._dense_as(x.dtype).T                       # [T, N]
        else:
            y = x @ self.weight.dequantize(x.dtype).T  # [T, N], transient dequant of this weight
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _dense_as(self, dtype: torch.dtype) -> torch.Tensor:
        w = self.weight
        if w.data.dtype != dtype and dtype in DENSE_DTYPES:
            self.weight = QWeight(DENSE_DTYPES[dtype], w.shape, w.data.to(dtype), name=w.name)
        return self.weight.data

    def kernel_weight(self, device: torch.device):
        from hybrid.kernels import QPNWeight

        if self._kernel_weight is None:
            self._kernel_weight = QPNWeight.from_qweight(self.weight, device)
        return self._kernel_weight

    def _cuda(self, x: torch.Tensor) -> torch.Tensor:
        from hybrid.kernels import qpn_linear

        return qpn_linear(x.to(torch.float16), self.kernel_weight(x.device)).to(x.dtype)


class FusedLinear:
    """Several quantized linears over one input as one QPN call (CUDA): their prepacked 16-row
    tiles concatenated. Valid when they share qtype, in-features and the global scale, and every
    out-features is a multiple of the 16-row tile. x [T, K] -> [T, sum N]."""

    def __init__(self, parts: list[Linear], device: torch.device):
        from hybrid.kernels import QPNWeight
        from hybrid.kernels import layout

        ws = [p.weight for p in parts]
        qs = [w.to(device) for w in ws]
        if ws[0].qtype is QType.NVFP4:
            packed = [layout.pack_nvfp4(q) for q in qs]
            words, scales = torch.cat([p[0] for p in packed]), torch.cat([p[1] for p in packed])
        else:
            words = torch.cat([layout.pack_fp8(q) for q in qs])
            scales = torch.zeros(16, dtype=torch.uint8, device=device)
        n = sum(w.shape[0] for w in ws)
        self.weight = QPNWeight(ws[0].qtype, (n, ws[0].shape[1]), torch.device(device), words, scales,
                                layout.global_scale(ws[0]), name="+".join(w.name for w in ws))
        biases = [p.bias for p in parts]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.to(device) if b is not None else torch.zeros(w.shape[0], device=device)
             for b, w in zip(biases, ws)])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from hybrid.kernels import qpn_linear

        y = qpn_linear(x.to(torch.float16), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def can_fuse(parts: list[Linear]) -> bool:
    """Quantized weights of one type, same in-features, out-features % 16 == 0, equal global scale."""
    ws = [p.weight for p in parts]
    q0 = ws[0].qtype
    if q0 not in (QType.NVFP4, QType.FP8) or any(w.qtype is not q0 for w in ws):
        return False
    if any(w.shape[1] != ws[0].shape[1] or w.shape[0] % 16 for w in ws):
        return False
    scale = (lambda w: w.scale_2) if q0 is QType.NVFP4 else (lambda w: w.scale)  # noqa: E731
    first = float(scale(ws[0]))
    return all(float(scale(w)) == first for w in ws)


def fused_linear(parts: list[Linear]):
    """One callable x [T, K] -> cat of the parts' outputs [T, sum N]: fused on CUDA when can_fuse,
    else the parts called one by one."""
    dev = parts[0].device
    if dev.type == "cuda" and can_fuse(parts):
        try:
            return FusedLinear(parts, dev)
        except (ValueError, ImportError):           # a shape the kernels cannot take
            pass
    return lambda x: torch.cat([p(x) for p in parts], dim=-1)
