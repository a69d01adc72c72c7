"""CPU-only build checks of cuda/fused.cu: every fused kernel compiles for sm_70 and sm_90 (NVRTC 12 +
ptxas from the pip wheels) with no register spills and no local-memory stack; the Volta build uses no
instruction that needs sm_80 (cp.async, bf16); the native sm_90 CUBIN of whatever NVRTC this machine
has (NVRTC 13 on the H200 machine) has no spills either; the prebuilt-PTX fallback."""
import pytest

from hybrid.kernels import fused_build as fused
from hybrid.kernels.nvrtc import NvrtcError, load_nvrtc


@pytest.fixture
def wheels():
    pytest.importorskip("nvidia.cuda_nvrtc", reason="needs nvidia-cuda-nvrtc-cu12 (pip)")
    pytest.importorskip("nvidia.cuda_nvcc", reason="needs nvidia-cuda-nvcc-cu12 (pip) for ptxas")


def _clean(reports, what):
    assert sorted(r.name for r in reports) == sorted(fused.KERNELS)
    bad = [(r.name, r.spill_stores, r.spill_loads, r.stack) for r in reports
           if r.spill_stores or r.spill_loads or r.stack]
    assert not bad, f"{what}: kernels spill or use a stack frame: {bad}"


@pytest.mark.parametrize("sm", [70, 90])
def test_fused_compiles_without_spills(wheels, sm):
    reports, ptx = fused.compile_check(sm)
    _clean(reports, f"sm_{sm}")
    assert "cp.async" not in ptx and "bf16" not in ptx


def test_native_sm90_cubin_without_spills():
    try:
        nv = load_nvrtc()
    except NvrtcError as exc:
        pytest.skip(str(exc))
    if 90 not in nv.supported_archs():
        pytest.skip(f"NVRTC {nv.version} cannot target sm_90")
    _clean(fused.native_check(90, nv), f"NVRTC {nv.version} sm_90")


def test_emit_prebuilt_ptx(wheels, tmp_path, monkeypatch):
    """The compute_70 PTX for a GPU machine whose NVRTC cannot target Volta, found through HYBRID_CACHE_DIR."""
    (path,) = fused.emit_prebuilt(tmp_path)
    monkeypatch.setenv("HYBRID_CACHE_DIR", str(tmp_path))
    assert path == fused.prebuilt_path(70) and path.exists()
    assert b".target sm_70" in path.read_bytes() and b"fused_rope_attn" in path.read_bytes()
