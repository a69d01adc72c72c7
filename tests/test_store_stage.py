"""Prefill offload from the CPU expert store (hybrid.runtime.store_stage), on the CPU: a store slot
uploaded and unpacked is the checkpoint's bytes again, bit for bit, for both NVFP4 CPU tile families
and FP8, padded tiles included; the global scales are the ones the checkpoint path folds; runs of
neighbouring slots go up in one copy; a bad HYBRID_PREFILL_SOURCE is one clear error."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cpu import layout as cpu_layout
from cpu.expert import NVFP4_F32, NVFP4_I16
from hybrid.checkpoint.formats import QType
from hybrid.errors import HybridError
from hybrid.experts.store import ExpertStore
from hybrid.runtime.prefill_stream import _fill, _raw_shapes
from hybrid.runtime.store_stage import (SOURCE_ENV, STAGE_KERNEL_ENV, StoreSource, _weight, source_mode,
                                        stage_kernel_enabled)
from tests.test_prefill_stream import _rand_fp8, _rand_nvfp4


def _store(qtype, L, E, H, I, seed):
    """Random experts {(layer, e): (gate, up, down)} and the ExpertStore built from them (4 KiB pages)."""
    gen = torch.Generator().manual_seed(seed)
    rand = (lambda n, k: _rand_nvfp4(gen, n, k)) if qtype is QType.NVFP4 else (lambda n, k: _rand_fp8(gen, n, k))
    ws = {(l, e): (rand(I, H), rand(I, H), rand(H, I)) for l in range(L) for e in range(E)}
    return ws, ExpertStore.build(L, E, H, I, lambda l, e: ws[l, e], qtype, hugepages="off", progress=False)


@pytest.mark.parametrize("int16", [True, False])
@pytest.mark.parametrize("n,k", [(64, 128), (80, 64), (8, 256)])
def test_nvfp4_tile_families_invert(int16, n, k):
    gen = torch.Generator().manual_seed(n + k)
    qw = _rand_nvfp4(gen, n, k)
    data, scale = qw.data.numpy(), qw.scale.view(torch.uint8).numpy()
    tiles = cpu_layout.pack_nvfp4(data, scale, int16=int16)
    flat = torch.from_numpy(tiles.reshape(1, tiles.shape[0], -1))               # [n=1, NT, tile bytes]
    d, s = _weight(NVFP4_I16 if int16 else NVFP4_F32, flat, k, cpu_layout.R)
    assert torch.equal(d[0, :n], qw.data) and torch.equal(s[0, :n], qw.scale.view(torch.uint8))
    assert not d[0, n:].any() and not s[0, n:].any()                             # padded rows are zeros


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
def test_uploaded_slots_unpack_to_checkpoint_bytes(qtype):
    """Two layers of 6 experts, I = 80 (padded tiles); experts [1, 2, 3] go up in one copy, [5, 0] in two."""
    L, E, H, I = 2, 6, 128, 80
    ws, store = _store(qtype, L, E, H, I, seed=7)
    try:
        src = StoreSource(store)
        meta = SimpleNamespace(qtype=qtype, hidden=H, inter=I)
        for layer, group in ((1, [1, 2, 3]), (0, [5, 0])):
            G = len(group)
            got = {k: torch.full(s, 0xAB, dtype=dt) for k, (s, dt) in _raw_shapes(qtype, G, H, I).items()}
            want = {k: torch.zeros(s, dtype=dt) for k, (s, dt) in _raw_shapes(qtype, G, H, I).items()}
            slots = torch.zeros(G, src.S, dtype=torch.uint8)
            copies = []
            real_copy = torch.Tensor.copy_
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(torch.Tensor, "copy_", lambda d, s, **kw: copies.append(s.numel()) or real_copy(d, s, **kw))
                assert src.upload(layer, group, slots) == G * src.S
            assert copies == ([3 * src.S] if group == [1, 2, 3] else [src.S, src.S])
            src.unpack(slots, got, G)
            got["gs"][:G] = src.global_scales(layer, group)
            for j, e in enumerate(group):
                _fill(want, j, ws[layer, e], meta)
            for name in want:
                assert torch.equal(got[name], want[name]), (layer, group, name)
    finally:
        store.close()


def test_source_mode(monkeypatch):
    monkeypatch.delenv(SOURCE_ENV, raising=False)
    assert source_mode() == "store"
    monkeypatch.setenv(SOURCE_ENV, "Checkpoint")
    assert source_mode() == "checkpoint"
    monkeypatch.setenv(SOURCE_ENV, "disk")
    with pytest.raises(HybridError, match=f"{SOURCE_ENV}='disk': expected one of store, checkpoint"):
        source_mode()


def test_stage_kernel_env(monkeypatch):
    monkeypatch.delenv(STAGE_KERNEL_ENV, raising=False)
    assert stage_kernel_enabled()
    monkeypatch.setenv(STAGE_KERNEL_ENV, "0")
    assert not stage_kernel_enabled()
    monkeypatch.setenv(STAGE_KERNEL_ENV, "yes")
    with pytest.raises(HybridError, match=f"{STAGE_KERNEL_ENV}='yes': expected 1"):
        stage_kernel_enabled()


def test_pin_without_cuda_is_none():
    """No CUDA here: pin() says so in a log line and returns None (prefill offload reads the checkpoint)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine pins for real (tests/test_prefill_stream_cuda.py)")
    store = SimpleNamespace(arena=SimpleNamespace(array=np.zeros(4096, np.uint8)))
    assert StoreSource.pin(store) is None


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
def test_load_slot_packs_what_a_slot_load_packs(qtype):
    """StoreSource.load_slot into slot 2 of 4 (QPN storage tensors on the CPU): the words, scales and
    folded global scales QPNExpertSlots.load packs from the checkpoint's tensors; other slots untouched."""
    from hybrid.kernels import QPNExpertSlots, layout

    H, I = 128, 64
    ws, store = _store(qtype, 2, 5, H, I, seed=11)
    try:
        src = StoreSource(store)
        slots = QPNExpertSlots(4, H, I, qtype, torch.device("cpu"))
        slots._alloc()                                        # the CUDA storage's tensors, on the CPU
        src.load_slot(slots, 2, 1, 3)
        gate, up, down = ws[1, 3]
        if qtype is QType.NVFP4:
            (wg, sg), (wu, su), (wd, sd) = (layout.pack_nvfp4(q) for q in (gate, up, down))
            assert torch.equal(slots.s13[2], torch.cat([sg, su])) and torch.equal(slots.s2[2], sd)
            assert not slots.s13[[0, 1, 3]].any()
        else:
            wg, wu, wd = (layout.pack_fp8(q) for q in (gate, up, down))
        assert torch.equal(slots.w13[2], torch.cat([wg, wu])) and torch.equal(slots.w2[2], wd)
        assert slots.gs[2].tolist() == [np.float32(layout.global_scale(q)) for q in (gate, up, down)]
        assert not slots.w13[[0, 1, 3]].any() and not slots.gs[[0, 1, 3]].any()
        assert slots.host == [None, None, True, None]
    finally:
        store.close()


