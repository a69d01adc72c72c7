"""hybrid-gguf: export a model folder to a qwen3moe GGUF, and quantize GGUFs with llama.cpp.

Examples:
    hybrid-gguf export tiny tiny-bf16.gguf --outtype bf16
    hybrid-gguf export ./tiny-nvfp4 tiny-nvfp4.gguf          # hybrid NVFP4 weights, re-packed bit-exact
    hybrid-gguf quantize tiny-bf16.gguf tiny-Q4_K_M.gguf --type Q4_K_M
    hybrid-gguf quantize tiny-bf16.gguf tiny-Q8_0-pure.gguf --type Q8_0 --pure
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybrid.cli.common import add_debug_flag, run_cli

MIB = 2**20


def build_parser() -> argparse.ArgumentParser:
    from hybrid.baselines.gguf_export import OUTTYPES
    from hybrid.baselines.quantize import TYPES

    p = argparse.ArgumentParser(prog="hybrid-gguf", description=__doc__.splitlines()[0],
                                epilog="\n".join(__doc__.splitlines()[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    e = sub.add_parser("export", help="HF model folder (BF16/F16/F32, or hybrid NVFP4/mixed) -> GGUF")
    e.add_argument("model", metavar="MODEL_DIR", help="model folder, or 'tiny' for the embedded model")
    e.add_argument("out", metavar="OUT.gguf", help="GGUF file to write")
    e.add_argument("--outtype", choices=OUTTYPES, default="bf16",
                   help="type of unquantized weights (default bf16); norms and router stay f32; "
                        "NVFP4 weights are re-packed as NVFP4 whatever this says")
    add_debug_flag(e)
    q = sub.add_parser("quantize", help="GGUF -> quantized GGUF through llama.cpp's quantizer")
    q.add_argument("src", metavar="IN.gguf")
    q.add_argument("dst", metavar="OUT.gguf")
    q.add_argument("--type", dest="qtype", required=True, metavar="TYPE",
                   help="one of: " + ", ".join(TYPES))
    q.add_argument("--pure", action="store_true", help="every tensor in TYPE (no k-quant mixture)")
    q.add_argument("--threads", type=int, default=0, help="quantizer threads (default: all)")
    q.add_argument("--verbose", action="store_true", help="show llama.cpp's quantize log")
    add_debug_flag(q)
    return p


def _export(args) -> int:
    from hybrid.baselines.gguf_export import export_gguf
    from hybrid.model.registry import resolve_model_path

    rep = export_gguf(resolve_model_path(args.model), args.out, args.outtype)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(rep.kinds.items()))
    print(f"wrote {rep.path}: {rep.n_tensors} tensors ({kinds} linears), "
          f"{Path(rep.path).stat().st_size / MIB:.2f} MiB")
    return 0


def _quantize(args) -> int:
    from hybrid.baselines.quantize import quantize_gguf

    out = quantize_gguf(args.src, args.dst, args.qtype, pure=args.pure, nthread=args.threads,
                        verbose=args.verbose)
    print(f"wrote {out}: {args.qtype}{' (pure)' if args.pure else ''}, {out.stat().st_size / MIB:.2f} MiB")
    return 0


def main(argv=None) -> int:
    return run_cli(lambda a: _export(a) if a.cmd == "export" else _quantize(a), build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
