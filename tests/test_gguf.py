"""GGUF export (metadata, names, tokenizer parity, NVFP4 re-pack) and llama.cpp quantize."""
import json

import numpy as np
import pytest
import torch

from hybrid.baselines import nvfp4_gguf
from hybrid.baselines.gguf_vocab import pre_tokenizer_name
from hybrid.checkpoint.formats import dequant_nvfp4, quantize_nvfp4
from hybrid.errors import CheckpointError, HybridError
from hybrid.testing import write_random_model

gguf = pytest.importorskip("gguf")

# K-quants need rows that are multiples of 256.
DIMS = dict(hidden_size=256, moe_intermediate_size=256, head_dim=64, num_experts=4, num_experts_per_tok=2,
            vocab_size=512, num_hidden_layers=2)
PARITY_TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The quick brown fox's tail, it's   three  spaces\tand a tab.\n\n\nNew lines!",
    "Numbers 12345 and 3.14159, symbols #$%^&*() and émigré café naïve 日本語 😀.",
    "   leading spaces and trailing spaces   ",
    "We'll they've I'd you're HELLO'S mixed-case 'quotes'",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("gguf") / "m", seed=3, **DIMS)


@pytest.fixture(scope="module")
def f32_gguf(model_dir, tmp_path_factory):
    from hybrid.baselines.gguf_export import export_gguf

    out = tmp_path_factory.mktemp("gguf_out") / "m-f32.gguf"
    export_gguf(model_dir, out, "f32")
    return out


def _kv(reader, key):
    f = reader.fields[key]
    return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tolist()


