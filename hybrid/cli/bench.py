"""hybrid-bench: kernels, speed, quality, calibration. One module per benchmark in hybrid/bench/.

Each benchmark module defines `HELP: str`, `add_arguments(parser)` and `run(args) -> int`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from hybrid.cli.common import OneLineParser, add_debug_flag, run_cli

BENCHES = {
    "cpu-kernels": "hybrid.bench.cpu_kernels",
    "cuda-kernels": "hybrid.bench.cuda_kernels",
    "calibrate": "hybrid.bench.calibrate",
    "cache": "hybrid.bench.cache",
    "quality": "hybrid.bench.quality",
    "speed": "hybrid.bench.speed",
    "decode": "hybrid.bench.decode",
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="hybrid-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, modname in BENCHES.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name != modname:
                raise
            continue
        p = sub.add_parser(name, help=mod.HELP.replace("%", "%%"), description=mod.HELP)  # argparse %-formats help
        mod.add_arguments(p)
        add_debug_flag(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    return run_cli(lambda a: a._run(a), parser, argv)


if __name__ == "__main__":
    sys.exit(main())
