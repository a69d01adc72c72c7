"""CPU-only build check: every QPN kernel compiles for sm_70 and sm_90 (NVRTC 12 + ptxas from the
pip wheels) with no register spills, and each path uses its tensor-core instruction."""
import pytest

nvrtc = pytest.importorskip("nvidia.cuda_nvrtc", reason="needs nvidia-cuda-nvrtc-cu12 (pip)")
pytest.importorskip("nvidia.cuda_nvcc", reason="needs nvidia-cuda-nvcc-cu12 (pip) for ptxas")

from hybrid.kernels.build import KERNELS, compile_check  # noqa: E402
from hybrid.kernels.qpn import GEMMF_TILES  # noqa: E402


@pytest.mark.parametrize("sm,mma", [(70, "mma.sync.aligned.m8n8k4"), (90, "mma.sync.aligned.m16n8k16")])
def test_compiles_without_spills(sm, mma):
    reports, ptx = compile_check(sm)
    assert sorted(r.name for r in reports) == sorted(KERNELS)
    assert {f"qpn{f}_gemmf_{bm}x{bn}" for f in (2, 8) for bm, bn in GEMMF_TILES} <= set(KERNELS)
    spills = [r.name for r in reports if r.spill_stores or r.spill_loads]
    assert not spills, f"sm_{sm} kernels spill: {spills}"
    assert mma in ptx


def test_cli_compile_only_exit_code(capsys):
    from hybrid.cli.bench import main

    assert main(["cuda-kernels", "--compile-only", "--arch", "sm_70"]) == 0
    out = capsys.readouterr().out
    assert "qpn2_linear_mt1" in out and "OK: no spills" in out


def test_prebuilt_ptx_fallback_plain_or_gzipped(tmp_path, monkeypatch):
    """Where NVRTC cannot build (e.g. NVRTC 13 for sm_70), the prebuilt PTX of this exact source is loaded,
    as written or gzipped (`.ptx.gz`); with neither, the NVRTC error stands."""
    import gzip

    from hybrid.kernels import build
    from hybrid.kernels.nvrtc import NvrtcError

    def no_nvrtc(*_a, **_k):
        raise NvrtcError("no NVRTC for sm_70 here")

    monkeypatch.setattr(build, "load_nvrtc", no_nvrtc)
    monkeypatch.setenv("HYBRID_CACHE_DIR", str(tmp_path))
    ptx = b"// PTX stand-in\n.version 7.0\n"
    with pytest.raises(NvrtcError, match="no NVRTC"):
        build._image_for(70, True)
    pre = build.prebuilt_path(70)
    pre.with_name(pre.name + ".gz").write_bytes(gzip.compress(ptx))
    assert build._image_for(70, True) == ptx
    pre.write_bytes(ptx + b"// plain\n")
    assert build._image_for(70, True) == ptx + b"// plain\n"


def test_l2_hint_source_compiles_and_stays_off_on_volta(monkeypatch):
    """HYBRID_QPN_L2=evict_first: on sm_80+ every weight load / copy of the hinted source carries an L2 cache
    policy (no spills); Volta's PTX is the plain source's; the switch is read per sm, a bad value is one line."""
    from hybrid.errors import HybridError
    from hybrid.kernels import build

    reports, ptx = compile_check(90, build.hinted_source())
    assert not [r.name for r in reports if r.spill_stores or r.spill_loads]
    assert "createpolicy.fractional.L2::evict_first" in ptx and "L2::cache_hint" in ptx
    assert "L2::cache_hint" not in compile_check(90)[1]
    assert compile_check(70, build.hinted_source())[1] == compile_check(70)[1]
    monkeypatch.delenv(build.L2_ENV, raising=False)
    assert not build.l2_evict_first(90)
    monkeypatch.setenv(build.L2_ENV, "evict_first")
    assert build.l2_evict_first(90) and build.l2_evict_first(80) and not build.l2_evict_first(70)
    monkeypatch.setenv(build.L2_ENV, "normal")
    assert not build.l2_evict_first(90)
    monkeypatch.setenv(build.L2_ENV, "sometimes")
    with pytest.raises(HybridError, match="HYBRID_QPN_L2='sometimes'"):
        build.l2_evict_first(90)
