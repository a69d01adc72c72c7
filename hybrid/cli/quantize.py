"""hybrid-quantize: turn a BF16/FP16/FP32 Hugging Face MoE checkpoint into NVFP4, FP8 or mixed FP4/FP8.

Examples:
    hybrid-quantize ./Qwen3-30B-A3B ./Qwen3-30B-A3B-NVFP4 --recipe nvfp4
    hybrid-quantize ./Qwen3-30B-A3B ./Qwen3-30B-A3B-mixed --recipe mixed --shard-size 4096
    hybrid-quantize tiny ./tiny-nvfp4 --recipe nvfp4 --format compressed-tensors
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybrid.checkpoint.formats import SCALES
from hybrid.checkpoint.recipes import FORMATS, RECIPES
from hybrid.cli.common import OneLineParser, add_debug_flag, run_cli
from hybrid.errors import HybridError

RECIPE_HELP = ("nvfp4: all Linears NVFP4 except router / shared-expert gate / lm_head; "
               "fp8: the same Linears FP8 per-tensor; "
               "mixed: attention FP8, experts and lm_head NVFP4, router/norms/embeddings BF16")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="hybrid-quantize", description=__doc__.splitlines()[0].split(": ", 1)[1],
                                epilog="\n".join(__doc__.splitlines()[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="source model folder (BF16/FP16/FP32 safetensors), or 'tiny' "
                   "for the embedded tiny model")
    p.add_argument("dst", metavar="DST", help="output folder; must not exist (or be empty). Written "
                   "atomically: on any error nothing is left behind")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="nvfp4", help=RECIPE_HELP)
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="modelopt",
                   help="output layout: modelopt (hf_quant_config.json; default) or compressed-tensors "
                        "(nvfp4-pack-quantized; --recipe nvfp4 only)")
    p.add_argument("--shard-size", type=float, default=4096, metavar="MB",
                   help="largest safetensors shard, in MiB (default 4096)")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="also keep Linears matching this module name or `*` wildcard unquantized "
                        "(repeatable), e.g. 'model.layers.0.*'")
    p.add_argument("--nvfp4-scales", choices=SCALES, default=None,
                   help="how each 16-value block's scale is chosen: amax (its largest value on E2M1's 6, as ModelOpt "
                        "does; the default) or mse (the least squared error of 8 candidate scales; the default with "
                        "--imatrix)")
    p.add_argument("--imatrix", default=None, metavar="FILE.npz",
                   help="importance matrix from `hybrid-gguf imatrix`: mse weighs each input column's error by its "
                        "mean squared activation (attention and expert linears)")
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda[:N]",
                   help="where the quantization runs (default auto: the first GPU torch sees, else the CPU); the "
                        "same bytes either way")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_debug_flag(p)
    return p


def resolve_source(name_or_path: str) -> Path:
    """A folder, or a registered model name such as 'tiny' (hybrid.model.registry, when present)."""
    try:
        from hybrid.model.registry import resolve_model_path
    except ImportError:
        return Path(name_or_path)
    return Path(resolve_model_path(name_or_path))


def load_importance(path: str, src: Path) -> dict:
    """--imatrix FILE.npz -> {module: [K]} for the model at src (one-line errors for a missing, unreadable or
    mismatched file)."""
    import zipfile

    from hybrid.baselines import imatrix as im
    from hybrid.model.config import ModelConfig

    if not Path(path).is_file():
        raise HybridError(f"--imatrix {path}: file not found")
    try:
        imatrix = im.load(Path(path))
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise HybridError(f"--imatrix {path}: not an importance matrix from `hybrid-gguf imatrix` ({exc})") from None
    cfg = ModelConfig.from_folder(src)
    try:
        return im.module_importance(imatrix, cfg)
    except ValueError as exc:
        raise HybridError(f"--imatrix {path}: does not fit {src.name} ({cfg.num_experts} experts): {exc}") from None


def body(args: argparse.Namespace) -> int:
    from hybrid.checkpoint.writer import quantize_checkpoint

    src = resolve_source(args.src)
    scales = args.nvfp4_scales or ("mse" if args.imatrix else "amax")
    importance = load_importance(args.imatrix, src) if args.imatrix else None
    try:
        result = quantize_checkpoint(src, args.dst, args.recipe, shard_mb=args.shard_size, fmt=args.fmt,
                                     exclude=tuple(args.exclude), progress=False if args.no_progress else None,
                                     nvfp4_scales=scales, importance=importance, device=args.device)
    except OSError as exc:   # disk full, permissions: the environment, not a bug
        raise HybridError(f"{exc.filename or args.dst}: {exc.strerror or exc}") from exc
    print(result.summary())
    return 0


def main(argv=None) -> int:
    return run_cli(body, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
