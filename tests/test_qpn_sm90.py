"""The sm_90a wgmma prefill GEMM (cuda/qpn_sm90.cu, hybrid.kernels.sm90): host-side planning and the
k-slot permutation on the CPU, the CPU-only build check (NVRTC 12 + ptxas wheels), and on an sm_90 GPU
the kernels vs the float64 reference on fresh inputs with poisoned (NaN) outputs."""
import re
from pathlib import Path

import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.kernels import layout, sm90
from tests.test_qpn_layout import fp8, nvfp4

MAKE = {QType.NVFP4: nvfp4, QType.FP8: fp8}


# ---------------------------------------------------------------------------- CPU: permutation
def test_k_slot_perm_is_the_packed_lane_order():
    """k-slot s of the MMA holds element perm(s): lane q's slots 2q, 2q+1, 2q+8, 2q+9 are its
    k-slice 4q..4q+3 (the QPN layout), and perm is a bijection of 0..15."""
    perm = sm90.k_slot_perm()
    assert sorted(perm) == list(range(16))
    for q in range(4):
        assert [perm[2 * q], perm[2 * q + 1], perm[2 * q + 8], perm[2 * q + 9]] == [4 * q + i for i in range(4)]


@pytest.mark.parametrize("m,k,mp,kp", [(3, 64, 64, 64), (17, 352, 64, 384), (100, 320, 128, 320)])
def test_permute_x_gathers_and_pads(m, k, mp, kp):
    x = torch.randn(m, k).half()
    xp = sm90.permute_x(x, mp, kp)
    assert xp.shape == (mp, kp)
    idx = torch.tensor([16 * (c // 16) + sm90.k_slot_perm()[c % 16] for c in range(k)])
    assert torch.equal(xp[:m, :k], x[:, idx])
    assert not xp[m:].any() and not xp[:, k:].any()


@pytest.mark.parametrize("nt", [64, 128, 256])
def test_block_x_is_the_core_matrix_layout(nt):
    """Element (token n, k) of stage (tile, kt) sits at halves (n / 8) 512 + (k / 8) 64 + (n % 8) 8 + k % 8
    of the stage block: byte offset (n / 8) 1024 + k8 128 + (n % 8) 16, the descriptor's SBO 1024, LBO 128."""
    mp, kp = 2 * nt, 192
    xp = torch.arange(mp * kp, dtype=torch.float32).view(mp, kp)
    xb = sm90.block_x(xp, nt)
    for tile, n, k in ((0, 0, 0), (1, 13, 70), (0, nt - 1, kp - 1), (1, 8, 9)):
        stage = tile * (kp // 64) + k // 64
        off = stage * nt * 64 + (n // 8) * 512 + (k % 64 // 8) * 64 + (n % 8) * 8 + k % 8
        assert xb[off] == xp[tile * nt + n, k]


@pytest.mark.parametrize("qtype,n,k", [(QType.NVFP4, 40, 192), (QType.FP8, 24, 96)])
def test_permuted_fragments_multiply_to_the_product(qtype, n, k):
    """The emulated data flow: A[r, slot] = the lane's decoded weight of that slot (W[r, 16 G +
    perm(slot)]), B[slot, m] = xp[m, slot]: A . B equals x . W^T."""
    qw = MAKE[qtype](n, k, seed=5)
    if qtype is QType.NVFP4:
        words, scales = layout.pack_nvfp4(qw)
        wd = layout.decode_nvfp4(words, scales, n, k, float(qw.scale_2)).double()
    else:
        wd = layout.decode_fp8(layout.pack_fp8(qw), n, k, float(qw.scale)).double()
    idx = torch.tensor([16 * (c // 16) + sm90.k_slot_perm()[c % 16] for c in range(k)])
    a = wd[:, idx]                                  # [N, K] in k-slot order
    x = torch.randn(7, k).half()
    b = sm90.permute_x(x, 7, k).double()            # [M, K] in k-slot order
    torch.testing.assert_close(b @ a.t(), x.double() @ wd.t(), rtol=1e-12, atol=1e-9)


# ---------------------------------------------------------------------------- CPU: planning
def test_stages_match_the_source():
    """STAGES / MIN_BLOCKS in sm90.py are the WGMMA(FMT, BR, NT, ST, MINB) lines of the source."""
    src = Path(sm90.__file__).with_name(sm90.SOURCE_NAME).read_text()
    rows = [tuple(map(int, r)) for r in re.findall(r"^WGMMA\((\d), (\d+), (\d+), (\d+), (\d), (\d+)\)", src, re.M)]
    assert {(f, br, nt): st for f, br, nt, st, _, _ in rows} == sm90.STAGES
    assert {(br, nt): mb for _, br, nt, _, mb, _ in rows} == sm90.MIN_BLOCKS
    assert {(f, br, nt): stw for f, br, nt, _, _, stw in rows} == sm90.STAGES_W
    assert sorted(sm90.MIN_BLOCKS) == sorted(sm90.TILES)


def test_source_shares_qpn_helpers():
    """sm90.source() carries qpn.cu's device helpers, each once and as qpn.cu has them (no copy in
    qpn_sm90.cu); a name qpn.cu lacks is a clear error."""
    from hybrid.kernels import build

    raw = Path(sm90.__file__).with_name(sm90.SOURCE_NAME).read_text()
    names = re.search(r"^// QPN_SHARED: (.*)$", raw, re.M).group(1).split()
    assert "dec_fp4" in names and "store_y" in names
    src = sm90.source()
    for name in names:
        assert not re.search(r"__forceinline__ [\w ]+? " + name + r"\(", raw), f"{name}: copied into qpn_sm90.cu"
        assert len(re.findall(r"__forceinline__ [\w ]+? " + name + r"\(", src)) == 1, name
        assert build.device_functions([name]) in src
    with pytest.raises(ValueError, match="no device function 'nope'"):
        build.device_functions(["nope"])


@pytest.mark.parametrize("fmt", [2, 8])
@pytest.mark.parametrize("tile", sm90.TILES)
def test_shared_memory_fits_the_h200(fmt, tile):
    """Every kernel's dynamic shared memory fits one SM (227 KB per block); MIN_BLOCKS of them fit."""
    smem = sm90.smem_bytes(fmt, *tile)
    assert smem <= 227 * 1024
    assert sm90.MIN_BLOCKS[tile] * (smem + 1024) <= 228 * 1024
    assert smem >= tile[1] * (tile[0] + 4) * 4   # the epilogue's staging
    smem_w = sm90.smem_bytes(fmt, *tile, "_w")   # one block per SM
    assert tile[1] * (tile[0] + 4) * 4 <= smem_w <= 227 * 1024


def test_plan_forced_grid_and_splits():
    p = sm90.plan(2, 512, 151936, 2048, 132, tile=(128, 256), splits=1, pipe="_w")   # lm_head, one split
    assert p.kernel == "qpn2_wgmma_128x256_w" and p.grid == (2, 1187, 1) and p.ks == 32 and p.pipe == "_w"
    assert (p.mp, p.kp) == (512, 2048)
    p = sm90.plan(8, 17, 200, 352, 132, tile=(256, 64), splits=1, pipe="_s")  # FP8, K = 32 mod 64: Kp 384
    assert p.kernel == "qpn8_wgmma_256x64_s" and (p.mp, p.kp) == (64, 384) and p.grid == (1, 1, 1) and p.ks == 6
    p = sm90.plan(2, 100, 300, 4096, 132, tile=(128, 64), splits=100)   # at most one split per step
    assert p.grid == (2, 3, 64) and p.ks == 1
    p = sm90.plan(2, 100, 300, 4096, 132, tile=(128, 64), splits=3)     # 64 steps in 3 splits of 22 (the last 20)
    assert p.grid[2] == 3 and p.ks == 22
    with pytest.raises(ValueError, match="must be one of"):
        sm90.plan(2, 100, 300, 4096, 132, tile=(128, 32))
    with pytest.raises(ValueError, match="pipe must be"):
        sm90.plan(2, 100, 300, 4096, 132, pipe="_x")
    with pytest.raises(ValueError, match="bad shape"):
        sm90.plan(2, 100, 300, 96, 132)


@pytest.mark.parametrize("fmt,m,n,k", [(2, 512, 151936, 2048), (8, 64, 5120, 25600), (2, 17, 4096, 2048),
                                       (8, 300, 768, 2048)])
def test_plan_is_the_least_modelled_cost(fmt, m, n, k):
    """The picked plan costs no more than any forced tile and split count, and its cost is cost_us."""
    p = sm90.plan(fmt, m, n, k, 132)
    assert p.us == pytest.approx(sm90.cost_us(fmt, m, n, k, 132, p.tile, p.grid[2], p.ks, p.pipe))
    for tile in sm90.TILES:
        for sp in (1, 2, 3, 5, 8):
            for pp in sm90.PLAN_PIPES:
                assert p.us <= sm90.plan(fmt, m, n, k, 132, tile=tile, splits=sp, pipe=pp).us + 1e-9


def test_cost_counts_whole_waves():
    """A last partial wave costs a whole one: 133 blocks of a one-per-SM tile take two waves on 132 SMs."""
    one = sm90.cost_us(2, 256, 128 * 132, 2048, 132, (128, 256), 1, 32)
    two = sm90.cost_us(2, 256, 128 * 133, 2048, 132, (128, 256), 1, 32)
    step = sm90.STEP_US[(2, 128, 256, "")]
    assert two - one == pytest.approx(32 * step, rel=1e-3)


def test_qpn_hook_is_sm90_only():
    from hybrid.kernels import qpn

    assert qpn.use_sm90(90, "wgmma") and not qpn.use_sm90(80, "wgmma") and not qpn.use_sm90(90, "mt")
    old = qpn.SM90_DEFAULT[0]
    try:
        qpn.SM90_DEFAULT[0] = False
        assert not qpn.use_sm90(90, None, 2, 512, 25600, 5120, 132)
        qpn.SM90_DEFAULT[0] = True   # by the models: dense_up at M = 512 yes (measured 2x), M = 16 never
        assert qpn.use_sm90(90, None, 2, 512, 25600, 5120, 132) and not qpn.use_sm90(90, None, 2, 16, 25600, 5120, 132)
        assert not qpn.use_sm90(80, None, 2, 512, 25600, 5120, 132)
    finally:
        qpn.SM90_DEFAULT[0] = old
    # elsewhere "wgmma" plans as the default
    assert qpn.prefill_plan(2, 512, 4096, 2048, 108, 80, "wgmma") == qpn.prefill_plan(2, 512, 4096, 2048, 108, 80)


# ---------------------------------------------------------------------------- CPU: build check
def test_compiles_for_sm90a_without_spills():
    pytest.importorskip("nvidia.cuda_nvrtc", reason="needs nvidia-cuda-nvrtc-cu12 (pip)")
    pytest.importorskip("nvidia.cuda_nvcc", reason="needs nvidia-cuda-nvcc-cu12 (pip) for ptxas")
    reports, ptx, log = sm90.compile_check()
    assert sorted(r.name for r in reports) == sorted(sm90.KERNELS + sm90.DIAG_KERNELS)
    assert not [r.name for r in reports if r.spill_stores or r.spill_loads]
    for nt in (64, 128, 256):
        assert f"wgmma.mma_async.sync.aligned.m64n{nt}k16.f32.f16.f16" in ptx
    assert "serialize" not in log.lower()
    regs = {r.name: r.registers for r in reports}
    for (br, nt), minb in sm90.MIN_BLOCKS.items():    # the blocks per SM the plan assumes fit in registers
        for f in (2, 8):
            assert regs[f"qpn{f}_wgmma_{br}x{nt}"] * sm90.THREADS * minb <= 65536


def test_cli_compile_only(capsys):
    pytest.importorskip("nvidia.cuda_nvrtc", reason="needs nvidia-cuda-nvrtc-cu12 (pip)")
    pytest.importorskip("nvidia.cuda_nvcc", reason="needs nvidia-cuda-nvcc-cu12 (pip) for ptxas")
    assert sm90.main(["--compile-only"]) == 0
    assert "OK: no spills" in capsys.readouterr().out


# ---------------------------------------------------------------------------- GPU (sm_90)
def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def needs_sm90(fn):
    return pytest.mark.cuda(pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")(fn))


SEED = [2000]


def fresh(shape):
    SEED[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(SEED[0])).half()


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def _check(w, wref, m, k, n, what, tile=None, splits=None, pipe=None):
    x = fresh((m, k))
    y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    sm90.linear(x.cuda(), w, y, tile=tile, splits=splits, pipe=pipe)
    y = y.cpu()
    assert torch.isfinite(y).all(), f"{what} M={m}: unwritten, NaN or overflowed outputs"
    err = rel_err(y, x.double() @ wref.t())
    assert err < 2e-3, f"{what} M={m}: relative error {err:.2e}"


@pytest.mark.parametrize("qtype,n,k", [(QType.NVFP4, 200, 320), (QType.FP8, 200, 352),
                                       (QType.NVFP4, 1000, 2048), (QType.FP8, 136, 1056),
                                       (QType.NVFP4, 5, 4096), (QType.FP8, 300, 2048)])
@pytest.mark.parametrize("tile", [None, *sm90.TILES])
@pytest.mark.parametrize("pipe", sm90.PIPES, ids=["grp", "step", "ws"])
@needs_sm90
def test_wgmma_matches_reference(qtype, n, k, tile, pipe):
    """Every tile forced (and picked), M on both sides of the tiles, N not a multiple of 8,
    16 or 128, FP8 K = 32 mod 64 (the last step half empty)."""
    from hybrid.kernels import QPNWeight

    qw = MAKE[qtype](n, k, seed=n + k)
    w = QPNWeight.from_qweight(qw, "cuda")
    wref = qw.dequantize(torch.float64)
    for m in (17, 64, 100, 129, 512):
        _check(w, wref, m, k, n, f"{qtype.value} N={n} K={k} tile={tile}{pipe}", tile=tile, pipe=pipe)


@pytest.mark.parametrize("qtype,n,k", [(QType.NVFP4, 1000, 2048), (QType.FP8, 136, 1056)])
@pytest.mark.parametrize("splits", [1, 2, 7, 64])
@needs_sm90
def test_wgmma_split_k(qtype, n, k, splits):
    """Split-K forced (1, 2, 7, more than the k-steps): fp32 partials summed in split order;
    deterministic (a second call is identical)."""
    from hybrid.kernels import QPNWeight

    qw = MAKE[qtype](n, k, seed=n + k + 3)
    w = QPNWeight.from_qweight(qw, "cuda")
    wref = qw.dequantize(torch.float64)
    for m in (17, 100, 300):
        _check(w, wref, m, k, n, f"{qtype.value} splits={splits}", splits=splits)
    x = fresh((40, k)).cuda()
    y1 = sm90.linear(x, w, torch.empty(40, n, dtype=torch.float16, device="cuda"), splits=splits)
    y2 = sm90.linear(x, w, torch.empty(40, n, dtype=torch.float16, device="cuda"), splits=splits)
    assert torch.equal(y1, y2)


@needs_sm90
def test_permute_kernel_matches_torch():
    import ctypes

    mod = sm90.module(torch.device("cuda", torch.cuda.current_device()))
    for m, k, mp, kp, nt in ((17, 352, 64, 384, 64), (100, 2048, 128, 2048, 128), (3, 64, 256, 64, 256),
                             (300, 320, 512, 320, 256)):
        x = fresh((m, k)).cuda()
        xp = torch.full((mp * kp,), float("nan"), dtype=torch.float16, device="cuda")
        sm90.launch(mod, "qpn_sm90_permute_x", (-(-mp * kp // 16 // 256), 1, 1), 0,
                    [sm90._p(x), sm90._p(xp), ctypes.c_int(m), ctypes.c_int(k), ctypes.c_int(mp), ctypes.c_int(kp),
                     ctypes.c_int(nt)])
        assert torch.equal(xp.cpu(), sm90.block_x(sm90.permute_x(x.cpu(), mp, kp), nt))


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
@needs_sm90
def test_qpn_linear_wgmma_variant(qtype):
    """qpn_linear with PREFILL_VARIANT 'wgmma' takes the wgmma GEMM on sm_90 for M > 16 (and the
    M <= 16 kernels below), poisoned outputs."""
    from hybrid.kernels import QPNWeight, qpn, qpn_linear

    qw = MAKE[qtype](512, 1024, seed=9)
    w = QPNWeight.from_qweight(qw, "cuda")
    wref = qw.dequantize(torch.float64)
    qpn.PREFILL_VARIANT[0] = "wgmma"
    try:
        for m in (8, 16, 17, 64, 512):
            x = fresh((m, 1024))
            out = torch.full((m, 512), float("nan"), dtype=torch.float16, device="cuda")
            y = qpn_linear(x.cuda(), w, out=out).cpu()
            assert torch.isfinite(y).all() and rel_err(y, x.double() @ wref.t()) < 2e-3, f"M={m}"
    finally:
        qpn.PREFILL_VARIANT[0] = None


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
@needs_sm90
def test_qpn_linear_default_sm90(qtype):
    """SM90_DEFAULT: qpn_linear takes the wgmma GEMM where its model beats the gemmf / WMMA pick's and
    that pick elsewhere; poisoned outputs, both paths correct."""
    from hybrid.kernels import QPNWeight, qpn, qpn_linear

    old = qpn.SM90_DEFAULT[0]
    qpn.SM90_DEFAULT[0] = True
    try:
        for n, k in ((3000, 2048), (200, 320)):
            qw = MAKE[qtype](n, k, seed=n + 1)
            w = QPNWeight.from_qweight(qw, "cuda")
            wref = qw.dequantize(torch.float64)
            for m in (17, 64, 128, 300):
                x = fresh((m, k))
                out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
                y = qpn_linear(x.cuda(), w, out=out).cpu()
                took = qpn.use_sm90(90, None, 2 if qtype is QType.NVFP4 else 8, m, n, k, 132)
                assert torch.isfinite(y).all() and rel_err(y, x.double() @ wref.t()) < 2e-3, f"N={n} M={m} sm90={took}"
    finally:
        qpn.SM90_DEFAULT[0] = old


@pytest.mark.parametrize("splits", [1, 3])
@needs_sm90
def test_wgmma_under_graph_capture(splits):
    """The wgmma prefill (pre-pass, GEMM, split-K sum) captured in a CUDA graph: each replay equals an
    eager call on the same input, bit for bit."""
    from hybrid.kernels import QPNWeight

    n, k, m = 1000, 2048, 64
    qw = MAKE[QType.NVFP4](n, k, seed=11)
    w = QPNWeight.from_qweight(qw, "cuda")
    xs = torch.zeros(m, k, dtype=torch.float16, device="cuda")
    ys = torch.empty(m, n, dtype=torch.float16, device="cuda")
    sm90.linear(xs, w, ys, splits=splits)             # eager first: module load, shared-memory limits
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sm90.linear(xs, w, ys, splits=splits)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sm90.linear(xs, w, ys, splits=splits)
    for _ in range(2):
        x = fresh((m, k)).cuda()
        xs.copy_(x)
        g.replay()
        eager = sm90.linear(x, w, torch.empty(m, n, dtype=torch.float16, device="cuda"), splits=splits)
        torch.cuda.synchronize()
        assert torch.equal(ys, eager), f"splits={splits}: graph replay differs from the eager call"


def test_module_launch_raises_the_dynamic_shared_memory_limit_once(monkeypatch):
    """driver.Module.launch(smem=): the function's dynamic shared memory limit raised (cuFuncSetAttribute,
    attribute 8) the first time a launch asks for more, then only launched with it; smem 0 sets nothing.
    The driver library is a recorder here (no GPU needed); sm90.launch goes through this path."""
    import ctypes

    from hybrid.kernels import driver

    calls = []

    class FakeCuda:
        def cuModuleGetFunction(self, out, handle, name):
            calls.append(("get", name))
            return 0

        def cuFuncSetAttribute(self, fn, attr, value):
            calls.append(("attr", attr, value))
            return 0

        def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, ptrs, extra):
            calls.append(("launch", smem))
            return 0

    class Stream:
        cuda_stream = 0

    monkeypatch.setattr(driver, "_cuda", lambda: FakeCuda())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    mod = object.__new__(driver.Module)
    mod.device, mod._handle, mod._funcs, mod._smem = torch.device("cuda", 0), ctypes.c_void_p(), {}, {}
    mod._carve, mod._carve_default = {}, None                 # a card below sm_90: no carveout set
    monkeypatch.delenv(driver.CARVEOUT_ENV, raising=False)
    for smem in (0, 1000, 1000, 500, 2000):
        mod.launch("k", (1, 1, 1), 256, [ctypes.c_int(1)], smem=smem)
    assert calls == [("get", b"k"), ("launch", 0), ("attr", driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 1000),
                     ("launch", 1000), ("launch", 1000), ("launch", 500),
                     ("attr", driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 2000), ("launch", 2000)]
    # sm_90+: every function's preferred carveout set once before its first launch, again when the A/B switch
    # names another value
    calls.clear()
    mod._carve_default = driver.CARVEOUT_SM90
    carve = driver.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    mod.launch("k", (1, 1, 1), 256, [ctypes.c_int(1)])
    mod.launch("k", (1, 1, 1), 256, [ctypes.c_int(1)])
    monkeypatch.setenv(driver.CARVEOUT_ENV, "-1")
    mod.launch("k", (1, 1, 1), 256, [ctypes.c_int(1)])
    assert calls == [("attr", carve, driver.CARVEOUT_SM90), ("launch", 0), ("launch", 0), ("attr", carve, -1),
                     ("launch", 0)]
