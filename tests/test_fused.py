"""The fused decode kernels' torch references (hybrid.kernels.fused.ref_*) against the torch ops of the
unfused path they stand for, on the CPU; the HYBRID_FUSED switch; the launchers' CPU fallback and
checks; decode_dense's residual argument."""
import pytest
import torch
import torch.nn.functional as F

from hybrid.errors import HybridError
from hybrid.kernels import fused
from hybrid.model.layers import Attention, KVCache, Rotary, decode_mask, rms_norm
from hybrid.model.moe import route


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ref_add_rms_norm_is_add_then_rms_norm(dtype):
    x, d, w = _rand(3, 64, seed=1, dtype=dtype), _rand(3, 64, seed=2, dtype=dtype), _rand(64, seed=3)
    x2, h, hf = fused.ref_add_rms_norm(x, w, 1e-6, delta=d, want_f32=True)
    assert torch.equal(x2, x + d)
    assert torch.equal(h, rms_norm(x + d, w, 1e-6))
    assert hf.dtype == torch.float32 and torch.equal(hf, h.float())
    x1, h1, none = fused.ref_add_rms_norm(x, w, 1e-6)
    assert x1 is x and none is None and torch.equal(h1, rms_norm(x, w, 1e-6))


def test_ref_rope_is_rotary_apply_table():
    rot = Rotary(16, 10000.0)
    table = rot.table(torch.device("cpu"), 32)
    xf = _rand(3, 5, 16, seed=4)
    cs = table[7:10]
    assert torch.equal(fused.ref_rope(xf, cs), Rotary.apply_table(xf, cs))
    cos, sin = rot.cos_sin(torch.arange(7, 10), "cpu")            # the CPU reference path
    torch.testing.assert_close(fused.ref_rope(xf, cs), Rotary.apply(xf, cos, sin), atol=1e-6, rtol=0)


@pytest.mark.parametrize("norm", [True, False])
def test_ref_qk_rope_kv_is_the_attention_ops(norm):
    hq, hkv, d, t, start = 4, 2, 16, 3, 5
    qkv = _rand(t, (hq + 2 * hkv) * d, seed=5)
    qn, kn = (_rand(d, seed=6), _rand(d, seed=7)) if norm else (None, None)
    table = Rotary(d, 10000.0).table(torch.device("cpu"), 16)
    ks, vs = torch.full((16, hkv, d), float("nan")), torch.full((16, hkv, d), float("nan"))
    q = fused.qk_rope_kv(qkv, qn, kn, table, ks, vs, hq, hkv, d, 1e-6, start=start)   # CPU: the ref
    # the CPU reference path of Attention: rms_norm per head, then Rotary.apply
    qh = qkv[:, : hq * d].view(t, hq, d)
    kh = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    if norm:
        qh, kh = rms_norm(qh, qn, 1e-6), rms_norm(kh, kn, 1e-6)
    cos, sin = Rotary(d, 10000.0).cos_sin(torch.arange(start, start + t), "cpu")
    torch.testing.assert_close(q, Rotary.apply(qh, cos, sin), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ks[start:start + t], Rotary.apply(kh, cos, sin), atol=1e-5, rtol=1e-5)
    assert torch.equal(vs[start:start + t], qkv[:, (hq + hkv) * d:].view(t, hkv, d))
    assert torch.isnan(ks[:start]).all() and torch.isnan(vs[start + t:]).all()   # other rows untouched
    pos = torch.tensor([start])
    ks2, vs2 = torch.zeros_like(ks), torch.zeros_like(vs)
    q2 = fused.qk_rope_kv(qkv, qn, kn, table, ks2, vs2, hq, hkv, d, 1e-6, pos=pos)
    assert torch.equal(q2, q) and torch.equal(ks2[start:start + t], ks[start:start + t])


@pytest.mark.parametrize("renorm", [True, False])
def test_ref_route_topk_is_route(renorm):
    x, w = _rand(5, 32, seed=8), _rand(16, 32, seed=9)
    ids, weights = fused.route_topk(x @ w.T, 4, renorm)                 # CPU: the ref
    rid, rw = route(x, w, 4, renorm)
    assert torch.equal(ids, rid) and torch.equal(weights, rw)


