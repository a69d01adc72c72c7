"""Every command's --help prints its usage and exits 0 (argparse %-formats help strings: a bare % in one
used to crash `hybrid-bench --help` with a traceback); count flags out of range are one-line errors at
parse time (they were tracebacks deep in a bench, or silently the default)."""
import importlib

import pytest

from hybrid.cli.bench import BENCHES

COMMANDS = ["run", "plan", "quantize", "gguf", "profile", "bench"]


@pytest.mark.parametrize("argv", [[c, "--help"] for c in COMMANDS] + [["bench", b, "--help"] for b in BENCHES])
def test_help_exits_zero(argv, capsys):
    mod = importlib.import_module(f"hybrid.cli.{argv[0]}")
    with pytest.raises(SystemExit) as exc:
        mod.main(argv[1:])
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


BAD = [["bench", "decode", "--prompt-tokens", "0"], ["bench", "decode", "--tokens", "-1"],
       ["bench", "decode", "--warmup", "-1"], ["bench", "quality", "--n-ctx", "1"],
       ["bench", "quality", "--threads", "0"], ["bench", "speed", "--repeats", "0"],
       ["bench", "speed", "--new-tokens", "0"], ["bench", "speed", "--threads", "-2"],
       ["bench", "cpu-kernels", "--threads", "0"], ["bench", "cpu-kernels", "--threads", "x"],
       ["bench", "calibrate", "--out", "x", "--gpu-mib", "0"], ["bench", "cuda-kernels", "--reps", "0"],
       ["bench", "cache", "--trace", "x", "--budget-experts", "-1"],
       ["gguf", "quantize", "a", "b", "--type", "q8_0", "--threads", "-1"]]


@pytest.mark.parametrize("argv", BAD, ids=lambda a: " ".join(a[1:3]))
def test_count_flags_out_of_range(argv, capsys):
    mod = importlib.import_module(f"hybrid.cli.{argv[0]}")
    with pytest.raises(SystemExit) as exc:
        mod.main(argv[1:])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    flag = next(a for a in argv if a.startswith("--") and a not in ("--out", "--trace", "--type"))
    assert len(err.splitlines()) == 1 and flag in err and "expected an integer" in err
