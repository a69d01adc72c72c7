"""Streaming checkpoint writer: a BF16/FP16/FP32 Hugging Face folder -> NVFP4 / FP8 / mixed.

The source is read tensor by tensor (safetensors mmap); a Linear group (q/k/v, an expert's
gate/up) is quantized together so it shares one NVFP4 weight_scale_2; outputs are buffered
only up to one shard. Everything is written into a hidden sibling folder that is renamed to
DST at the very end, so a failure never leaves a half-written DST behind.

Output, ModelOpt layout, per quantized Linear `m` [N, K]:
    NVFP4: m.weight u8 [N, K/2], m.weight_scale e4m3fn [N, K/16], m.weight_scale_2 f32 [],
           m.input_scale f32 []
    FP8:   m.weight e4m3fn [N, K], m.weight_scale f32 [], m.input_scale f32 []
  input_scale is the static activation scale that W4A4 / W8A8 kernels would use; this writer
  does no calibration and stores INPUT_SCALE (1.0). hybrid's kernels are weight-only and never
  read it.
Output, compressed-tensors `nvfp4-pack-quantized` (NVFP4 only):
    m.weight_packed u8 [N, K/2], m.weight_scale e4m3fn [N, K/16],
    m.weight_global_scale f32 [1] = 1 / weight_scale_2
Every other tensor (norms, embeddings, router, biases, excluded Linears) is copied unchanged.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from hybrid.checkpoint import recipes as R
from hybrid.checkpoint.files import INDEX, SafetensorsFiles
from hybrid.checkpoint.formats import SCALES, nvfp4_global_scale, quantize_fp8, quantize_nvfp4
from hybrid.checkpoint.names import Names, shared_scale_groups
from hybrid.errors import CheckpointError, HybridError
from hybrid.hardware import require_gpus, torch_arch_problem
from hybrid.model.config import ModelConfig

INPUT_SCALE = 1.0
ROW_CHUNK = 4096   # rows of one Linear quantized at a time
SOURCE_DTYPES = ("BF16", "F16", "F32")
QUANT_SUFFIXES = (".weight_scale", ".weight_scale_2", ".weight_packed", ".weight_global_scale",
                  ".input_scale", ".qweight", ".scales", ".qzeros")
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
NOT_COPIED = {"config.json", "hf_quant_config.json", INDEX}


def natural_key(name: str) -> list:
    """'layers.10' sorts after 'layers.9'."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# ----- the source folder ----------------------------------------------------------------------------
class SourceModel(SafetensorsFiles):
    """Lazy view of a source folder's tensors (hybrid.checkpoint.files), every file opened up front;
    get() refuses non-finite weights."""

    def __init__(self, folder: Path):
        super().__init__(folder, f" (expected model.safetensors or {INDEX} with shards)")
        self.open_all()

    def get(self, name: str) -> torch.Tensor:
        """The tensor, checked finite (NaN / Inf weights are refused; aminmax propagates NaN and is
        ~10x faster than isfinite on bf16)."""
        t = self.tensor(name)
        if t.is_floating_point() and t.numel() and not all(map(math.isfinite, torch.aminmax(t))):
            raise CheckpointError(f"{self.path(name)}: tensor {name} contains NaN or Inf values; "
                                  "expected finite weights")
        return t


def expected_tensors(cfg: ModelConfig, specs: list[R.LinearSpec]) -> dict[str, tuple[int, ...]]:
    """Every tensor config.json implies, with its shape."""
    names = Names(cfg.model_type)
    h = cfg.hidden_size
    exp: dict[str, tuple[int, ...]] = {f"{names.embed()}.weight": (cfg.vocab_size, h),
                                       f"{names.final_norm()}.weight": (h,)}
    for layer in range(cfg.num_hidden_layers):
        exp[f"{names.layer('input_norm', layer)}.weight"] = (h,)
        exp[f"{names.layer('post_norm', layer)}.weight"] = (h,)
        if cfg.qk_norm and names.has_qk_norm:
            exp[f"{names.layer('q_norm', layer)}.weight"] = (cfg.head_dim,)
            exp[f"{names.layer('k_norm', layer)}.weight"] = (cfg.head_dim,)
    for s in specs:
        exp[f"{s.name}.weight"] = s.shape
        if s.bias:
            exp[f"{s.name}.bias"] = (s.shape[0],)
    return exp


