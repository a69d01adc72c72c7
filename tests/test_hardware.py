"""Hardware detection (parsers, a fake NVML) and `hybrid-bench calibrate` writing a loadable profile."""
from __future__ import annotations

import json
import sys
import types

import pytest

from hybrid import hardware
from hybrid.cli.bench import main as bench_main
from hybrid.planner import load_profile

MEMINFO = """MemTotal:       131916292 kB
MemFree:         2000000 kB
MemAvailable:   126877696 kB
HugePages_Total:    8192
HugePages_Free:     8000
Hugepagesize:       2048 kB
"""

# two sockets' worth of lines trimmed to: 4 logical CPUs, 2 physical cores (hyper-threads)
CPUINFO = "".join(
    f"processor\t: {i}\nmodel name\t: Intel(R) Xeon(R) CPU E5-2686 v4 @ 2.30GHz\n"
    f"physical id\t: 0\ncore id\t\t: {i % 2}\n"
    f"flags\t\t: fpu sse2 avx avx2 fma f16c bmi2\n\n" for i in range(4))


def test_parse_meminfo():
    m = hardware.parse_meminfo(MEMINFO)
    assert m.total_bytes == 131916292 * 1024 and m.available_bytes == 126877696 * 1024
    assert (m.hugepages_total, m.hugepages_free, m.hugepage_size_bytes) == (8192, 8000, 2 * 2**20)


def test_parse_cpuinfo_and_flags():
    info = hardware.parse_cpuinfo(CPUINFO)
    assert (info["logical"], info["physical"]) == (4, 2)
    cpu = hardware.cpu_from(info, None, None)
    assert cpu.model.startswith("Intel(R) Xeon(R) CPU E5-2686 v4")
    assert (cpu.physical_cores, cpu.logical_cores) == (2, 4)
    assert cpu.avx2 and cpu.fma and cpu.f16c and not cpu.avx512
    assert hardware.cpu_from(info, 18, 36).physical_cores == 18    # psutil wins when it answers


def _fake_pynvml(fail_init=False):
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def init():
        if fail_init:
            raise NVMLError("Driver Not Loaded")

    def unsupported(h):
        raise NVMLError("Not Supported")

    m.NVMLError = NVMLError
    m.nvmlInit, m.nvmlShutdown = init, lambda: None
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: b"Tesla V100-SXM2-16GB"
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (7, 0)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=16945512448, free=16500000000, used=0)
    m.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 3
    m.nvmlDeviceGetCurrPcieLinkWidth = unsupported
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 3
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16
    m.nvmlSystemGetDriverVersion = lambda: b"580.159.04"
    m.NVML_CLOCK_SM = 1
    m.nvmlDeviceGetClockInfo = lambda h, kind: 1980 if kind == 1 else 0
    m.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980 if kind == 1 else 0
    m.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 4
    return m


def test_detect_gpus_with_fake_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    gpus = hardware.detect_gpus()
    assert len(gpus) == 2 and gpus[1].index == 1
    g = gpus[0]
    assert (g.name, g.compute_capability, g.memory_total_bytes) == ("Tesla V100-SXM2-16GB", "7.0", 16945512448)
    assert (g.pcie_gen, g.pcie_width, g.pcie_gen_max, g.pcie_width_max) == (3, None, 3, 16)


def test_detect_gpus_without_driver(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_init=True))
    notes: list[str] = []
    assert hardware.detect_gpus(notes) == ()
    assert "NVML unavailable (Driver Not Loaded)" in notes[0]


def test_driver_version(monkeypatch):
    """The driver's version from NVML for the benchmark records; None without a driver or without pynvml."""
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    assert hardware.driver_version() == "580.159.04"
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_init=True))
    assert hardware.driver_version() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)          # import pynvml raises ImportError
    assert hardware.driver_version() is None


def test_sm_clocks(monkeypatch):
    """The SM clock now and at most, and the clock event reasons, for the benchmark records; None without a driver."""
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    assert hardware.sm_clocks(0) == {"sm_clock_mhz": 1980, "sm_clock_max_mhz": 1980, "clock_event_reasons": "0x4"}
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_init=True))
    assert hardware.sm_clocks(0) is None


def test_detect_this_machine():
    hw = hardware.detect()
    assert hw.cpu.physical_cores >= 1 and hw.cpu.logical_cores >= hw.cpu.physical_cores
    assert hw.memory.total_bytes > 2**28
    assert json.loads(json.dumps(hw.to_dict()))["cpu"]["model"]


def test_calibrate_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "here.json"
    rc = bench_main(["calibrate", "--out", str(out), "--cpu-mib", "16", "--gpu-mib", "16",
                     "--pcie-mib", "8", "--repeats", "2", "--base", "v100x2-e5v4"])
    assert rc == 0 and f"wrote {out}" in capsys.readouterr().out
    prof = load_profile(str(out))
    assert prof.name == "here"
    assert prof.cpu.stream_copy_gbs.source == "measured" and prof.cpu.stream_copy_gbs.value > 0
    assert prof.overheads.cpu_dispatch_us.source == "measured"
    assert prof.overheads.token_us == load_profile("v100x2-e5v4").overheads.token_us   # from --base
    assert "git " in prof.cpu.stream_copy_gbs.note
    r8 = prof.cpu.nvfp4_m8_ratio                   # measured with the M = 1 hook, or the default
    assert r8 is not None and r8.value > 0
    assert r8.source == ("measured" if prof.cpu.nvfp4_kernel_gbs.source == "measured" else "assumed")
    import torch

    assert len(prof.gpus) == torch.cuda.device_count()
    for g in prof.gpus:
        assert g.read_gbs.source == g.h2d_gbs.source == "measured"
        assert g.attn_kv_gbs is None or g.attn_kv_gbs.value > 0   # measured, or (it failed) the base's: none


