"""Quantization config of a checkpoint: which Linear is stored as NVFP4, FP8 or dense.

Sources, in order: hf_quant_config.json (ModelOpt), config.json `quantization_config`
(quant_method "modelopt" or "compressed-tensors"). Exclusions honour `*` wildcards
(ModelOpt `exclude_modules`) and `re:` regexes (compressed-tensors `ignore`).
"""
from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from hybrid.checkpoint.formats import QType
from hybrid.errors import CheckpointError

MODELOPT_ALGOS = {"NVFP4": QType.NVFP4, "W4A16_NVFP4": QType.NVFP4, "FP8": QType.FP8}


@dataclass
class QuantConfig:
    """method: None (dense), 'modelopt' or 'compressed-tensors'."""

    method: str | None = None
    default: QType | None = None                        # algo for non-excluded Linears
    per_module: dict[str, QType] = field(default_factory=dict)  # MIXED_PRECISION
    exclude: list[str] = field(default_factory=list)
    source: str = ""

    def is_excluded(self, module: str) -> bool:
        for pat in self.exclude:
            if pat.startswith("re:"):
                if re.match(pat[3:], module):
                    return True
            elif fnmatch.fnmatchcase(module, pat) or module == pat:
                return True
        return False

    def expected(self, module: str) -> QType | None:
        """The quantized type the config promises for a Linear, or None (dense)."""
        if self.method is None or self.is_excluded(module):
            return None
        if self.per_module:
            return self.per_module.get(module)
        return self.default

    @classmethod
    def load(cls, folder: str | Path, config: dict) -> "QuantConfig":
        folder = Path(folder)
        hf = folder / "hf_quant_config.json"
        if hf.is_file():
            try:
                d = json.loads(hf.read_text())
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{hf}: not valid JSON ({exc.msg})") from None
            return cls._modelopt(d.get("quantization", d), str(hf))
        qc = config.get("quantization_config")
        if not qc:
            return cls()
        where = f"{folder / 'config.json'}: quantization_config"
        method = qc.get("quant_method")
        if method == "modelopt":
            return cls._modelopt(qc, where)
        if method == "compressed-tensors":
            return cls._compressed(qc, where)
        raise CheckpointError(f"{where}: unsupported quant_method {method!r}; "
                              "expected 'modelopt' or 'compressed-tensors'")

    @classmethod
    def _modelopt(cls, q: dict, where: str) -> "QuantConfig":
        algo = q.get("quant_algo")
        exclude = list(q.get("exclude_modules") or [])
        if algo == "MIXED_PRECISION":
            layers = q.get("quantized_layers") or {}
            per = {}
            for mod, spec in layers.items():
                a = spec.get("quant_algo")
                if a not in MODELOPT_ALGOS:
                    raise CheckpointError(f"{where}: unsupported quant_algo {a!r} for {mod}; "
                                          f"expected one of {', '.join(MODELOPT_ALGOS)}")
                per[mod] = MODELOPT_ALGOS[a]
            return cls("modelopt", None, per, exclude, where)
        if algo not in MODELOPT_ALGOS:
            raise CheckpointError(f"{where}: unsupported quant_algo {algo!r}; expected one of "
                                  f"{', '.join(list(MODELOPT_ALGOS) + ['MIXED_PRECISION'])}")
        gs = q.get("group_size", 16)
        if MODELOPT_ALGOS[algo] is QType.NVFP4 and gs not in (None, 16):
            raise CheckpointError(f"{where}: NVFP4 group_size {gs} unsupported; expected 16")
        return cls("modelopt", MODELOPT_ALGOS[algo], {}, exclude, where)

    @classmethod
    def _compressed(cls, q: dict, where: str) -> "QuantConfig":
        fmt = q.get("format")
        if fmt != "nvfp4-pack-quantized":
            raise CheckpointError(f"{where}: unsupported compressed-tensors format {fmt!r}; "
                                  "expected 'nvfp4-pack-quantized'")
        return cls("compressed-tensors", QType.NVFP4, {}, list(q.get("ignore") or []), where)