def refuse_quantized(folder: Path, raw: dict, source: SourceModel) -> None:
    if (folder / "hf_quant_config.json").is_file():
        raise CheckpointError(f"{folder / 'hf_quant_config.json'}: source is already quantized; "
                              "expected a BF16/FP16/FP32 checkpoint")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"{folder / 'config.json'}: source is already quantized "
                              f"(quantization_config quant_method={method!r}); expected a BF16/FP16/FP32 checkpoint")
    for name in source.where:
        if name.endswith(QUANT_SUFFIXES):
            raise CheckpointError(f"{source.path(name)}: tensor {name} is a quantization scale; "
                                  "source is already quantized, expected BF16/FP16/FP32")


def validate_source(cfg: ModelConfig, source: SourceModel, specs: list[R.LinearSpec]) -> None:
    """Every expected tensor present with its shape; every tensor BF16/FP16/FP32 (headers only)."""
    for name, shape in expected_tensors(cfg, specs).items():
        if name not in source.where:
            raise CheckpointError(f"{source.folder}: missing tensor {name} (expected by config.json, "
                                  f"model_type={cfg.model_type})")
        got = source.meta(name)[1]
        if got != shape:
            raise CheckpointError(f"{source.path(name)}: tensor {name} has shape {list(got)}, "
                                  f"expected {list(shape)} from config.json")
    for name in sorted(source.where, key=natural_key):
        dtype = source.meta(name)[0]
        if dtype not in SOURCE_DTYPES:
            raise CheckpointError(f"{source.path(name)}: tensor {name} has dtype {dtype}, "
                                  f"expected one of BF16, F16, F32")


# ----- the output folder --------------------------------------------------------------------------
class ShardWriter:
    """Buffers output tensors and writes a safetensors shard whenever the buffer passes max_bytes."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.buf: dict[str, torch.Tensor] = {}
        self.size = 0
        self.parts: list[tuple[str, list[str]]] = []   # (temporary file name, tensor names)
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.buf:
            raise ValueError(f"duplicate output tensor {name}")
        self.buf[name] = t.contiguous()
        self.size += t.numel() * t.element_size()

    def maybe_flush(self) -> None:
        if self.size >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        fname = f"part-{len(self.parts) + 1:05d}.safetensors"
        save_file(self.buf, str(self.folder / fname), metadata={"format": "pt"})
        os.chmod(self.folder / fname, 0o666 & ~_umask())   # save_file creates it 0600
        self.parts.append((fname, list(self.buf)))
        self.total += self.size
        self.buf, self.size = {}, 0

    def finish(self) -> list[str]:
        """Final names: model.safetensors, or model-0000i-of-0000n.safetensors + index."""
        self.flush()
        n = len(self.parts)
        if n == 1:
            os.replace(self.folder / self.parts[0][0], self.folder / "model.safetensors")
            return ["model.safetensors"]
        weight_map, files = {}, []
        for i, (tmp, keys) in enumerate(self.parts):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / tmp, self.folder / fname)
            weight_map.update({k: fname for k in keys})
            files.append(fname)
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return files


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _staging_folder(src: Path, dst: Path) -> Path:
    if dst.resolve() == src.resolve():
        raise HybridError(f"{dst}: DST must differ from SRC")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise HybridError(f"{dst}: output folder already exists and is not empty; choose a new DST")
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _copy_side_files(src: Path, out: Path) -> list[str]:
    """Tokenizer, generation_config.json, chat template, README...: every top-level non-weight file."""
    copied = []
    for p in sorted(src.iterdir()):
        if p.is_file() and p.name not in NOT_COPIED and not p.name.endswith(WEIGHT_FILES):
            shutil.copy2(p, out / p.name)
            copied.append(p.name)
    return copied


# ----- quantizing -------------------------------------------------------------------------------
@dataclass
class Unit:
    """Tensors processed together: a Linear group sharing weight_scale_2, or one copied tensor."""

    linears: tuple[R.LinearSpec, ...] = ()
    copy: str | None = None


def plan_units(source: SourceModel, specs: list[R.LinearSpec], plan: dict[str, str | None],
               cfg: ModelConfig) -> list[Unit]:
    """Source order (natural sort); a group's members are emitted together at its first member."""
    by_name = {s.name: s for s in specs if plan[s.name] is not None}
    group_of: dict[str, tuple[str, ...]] = {}
    for g in shared_scale_groups(Names(cfg.model_type), cfg.num_hidden_layers, cfg.num_experts):
        members = tuple(m for m in g if plan.get(m) == R.NVFP4)
        for m in members:
            group_of[m] = members
    units, done = [], set()
    for name in sorted(source.where, key=natural_key):
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in by_name:
            if module not in done:
                group = group_of.get(module, (module,))
                done.update(group)
                units.append(Unit(linears=tuple(by_name[m] for m in group)))
        else:
            units.append(Unit(copy=name))
    return units


