"""ExpertStore: layout, each backing path (hugetlb where reserved, thp, normal), errors."""
import logging
import resource

import numpy as np
import pytest
import torch

from cpu import layout
from hybrid.checkpoint.formats import QType
from hybrid.errors import CheckpointError, HybridError
from hybrid.experts import store as st
from hybrid.experts.store import ExpertStore
from hybrid.hardware import MemoryInfo, detect_memory
from tests.test_cpu_kernels import packed, rand_fp8, rand_nvfp4

L, E, H, I = 2, 3, 64, 48


def experts(qtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    mk = rand_nvfp4 if qtype == "nvfp4" else rand_fp8
    return {(l, e): (mk(I, H, rng), mk(I, H, rng), mk(H, I, rng)) for l in range(L) for e in range(E)}


@pytest.mark.parametrize("qtype", ["nvfp4", "fp8"])
def test_build_lays_out_every_expert_in_its_slot(qtype):
    ws = experts(qtype)
    s = ExpertStore.build(L, E, H, I, lambda l, e: ws[l, e], qtype, hugepages="off", progress=False)
    try:
        assert s.qtype is QType(qtype) and s.backing == "normal"
        assert s.nbytes == L * E * s.slot_nbytes
        g, u, d = ws[1, 2]
        gu0, dn0 = s.offsets[1, 2]
        nti = layout.num_tiles(I)
        pairs = s.arena.array[gu0:dn0].reshape(nti, 2, -1)
        assert np.array_equal(pairs[:, 0].ravel(), packed(g).ravel())
        assert np.array_equal(pairs[:, 1].ravel(), packed(u).ravel())
        assert np.array_equal(s.arena.array[dn0: gu0 + s.slot_nbytes], packed(d).ravel())
        want = [float(q.scale_2 if qtype == "nvfp4" else q.scale) for q in (g, u, d)]
        assert np.allclose(s.scales[1, 2], want, rtol=0)
        gu, dn, scl = s.slots(1, [2, 0])
        assert gu.tolist() == [s.offsets[1, 2, 0], s.offsets[1, 0, 0]] and scl.shape == (2, 3)
    finally:
        s.close()


def test_auto_logs_one_line_naming_the_backing(caplog):
    ws = experts("nvfp4")
    with caplog.at_level(logging.INFO, logger="hybrid.experts"):
        s = ExpertStore.build(L, E, H, I, lambda l, e: ws[l, e], QType.NVFP4, progress=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "hybrid.experts"]
    expected = ("hugetlb" if detect_memory().hugepages_free >= 1
                else "thp" if st.thp_mode() in ("always", "madvise") else "normal")
    assert s.backing == expected
    assert expected in lines[0]
    # a thp arena says, after the fill, how much of it the kernel backed with 2 MiB pages
    assert len(lines) == (2 if expected == "thp" else 1)
    if expected == "thp":
        assert "in 2 MiB pages after the fill" in lines[1]
    s.close()


def test_normal_path():
    a = st.alloc_normal(5 * 4096 + 3)
    a.array[:] = 7
    assert a.backing == "normal" and a.array.size == 5 * 4096 + 3 and int(a.array.sum()) == 7 * a.array.size
    assert a.huge_fraction() == 0.0
    a.close()


@pytest.mark.skipif(st.thp_mode() == "never", reason="transparent hugepages disabled on this machine")
def test_thp_path_is_2mib_aligned():
    a = st.alloc_thp(3 * st.HUGE + 100)
    a.array[::4096] = 1
    assert a.backing == "thp" and a.array.ctypes.data % st.HUGE == 0 and a.array.size == 3 * st.HUGE + 100
    assert int(a.array.sum()) == len(range(0, a.array.size, 4096))
    frac = a.huge_fraction()               # what the kernel gave (the madvised range rounds up to 4 pages)
    assert frac is not None and 0.0 <= frac <= 1.0
    a.close()


@pytest.mark.skipif(detect_memory().hugepages_free < 1, reason="no 2 MiB hugepages reserved")
def test_hugetlb_path():
    a = st.alloc_hugetlb(1000)
    a.array[:] = 3
    assert a.backing == "hugetlb" and int(a.array.sum()) == 3000
    a.close()


def test_hugepages_on_without_reserve_names_the_sysctl(monkeypatch):
    monkeypatch.setattr(st, "detect_memory", lambda: MemoryInfo(0, 0, hugepages_total=0, hugepages_free=0,
                                                                 hugepage_size_bytes=st.HUGE))
    ws = experts("nvfp4")
    slot = ExpertStore.build(1, 1, H, I, lambda l, e: ws[0, 0], "nvfp4", hugepages="off",
                             progress=False).slot_nbytes
    need = -(-L * E * slot // st.HUGE)
    with pytest.raises(HybridError, match=rf"sysctl -w vm.nr_hugepages={need}\b"):
        ExpertStore.build(L, E, H, I, lambda l, e: ws[l, e], "nvfp4", hugepages="on", progress=False)


def _pack_nvfp4_numpy(data, scale):
    """The layout written out with numpy (module docstring of cpu/layout.py), for comparison."""
    n, g = scale.shape
    nt = layout.num_tiles(n)
    tiles = np.zeros((nt, g, 9, layout.R), np.uint8)
    for t in range(nt):
        rows = slice(t * layout.R, min(n, (t + 1) * layout.R))
        m = rows.stop - rows.start
        tiles[t, :, :8, :m] = layout.RECODE[data[rows].reshape(m, g, 8)].transpose(1, 2, 0)
        tiles[t, :, 8, :m] = scale[rows].T
    return tiles


def _pack_nvfp4_i16_numpy(data, scale):
    """The int16 kernels' block-major layout (cpu/layout.py) with numpy: per 8-row block, the whole K
    of codes (ModelOpt bytes regrouped per group), then the block's scales."""
    n, g = scale.shape
    nt = layout.num_tiles(n)
    d = np.zeros((nt * layout.R, g * 8), np.uint8)
    s = np.zeros((nt * layout.R, g), np.uint8)
    d[:n], s[:n] = data, scale
    codes = d.reshape(nt, layout.R // 8, 8, g, 2, 4).transpose(0, 1, 3, 4, 2, 5).reshape(nt, layout.R // 8, g * 64)
    scl = s.reshape(nt, layout.R // 8, 8, g).transpose(0, 1, 3, 2).reshape(nt, layout.R // 8, g * 8)
    return np.concatenate([codes, scl], axis=2)


@pytest.mark.parametrize("n,k", [(64, 32), (100, 96), (130, 2048)])
def test_compiled_pack_equals_numpy_layout(n, k):
    rng = np.random.default_rng(n + k)
    data = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = rng.integers(0, 128, (n, k // 16), dtype=np.uint8)
    out = np.full(layout.nvfp4_nbytes(n, k), 0xAB, np.uint8)  # poisoned: padding must be zeroed
    # the fp32-kernel layout (AVX2 hosts default to the int16 kernels' layout: tests/test_cpu_kernels.py)
    assert np.array_equal(layout.pack_nvfp4(data, scale, out, int16=False), _pack_nvfp4_numpy(data, scale))
    out = np.full(layout.nvfp4_nbytes(n, k), 0xAB, np.uint8)
    assert np.array_equal(layout.pack_nvfp4(data, scale, out, int16=True).reshape(-1),
                          _pack_nvfp4_i16_numpy(data, scale).reshape(-1))
    f8 = rng.integers(0, 256, (n, k), dtype=np.uint8)
    want = np.zeros((layout.num_tiles(n), k, layout.R), np.uint8)
    for t in range(want.shape[0]):
        rows = f8[t * layout.R:(t + 1) * layout.R]
        want[t, :, :rows.shape[0]] = rows.T
    out8 = np.full(layout.fp8_nbytes(n, k), 0xCD, np.uint8)
    assert np.array_equal(layout.pack_fp8(f8, out8), want)


@pytest.mark.parametrize("qtype", ["nvfp4", "fp8"])
def test_fill_is_the_same_on_any_number_of_threads(qtype):
    ws = experts(qtype, seed=3)
    stores = [ExpertStore.build(L, E, H, I, lambda l, e: ws[l, e], qtype, hugepages="off", progress=False,
                                workers=w) for w in (1, 2, 5)]
    try:
        for s in stores[1:]:
            assert np.array_equal(s.arena.array, stores[0].arena.array)
            assert np.array_equal(s.scales, stores[0].scales)
    finally:
        for s in stores:
            s.close()


def test_bad_hugepages_flag_and_bad_expert_are_user_errors():
    ws = experts("nvfp4")
    with pytest.raises(HybridError, match="--hugepages"):
        ExpertStore.build(L, E, H, I, lambda l, e: ws[l, e], "nvfp4", hugepages="maybe", progress=False)
    with pytest.raises(CheckpointError, match="layer 0 expert 0 down"):
        ExpertStore.build(L, E, H, I, lambda l, e: (ws[l, e][0], ws[l, e][1], ws[l, e][0]), "nvfp4",
                          hugepages="off", progress=False)
    for bad in ("bf16", "int3"):
        with pytest.raises(HybridError, match="qtype"):
            ExpertStore.build(L, E, H, I, lambda l, e: ws[l, e], bad, hugepages="off", progress=False)
    with pytest.raises(HybridError, match="inter size 40"):
        ExpertStore.build(L, E, H, 40, lambda l, e: ws[l, e], "NVFP4", hugepages="off", progress=False)


@pytest.mark.skipif(0 <= resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] < (4 << 20),
                    reason="RLIMIT_MEMLOCK below 4 MiB")
def test_mlock_small_store():
    ws = experts("fp8")
    s = ExpertStore.build(L, E, H, I, lambda l, e: ws[l, e], "fp8", hugepages="off", mlock=True, progress=False)
    assert s.nbytes > 0
    s.close()


def test_store_keeps_no_reference_to_the_source_tensors():
    import weakref
    ws = experts("nvfp4")
    refs = [weakref.ref(t) for q in ws[0, 0] for t in (q.data, q.scale)]
    s = ExpertStore.build(L, E, H, I, lambda l, e: ws[l, e], "nvfp4", hugepages="off", progress=False)
    del ws
    assert all(r() is None for r in refs)            # no second copy kept alive by the store
    s.close()
    torch.zeros(1)  # keep torch import used
