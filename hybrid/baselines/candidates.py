"""Quality-bench candidates: where each one's weights come from and which engine runs them.

- hybrid recipes (bf16, nvfp4, mixed, fp8; nvfp4-mse / mixed-mse: `--nvfp4-scales mse`, -mse-imat: with `--imatrix`):
  `hybrid-quantize` checkpoints run by hybrid's runtime (`hybrid.runtime.open_session(...).model.forward_logits`),
  the very path `hybrid-run` uses.
- gguf-<recipe>: the same hybrid checkpoint re-packed into a GGUF (NVFP4 bit-exact), run by llama.cpp.
- llama.cpp types (Q8_0, Q4_K_M, IQ4_XS, ...): the BF16 export quantized by llama.cpp's quantizer;
  `<TYPE>-imat` adds an importance matrix computed by hybrid.baselines.imatrix.
Files are built once in a per-model subfolder of the work folder (keyed by a fingerprint of the
model folder) and reused; engines load lazily and `close()` frees them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hybrid.baselines import report
from hybrid.baselines.gguf_export import export_gguf
from hybrid.baselines.quantize import TYPES, quantize_gguf
from hybrid.errors import HybridError
from hybrid.model.head import HEAD_TYPES

HYBRID_RECIPES = ("bf16", "nvfp4", "mixed", "fp8", "nvfp4-mse", "mixed-mse", "nvfp4-mse-imat", "mixed-mse-imat")
MSE_SUFFIX = "-mse"        # hybrid-quantize --nvfp4-scales mse
HYBRID_IMAT = "-imat"      # ... --imatrix (CandidateMaker.imatrix: the validation split's statistic)
RECIPE_WEIGHTS = {
    "bf16": "source weights (unquantized)",
    "nvfp4": "hybrid NVFP4: attention + experts + lm_head(if untied) FP4, router/norms/embed BF16",
    "mixed": "hybrid mixed: attention FP8, experts + lm_head NVFP4, router/norms/embed BF16",
    "fp8": "hybrid FP8 per-tensor linears",
    "nvfp4-mse": "hybrid NVFP4 as nvfp4, each block's scale the least-squared-error one (--nvfp4-scales mse)",
    "mixed-mse": "hybrid mixed as mixed, each NVFP4 block's scale the least-squared-error one (--nvfp4-scales mse)",
    "nvfp4-mse-imat": "hybrid NVFP4 as nvfp4-mse, the errors weighed by an importance matrix (--imatrix; 64x128 "
                      "validation-split tokens)",
    "mixed-mse-imat": "hybrid mixed as mixed-mse, the errors weighed by an importance matrix (--imatrix; 64x128 "
                      "validation-split tokens)",
}
IMAT_SUFFIX = "-IMAT"
IMATRIX_CTX, IMATRIX_CHUNKS = 128, 64
OUTTYPE_OF_DTYPE = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def llama_info() -> dict:
    from hybrid.baselines.llama_runner import llama_cpp_info

    return {"llama_cpp": llama_cpp_info()}


class Candidate:
    """One row of the table. logits(ids int [T]) -> float32 [T, V], teacher-forced, fresh cache."""

    def __init__(self, name: str, engine: str, weights: str, path: Path):
        self.name, self.engine, self.weights, self.path = name, engine, weights, Path(path)

    def describe(self) -> dict:
        is_gguf = self.path.suffix == ".gguf"
        size = self.path.stat().st_size if is_gguf else report.folder_bytes(self.path)
        experts = report.gguf_expert_bytes(self.path) if is_gguf else report.checkpoint_expert_bytes(self.path)
        return {"candidate": self.name, "engine": self.engine, "weights": self.weights,
                "file_bytes": int(size), "expert_bytes": int(experts)}

    def logits(self, ids) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass


class GGUFCandidate(Candidate):
    def __init__(self, name, weights, path, n_ctx: int, threads: int | None):
        super().__init__(name, "llama.cpp", weights, path)
        self.n_ctx, self.threads, self._runner = n_ctx, threads, None

    @property
    def runner(self):
        from hybrid.baselines.llama_runner import LlamaRunner

        if self._runner is None:
            self._runner = LlamaRunner(self.path, n_ctx=self.n_ctx, n_threads=self.threads)
        return self._runner

    def logits(self, ids) -> np.ndarray:
        return self.runner.logits(ids)

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None


class HybridCandidate(Candidate):
    """hybrid's runtime as `hybrid-run` opens it: `open_session(folder, RuntimeOptions(...))`.

    opts: RuntimeOptions fields (device, cache_slots, gpus, layer_split, cpu_engine, ...); the
    default is `hybrid-run --device cpu`."""

    def __init__(self, name, weights, path, **opts):
        super().__init__(name, "hybrid", weights, path)
        self.opts, self._session = {"device": "cpu", **opts}, None

    @property
    def session(self):
        from hybrid.runtime import RuntimeOptions, open_session

        if self._session is None:
            self._session = open_session(self.path, RuntimeOptions(**self.opts))
        return self._session

    def describe(self) -> dict:
        d = super().describe()
        if self._session is not None:
            d["placement"] = self._session.placement.describe()
            d["cpu_runner"] = type(self._session.cpu).__name__
        return d

    def logits(self, ids) -> np.ndarray:
        import torch

        out = self.session.model.forward_logits(torch.as_tensor(np.asarray(ids), dtype=torch.long))
        return out.float().cpu().numpy()

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


def source_fingerprint(src: Path) -> str:
    """Short hash of a model folder: its JSON files' bytes and its weight files' names, sizes, mtimes."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(Path(src).iterdir()):
        if f.suffix == ".json":
            h.update(f.name.encode() + f.read_bytes())
        elif f.suffix == ".safetensors":
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{Path(src).resolve().name}-{h.hexdigest()[:12]}"


