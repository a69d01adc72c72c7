"""Lazy, memory-mapped reader of Hugging Face model folders (single-file or sharded safetensors).

Nothing is dequantized here: `linear(name)` returns the stored tensors as a QWeight.
"""
from __future__ import annotations

import math

from pathlib import Path

import torch

from hybrid.checkpoint.files import SafetensorsFiles
from hybrid.checkpoint.formats import DENSE_DTYPES, QType
from hybrid.checkpoint.quant_config import QuantConfig
from hybrid.checkpoint.qweight import QWeight
from hybrid.errors import CheckpointError
from hybrid.model.config import ModelConfig


class Checkpoint(SafetensorsFiles):
    """A model folder: config, quantization config, and tensors by name (mmap, lazy; the file
    layer is hybrid.checkpoint.files)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: model folder not found")
        self.config = ModelConfig.from_folder(self.folder)
        self.quant = QuantConfig.load(self.folder, self.config.raw)
        super().__init__(self.folder)

    def dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A float tensor (norm, embedding, router) with its expected shape checked."""
        t = self.tensor(name)
        if t.dtype not in DENSE_DTYPES:
            raise CheckpointError(f"{self.path(name)}: tensor {name!r} has dtype {t.dtype}, "
                                  "expected bf16/fp16/fp32")
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.path(name)}: tensor {name!r} has shape {tuple(t.shape)}, "
                                  f"expected {tuple(shape)}")
        return t

    # ----- linears -------------------------------------------------------------------------
    def linear(self, module: str, shape: tuple[int, int]) -> QWeight:
        """The weight of Linear `module` ([N, K] = shape) as stored: NVFP4, FP8 or dense."""
        expected = self.quant.expected(module)
        if self.has(f"{module}.weight_packed"):
            qw = self._compressed_nvfp4(module, shape)
        elif self.has(f"{module}.weight"):
            w = self.tensor(f"{module}.weight")
            if w.dtype == torch.uint8:
                qw = self._qweight(module, QType.NVFP4, shape, w, self.tensor(f"{module}.weight_scale"),
                                   self.tensor(f"{module}.weight_scale_2"))
            elif w.dtype == torch.float8_e4m3fn:
                qw = self._qweight(module, QType.FP8, shape, w, self.tensor(f"{module}.weight_scale"), None)
            elif w.dtype in DENSE_DTYPES:
                qw = self._qweight(module, DENSE_DTYPES[w.dtype], shape, w, None, None)
            else:
                raise CheckpointError(f"{self.path(module + '.weight')}: tensor {module}.weight has "
                                      f"dtype {w.dtype}; expected uint8 (NVFP4), float8_e4m3fn or bf16/fp16/fp32")
        else:
            raise CheckpointError(f"{self.folder}: missing tensor {module + '.weight'!r}")
        if expected is not None and qw.qtype is not expected:
            raise CheckpointError(f"{self.path(module + '.weight')}: {module} is stored as {qw.qtype.value} "
                                  f"but {self.quant.source} says {expected.value}")
        return qw

    def _compressed_nvfp4(self, module: str, shape) -> QWeight:
        gs = self.tensor(f"{module}.weight_global_scale").float().reshape(-1)[0]
        if not torch.isfinite(gs) or gs <= 0:
            raise CheckpointError(f"{self.path(module + '.weight_packed')}: {module}.weight_global_scale "
                                  f"is {gs.item()}; expected a positive finite number")
        return self._qweight(module, QType.NVFP4, shape, self.tensor(f"{module}.weight_packed"),
                             self.tensor(f"{module}.weight_scale"), (1.0 / gs).reshape(()))

    def _qweight(self, module, qtype, shape, data, scale, scale_2) -> QWeight:
        where = self.path(f"{module}.weight" if self.has(f"{module}.weight") else f"{module}.weight_packed")
        if scale_2 is not None:
            scale_2 = scale_2.float().reshape(())
        if qtype is QType.FP8:
            scale = scale.float().reshape(())
        try:
            qw = QWeight(qtype, tuple(shape), data, scale, scale_2, name=module)
        except ValueError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        _check_scales(qw, where)
        return qw


def _check_scales(qw: QWeight, where: Path) -> None:
    for label, s in (("weight_scale", qw.scale), ("weight_scale_2", qw.scale_2)):
        if s is None:
            continue
        if s.dtype == torch.float8_e4m3fn:
            # numpy, not torch: no OpenMP team per call (tiny torch ops on a busy host cost ~10 ms)
            bits = s.contiguous().view(torch.uint8).cpu().numpy()
            bad_nan = bool(((bits & 0x7F) == 0x7F).any())
            bad_neg = bool((bits & 0x80).any())
        elif s.numel() == 1:
            v = float(s)
            bad_nan, bad_neg = not math.isfinite(v), v < 0
        else:
            bad_nan = bool(torch.isnan(s).any() or torch.isinf(s).any())
            bad_neg = bool((s < 0).any())
        if bad_nan or bad_neg:
            what = "NaN/inf" if bad_nan else "negative"
            raise CheckpointError(f"{where}: {qw.name}.{label} has {what} values; expected finite, >= 0")
