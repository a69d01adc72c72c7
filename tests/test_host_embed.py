"""hybrid.runtime.host_embed and fused.embed_rows on a machine without a GPU: host ids take the reference, a table
that cannot be registered gives None (the decode then copies it to the card), bad arguments one-line errors. The
kernel itself: tests/test_fused_emu.py (emulated) and tests/test_fused_cuda.py (GPU)."""
import pytest
import torch

from hybrid.kernels import fused
from hybrid.runtime.host_embed import HostEmbedding, host_embed_enabled, owned_copy


def test_host_ids_take_the_reference():
    table = torch.randn(10, 6, dtype=torch.float32).to(torch.bfloat16)
    ids = torch.tensor([9, 0, 9])
    got = fused.embed_rows(table, ids, torch.float16)
    assert got.dtype is torch.float16 and torch.equal(got, table[ids].to(torch.float16))
    with pytest.raises(ValueError, match=r"^table: expected shape \[V, H\], got \[10\]"):
        fused.embed_rows(table[:, 0], ids, torch.float16)


def test_tables_the_kernel_cannot_read_are_not_pinned():
    assert HostEmbedding.pin(torch.zeros(4, 8, dtype=torch.int8)) is None
    assert HostEmbedding.pin(torch.zeros(8, 4).t()) is None                     # strided


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_no_cuda_gives_none():
    assert HostEmbedding.pin(torch.zeros(4, 8, dtype=torch.float16)) is None


def test_owned_copy_and_switch(monkeypatch):
    t = torch.arange(12, dtype=torch.float16).reshape(3, 4)
    c = owned_copy(t)
    assert torch.equal(c, t) and c.data_ptr() != t.data_ptr() and c.is_contiguous()
    monkeypatch.delenv("HYBRID_HOST_EMBED", raising=False)
    assert host_embed_enabled()
    monkeypatch.setenv("HYBRID_HOST_EMBED", "0")
    assert not host_embed_enabled()