def test_attention_kv_rate_from_two_key_counts():
    """calibrate's attention figure: K and V bytes per key over the time per extra key."""
    from hybrid.bench.calibrate import kv_rate

    # 4 KV heads of 128, fp16: 2048 bytes per key; 2 ns more per key -> 1024 GB/s
    assert kv_rate((10.0, 22.288), (2048, 8192), 4, 128) == pytest.approx(1024, rel=1e-6)
    for flat in ((12.0, 12.0), (12.0, 11.0)):
        with pytest.raises(ValueError, match="did not grow with the keys"):
            kv_rate(flat, (2048, 8192), 4, 128)


def test_kernel_efficiency_leaves_the_fixed_costs_to_graph_kernel_us():
    """calibrate's kernel_efficiency: bytes over the time left after kernels x graph_kernel_us (the planner
    charges those apart), as a share of read bandwidth; capped at 1; no streaming time left is an error."""
    from hybrid.bench.calibrate import efficiency

    # 1 GB in 300 us with 50 kernels at 2 us: 200 us of streaming at 5 TB/s of a 4 TB/s read ceiling -> 1
    assert efficiency(10**9, 300.0, 50, 2.0, 4e12) == 1.0
    assert efficiency(10**8, 300.0, 50, 2.0, 4e12) == pytest.approx(10**8 / 200e-6 / 4e12)
    assert efficiency(10**8, 300.0, 0, 2.0, 4e12) == pytest.approx(10**8 / 300e-6 / 4e12)
    with pytest.raises(ValueError, match="leave no streaming time"):
        efficiency(10**8, 100.0, 50, 2.0, 4e12)


def test_calibrate_bad_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["calibrate", "--out", str(tmp_path / "x.json"), "--repeats", "0"])
    assert exc.value.code == 2
    assert "error: argument --repeats: expected an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("text", ["", "garbage without colon\n"])
def test_parsers_tolerate_odd_input(text):
    assert hardware.parse_meminfo(text).total_bytes == 0
    assert hardware.parse_cpuinfo(text)["logical"] == 0


CU130_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]   # torch's CUDA 13 wheels


def fake_torch_gpu(monkeypatch, cap, archs, n=1):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Tesla V100-SXM2-16GB" if cap == (7, 0) else "GPU")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(archs))


def test_arch_runs_on():
    """CUBINs on their major at a minor up to the GPU's ("a" / "f" ones on that GPU only); PTX on any GPU at or past
    its version."""
    from hybrid.hardware import _arch_runs_on

    assert _arch_runs_on("sm_70", 7, 0) and _arch_runs_on("sm_80", 8, 6) and not _arch_runs_on("sm_86", 8, 0)
    assert not _arch_runs_on("sm_75", 7, 0) and not _arch_runs_on("sm_80", 9, 0)
    assert _arch_runs_on("sm_90a", 9, 0) and not _arch_runs_on("sm_90a", 10, 0) and _arch_runs_on("sm_100", 10, 3)
    assert _arch_runs_on("compute_70", 9, 0) and not _arch_runs_on("compute_120", 7, 0)
    assert not _arch_runs_on("gfx90a", 9, 0) and not _arch_runs_on("sm_x", 7, 0)


@pytest.mark.parametrize("cap,archs,ok", [
    ((7, 0), CU130_ARCHS, False),                              # a V100 under a CUDA 13 torch: the case that matters
    ((7, 0), ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"], True),   # the cu126 wheels
    ((9, 0), CU130_ARCHS, True),
    ((12, 1), CU130_ARCHS, True),                              # sm_120 CUBIN, minor 1
    ((7, 0), [], True),                                        # a build that does not say: not blocked
])
def test_torch_arch_problem(monkeypatch, cap, archs, ok):
    """torch_arch_problem: None where torch's build runs on the GPU (or does not say); else one sentence naming the
    GPU, the build's CUDA and archs and the fix -- and require_gpus, the runtime's and hybrid-quantize's --device
    check, raises it as one line."""
    from hybrid.errors import HybridError
    from hybrid.hardware import require_gpus, torch_arch_problem

    fake_torch_gpu(monkeypatch, cap, archs)
    problem = torch_arch_problem(0)
    assert (problem is None) == ok
    if ok:
        assert require_gpus("--device cuda") == 1
        return
    assert "GPU 0 (Tesla V100-SXM2-16GB, sm_70) cannot run this torch build's kernels" in problem
    assert "cu126" in problem and "--device cpu" in problem and "\n" not in problem
    with pytest.raises(HybridError, match=r"^--gpus 0: GPU 0 \(Tesla V100"):
        require_gpus("--device cuda", [0], "--gpus 0")
