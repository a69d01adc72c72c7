"""tools/gpu_miss_graph_ab.py on the CPU: wall_times (a profiled GPU timeline's exposed time per kernel, overlapping
kernels charged only what they add to the latest end, its idle gaps and each kernel's start after the previous one's
end, per step) and mode_env (the switches of one mode)."""
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

PATH = Path(__file__).resolve().parents[1] / "tools" / "gpu_miss_graph_ab.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("gpu_miss_graph_ab", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ev(name, start, end, dev="CUDA"):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                           device_type=SimpleNamespace(name=dev))


def test_wall_times_overlap_idle_and_steps():
    tool = load_tool()
    # a step: a (0-10), b overlapping its tail (5-12), a gap, c (15-20) holding d (16-18); a CPU event and an
    # empty record are not counted; the second step is the first 30 us later
    one = [ev("a", 0, 10), ev("b", 5, 12), ev("c", 15, 20), ev("d", 16, 18), ev("cpu", 0, 30, "CPU"), ev("z", 3, 3)]
    two = [ev(e.name, e.time_range.start + 30, e.time_range.end + 30, e.device_type.name) for e in one]
    w = tool.wall_times(one + two, steps=2)
    assert w["span_us"] == 25.0                       # 0 .. 50 over 2 steps
    assert w["idle_us"] == 8.0                        # gaps 12-15, 20-30, 42-45
    assert {n: us for n, us, _ in w["exposed"]} == {"a": 10.0, "b": 2.0, "c": 5.0, "d": 0.0}
    assert w["start_after_prev"]["b"] == -5.0 and w["start_after_prev"]["d"] == -4.0
    assert w["start_after_prev"]["a"] == 6.0          # (0 - 0 + 30 - 18) / 2
    assert tool.wall_times([ev("cpu", 0, 1, "CPU")], 1) == {}


def test_mode_env_one_or_several_switches():
    tool = load_tool()
    assert tool.mode_env("HYBRID_FUSED_NEW", "norm,router+x") == {"HYBRID_FUSED_NEW": "norm,router+x"}
    assert tool.mode_env("HYBRID_PDL+HYBRID_SMEM_CARVEOUT", "1+-1") == {"HYBRID_PDL": "1", "HYBRID_SMEM_CARVEOUT": "-1"}
    with pytest.raises(SystemExit, match="2 switches"):
        tool.mode_env("HYBRID_PDL+HYBRID_SMEM_CARVEOUT", "1")
