"""The hybrid runtime on a GPU: two logical cards on GPU 0 at every split point give the reference
model's greedy ids (NVFP4 experts: QPN grouped kernel for hits, Numba runner for misses), with a
can-miss layer's hits inside its decode graph (HYBRID_MISS_GRAPH=1) and launched eagerly (0)."""
import pytest
import torch

from hybrid.generate import generate
from hybrid.model.config import ModelConfig
from hybrid.model.loader import load_model
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.sampler import Sampler, SamplerConfig
from hybrid.testing import write_random_model
from hybrid.tokenizer import Tokenizer
from tests.quant_layouts import to_nvfp4

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.cuda]


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("rtc")
    src = write_random_model(root / "bf16", "qwen3_moe", seed=3, skew=1.0, num_hidden_layers=4, num_experts=16,
                             num_experts_per_tok=4, hidden_size=128, moe_intermediate_size=64)
    return to_nvfp4(src, root / "nvfp4")


def greedy(model, path, n=8):
    cfg = ModelConfig.from_folder(path)
    tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    return generate(model, tok, tok.encode("def fibonacci(n):"), n, Sampler(SamplerConfig())).generated_ids


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
GPUS = [pytest.param((0, 0), id="one-gpu"), pytest.param((0, 1), id="two-gpus", marks=two_gpus)]


@pytest.mark.parametrize("miss_graph", ["0", "1"])
@pytest.mark.parametrize("gpus", GPUS)
@pytest.mark.parametrize("split,slots", [(1, (0,)), (2, (32,)), (3, (48, 16))])
def test_two_cards_match_cuda_reference(nvfp4, split, slots, gpus, miss_graph, monkeypatch):
    """Two logical cards on GPU 0, or two physical GPUs (the hidden state crossing at the split)."""
    monkeypatch.setenv("HYBRID_MISS_GRAPH", miss_graph)
    want = greedy(load_model(nvfp4, device="cuda"), nvfp4)
    s = open_session(nvfp4, RuntimeOptions(device="cuda", gpus=gpus, layer_split=(split,), cache_slots=slots,
                                           cache_warm="profile"))
    try:
        devices = [str(d) for d in s.model.layer_devices]
        got = greedy(s.model, nvfp4)
        linked, err = sorted(s.model.graphs.links), s.model.graphs.error
    finally:
        s.close()
    assert err is None
    assert bool(linked) == (miss_graph == "1")              # --cache-warm profile, no profile: all can miss
    assert devices == [f"cuda:{gpus[0]}"] * split + [f"cuda:{gpus[1]}"] * (4 - split)
    assert got == want
    rep = s.report()
    assert rep["slot_storage"] in ([], ["QPNSlots"]) and rep["cpu_runner"] == "NumbaCpuRunner"
    assert rep["pcie_bytes"]["ids_d2h"] > 0
    assert (rep["pcie_bytes"]["hops"] > 0) == (gpus[0] != gpus[1])


@pytest.mark.parametrize("gpus", GPUS)
def test_warm_fill_on_cuda(nvfp4, gpus):
    """--cache-warm auto (the default), no expert profile: the slots hold experts from load (id order). Layers
    whose experts all fit never miss (no miss link), the other keeps its miss path; greedy ids as the reference."""
    want = greedy(load_model(nvfp4, device="cuda"), nvfp4)
    s = open_session(nvfp4, RuntimeOptions(device="cuda", gpus=gpus, layer_split=(3,), cache_slots=(48, 8)))
    try:
        got = greedy(s.model, nvfp4)
        linked, err, rep = sorted(s.model.graphs.links), s.model.graphs.error, s.report()
    finally:
        s.close()
    assert err is None and got == want
    assert linked == [3]               # card 0: 3 layers x 16 experts in 48 slots; card 1: 8 of layer 3's 16
    assert rep["cards"][0]["hit_rate"] == 1.0 and 0 < rep["cards"][1]["hit_rate"] < 1


@pytest.mark.parametrize("head", ["fp8", "nvfp4"])
def test_quantized_head_on_cuda(nvfp4, head):
    """--lm-head fp8 / nvfp4: the head runs through the QPN kernels inside the decode graph (two logical cards,
    the head on the second): the greedy ids of the reference path with the same head, logits close to the BF16
    head's."""
    want = greedy(load_model(nvfp4, device="cuda", lm_head=head), nvfp4)
    s = open_session(nvfp4, RuntimeOptions(device="cuda", gpus=(0, 0), layer_split=(2,), cache_slots=(32,),
                                           lm_head=head))
    try:
        got, err = greedy(s.model, nvfp4), s.model.graphs.error
        qtype = s.model.lm_head.weight.qtype.value
        ids = torch.arange(1, 33)
        q = s.model.forward_logits(ids).float().cpu()
    finally:
        s.close()
    base = load_model(nvfp4, device="cuda").forward_logits(ids.cuda()).float().cpu()
    assert err is None and got == want and qtype == head
    assert ((q - base).norm() / base.norm()).item() < {"fp8": 0.03, "nvfp4": 0.1}[head]


def test_save_expert_profile_on_cuda(nvfp4, tmp_path):
    """--save-expert-profile through the graphed, overlapped decode: every routed token counted once (the steps
    run ahead included, none twice), a file the strict reader takes."""
    from hybrid.experts.popularity import load_profile

    out = tmp_path / "p.experts.json"
    s = open_session(nvfp4, RuntimeOptions(device="cuda", gpus=(0, 0), layer_split=(2,), cache_slots=(16, 8),
                                           save_expert_profile=str(out), cpu_engine="torch"))   # no Numba compile
    try:
        cfg = ModelConfig.from_folder(nvfp4)
        tok = Tokenizer(nvfp4, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        prompt = tok.encode("def fibonacci(n):")
        res = generate(s.model, tok, prompt, 8, Sampler(SamplerConfig()))
        steps = s.stats.graph_steps
    finally:
        s.close()
    prof = load_profile(out, cfg)
    assert steps > 0 and prof.tokens == len(prompt) + len(res.generated_ids) - 1
    assert (prof.counts.sum(1) == prof.tokens * cfg.num_experts_per_tok).all()


def test_calibrate_decode_layer_graphs():
    """calibrate's kernel_efficiency and fused_layer_us on this GPU: the QPN kernels' graph of 12 decode layers
    gives a fraction of read bandwidth in (0, 1], and the same layers with the fused kernels between their QPN
    kernels (as the runtime launches them) take longer by a positive time per layer."""
    from hybrid.bench.calibrate import _gpu_time, _kernel_efficiency

    read = 256 * 2**20 / _gpu_time(0, 256 * 2**20, 3, "read")
    eff, fused = _kernel_efficiency(0, 3, read, 2.0)
    assert not isinstance(fused, BaseException), fused
    assert 0 < eff <= 1 and 0 < fused < 1000
