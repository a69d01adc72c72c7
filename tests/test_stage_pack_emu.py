"""The stage-pack kernel of cuda/qpn.cu (qpn2_stage_pack: CPU-store slots -> QPN2 words and scales) run on the
CPU under the emulation shim (tests/cuda_emu.py): bit for bit what hybrid.runtime.stage_pack.pack_group packs
from the checkpoint's bytes, into the right slots of a poisoned storage, negative group scales included. Its
GPU run is tests/test_prefill_stream_cuda.py's."""
import ctypes
from types import SimpleNamespace

import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.experts.store import ExpertStore
from hybrid.kernels import QPNExpertSlots, build
from hybrid.runtime.prefill_stream import _fill, _raw_shapes
from hybrid.runtime.stage_pack import pack_group
from hybrid.runtime.store_stage import StoreSource
from tests.cuda_emu import SHIM, compile_emu
from tests.test_prefill_stream import _rand_nvfp4

RULE = "// " + "-" * 64 + " stage pack"
ENTRY = r"""
extern "C" void emu_stage(int gx, int gy, const unsigned char* src, long long S, int H, int I, u32* w13,
                          unsigned char* s13, u32* w2, unsigned char* s2) {
  run_grid(gx, gy, 256, [&] { qpn2_stage_pack(src, S, H, I, w13, s13, w2, s2); });
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    src = build.source()
    kernel = src[src.index(RULE):]
    head = "typedef unsigned int u32;\ntypedef unsigned short u16;\ntypedef unsigned long long u64;\n"
    return compile_emu(tmp_path_factory, "stage", SHIM + head + kernel + ENTRY)


@pytest.mark.parametrize("h,i", [(128, 64), (64, 192)])
def test_stage_pack_kernel_equals_pack_group(lib, h, i):
    gen = torch.Generator().manual_seed(h + i)
    L, E, first, n = 2, 5, 1, 3
    ws = {(l, e): (_rand_nvfp4(gen, i, h), _rand_nvfp4(gen, i, h), _rand_nvfp4(gen, h, i)) for l in range(L) for e in range(E)}
    store = ExpertStore.build(L, E, h, i, lambda l, e: ws[l, e], QType.NVFP4, hugepages="off", progress=False)
    try:
        src = StoreSource(store)
        if src.kind != 2:
            pytest.skip("the stage-pack kernel reads the int16 NVFP4 tile family (an AVX2 host's store)")
        layer, group = 1, [4, 0, 2]
        up = torch.zeros(n, src.S, dtype=torch.uint8)
        src.upload(layer, group, up)
        want = QPNExpertSlots(5, h, i, QType.NVFP4, torch.device("cpu"))
        want._alloc()
        raw = {k: torch.zeros(s, dtype=dt) for k, (s, dt) in _raw_shapes(QType.NVFP4, n, h, i).items()}
        for j, e in enumerate(group):
            _fill(raw, j, ws[layer, e], SimpleNamespace(qtype=QType.NVFP4, hidden=h, inter=i))
        pack_group(want, n, raw, first=first)
        got = QPNExpertSlots(5, h, i, QType.NVFP4, torch.device("cpu"))
        got._alloc()
        for t in (got.w13, got.w2):
            t.fill_(0x5A5A5A5A)
        for t in (got.s13, got.s2):
            t.fill_(0xA5)
        words = (2 * i // 16) * (h // 64) * 128 + (h // 16) * (i // 64) * 128
        p = lambda t: ctypes.c_void_p(t.data_ptr())   # noqa: E731
        lib.emu_stage(ctypes.c_int(-(-words // 256)), ctypes.c_int(n), p(up), ctypes.c_longlong(src.S),
                      ctypes.c_int(h), ctypes.c_int(i), p(got.w13[first]), p(got.s13[first]), p(got.w2[first]),
                      p(got.s2[first]))
        for name in ("w13", "s13", "w2", "s2"):
            g, w = getattr(got, name), getattr(want, name)
            assert torch.equal(g[first:first + n], w[first:first + n]), name
            assert (g[:first] == g.flatten()[0]).all() and (g[first + n:] == g.flatten()[0]).all(), name  # untouched
    finally:
        store.close()
