"""Test helpers: turn a BF16 model folder into ModelOpt NVFP4 or compressed-tensors layouts by hand.

Deliberately independent of hybrid.checkpoint.writer, so reader tests don't depend on the writer.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hybrid.checkpoint.formats import quantize_fp8, quantize_nvfp4


def is_expert_or_attn(name: str) -> bool:
    return name.endswith(".weight") and ("experts." in name or "self_attn." in name and "_proj" in name)


def to_nvfp4(src: Path, dst: Path, layout: str = "modelopt") -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        sd = load_file(str(f))
        out = {}
        for k, t in sd.items():
            if not is_expert_or_attn(k):
                out[k] = t
                continue
            mod = k[: -len(".weight")]
            if layout == "mixed" and "self_attn." in k:
                w8, sc = quantize_fp8(t.float())
                out.update({f"{mod}.weight": w8, f"{mod}.weight_scale": sc, f"{mod}.input_scale": torch.tensor(1.0)})
                continue
            packed, scale, s2 = quantize_nvfp4(t.float())
            if layout in ("modelopt", "mixed"):
                out.update({f"{mod}.weight": packed, f"{mod}.weight_scale": scale,
                            f"{mod}.weight_scale_2": s2, f"{mod}.input_scale": torch.tensor(1.0)})
            else:
                out.update({f"{mod}.weight_packed": packed, f"{mod}.weight_scale": scale,
                            f"{mod}.weight_global_scale": (1.0 / s2).reshape(1)})
        save_file(out, str(f))
    if (dst / "model.safetensors.index.json").exists():
        idx = json.loads((dst / "model.safetensors.index.json").read_text())
        new = {}
        for f in dst.glob("*.safetensors"):
            from safetensors import safe_open
            with safe_open(str(f), "pt") as h:
                new.update({k: f.name for k in h.keys()})
        idx["weight_map"] = new
        (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    cfg = json.loads((dst / "config.json").read_text())
    if layout == "mixed":
        (dst / "hf_quant_config.json").write_text(json.dumps({"quantization": {
            "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"],
            "quantized_layers": {k[: -len(".weight")]: {"quant_algo": "FP8" if "self_attn." in k else "NVFP4"}
                                 for k in _all_keys(dst) if is_expert_or_attn(k)}}}))
    elif layout == "modelopt":
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head", "*mlp.gate"]}}))
    else:
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                      "ignore": ["lm_head", "re:.*mlp.gate$"]}
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _all_keys(folder: Path) -> list[str]:
    from safetensors import safe_open
    keys = []
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            keys += [k for k in h.keys() if k.endswith(".weight") and "_proj" in k]
    return keys


def dequantized_copy(src: Path, dst: Path) -> Path:
    """Write every Linear of a quantized folder dequantized to fp32 (for transformers comparisons)."""
    from hybrid.checkpoint.reader import Checkpoint

    ck = Checkpoint(src)
    dst.mkdir(parents=True)
    for f in ("config.json", "tokenizer.json", "generation_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    out = {}
    for k in ck.names():
        if k.endswith((".weight_scale", ".weight_scale_2", ".input_scale", ".weight_global_scale")):
            continue
        if k.endswith(".weight_packed"):
            mod = k[: -len(".weight_packed")]
        elif k.endswith(".weight") and ck.tensor(k).dtype in (torch.uint8, torch.float8_e4m3fn):
            mod = k[: -len(".weight")]
        else:
            out[k] = ck.tensor(k).float()
            continue
        t = ck.tensor(k)
        n = t.shape[0]
        kdim = t.shape[1] * (2 if t.dtype == torch.uint8 else 1)
        out[f"{mod}.weight"] = ck.linear(mod, (n, kdim)).dequantize()
    save_file(out, str(dst / "model.safetensors"))
    return dst
