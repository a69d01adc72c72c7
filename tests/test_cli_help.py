"""Every command's --help prints its usage and exits 0 (argparse %-formats help strings: a bare % in one
used to crash `hybrid-bench --help` with a traceback)."""
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
