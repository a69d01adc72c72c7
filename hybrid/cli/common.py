"""Shared plumbing for the console scripts: user errors become one line and an exit code."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from hybrid.errors import HybridError

EXIT_USER_ERROR = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (`PROG: error: ... (see --help)`) and exits 2
    instead of printing the whole usage first; its subcommands' parsers are of this class too."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def int_at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= least, else the one-line flag error (`argument --x: expected ...`)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
        return value

    return parse


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")


def run_cli(body: Callable[[argparse.Namespace], int | None], parser: argparse.ArgumentParser,
            argv: Sequence[str] | None = None) -> int:
    """Parse argv, run body(args); HybridError -> `error: ...` on stderr and exit code 2."""
    args = parser.parse_args(argv)
    try:
        rc = body(args)
    except HybridError as exc:
        if getattr(args, "debug", False):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # e.g. `hybrid-plan | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)