def test_metadata_and_tensor_names(f32_gguf):
    r = gguf.GGUFReader(str(f32_gguf))
    assert _kv(r, "general.architecture") == "qwen3moe"
    expect = {"qwen3moe.embedding_length": 256, "qwen3moe.block_count": 2, "qwen3moe.expert_count": 4,
              "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 256,
              "qwen3moe.attention.head_count": 4, "qwen3moe.attention.head_count_kv": 2,
              "qwen3moe.attention.key_length": 64, "qwen3moe.attention.value_length": 64,
              "qwen3moe.context_length": 512, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2"}
    for k, v in expect.items():
        assert _kv(r, k) == v, k
    assert _kv(r, "qwen3moe.rope.freq_base") == pytest.approx(10000.0)
    assert _kv(r, "qwen3moe.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    names = {t.name: t for t in r.tensors}
    want = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for L in range(2):
        want |= {f"blk.{L}.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                 "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate_inp",
                                                 "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    assert set(names) == want
    assert list(names["blk.0.ffn_gate_exps.weight"].shape) == [256, 256, 4]     # ggml order: K, N, E
    assert list(names["blk.1.ffn_down_exps.weight"].shape) == [256, 256, 4]
    assert list(names["blk.0.ffn_gate_inp.weight"].shape) == [256, 4]
    assert names["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_tied_model_has_no_output_tensor(tmp_path):
    from hybrid.baselines.gguf_export import export_gguf

    d = write_random_model(tmp_path / "tied", tie_word_embeddings=True, **DIMS)
    export_gguf(d, tmp_path / "t.gguf", "bf16")
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors}
    assert "output.weight" not in names and "token_embd.weight" in names


@pytest.mark.llama
def test_llama_logits_match_hybrid_reference(model_dir, f32_gguf):
    pytest.importorskip("llama_cpp")
    from hybrid.baselines.llama_runner import LlamaRunner
    from hybrid.model import load_model

    r = LlamaRunner(f32_gguf, n_ctx=64)
    ids = r.tokenize(PARITY_TEXTS[0] + PARITY_TEXTS[1])[:48]
    ours = load_model(model_dir).forward_logits(torch.tensor(ids)).numpy()
    theirs = r.logits(ids)
    assert theirs.shape == ours.shape == (len(ids), 512)
    np.testing.assert_allclose(theirs, ours, atol=5e-3 * np.abs(ours).max())   # F16 KV cache in llama.cpp
    assert (theirs.argmax(-1) == ours.argmax(-1)).mean() > 0.95
    again = r.logits(ids)                                     # fresh cache each time
    np.testing.assert_array_equal(again, theirs)


@pytest.mark.llama
def test_tokenizer_parity_with_tokenizers(model_dir, f32_gguf):
    pytest.importorskip("llama_cpp")
    from tokenizers import Tokenizer

    from hybrid.baselines.llama_runner import LlamaRunner
    from hybrid.bench.prompts import all_texts

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    r = LlamaRunner(f32_gguf, n_ctx=64)
    for text in PARITY_TEXTS + list(all_texts().values()):
        assert r.tokenize(text) == tok.encode(text, add_special_tokens=False).ids, text[:40]


@pytest.mark.llama
def test_tokenizer_parity_embedded_tiny(tmp_path):
    pytest.importorskip("llama_cpp")
    from tokenizers import Tokenizer

    from hybrid.baselines.gguf_export import export_gguf
    from hybrid.baselines.llama_runner import LlamaRunner
    from hybrid.bench.prompts import all_texts
    from hybrid.model.registry import resolve_model_path

    try:
        tiny = resolve_model_path("tiny")
    except HybridError:
        pytest.skip("embedded tiny model not installed")
    export_gguf(tiny, tmp_path / "tiny.gguf", "bf16")
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    r = LlamaRunner(tmp_path / "tiny.gguf", n_ctx=64)
    for text in PARITY_TEXTS + list(all_texts(tiny).values()):
        assert r.tokenize(text) == tok.encode(text, add_special_tokens=False).ids, text[:40]


def test_pre_tokenizer_mapping():
    assert pre_tokenizer_name({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, "t") == "gpt-2"
    qwen = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
                                               "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
    assert pre_tokenizer_name(qwen, "t") == "qwen2"
    with pytest.raises(CheckpointError, match="add_prefix_space"):
        pre_tokenizer_name({"type": "ByteLevel", "add_prefix_space": True}, "t")
    with pytest.raises(CheckpointError, match="no known llama.cpp pre-type"):
        pre_tokenizer_name({"type": "Whitespace"}, "t")


def test_nvfp4_repack_is_bit_exact():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 192, generator=g) * torch.logspace(-2, 1, 192)
    packed, scale, s2 = quantize_nvfp4(w)
    packed[0, :16] = torch.arange(256, dtype=torch.int64)[:16].to(torch.uint8) * 17   # every nibble code
    blocks = nvfp4_gguf.repack_rows(packed, scale)
    assert blocks.shape == (8, 192 // 64 * 36) and blocks.dtype == np.uint8
    ref = dequant_nvfp4(packed, scale, 1.0).numpy()
    np.testing.assert_array_equal(nvfp4_gguf.dequant_blocks(blocks, 192), ref)
    # ggml layout: 4 scale bytes then sub-block s in qs[8s:8s+8], byte j = elements j | j+8 << 4
    codes = np.stack([packed.numpy() & 15, packed.numpy() >> 4], -1).reshape(8, 192)
    assert blocks[0, 4] == (codes[0, 0] | (codes[0, 8] << 4))
    assert blocks[0, 0] == scale.view(torch.uint8)[0, 0].item() & 0x7F


def test_nvfp4_repack_rejects_k_not_multiple_of_64():
    packed, scale, _ = quantize_nvfp4(torch.randn(4, 48))
    with pytest.raises(CheckpointError, match="multiple of 64"):
        nvfp4_gguf.repack_rows(packed, scale, "blk.0.attn_q")


@pytest.fixture(scope="module")
def nvfp4_dir(model_dir, tmp_path_factory):
    from hybrid.checkpoint.writer import quantize_checkpoint

    dst = tmp_path_factory.mktemp("nv") / "m-nvfp4"
    quantize_checkpoint(model_dir, dst, "nvfp4", progress=False)
    return dst


def test_nvfp4_checkpoint_exports_identical_weights(nvfp4_dir, tmp_path):
    from hybrid.baselines.gguf_export import export_gguf
    from hybrid.baselines.source import SourceModel

    rep = export_gguf(nvfp4_dir, tmp_path / "nv.gguf", "bf16")
    assert rep.kinds.get("nvfp4", 0) > 0
    r = gguf.GGUFReader(str(tmp_path / "nv.gguf"))
    t = {x.name: x for x in r.tensors}
    src = SourceModel(nvfp4_dir)
    assert t["blk.0.attn_v.weight"].tensor_type == gguf.GGMLQuantizationType.NVFP4
    lin = src.linear("model.layers.0.self_attn.v_proj")
    got = nvfp4_gguf.dequant_blocks(np.array(t["blk.0.attn_v.weight"].data), 256) * \
        float(np.array(t["blk.0.attn_v.scale"].data)[0])
    np.testing.assert_array_equal(got, lin.dequantize().numpy())
    exps = np.array(t["blk.1.ffn_down_exps.weight"].data)                        # [E, N, K/64*36]
    scales = np.array(t["blk.1.ffn_down_exps.scale"].data)                       # [E]
    for e in range(4):
        lin = src.linear(f"model.layers.1.mlp.experts.{e}.down_proj")
        assert scales[e] == np.float32(lin.scale_2)
        np.testing.assert_array_equal(nvfp4_gguf.dequant_blocks(exps[e], 256) * scales[e],
                                      lin.dequantize().numpy())
    assert _kv(r, "general.file_type") == 39


@pytest.mark.llama
def test_nvfp4_gguf_runs_close_to_hybrid(nvfp4_dir, tmp_path):
    pytest.importorskip("llama_cpp")
    from hybrid.baselines.gguf_export import export_gguf
    from hybrid.baselines.llama_runner import LlamaRunner
    from hybrid.model import load_model

    export_gguf(nvfp4_dir, tmp_path / "nv.gguf", "bf16")
    r = LlamaRunner(tmp_path / "nv.gguf", n_ctx=64)
    ids = r.tokenize(PARITY_TEXTS[2])[:40]
    theirs = r.logits(ids)
    ours = load_model(nvfp4_dir).forward_logits(torch.tensor(ids)).numpy()
    # same weights; llama.cpp quantizes activations to Q8_0 for NVFP4 dot products
    assert np.abs(theirs - ours).max() < 0.1 * np.abs(ours).max()
    assert (theirs.argmax(-1) == ours.argmax(-1)).mean() >= 0.8


@pytest.mark.parametrize("qtype,expert_type", [("Q8_0", "Q8_0"), ("Q4_K_M", "Q4_K"), ("IQ4_XS", "IQ4_XS"),
                                               ("IQ3_S", "IQ3_S"), ("MXFP4_MOE", "MXFP4")])
@pytest.mark.llama
def test_quantize_types(f32_gguf, tmp_path, qtype, expert_type):
    pytest.importorskip("llama_cpp")
    from hybrid.baselines.quantize import quantize_gguf

    out = quantize_gguf(f32_gguf, tmp_path / f"{qtype}.gguf", qtype)
    assert out.stat().st_size < f32_gguf.stat().st_size / 3
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.ffn_up_exps.weight"] == expert_type
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"                  # router never quantized


@pytest.mark.llama
def test_quantize_pure_and_errors(f32_gguf, tmp_path):
    pytest.importorskip("llama_cpp")
    from hybrid.baselines.quantize import quantize_gguf

    out = quantize_gguf(f32_gguf, tmp_path / "p.gguf", "Q4_K_M", pure=True)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert {types[n] for n in types if n.endswith(("exps.weight", "attn_q.weight", "attn_v.weight"))} == {"Q4_K"}
    with pytest.raises(HybridError, match="expected one of"):
        quantize_gguf(f32_gguf, tmp_path / "x.gguf", "Q9_Z")
    with pytest.raises(HybridError, match="not found"):
        quantize_gguf(tmp_path / "missing.gguf", tmp_path / "x.gguf", "Q8_0")
    with pytest.raises(HybridError, match="importance matrix"):
        quantize_gguf(f32_gguf, tmp_path / "x.gguf", "IQ2_XXS")


@pytest.mark.llama
def test_cli(model_dir, tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    from hybrid.cli.gguf import main

    assert main(["export", str(model_dir), str(tmp_path / "a.gguf"), "--outtype", "f16"]) == 0
    assert main(["quantize", str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf"), "--type", "Q8_0"]) == 0
    assert (tmp_path / "b.gguf").stat().st_size > 0
    assert main(["quantize", str(tmp_path / "a.gguf"), str(tmp_path / "c.gguf"), "--type", "NVFP4"]) == 2
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "d.gguf")]) == 2
    err = capsys.readouterr().err
    assert "error: --type 'NVFP4'" in err and "nowhere" in err


def test_export_refuses_other_architectures(tmp_path):
    from hybrid.baselines.gguf_export import export_gguf

    d = write_random_model(tmp_path / "mx", model_type="mixtral")
    with pytest.raises(HybridError, match="qwen3_moe"):
        export_gguf(d, tmp_path / "x.gguf")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "mixtral"


def test_imatrix_is_mean_squared_input(model_dir, tmp_path):
    from hybrid.baselines import imatrix as im
    from hybrid.model.layers import rms_norm
    from safetensors.torch import load_file

    chunks = [list(range(3, 35)), list(range(40, 72))]
    data = im.compute_imatrix(model_dir, chunks)
    names = {f"blk.{L}.{n}.weight" for L in range(2)
             for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    assert set(data) == names
    assert data["blk.0.ffn_gate_exps.weight"].shape == (4 * 256,)
    # layer 0's q/k/v input is rms_norm(embedding) of the calibration tokens
    sd = load_file(str(model_dir / "model.safetensors"))
    x = rms_norm(sd["model.embed_tokens.weight"].float()[torch.tensor(chunks).reshape(-1)],
                 sd["model.layers.0.input_layernorm.weight"].float(), 1e-6)
    np.testing.assert_allclose(data["blk.0.attn_q.weight"], (x.double() ** 2).mean(0).numpy(), rtol=1e-5)
    np.testing.assert_array_equal(data["blk.0.attn_q.weight"], data["blk.0.attn_v.weight"])
    # gate and up of an expert see the same inputs; down sees the SwiGLU product
    np.testing.assert_array_equal(data["blk.1.ffn_gate_exps.weight"], data["blk.1.ffn_up_exps.weight"])
    assert (data["blk.1.ffn_down_exps.weight"] > 0).all()
    im.save(tmp_path / "i.npz", data)
    back = im.load(tmp_path / "i.npz")
    assert set(back) == names and all(np.array_equal(back[k], data[k]) for k in names)


@pytest.mark.llama
def test_quantize_with_imatrix_changes_the_weights(f32_gguf, model_dir, tmp_path):
    pytest.importorskip("llama_cpp")
    from hybrid.baselines import imatrix as im
    from hybrid.baselines.quantize import quantize_gguf

    data = im.compute_imatrix(model_dir, [list(range(3, 67))])
    skewed = {k: v * np.linspace(0.01, 10, v.size, dtype=np.float32) for k, v in data.items()}
    a = quantize_gguf(f32_gguf, tmp_path / "a.gguf", "IQ3_S")
    b = quantize_gguf(f32_gguf, tmp_path / "b.gguf", "IQ3_S", imatrix=skewed)
    ta = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(a)).tensors}
    tb = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(b)).tensors}
    assert not np.array_equal(ta["blk.0.ffn_up_exps.weight"], tb["blk.0.ffn_up_exps.weight"])
    np.testing.assert_array_equal(ta["blk.0.ffn_gate_inp.weight"], tb["blk.0.ffn_gate_inp.weight"])


@pytest.mark.llama
def test_cli_imatrix(model_dir, tmp_path):
    pytest.importorskip("llama_cpp")
    from hybrid.cli.gguf import main

    assert main(["imatrix", str(model_dir), str(tmp_path / "i.npz"), "--n-ctx", "16", "--chunks", "2"]) == 0
    assert main(["export", str(model_dir), str(tmp_path / "a.gguf")]) == 0
    assert main(["quantize", str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf"), "--type", "IQ4_XS",
                 "--imatrix", str(tmp_path / "i.npz")]) == 0
    assert main(["quantize", str(tmp_path / "a.gguf"), str(tmp_path / "c.gguf"), "--type", "IQ4_XS",
                 "--imatrix", str(tmp_path / "none.npz")]) == 2


def test_missing_llama_cpp_is_a_user_error(monkeypatch, tmp_path):
    import sys

    from hybrid.baselines.quantize import quantize_gguf

    monkeypatch.setitem(sys.modules, "llama_cpp", None)          # import llama_cpp -> ImportError
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    with pytest.raises(HybridError, match="llama-cpp-python is not installed"):
        quantize_gguf(tmp_path / "a.gguf", tmp_path / "b.gguf", "Q8_0")