def placement_opts(where: str, name: str) -> dict:
    """'' | 'slots=N' (expert slots per card; 0 = every expert on the CPU runner) | 'split=L'
    (two logical cards, layers split at L) | 'torch' (torch CPU expert engine) | 'head=fp8' / 'head=nvfp4'
    (hybrid-run --lm-head) -> RuntimeOptions fields."""
    if not where:
        return {}
    key, _, val = where.partition("=")
    try:
        if key == "slots":
            return {"cache_slots": (int(val),)}
        if key == "split":
            return {"gpus": (0, 0), "layer_split": (int(val),)}
    except ValueError:
        pass
    if key == "head" and val in HEAD_TYPES:
        return {"lm_head": val}
    if key == "torch" and not val:
        return {"cpu_engine": "torch"}
    raise HybridError(f"--against {name!r}: placement {where!r}; expected slots=N, split=L, torch or "
                      f"head={'/'.join(HEAD_TYPES)}")


class CandidateMaker:
    """Builds (once, in `work`) the files each candidate name needs."""

    def __init__(self, src: Path, work: Path, n_ctx: int, threads: int | None = None, hybrid_opts=None):
        self.src, self.n_ctx, self.threads = Path(src), n_ctx, threads
        self.work = Path(work) / source_fingerprint(self.src)        # a changed model gets new files
        self.work.mkdir(parents=True, exist_ok=True)
        self.hybrid_opts = dict(hybrid_opts or {})

    def base_gguf(self) -> Path:
        """The unquantized GGUF export, in the source's own dtype (lossless)."""
        import json

        dtype = json.loads((self.src / "config.json").read_text()).get("torch_dtype", "bfloat16")
        outtype = OUTTYPE_OF_DTYPE.get(str(dtype), "f32")
        path = self.work / f"model-{outtype}.gguf"
        if not path.exists():
            export_gguf(self.src, path, outtype)
        return path

    def hybrid_checkpoint(self, recipe: str) -> Path:
        if recipe == "bf16":
            return self.src
        dst = self.work / f"hybrid-{recipe}"
        if not (dst / "config.json").exists():
            from hybrid.checkpoint.writer import quantize_checkpoint

            from hybrid.baselines.imatrix import module_importance
            from hybrid.model.config import ModelConfig

            base, imat = (recipe[: -len(HYBRID_IMAT)], True) if recipe.endswith(HYBRID_IMAT) else (recipe, False)
            base, mse = (base[: -len(MSE_SUFFIX)], True) if base.endswith(MSE_SUFFIX) else (base, False)
            importance = module_importance(self.imatrix(), ModelConfig.from_folder(self.src)) if imat else None
            quantize_checkpoint(self.src, dst, base, progress=False, nvfp4_scales="mse" if mse else "amax",
                                importance=importance)
        return dst

    def imatrix(self) -> dict:
        """Importance matrix from hybrid's forward on the model's training text (cached in work)."""
        from tokenizers import Tokenizer

        from hybrid.baselines import imatrix as im

        path = self.work / "imatrix.npz"
        if not path.exists():
            tok = Tokenizer.from_file(str(self.src / "tokenizer.json"))
            chunks = im.calibration_chunks(self.src, tok, IMATRIX_CTX, IMATRIX_CHUNKS)
            im.save(path, im.compute_imatrix(self.src, chunks))
        return im.load(path)

    def gguf_type(self, qtype: str, with_imatrix: bool = False) -> Path:
        base = self.base_gguf()
        if base.stem == f"model-{qtype.lower()}":
            return base
        path = self.work / f"model-{qtype}{'-imat' if with_imatrix else ''}.gguf"
        if not path.exists():
            quantize_gguf(base, path, qtype, imatrix=self.imatrix() if with_imatrix else None)
        return path

    def make(self, name: str) -> Candidate:
        low, _, where = name.lower().partition("@")
        if low in HYBRID_RECIPES:
            opts = {**self.hybrid_opts, **placement_opts(where, name)}
            weights = RECIPE_WEIGHTS[low] + (f"; lm_head quantized to {opts['lm_head'].upper()} at load (--lm-head)"
                                             if opts.get("lm_head", "keep") != "keep" else "")
            return HybridCandidate(name, weights, self.hybrid_checkpoint(low), **opts)
        if where:
            raise HybridError(f"--against {name!r}: @placement applies to hybrid recipes only")
        if low.startswith("gguf-") and low[5:] in HYBRID_RECIPES:
            recipe = low[5:]
            path = self.work / f"{low}.gguf"
            if not path.exists():
                export_gguf(self.hybrid_checkpoint(recipe), path, "bf16")
            return GGUFCandidate(name, f"{RECIPE_WEIGHTS[recipe]}; re-packed into GGUF (NVFP4 bit-exact, "
                                       "FP8 dequantized to F32)", path, self.n_ctx, self.threads)
        if name.upper() in TYPES:
            qtype = name.upper()
            return GGUFCandidate(qtype, f"llama.cpp {qtype} mix (llama_model_quantize defaults, no imatrix)",
                                 self.gguf_type(qtype), self.n_ctx, self.threads)
        if name.upper().endswith(IMAT_SUFFIX) and name.upper()[: -len(IMAT_SUFFIX)] in TYPES:
            qtype = name.upper()[: -len(IMAT_SUFFIX)]
            return GGUFCandidate(f"{qtype}{IMAT_SUFFIX.lower()}", f"llama.cpp {qtype} mix with an importance matrix "
                                 f"({IMATRIX_CHUNKS}x{IMATRIX_CTX} validation-split tokens, hybrid.baselines.imatrix)",
                                 self.gguf_type(qtype, True), self.n_ctx, self.threads)
        raise HybridError(f"--against {name!r}: expected a hybrid recipe ({', '.join(HYBRID_RECIPES)}), "
                          f"gguf-<recipe>, or a llama.cpp type ({', '.join(TYPES)}), optionally with -imat")
