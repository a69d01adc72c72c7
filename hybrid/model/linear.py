"""The one linear interface every weight goes through: y = x @ W^T (+ b).

W is a QWeight in its storage format. On CUDA the QPN kernels read it packed
(hybrid.kernels.qpn_linear); elsewhere the reference path dequantizes this one weight
transiently, so no dequantized copy of the model ever exists.
"""
from __future__ import annotations

import torch

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
        else:
            y = x @ self.weight.dequantize(x.dtype).T  # [T, N], transient dequant of this weight
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _cuda(self, x: torch.Tensor) -> torch.Tensor:
        from hybrid.kernels import QPNWeight, qpn_linear

        if self._kernel_weight is None:
            self._kernel_weight = QPNWeight.from_qweight(self.weight, x.device)
        return qpn_linear(x.to(torch.float16), self._kernel_weight).to(x.dtype)
