"""tools/gpu_sm_clock_probe.py and tools/qpn_ncu_target.py (GPU probes) on a machine without CUDA: --help works and a
run is one line and exit status 2, not a traceback."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.mark.parametrize("name", ["gpu_sm_clock_probe.py", "qpn_ncu_target.py"])
def test_probe_tool_without_cuda(name):
    helped = subprocess.run([sys.executable, str(TOOLS / name), "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--shape" in helped.stdout
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the probe would run")
    ran = subprocess.run([sys.executable, str(TOOLS / name)], capture_output=True, text=True)
    assert ran.returncode == 2
    assert ran.stderr.strip() == f"{name[:-3]}: no CUDA device" and "Traceback" not in ran.stderr
