"""hybrid's reference forward vs transformers on the same weights (fp32 tolerance)."""
import pytest
import torch

from hybrid.model import load_model
from hybrid.testing import write_random_model
from tests.quant_layouts import dequantized_copy, to_nvfp4

transformers = pytest.importorskip("transformers")
IDS = torch.tensor([5, 17, 99, 3, 250, 7, 8, 9, 11, 300, 42, 1])


def hf_logits(folder, ids):
    m = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return m(ids[None]).logits[0], m


def hf_greedy(m, ids, n):
    with torch.no_grad():
        out = m.generate(ids[None], max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def hybrid_greedy(model, ids, n):
    model.new_cache(len(ids) + n)
    logits, out, pos = model.forward(ids, 0, last_only=True), [], len(ids)
    for _ in range(n):
        t = int(torch.argmax(logits[-1]))
        out.append(t)
        logits = model.forward(torch.tensor([t]), pos, last_only=True)
        pos += 1
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_bf16_logits_and_greedy_match_transformers(arch, tmp_path):
    d = write_random_model(tmp_path / arch, arch, seed=3)
    ref, m = hf_logits(d, IDS)
    model = load_model(d)
    torch.testing.assert_close(model.forward_logits(IDS), ref, rtol=1e-4, atol=1e-4)
    assert hybrid_greedy(model, IDS, 8) == hf_greedy(m, IDS, 8)


@pytest.mark.parametrize("layout", ["modelopt", "mixed", "compressed-tensors"])
def test_quantized_logits_match_transformers_on_dequantized(layout, qwen3_dir, tmp_path):
    q = to_nvfp4(qwen3_dir, tmp_path / "q", layout)
    ref, m = hf_logits(dequantized_copy(q, tmp_path / "deq"), IDS)
    model = load_model(q)
    torch.testing.assert_close(model.forward_logits(IDS), ref, rtol=1e-4, atol=1e-4)
    assert hybrid_greedy(model, IDS, 8) == hf_greedy(m, IDS, 8)


def test_incremental_decode_equals_full_forward(qwen3_dir):
    model = load_model(qwen3_dir)
    full = model.forward_logits(IDS)
    model.new_cache(len(IDS))
    parts = [model.forward(IDS[:5], 0), model.forward(IDS[5:9], 5), model.forward(IDS[9:], 9)]
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gqa", ["native", "expand"])
@pytest.mark.parametrize("t,past", [(1, 5), (7, 9), (16, 48)])
def test_later_chunk_attention_is_causal_from_its_start(t, past, gqa, monkeypatch):
    """A chunk's T queries at positions past.. see keys 0..past + i: the lower-right causal bias path equals
    the boolean-mask path (HYBRID_PREFILL_MASK=1) and float64 softmax attention, GQA heads shared through
    enable_gqa (native) or stride-0 expanded keys (expand: what GPUs without flash attention take)."""
    from hybrid.model.layers import later_chunk_attention

    monkeypatch.setenv("HYBRID_SDPA_GQA", gqa)
    g = torch.Generator().manual_seed(t * 100 + past)
    hq, hkv, d, s = 8, 2, 16, past + t
    q, k, v = (torch.randn(1, h, n, d, generator=g) for h, n in ((hq, t), (hkv, s), (hkv, s)))
    got = later_chunk_attention(q, k, v, past)
    monkeypatch.setenv("HYBRID_PREFILL_MASK", "1")
    masked = later_chunk_attention(q, k, v, past)
    kk, vv = (x.double().repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    sc = q.double() @ kk.transpose(-1, -2) / d ** 0.5
    sc = sc.masked_fill(torch.arange(s)[None, :] > torch.arange(past, s)[:, None], float("-inf"))
    want = sc.softmax(-1) @ vv
    assert torch.allclose(got.double(), want, atol=1e-5) and torch.allclose(masked.double(), want, atol=1e-5)


@pytest.mark.parametrize("t", [1, 9, 32])
def test_gqa_attention_expand_equals_native(t, monkeypatch):
    """A prompt's first step (is_causal) through gqa_attention: the expanded-keys path equals enable_gqa;
    a [T, Hq, D] query's heads are regrouped as a view (no copy); pre-Ampere CUDA devices take expand."""
    from hybrid.model import layers

    g = torch.Generator().manual_seed(t)
    hq, hkv, d = 8, 2, 16
    q = torch.randn(t, hq, d, generator=g)
    k, v = (torch.randn(1, hkv, t, d, generator=g) for _ in range(2))
    qh = q.transpose(0, 1)[None]
    assert qh[0].reshape(hkv, hq // hkv, t, d).data_ptr() == q.data_ptr()
    out = {}
    for mode in ("native", "expand"):
        monkeypatch.setenv("HYBRID_SDPA_GQA", mode)
        out[mode] = layers.gqa_attention(qh, k, v, is_causal=True)
    torch.testing.assert_close(out["expand"], out["native"], atol=1e-6, rtol=1e-6)
    monkeypatch.delenv("HYBRID_SDPA_GQA")
    assert layers.gqa_native(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 0))
    assert not layers.gqa_native(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert layers.gqa_native(torch.device("cuda", 0))
    monkeypatch.setenv("HYBRID_SDPA_GQA", "auto")
    assert layers.sdpa_gqa_mode() is None and layers.gqa_native(torch.device("cuda", 0))
    monkeypatch.setenv("HYBRID_SDPA_GQA", "yes")
    from hybrid.errors import HybridError

    with pytest.raises(HybridError, match="HYBRID_SDPA_GQA='yes': expected auto, native"):
        layers.gqa_native(torch.device("cuda", 0))
