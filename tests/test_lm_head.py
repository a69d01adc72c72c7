"""--lm-head: a 16-bit output head quantized once at load (hybrid.model.head) through the loader, the runtime's
options, hybrid-run and the quality bench's candidates, on the embedded tiny model (CPU)."""
import pytest
import torch

from hybrid.baselines.candidates import placement_opts
from hybrid.checkpoint.formats import QType, quantize_fp8, quantize_nvfp4
from hybrid.checkpoint.qweight import QWeight
from hybrid.errors import HybridError
from hybrid.model import head
from hybrid.model.config import ModelConfig
from hybrid.model.head import quantize_head
from hybrid.model.loader import load_model
from hybrid.model.registry import EMBEDDED
from hybrid.runtime import RuntimeOptions
from hybrid.tokenizer import Tokenizer

TINY = EMBEDDED["tiny"]
CODE = """def fibonacci(n):
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b


def is_prime(n):
    for i in range(2, int(n ** 0.5) + 1):
        if n % i == 0:
            return False
    return n > 1
"""
needs_tiny = pytest.mark.skipif(not (TINY / "config.json").is_file(), reason="embedded tiny model not installed")


def dense_head(v=300, h=64, seed=0):
    w = torch.randn(v, h, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[7, 3] = 2.5     # one outlier row: the per-tensor scale must come from the whole head, not a chunk
    return QWeight(QType.BF16, (v, h), w.to(torch.bfloat16), name="lm_head")


@pytest.mark.parametrize("to", ["fp8", "nvfp4"])
def test_chunked_quantization_is_the_whole_tensor_one(to, monkeypatch):
    """Rows quantized ROWS at a time give the bits of one call over the whole head (its global scale; NVFP4 with
    the least-squared-error block scales)."""
    monkeypatch.setattr(head, "ROWS", 128)          # 300 rows: chunks of 128, 128, 44
    w = dense_head()
    q = quantize_head(w, to)
    whole = quantize_fp8(w.data.float()) if to == "fp8" else quantize_nvfp4(w.data.float(), scales="mse")
    assert q.qtype is {"fp8": QType.FP8, "nvfp4": QType.NVFP4}[to] and q.shape == w.shape and q.name == "lm_head"
    assert torch.equal(q.data.view(torch.uint8), whole[0].view(torch.uint8))
    if to == "nvfp4":
        assert torch.equal(q.scale.view(torch.uint8), whole[1].view(torch.uint8)) and torch.equal(q.scale_2, whole[2])
    else:
        assert torch.equal(q.scale, whole[1])
    err = (q.dequantize() - w.data.float()).norm() / w.data.float().norm()
    assert err < {"fp8": 0.05, "nvfp4": 0.15}[to]


def test_keep_and_stored_quantized_heads_are_left_alone():
    w = dense_head()
    assert quantize_head(w, "keep") is w
    q = quantize_head(w, "nvfp4")
    assert quantize_head(q, "fp8") is q
    with pytest.raises(ValueError, match="lm_head type 'int4'"):
        quantize_head(w, "int4")
    odd = QWeight(QType.BF16, (8, 40), torch.ones(8, 40, dtype=torch.bfloat16), name="lm_head")
    with pytest.raises(HybridError, match="--lm-head nvfp4: lm_head has 40 in-features, not a multiple of 16"):
        quantize_head(odd, "nvfp4")
    assert quantize_head(odd, "fp8").qtype is QType.FP8


def test_bad_option_is_one_line():
    with pytest.raises(HybridError, match="--lm-head q4: expected one of keep, fp8, nvfp4"):
        RuntimeOptions(lm_head="q4")


def test_candidate_option():
    assert placement_opts("head=fp8", "nvfp4@head=fp8") == {"lm_head": "fp8"}
    with pytest.raises(HybridError, match="head=keep/fp8/nvfp4"):
        placement_opts("head=q4", "nvfp4@head=q4")


@needs_tiny
@pytest.mark.parametrize("to", ["fp8", "nvfp4"])
def test_loaded_head_is_quantized_and_close(to):
    """The tiny model's tied head quantized at load: the embedding untouched, the logits close to the BF16 head's
    and the same top token on most positions."""
    base = load_model(TINY)
    model = load_model(TINY, lm_head=to)
    assert model.lm_head.weight.qtype is {"fp8": QType.FP8, "nvfp4": QType.NVFP4}[to]
    assert torch.equal(model.embed, base.embed) and base.lm_head.weight.qtype is QType.BF16
    cfg = ModelConfig.from_folder(TINY)
    ids = torch.tensor(Tokenizer(TINY, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id).encode(CODE))
    a, b = base.forward_logits(ids).float(), model.forward_logits(ids).float()
    assert ((b - a).norm() / a.norm()).item() < {"fp8": 0.03, "nvfp4": 0.1}[to]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9


def test_head_rows_are_not_placements():
    """quality.md's placement-invariance line: an @head= row holds other weights, so it is not one of them."""
    from hybrid.baselines.quality_report import placement_lines

    row = lambda c, top: {"engine": "hybrid", "candidate": c, "count": 100, "same_top_pct": top, "mean_kld": 0.02,  # noqa: E731
                          "ppl": 17.0}
    lines = placement_lines([row("nvfp4", 92.0), row("nvfp4@slots=0", 92.0), row("nvfp4@head=nvfp4", 90.0)])
    assert lines == ["- nvfp4 under 2 placements (nvfp4, nvfp4@slots=0): same top token at 92..92 of 100 positions "
                     "(spread 0); mean KLD 0.02000..0.02000; PPL 17.000..17.000"]
