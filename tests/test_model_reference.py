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