def quantize_nvfp4_rows(w: torch.Tensor, scale_2: float | None = None, rows: int = ROW_CHUNK, scales: str = "amax",
                        importance: torch.Tensor | None = None):
    """quantize_nvfp4 over row chunks (same result; bounded fp32 temporaries for e.g. lm_head [V, H])."""
    if scale_2 is None:
        scale_2 = nvfp4_global_scale(float(w.abs().max()))
    parts = [quantize_nvfp4(w[i:i + rows].float(), scale_2, scales, importance) for i in range(0, w.shape[0], rows)]
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), parts[0][2])


def quantize_group(source: SourceModel, linears: tuple[R.LinearSpec, ...], plan, fmt: str, scales: str = "amax",
                   importance: dict | None = None, device: str = "cpu"):
    """-> {output tensor name: tensor on the CPU} for one Linear group (one shared NVFP4 weight_scale_2; scales: how
    NVFP4 block scales are chosen, formats.SCALES; importance: module -> [K] column weights of their search),
    quantized on `device`."""
    weights = {s.name: source.get(f"{s.name}.weight").to(device) for s in linears}   # [N, K] each, source dtype
    scale_2 = None
    if len(linears) > 1:
        scale_2 = nvfp4_global_scale(max(float(w.abs().max()) for w in weights.values()))
    out: dict[str, torch.Tensor] = {}
    for s in linears:
        w, m = weights[s.name], s.name
        if plan[m] == R.NVFP4:
            imp = (importance or {}).get(m)
            packed, scale, s2 = quantize_nvfp4_rows(w, scale_2, scales=scales,
                                                    importance=None if imp is None else torch.as_tensor(imp))
            packed, scale, s2 = packed.cpu(), scale.cpu(), s2.cpu()
            if fmt == "compressed-tensors":
                out.update({f"{m}.weight_packed": packed, f"{m}.weight_scale": scale,
                            f"{m}.weight_global_scale": (1.0 / s2.reshape(1)).to(torch.float32)})
            else:
                out.update({f"{m}.weight": packed, f"{m}.weight_scale": scale, f"{m}.weight_scale_2": s2,
                            f"{m}.input_scale": torch.tensor(INPUT_SCALE, dtype=torch.float32)})
        else:
            q, scale = quantize_fp8(w.float())
            q, scale = q.cpu(), scale.cpu()
            out.update({f"{m}.weight": q, f"{m}.weight_scale": scale,
                        f"{m}.input_scale": torch.tensor(INPUT_SCALE, dtype=torch.float32)})
    return out


@dataclass
class QuantizeResult:
    dst: Path
    recipe: str
    fmt: str
    counts: dict[str, int] = field(default_factory=dict)   # "NVFP4" / "FP8" / "dense" -> Linears
    bytes_in: int = 0
    bytes_out: int = 0
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        kinds = ", ".join(f"{v} {k}" for k, v in self.counts.items() if v)
        return (f"wrote {self.dst} ({self.fmt}, recipe {self.recipe}): Linears {kinds}; "
                f"{self.bytes_in / 2**20:.1f} MiB -> {self.bytes_out / 2**20:.1f} MiB in "
                f"{len(self.files)} file(s), {self.seconds:.1f} s")


def quantize_checkpoint(src: str | Path, dst: str | Path, recipe: str = "nvfp4", *,
                        shard_mb: float = 4096, fmt: str = "modelopt", exclude=(),
                        progress: bool | None = None, nvfp4_scales: str = "amax",
                        importance: dict | None = None, device: str = "cpu") -> QuantizeResult:
    """Quantize folder `src` into a new folder `dst`. Raises HybridError on bad input (dst untouched).

    nvfp4_scales: how NVFP4 block scales are chosen (formats.SCALES): "amax" as ModelOpt does, or "mse";
    importance: {module name: float [K]} (hybrid.baselines.imatrix.module_importance) weighing "mse"'s errors;
    device: where the quantization runs ("cpu", "cuda[:N]", or "auto": the first GPU where torch sees one); the
    output is the same bytes on either (results/runtime.md section 47).

    progress: tqdm bar on stderr; None = only when stderr is a terminal.
    """
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    rec = R.get_recipe(recipe)
    if fmt not in R.FORMATS:
        raise HybridError(f"--format {fmt!r}: unknown; expected one of {', '.join(R.FORMATS)}")
    if fmt == "compressed-tensors" and rec.quant_algo != R.NVFP4:
        raise HybridError(f"--format compressed-tensors supports --recipe nvfp4 only, got {recipe!r}")
    device = check_device(device)
    if nvfp4_scales not in SCALES:
        raise HybridError(f"--nvfp4-scales {nvfp4_scales!r}: expected one of {', '.join(SCALES)}")
    if shard_mb <= 0:
        raise HybridError(f"--shard-size {shard_mb}: expected a positive number of MB")
    if not src.is_dir():
        raise CheckpointError(f"{src}: source model folder not found")
    cfg = ModelConfig.from_folder(src)
    source = SourceModel(src)
    refuse_quantized(src, cfg.raw, source)
    specs = R.linear_specs(cfg)
    validate_source(cfg, source, specs)
    plan = rec.assign(specs, exclude)
    check_importance(importance, specs, nvfp4_scales)
    units = plan_units(source, specs, plan, cfg)

    tmp = _staging_folder(src, dst)
    try:
        result = _write(source, units, plan, rec, fmt, exclude, cfg, tmp, int(shard_mb * 2**20), progress,
                        nvfp4_scales, importance, device)
        if dst.exists():
            dst.rmdir()   # an empty folder the user made beforehand
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.dst, result.recipe, result.seconds = dst, rec.name, time.perf_counter() - t0
    return result


