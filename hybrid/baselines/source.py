"""Read a Hugging Face model folder's tensors for GGUF export: dense, NVFP4 (ModelOpt) or FP8 linears.

Export needs only tensor-by-name access (hybrid.checkpoint.files) and the per-linear storage kind.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid.checkpoint.files import SafetensorsFiles
from hybrid.errors import CheckpointError

DENSE, NVFP4, FP8 = "dense", "nvfp4", "fp8"


@dataclass(slots=True)
class Linear:
    """One linear weight as stored. nvfp4: packed u8 [N, K/2], scale e4m3 [N, K/16], scale_2 f32 [].
    fp8: weight e4m3 [N, K], scale_2 = per-tensor f32 scale. dense: weight [N, K] float."""

    kind: str
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    scale_2: float = 1.0

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        if self.kind == DENSE:
            return self.weight.float()
        if self.kind == FP8:
            return self.weight.float() * self.scale_2
        from hybrid.checkpoint.formats import dequant_nvfp4
        return dequant_nvfp4(self.weight, self.scale, torch.tensor(self.scale_2, dtype=torch.float32)).float()


class SourceModel(SafetensorsFiles):
    """config.json plus tensor access over the folder's safetensors files (hybrid.checkpoint.files)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.config = self._read_json("config.json")
        super().__init__(self.folder)

    def _read_json(self, name: str) -> dict:
        path = self.folder / name
        if not path.exists():
            raise CheckpointError(f"{path}: missing")
        return json.loads(path.read_text())

    def linear(self, base: str) -> Linear:
        """The linear `base` (name without .weight) with its storage kind."""
        w = self.tensor(f"{base}.weight")
        if w.dtype == torch.uint8:
            scale = self.tensor(f"{base}.weight_scale")
            s2 = self.tensor(f"{base}.weight_scale_2") if self.has(f"{base}.weight_scale_2") else torch.tensor(1.0)
            if scale.dim() != 2 or scale.shape[1] * 8 != w.shape[1]:
                raise CheckpointError(f"{base}.weight_scale: shape {tuple(scale.shape)} does not fit packed "
                                      f"NVFP4 weight {tuple(w.shape)} (expected [N, K/16])")
            return Linear(NVFP4, w, scale, float(s2.float().reshape(-1)[0]))
        if w.dtype == torch.float8_e4m3fn:
            s = self.tensor(f"{base}.weight_scale").float()
            if s.numel() != 1:
                raise CheckpointError(f"{base}.weight_scale: FP8 export needs a per-tensor scale, got {tuple(s.shape)}")
            return Linear(FP8, w, None, float(s.reshape(-1)[0]))
        if not w.dtype.is_floating_point:
            raise CheckpointError(f"{base}.weight: dtype {w.dtype} is neither float, NVFP4 (uint8) nor FP8")
        return Linear(DENSE, w)
