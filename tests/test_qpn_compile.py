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


def test_l2_hint_on_decode_stream_only_and_off_on_volta(monkeypatch):
    """The default build gives every decode weight load / copy an L2 evict-first policy on sm_80+ (no spills) and
    none to the prefill GEMMs' tile loads; HYBRID_QPN_L2=normal builds without it; Volta's PTX is the same
    either way; the switch is read per sm, a bad value is one line."""
    import re

    from hybrid.errors import HybridError
    from hybrid.kernels import build

    reports, ptx = compile_check(90)
    assert not [r.name for r in reports if r.spill_stores or r.spill_loads]
    assert "createpolicy.fractional.L2::evict_first" in ptx

    def hinted(kernel: str) -> bool:
        body = ptx[ptx.index(f".entry {kernel}("):]
        return "L2::cache_hint" in body[:body.index("\n}\n")]

    assert hinted("qpn2_linear_m1_as2") and hinted("qpn2_linear_mt1_t2u1") and hinted("qpn8_moe_down_mt1_as")
    gemms = re.findall(r"\.entry (qpn[28]_(?:moe_)?gemmf?_\w+)\(", ptx)
    assert gemms and not [g for g in gemms if hinted(g)]
    assert "L2::cache_hint" not in compile_check(90, build.unhinted_source())[1]
    assert compile_check(70, build.unhinted_source())[1] == compile_check(70)[1]
    monkeypatch.delenv(build.L2_ENV, raising=False)
    assert build.l2_mode(90) == build.l2_mode(80) == "evict_first" and build.l2_mode(70) == "normal"
    monkeypatch.setenv(build.L2_ENV, "normal")
    assert build.l2_mode(90) == "normal"
    monkeypatch.setenv(build.L2_ENV, "sometimes")
    with pytest.raises(HybridError, match="HYBRID_QPN_L2='sometimes'"):
        build.l2_mode(90)
