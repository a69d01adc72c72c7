"""QWeight: one linear layer's weight as stored (packed), with a reference dequantize."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.checkpoint.formats import GROUP, QType, dequant_fp8, dequant_nvfp4


@dataclass
class QWeight:
    """A Linear weight [N, K] in its storage format; never dequantized as a whole model.

    NVFP4: data = packed u8 [N, K/2], scale = e4m3fn [N, K/16], scale_2 = fp32 [] (global)
    FP8:   data = e4m3fn [N, K],      scale = fp32 [] (per tensor), scale_2 = None
    dense: data = f32/f16/bf16 [N, K], scale = scale_2 = None
    """

    qtype: QType
    shape: tuple[int, int]
    data: torch.Tensor
    scale: torch.Tensor | None = None
    scale_2: torch.Tensor | None = None
    name: str = ""

    def __post_init__(self) -> None:
        n, k = self.shape
        where = self.name or "weight"
        if self.qtype is QType.NVFP4:
            _expect(where, "weight", self.data, (n, k // 2), torch.uint8)
            _expect(where, "weight_scale", self.scale, (n, k // GROUP), torch.float8_e4m3fn)
            if k % GROUP:
                raise ValueError(f"{where}: NVFP4 in-features {k} not divisible by {GROUP}")
        elif self.qtype is QType.FP8:
            _expect(where, "weight", self.data, (n, k), torch.float8_e4m3fn)
        elif tuple(self.data.shape) != (n, k):
            raise ValueError(f"{where}: expected shape {(n, k)}, got {tuple(self.data.shape)}")

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes as stored (packed weights + scales)."""
        total = self.data.numel() * self.data.element_size()
        for t in (self.scale, self.scale_2):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Reference dequantize of this one weight -> [N, K] (a transient, for CPU mode/tests)."""
        if self.qtype is QType.NVFP4:
            w = dequant_nvfp4(self.data, self.scale, self.scale_2)
        elif self.qtype is QType.FP8:
            w = dequant_fp8(self.data, self.scale)
        else:
            w = self.data
        return w.to(dtype)

    def to(self, device) -> "QWeight":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QWeight(self.qtype, self.shape, mv(self.data), mv(self.scale), mv(self.scale_2), self.name)


def _expect(where: str, what: str, t: torch.Tensor | None, shape, dtype) -> None:
    if t is None:
        raise ValueError(f"{where}: missing {what}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{where}: {what} expected {dtype} {tuple(shape)}, "
                         f"got {t.dtype} {tuple(t.shape)}")
