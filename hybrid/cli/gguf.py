"""hybrid-gguf: export a model folder to a qwen3moe GGUF, and quantize GGUFs with llama.cpp.

Examples:
    hybrid-gguf export tiny tiny-bf16.gguf --outtype bf16
    hybrid-gguf export ./tiny-nvfp4 tiny-nvfp4.gguf          # hybrid NVFP4 weights, re-packed bit-exact
    hybrid-gguf quantize tiny-bf16.gguf tiny-Q4_K_M.gguf --type Q4_K_M
    hybrid-gguf quantize tiny-bf16.gguf tiny-Q8_0-pure.gguf --type Q8_0 --pure
    hybrid-gguf imatrix tiny imatrix.npz
    hybrid-gguf quantize tiny-bf16.gguf tiny-IQ3_S-imat.gguf --type IQ3_S --imatrix imatrix.npz
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybrid.cli.common import OneLineParser, add_debug_flag, int_at_least, run_cli
from hybrid.errors import HybridError

MIB = 2**20


def build_parser() -> argparse.ArgumentParser:
    from hybrid.baselines.gguf_export import OUTTYPES
    from hybrid.baselines.quantize import TYPES

    p = OneLineParser(prog="hybrid-gguf", description=__doc__.splitlines()[0],
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
    q.add_argument("--threads", type=int_at_least(0), default=0, help="quantizer threads (default: all)")
    q.add_argument("--imatrix", default=None, metavar="FILE.npz", help="importance matrix from `hybrid-gguf imatrix`")
    q.add_argument("--verbose", action="store_true", help="show llama.cpp's quantize log")
    add_debug_flag(q)
    m = sub.add_parser("imatrix", help="importance matrix (mean squared matmul inputs) from hybrid's forward")
    m.add_argument("model", metavar="MODEL_DIR", help="model folder, or 'tiny'")
    m.add_argument("out", metavar="OUT.npz")
    m.add_argument("--n-ctx", type=int_at_least(2), default=128, help="tokens per calibration chunk (default 128)")
    m.add_argument("--chunks", type=int_at_least(1), default=16, help="calibration chunks (default 16)")
    add_debug_flag(m)
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

    imatrix = None
    if args.imatrix:
        from hybrid.baselines import imatrix as im

        if not Path(args.imatrix).is_file():
            raise HybridError(f"--imatrix {args.imatrix}: file not found")
        imatrix = im.load(Path(args.imatrix))
    out = quantize_gguf(args.src, args.dst, args.qtype, pure=args.pure, nthread=args.threads,
                        verbose=args.verbose, imatrix=imatrix)
    print(f"wrote {out}: {args.qtype}{' (pure)' if args.pure else ''}, {out.stat().st_size / MIB:.2f} MiB")
    return 0


def _imatrix(args) -> int:
    from tokenizers import Tokenizer

    from hybrid.baselines import imatrix as im
    from hybrid.model.registry import resolve_model_path

    if args.n_ctx < 2 or args.chunks < 1:
        raise HybridError("--n-ctx must be >= 2 and --chunks >= 1")
    src = resolve_model_path(args.model)
    chunks = im.calibration_chunks(src, Tokenizer.from_file(str(src / "tokenizer.json")), args.n_ctx, args.chunks)
    if not chunks:
        raise HybridError(f"no calibration text of {args.n_ctx} tokens for {src}")
    data = im.compute_imatrix(src, chunks)
    im.save(Path(args.out), data)
    print(f"wrote {args.out}: {len(data)} tensors from {len(chunks)} x {args.n_ctx} tokens")
    return 0


COMMANDS = {"export": _export, "quantize": _quantize, "imatrix": _imatrix}


def main(argv=None) -> int:
    return run_cli(lambda a: COMMANDS[a.cmd](a), build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