def check_device(device: str) -> str:
    """--device auto|cpu|cuda|cuda:N -> the torch device string (auto: "cuda" where torch sees a GPU it can run on,
    else "cpu"); one line where it does not exist here or torch cannot run on it."""
    if device == "auto":   # the CPU where torch cannot run on the GPU either (the same bytes)
        return "cuda" if torch.cuda.is_available() and torch_arch_problem(0) is None else "cpu"
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise HybridError(f"--device {device}: expected auto, cpu, cuda or cuda:N") from None
    if d.type == "cuda":
        require_gpus(f"--device {device}", [d.index or 0])
    elif d.type != "cpu":
        raise HybridError(f"--device {device}: expected auto, cpu, cuda or cuda:N")
    return str(d)


def check_importance(importance: dict | None, specs: list[R.LinearSpec], scales: str) -> None:
    """--imatrix: only with --nvfp4-scales mse, every entry a Linear of the model with one weight per input column."""
    if not importance:
        return
    if scales != "mse":
        raise HybridError("--imatrix weighs the NVFP4 scale search: it needs --nvfp4-scales mse")
    shapes = {s.name: s.shape for s in specs}
    for name, imp in importance.items():
        if name not in shapes:
            raise HybridError(f"--imatrix: {name} is not a Linear of this model")
        if tuple(np.shape(imp)) != (shapes[name][1],):
            raise HybridError(f"--imatrix: {name} has {list(np.shape(imp))} importances, expected "
                              f"[{shapes[name][1]}] (its in-features)")


def _write(source, units, plan, rec, fmt, exclude, cfg, out: Path, max_bytes: int, progress,
           scales: str = "amax", importance: dict | None = None, device: str = "cpu") -> QuantizeResult:
    from tqdm import tqdm

    writer = ShardWriter(out, max_bytes)
    total = sum(source.nbytes(n) for n in source.where)
    with tqdm(total=total, unit="B", unit_scale=True, desc="quantize", disable=None if progress is None
              else not progress, leave=False) as bar:
        for u in units:
            if u.copy is not None:
                writer.add(u.copy, source.get(u.copy))
                bar.update(source.nbytes(u.copy))
            else:
                try:
                    parts = quantize_group(source, u.linears, plan, fmt, scales, importance, device)
                except torch.OutOfMemoryError:
                    raise HybridError(f"{device}: out of GPU memory quantizing {', '.join(s.name for s in u.linears)}"
                                      "; free the GPU or pass --device cpu (the same bytes)") from None
                for name, t in parts.items():
                    writer.add(name, t)
                bar.update(sum(source.nbytes(f"{s.name}.weight") for s in u.linears))
            writer.maybe_flush()
    files = writer.finish()
    _write_configs(out, cfg.raw, rec, plan, fmt, exclude)
    _copy_side_files(source.folder, out)
    counts = {"NVFP4": 0, "FP8": 0, "dense": 0}
    for a in plan.values():
        counts[a or "dense"] += 1
    return QuantizeResult(out, rec.name, fmt, counts, total, writer.total, files)


def _write_configs(out: Path, raw: dict, rec, plan, fmt: str, exclude) -> None:
    config = dict(raw)
    if fmt == "compressed-tensors":
        config["quantization_config"] = R.compressed_tensors_config(plan)
    else:
        (out / "hf_quant_config.json").write_text(json.dumps(R.hf_quant_config(rec, plan, exclude), indent=2) + "\n")
        config["quantization_config"] = R.modelopt_quantization_config(rec, plan, exclude)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
