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
from hybrid.runtime.store_stage import SOURCE_ENV, StoreSource, _weight, source_mode
from tests.test_prefill_stream import _rand_fp8, _rand_nvfp4


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
    gen = torch.Generator().manual_seed(7)
    L, E, H, I = 2, 6, 128, 80
    rand = (lambda n, k: _rand_nvfp4(gen, n, k)) if qtype is QType.NVFP4 else (lambda n, k: _rand_fp8(gen, n, k))
    ws = {(l, e): (rand(I, H), rand(I, H), rand(H, I)) for l in range(L) for e in range(E)}
    store = ExpertStore.build(L, E, H, I, lambda l, e: ws[l, e], qtype, hugepages="off", progress=False)
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


def test_pin_without_cuda_is_none():
    """No CUDA here: pin() says so in a log line and returns None (prefill offload reads the checkpoint)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine pins for real (tests/test_prefill_stream_cuda.py)")
    store = SimpleNamespace(arena=SimpleNamespace(array=np.zeros(4096, np.uint8)))
    assert StoreSource.pin(store) is None
