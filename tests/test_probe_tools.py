"""tools/qpn_loop_probe.py (a GPU probe) on a machine without CUDA: --help works, the two loop modes exclude each
other, and a run is one line and exit status 2, not a traceback."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[1] / "tools" / "qpn_loop_probe.py"


def test_loop_probe_without_cuda():
    helped = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--launches" in helped.stdout and "--seconds" in helped.stdout
    both = subprocess.run([sys.executable, str(TOOL), "--seconds", "1", "--launches", "2"], capture_output=True,
                          text=True)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the probe would run")
    ran = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True)
    assert ran.returncode == 2
    assert ran.stderr.strip() == "qpn_loop_probe: no CUDA device" and "Traceback" not in ran.stderr
