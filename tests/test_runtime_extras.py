"""Int8 KV cache, the metrics exposition, hybrid-bench decode and hybrid-profile on small models."""
import json

import pytest
import torch

from hybrid.metrics import Registry, render_prometheus
from hybrid.model.loader import load_model
from hybrid.planner.memory import kv_bytes_per_token_layer
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.runtime.kv_int8 import Int8KVCache
from hybrid.testing import write_random_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("x") / "m", "qwen3_moe", seed=5, num_hidden_layers=2,
                              num_experts=8, num_experts_per_tok=2)


def test_int8_kv_roundtrip_and_bytes(model_dir):
    from hybrid.model.config import ModelConfig

    cfg = ModelConfig.from_folder(model_dir)
    c = Int8KVCache(2, 16, cfg.num_key_value_heads, cfg.head_dim, torch.float32, [torch.device("cpu")] * 2)
    k = torch.randn(5, cfg.num_key_value_heads, cfg.head_dim)
    c.write(1, 3, k, -k)
    back = c.k[1][3:8]
    err = (back - k).abs().amax(-1) / k.abs().amax(-1)                    # per token-head, <= 1/254
    assert back.shape == k.shape and float(err.max()) <= 1 / 254 + 1e-3
    assert torch.equal(c.v[1][3:8], -back)
    assert c.nbytes == 2 * 16 * kv_bytes_per_token_layer(cfg, "int8")      # 2 layers x 16 tokens, as planned


def test_int8_kv_logits_close_to_fp32(model_dir):
    ids = torch.tensor([3, 9, 27, 81, 5, 6, 7])
    want = load_model(model_dir).forward_logits(ids)
    s = open_session(model_dir, RuntimeOptions(kv_dtype="int8", cache_slots=(4,)))
    got = s.model.forward_logits(ids)
    s.close()
    assert isinstance(s.model.model.cache, Int8KVCache)
    assert not torch.equal(got, want)                                        # it is quantized...
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)              # ...and close


def test_prometheus_text_format():
    r = Registry()
    r.counter("x_total", "things").inc(3, layer=1, card="a\"b")
    r.gauge("rate", "a rate").set(0.25)
    text = render_prometheus(r)
    assert text.splitlines() == ["# HELP hybrid_x_total things", "# TYPE hybrid_x_total counter",
                                 'hybrid_x_total{card="a\\"b",layer="1"} 3', "# HELP hybrid_rate a rate",
                                 "# TYPE hybrid_rate gauge", "hybrid_rate 0.25"]
    with pytest.raises(ValueError):
        r.counter("x_total", "things").inc(-1)


def test_bench_decode_record(model_dir, tmp_path, capsys):
    from hybrid.cli.bench import main

    rc = main(["decode", "--model", str(model_dir), "--prompt-tokens", "6", "--warmup", "2", "--tokens", "4",
               "--cache-slots", "8", "--profile", "v100x2-e5v4", "--layer-split", "1", "--gpus", "0,1",
               "--out", str(tmp_path)])
    assert rc == 0
    rec = json.loads((tmp_path / "runtime.jsonl").read_text().splitlines()[-1])
    assert rec["bench"] == "decode" and rec["tokens"] == 4 and rec["decode_tok_s"] > 0
    assert rec["prediction"]["profile"] == "v100x2-e5v4" and len(rec["cards"]) == 2
    assert rec["measured_over_predicted"] == pytest.approx(rec["decode_tok_s"] / rec["prediction"]["tok_s"],
                                                           rel=1e-3)
    pred = rec["prediction"]         # also at the measured steps' mean context: prompt + half the tokens
    assert pred["measured_context"] == 6 + 4 // 2 < pred["context"]
    assert pred["tok_s_at_measured_context"] >= pred["tok_s"]
    assert rec["measured_over_predicted_at_context"] == pytest.approx(
        rec["decode_tok_s"] / pred["tok_s_at_measured_context"], rel=1e-3)
    assert rec["git_sha"] and rec["machine"]


def test_profile_cli_feeds_planner(model_dir, tmp_path):
    from hybrid.cli.profile import main
    from hybrid.model.config import ModelConfig
    from hybrid.planner import load_popularity

    out = tmp_path / "m.experts.json"
    texts = tmp_path / "t.txt"
    texts.write_text("hello world\n\ndef f(x):\n    return x\n")
    assert main(["--model", str(model_dir), "--prompts", str(texts), "--out", str(out)]) == 0
    pop = load_popularity(out, ModelConfig.from_folder(model_dir))         # the planner's strict reader
    assert len(pop.shares) == 2 and abs(sum(pop.shares[0]) - 1) < 1e-9


@pytest.mark.parametrize("gpu,cc,gpus,want", [("NVIDIA H200", (9, 0), (0, 0), "h200"),
                                              ("Tesla V100-SXM2-16GB", (7, 0), (0, 1), "v100x2-e5v4"),
                                              ("NVIDIA H200", (9, 0), (0, 1), "h200x2"),
                                              ("NVIDIA H200", (9, 0), (0, 2), "h200x2@this-machine"),
                                              ("Quadro X", (7, 5), (0,), "v100x2-e5v4@this-machine")])
def test_cuda_without_profile_picks_matching_shipped_profile(monkeypatch, gpu, cc, gpus, want):
    """The shipped profile that names the GPU (for every ordinal used), else the nearest one with this
    machine's sizes (test_planner.py::test_nearest_profile_and_adapted_sizes)."""
    from types import SimpleNamespace

    from hybrid.runtime.session import _hardware_profile

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name=gpu, major=cc[0], minor=cc[1], total_memory=24 << 30))
    prof = _hardware_profile(RuntimeOptions(device="cuda", gpus=gpus))
    assert prof.name == want
    if want.endswith("@this-machine"):
        assert [g.name for g in prof.gpus] == [gpu] * (max(gpus) + 1) and prof.gpus[0].memory_mib == 24 << 10
