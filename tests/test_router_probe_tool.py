"""tools/gpu_router_probe.py on the CPU: its probe copies of the router kernel are made from the shipped source,
compile for sm_70 and sm_90 without spills, and replace only the router's launch, per HYBRID_ROUTER_PROBE."""
import importlib.util
from pathlib import Path

import pytest

from hybrid.kernels import driver, fused_build

PATH = Path(__file__).resolve().parents[1] / "tools" / "gpu_router_probe.py"


@pytest.fixture
def probe():
    spec = importlib.util.spec_from_file_location("gpu_router_probe", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_source_adds_the_probe_kernels(probe):
    src = fused_build.source()
    out = probe.probe_source(src)
    assert out.startswith(src[: src.index("fused_add_norm_router_e(")])
    for name in ("fused_add_norm_router_e_nolast(", "fused_add_norm_router_e_emptylast(",
                 "fused_add_norm_router_e_stamps("):
        assert out.count(name) == 1
    nolast = out[out.index("fused_add_norm_router_e_nolast("):out.index("fused_add_norm_router_e_emptylast(")]
    assert "arrive_last" not in nolast and "topk_warp" not in nolast and "route_plan_warp" in nolast
    empty = out[out.index("fused_add_norm_router_e_emptylast("):]
    empty = empty[: empty.index("\n}\n")]
    assert "arrive_last" in empty and "topk_warp" not in empty and "*counter = 0" in empty
    stamps = out[out.index("fused_add_norm_router_e_stamps("):]
    stamps = stamps[: stamps.index("\n}\n")]
    assert "route_tokens<4>(" in stamps and all(f"STAMP({n})" in stamps for n in range(5))
    with pytest.raises(ValueError, match="stamps probe"):
        probe.probe_source(src.replace("gridDim.x, &last);\n", "gridDim.x,\n                                    &last);\n", 1))
    with pytest.raises(ValueError, match="zeroing loop"):
        probe.probe_source(src.replace("// the MoE output\n", "// moved\n", 1))


@pytest.mark.parametrize("sm", [70, 90])
def test_probe_kernels_compile_without_spills(probe, monkeypatch, sm):
    pytest.importorskip("nvidia.cuda_nvrtc", reason="needs nvidia-cuda-nvrtc-cu12 (pip)")
    pytest.importorskip("nvidia.cuda_nvcc", reason="needs nvidia-cuda-nvcc-cu12 (pip) for ptxas")
    shipped = fused_build.source()
    monkeypatch.setattr(fused_build, "source", lambda: probe.probe_source(shipped))
    reports, _ = fused_build.compile_check(sm)
    names = {r.name for r in reports}
    assert {f"fused_add_norm_router_e_{m}" for m in ("nolast", "emptylast", "stamps")} <= names
    # the stamps probe may spill (its clock values; its phases are read, not its time)
    assert not [r.name for r in reports if (r.spill_stores or r.spill_loads or r.stack) and not r.name.endswith("_stamps")]


def test_launch_renamed_per_mode(probe, monkeypatch):
    seen = []
    monkeypatch.setattr(driver.Module, "launch", lambda self, name, grid, block, args, *r, **k: seen.append(name))
    monkeypatch.setattr(fused_build, "source", fused_build.source)     # restored after the test
    probe.install()
    probe.install()                                                   # once only
    assert getattr(fused_build.source, "probe", False)
    assert "fused_add_norm_router_e_nolast(" in fused_build.source()
    m = driver.Module.__new__(driver.Module)
    for mode, want in (("off", "fused_add_norm_router_e"), ("nolast", "fused_add_norm_router_e_nolast"),
                       ("emptylast", "fused_add_norm_router_e_emptylast"),
                       ("stamps", "fused_add_norm_router_e_stamps")):
        monkeypatch.setenv(probe.ENV, mode)
        m.launch("fused_add_norm_router_e", (128, 1, 1), 128, [])
        m.launch("fused_rope_attn_e", (8, 1, 1), 128, [])
        assert seen[-2:] == [want, "fused_rope_attn_e"]
    monkeypatch.setenv(probe.ENV, "sometimes")
    with pytest.raises(ValueError, match="HYBRID_ROUTER_PROBE='sometimes'"):
        m.launch("fused_add_norm_router_e", (128, 1, 1), 128, [])


def test_stamps_session_record(probe, monkeypatch):
    """main()'s record of a stamps session: the phases' mean cycles per launch from two reads of probe_stamps."""
    reads = iter([[10, 20, 30, 40, 0, 0, 0, 5], [30, 60, 90, 120, 0, 0, 0, 15]])
    monkeypatch.setattr(probe, "read_stamps", lambda module: next(reads))
    monkeypatch.setattr(fused_build, "module", lambda device: None)
    monkeypatch.setattr(probe, "torch_device", lambda: None)
    got = []
    record = probe.stamps_recorder(got.append)
    record({"check": "a", "env": {probe.ENV: "off"}})
    record({"check": "b", "env": {probe.ENV: "stamps"}})
    record({"check": "c", "env": {probe.ENV: "stamps"}})
    assert "stamps" not in got[0]
    assert got[1]["stamps"] == {"launches": 5, "cycles": dict(zip(probe.PHASES, (2.0, 4.0, 6.0, 8.0)))}
    assert got[2]["stamps"] == {"launches": 10, "cycles": dict(zip(probe.PHASES, (2.0, 4.0, 6.0, 8.0)))}
