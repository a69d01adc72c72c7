"""CPU-only build check of cuda/fused.cu: every fused kernel compiles for sm_70 and sm_90 (NVRTC 12 +
ptxas from the pip wheels) with no register spills and no local-memory stack; the Volta build uses no
instruction that needs sm_80 (cp.async, bf16)."""
import pytest

pytest.importorskip("nvidia.cuda_nvrtc", reason="needs nvidia-cuda-nvrtc-cu12 (pip)")
pytest.importorskip("nvidia.cuda_nvcc", reason="needs nvidia-cuda-nvcc-cu12 (pip) for ptxas")

from hybrid.kernels.fused import KERNELS, compile_check  # noqa: E402


@pytest.mark.parametrize("sm", [70, 90])
def test_fused_compiles_without_spills(sm):
    reports, ptx = compile_check(sm)
    assert sorted(r.name for r in reports) == sorted(KERNELS)
    bad = [(r.name, r.spill_stores, r.spill_loads, r.stack) for r in reports
           if r.spill_stores or r.spill_loads or r.stack]
    assert not bad, f"sm_{sm} kernels spill or use a stack frame: {bad}"
    assert "cp.async" not in ptx and "bf16" not in ptx


def test_emit_prebuilt_ptx(tmp_path, monkeypatch):
    """The compute_70 PTX for a GPU machine whose NVRTC cannot target Volta, found through HYBRID_CACHE_DIR."""
    from hybrid.kernels import fused

    (path,) = fused.emit_prebuilt(tmp_path)
    monkeypatch.setenv("HYBRID_CACHE_DIR", str(tmp_path))
    assert path == fused.prebuilt_path(70) and path.exists()
    assert b".target sm_70" in path.read_bytes() and b"fused_rope_attn" in path.read_bytes()