def test_promote_mode_and_target(monkeypatch):
    """Promotions read the store (the default, or HYBRID_PROMOTE_SOURCE=store) only with a pinned source
    and packed slot storage of the store's weight type; HYBRID_PROMOTE_SOURCE=checkpoint reads the
    checkpoint."""
    from hybrid.runtime.hybrid_experts import HybridExperts
    from hybrid.runtime.store_stage import PROMOTE_ENV, promote_mode

    monkeypatch.delenv(PROMOTE_ENV, raising=False)
    assert promote_mode() == "store"
    packed = SimpleNamespace(qtype=QType.NVFP4)
    card = SimpleNamespace(slots=SimpleNamespace(packed=lambda layer: packed if layer == 0 else None))
    ex = HybridExperts.__new__(HybridExperts)
    ex.store_source = StoreSource.__new__(StoreSource)                # only its store's weight type matters
    ex.store_source.store = SimpleNamespace(qtype=QType.NVFP4)
    assert ex._promote_target(card, 0) is packed                     # default: the store
    monkeypatch.setenv(PROMOTE_ENV, "checkpoint")
    assert ex._promote_target(card, 0) is None
    monkeypatch.setenv(PROMOTE_ENV, "store")
    assert ex._promote_target(card, 0) is packed
    assert ex._promote_target(card, 1) is None                       # reference storage (CPU card)
    packed.qtype = QType.FP8
    assert ex._promote_target(card, 0) is None                       # not the store's weight type
    ex.store_source = None
    assert ex._promote_target(card, 0) is None                       # nothing pinned
    monkeypatch.setenv(PROMOTE_ENV, "disk")
    with pytest.raises(HybridError, match=f"{PROMOTE_ENV}='disk'"):
        promote_mode()