@pytest.mark.parametrize("pos", [0, 3, 9])
def test_ref_decode_attn_is_attention(pos):
    hq, hkv, d = 4, 2, 16
    q = _rand(1, hq, d, seed=10)
    ks, vs = _rand(12, hkv, d, seed=11), _rand(12, hkv, d, seed=12)
    attn = Attention(None, None, None, None, hq, hkv, d, None, None, 1e-6)
    want = attn._attend(q, ks[: pos + 1], vs[: pos + 1], pos)             # the CPU reference path
    got = fused.decode_attn(q, ks, vs, 12, start=pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    mask = decode_mask(pos, 12, torch.float32, "cpu")                      # the CUDA path's math
    torch.testing.assert_close(got, attn._sdpa1(q, ks, vs, mask), atol=1e-5, rtol=1e-5)
    assert torch.equal(fused.decode_attn(q, ks, vs, 12, pos=torch.tensor([pos])), got)


@pytest.mark.parametrize("hkv,g,d", [(4, 8, 128), (1, 16, 128), (8, 1, 256), (4, 3, 40), (1, 2, 16), (1, 15, 136),
                                     (2, 8, 64), (1, 1, 8), (1, 16, 8)])
@pytest.mark.parametrize("sms", [1, 80, 132])
def test_attn_plan(hkv, g, d, sms):
    """The attention split plan covers the keys with no split past them, one split while the keys fit
    one round, and stays inside the kernel's fixed sizes (cuda/fused.cu ATT_*)."""
    for keys in [1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 127, 128, 129, 256, 301, 512, 1024, 3001, 4096, 32768]:
        splits, rounds, rk, cpl = fused.attn_plan(keys, hkv, g, d, sms)
        kp = fused.ATT_THREADS >> cpl
        assert 2 ** cpl >= d // 8 and 2 ** (cpl - 1) < d // 8 or cpl == 0
        assert rk <= fused.ATT_MAX_ROUND and rk * d <= 4096 and rk % kp == 0 and rk // kp <= 4
        assert -(-g // kp) <= 4                                    # query heads per thread in P.V
        assert (splits - 1) * rounds * rk < keys <= splits * rounds * rk
        assert splits * g <= fused.ATT_MAX_W and (splits == 1 or splits * g * d <= fused.ATT_COMBINE_Q)
        assert splits == 1 or keys > rk
        assert splits * hkv < sms * fused.ATT_BLOCKS_PER_SM + hkv  # about ATT_BLOCKS_PER_SM blocks per SM


@pytest.mark.parametrize("value,parts", [(None, set(fused.PARTS)), ("1", set(fused.PARTS)), ("0", set()),
                                         ("off", set()), ("norm,route", {"norm", "route"}), ("attn", {"attn"})])
def test_switch(monkeypatch, value, parts):
    if value is None:
        monkeypatch.delenv("HYBRID_FUSED", raising=False)
    else:
        monkeypatch.setenv("HYBRID_FUSED", value)
    assert {p for p in fused.PARTS if fused.enabled(p)} == parts


def test_launchers_reject_bad_ranks():
    with pytest.raises(ValueError, match="x: expected shape"):
        fused.add_rms_norm(torch.zeros(2, 3, 4), torch.zeros(4), 1e-6)
    with pytest.raises(ValueError, match="logits: expected shape"):
        fused.route_topk(torch.zeros(8), 2, True)
    with pytest.raises(ValueError, match="q: expected shape"):
        fused.decode_attn(torch.zeros(2, 4, 16), torch.zeros(8, 2, 16), torch.zeros(8, 2, 16), 8)


def test_cuda_rms_norm_falls_back_without_fp32_weight():
    """rms_norm on a CPU tensor is the reference math whatever the switch says."""
    x, w = _rand(2, 32, seed=13), _rand(32, seed=14)
    assert torch.equal(rms_norm(x, w, 1e-6), fused.ref_rms_norm(x, w, 1e-6))
    torch.testing.assert_close(rms_norm(x, w, 1e-6), F.rms_norm(x, (32,), w, 1e-6), atol=1e-6, rtol=1e-6)


def test_decode_dense_residual(qwen3_dir):
    """decode_dense(x, residual=r) is decode_dense(x + r): the runtime may pass the MoE output."""
    from hybrid.model.loader import load_model

    m = load_model(qwen3_dir)
    m.new_cache(8)
    m.prepare()
    x, r = _rand(1, m.cfg.hidden_size, seed=15), _rand(1, m.cfg.hidden_size, seed=16)
    pos = torch.tensor([3])
    mask = m.decode_mask(pos, 8)
    a = m.decode_dense(0, x + r, pos, 8, mask)
    m.new_cache(8)
    b = m.decode_dense(0, x, pos, 8, mask, residual=r)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert isinstance(m.cache, KVCache)


def test_route_outputs_on_cpu():
    """route_topk's optional outputs (slot ids, the runtime's route row) are the runtime's torch ops."""
    logits = _rand(3, 16, seed=17)
    table = torch.randperm(16, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    slots, row = torch.full((12,), -1, dtype=torch.int32), torch.full((3, 8), float("nan"))
    ids, w = fused.route_topk(logits, 4, True, table, slots, row)
    assert torch.equal(slots, table[ids.reshape(-1)])
    assert torch.equal(row[:, :4], ids.float()) and torch.equal(row[:, 4:], w)
    with pytest.raises(ValueError, match="slot_table and slots"):
        fused.route_topk(logits, 4, True, table, None)


def test_decode_dense_route_out(qwen3_dir):
    from hybrid.model.loader import load_model
    from hybrid.model.qwen_moe import RouteOut

    m = load_model(qwen3_dir)
    m.new_cache(8)
    m.prepare()
    k, e = m.cfg.num_experts_per_tok, m.cfg.num_experts
    x, pos = _rand(1, m.cfg.hidden_size, seed=18), torch.tensor([2])
    out = RouteOut(torch.arange(e, dtype=torch.int32).flip(0).contiguous(),
                   torch.zeros(k, dtype=torch.int32), torch.zeros(1, 2 * k))
    _, _, ids, w = m.decode_dense(0, x, pos, 8, m.decode_mask(pos, 8), route_out=out)
    assert torch.equal(out.slots, (e - 1 - ids.reshape(-1)).to(torch.int32))
    assert torch.equal(out.row, torch.cat([ids.float(), w], 1))


@pytest.mark.parametrize("renorm", [True, False])
def test_ref_router_topk_is_route(renorm):
    x, w = _rand(2, 32, seed=19), _rand(16, 32, seed=20)
    ids, weights = fused.router_topk(x, w, 4, renorm)                  # CPU: the ref
    rid, rw = route(x, w, 4, renorm)
    assert torch.equal(ids, rid) and torch.equal(weights, rw)


def test_ref_add_norm_router_is_add_norm_then_route():
    x, d, w = _rand(2, 32, seed=21), _rand(2, 32, seed=22), _rand(32, seed=23)
    router = _rand(16, 32, seed=24)
    x2, h, ids, weights = fused.add_norm_router(x, w, 1e-6, router, 4, True, d)   # CPU: the ref
    assert torch.equal(x2, x + d) and torch.equal(h, rms_norm(x + d, w, 1e-6))
    rid, rw = route(h, router, 4, True)
    assert torch.equal(ids, rid) and torch.equal(weights, rw)


def test_ref_rope_attn_is_rope_then_attention():
    hq, hkv, d, p = 4, 2, 16, 6
    qkv = _rand(1, (hq + 2 * hkv) * d, seed=25)
    qn, kn = _rand(d, seed=26), _rand(d, seed=27)
    table = Rotary(d, 10000.0).table(torch.device("cpu"), 16)
    ks, vs = _rand(16, hkv, d, seed=28), _rand(16, hkv, d, seed=29)
    ks2, vs2 = ks.clone(), vs.clone()
    got = fused.rope_attn(qkv, qn, kn, table, ks, vs, hq, hkv, d, 1e-6, 16, start=p)     # CPU: the ref
    q = fused.qk_rope_kv(qkv, qn, kn, table, ks2, vs2, hq, hkv, d, 1e-6, start=p)
    assert torch.equal(got, fused.decode_attn(q, ks2, vs2, 16, start=p))
    assert torch.equal(ks, ks2) and torch.equal(vs, vs2)


def test_new_kernel_switch(monkeypatch):
    """HYBRID_FUSED_NEW: unset = NEW_DEFAULT (every newer kernel), 0 = the older kernels, 1 = all of them, a
    list = those."""
    monkeypatch.delenv("HYBRID_FUSED_NEW", raising=False)
    assert all(fused.new_kernel(p) == (p in fused.NEW_DEFAULT) for p in fused.NEW_PARTS)
    assert fused.NEW_DEFAULT == frozenset(fused.NEW_PARTS)
    monkeypatch.setenv("HYBRID_FUSED_NEW", "0")
    assert not any(fused.new_kernel(p) for p in fused.NEW_PARTS)
    monkeypatch.setenv("HYBRID_FUSED_NEW", "1")
    assert all(fused.new_kernel(p) for p in fused.NEW_PARTS)
    monkeypatch.setenv("HYBRID_FUSED_NEW", "router, attn")
    assert [fused.new_kernel(p) for p in fused.NEW_PARTS] == [False, True, True, False, False]


def test_route_rank_switch(monkeypatch):
    """$HYBRID_ROUTE_RANK names the ranking; unset = ROUTE_RANK_DEFAULT; anything else a one-line user error."""
    monkeypatch.delenv("HYBRID_ROUTE_RANK", raising=False)
    assert fused.route_rank() == fused.ROUTE_RANKS[fused.ROUTE_RANK_DEFAULT]
    monkeypatch.setenv("HYBRID_ROUTE_RANK", "rounds")
    assert fused.route_rank() == 0
    monkeypatch.setenv("HYBRID_ROUTE_RANK", "fast")
    with pytest.raises(HybridError, match="HYBRID_ROUTE_RANK='fast': expected one of rounds, logits"):
        fused.route_rank()


def test_wide_attention_shapes(monkeypatch):
    """fused_rope_attn_w takes at most ATT_HPT_W query heads per thread in P.V (128 / 2^cpl rows of heads);
    its plan aims at ATT_W_BLOCKS_PER_SM blocks per SM; rope_attn_kernel picks it by HYBRID_FUSED_NEW."""
    monkeypatch.delenv("HYBRID_FUSED_NEW", raising=False)
    monkeypatch.delenv("HYBRID_ATT_W_PER_SM", raising=False)
    assert fused.rope_attn_kernel(32, 4, 128) == ("fused_rope_attn_w", fused.ATT_W_BLOCKS_PER_SM)
    assert fused.rope_attn_kernel(32, 2, 256) == ("fused_rope_attn_e", None)          # 16 heads of 256: too many
    assert fused.rope_attn_kernel(32, 4, 128, aligned=False) == ("fused_rope_attn", None)
    monkeypatch.setenv("HYBRID_FUSED_NEW", "norm,router,attn,plan")
    assert fused.rope_attn_kernel(32, 4, 128) == ("fused_rope_attn_e", None)
    monkeypatch.setenv("HYBRID_FUSED_NEW", "0")
    assert fused.rope_attn_kernel(32, 4, 128) == ("fused_rope_attn", None)
    assert fused.wide_fits(8, 128) and fused.wide_fits(16, 128) and fused.wide_fits(16, 64)
    assert fused.wide_fits(8, 256) and not fused.wide_fits(16, 256) and not fused.wide_fits(12, 256)
    monkeypatch.delenv("HYBRID_FUSED_NEW")
    monkeypatch.setenv("HYBRID_ATT_W_PER_SM", "0.8")                                 # the A/B switch
    assert fused.rope_attn_kernel(32, 4, 128) == ("fused_rope_attn_w", 0.8)
    for bad in ("0", "x", "9"):
        monkeypatch.setenv("HYBRID_ATT_W_PER_SM", bad)
        with pytest.raises(HybridError, match="HYBRID_ATT_W_PER_SM"):   # one line, not a traceback
            fused.attn_w_per_sm()
    s1, r1, _, _ = fused.attn_plan(2048, 4, 8, 128, 132, 1.05)
    s2, r2, _, _ = fused.attn_plan(2048, 4, 8, 128, 132)
    assert s1 * r1 >= 64 and s2 * r2 >= 64 and 4 * s1 <= 1.05 * 132 + 4 < 4 * s2


def test_fused_kernels_ab_tool_dry_run(capsys, monkeypatch):
    """tools/gpu_fused_kernels_ab.py's router cases (alone, with the plan, after an o_proj-shaped QPN linear)
    run on the CPU references: one record per setting, the new kernel's routing equal to the reference's."""
    import importlib.util
    import json
    from pathlib import Path

    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setenv("HYBRID_FUSED_NEW", "all")           # the tool sets it; restored after the test
    path = Path(__file__).resolve().parents[1] / "tools" / "gpu_fused_kernels_ab.py"
    spec = importlib.util.spec_from_file_location("gpu_fused_kernels_ab", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--device", "cpu", "--launches", "1", "--what", "router", "--tokens", "1", "8",
                      "--router", "256", "16", "8", "--router-context"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    got = [(r["setting"], r["T"]) for r in recs]       # 8 tokens x 8 experts: past one warp's plan, none
    assert got == [("old", 1), ("new", 1), ("new_bare", 1), ("new_plan", 1), ("old", 8), ("new", 8), ("new_bare", 8),
                   ("in_context", 1), ("in_context_plan", 1), ("in_context", 8)]
    assert recs[1]["ids_equal_ref"] == recs[5]["ids_equal_ref"] == "1/1"
