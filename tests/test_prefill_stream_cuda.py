"""Prefill offload on a GPU: the batched staging pack equals QPNExpertSlots.load on the device bit for bit,
a staged layer equals the same experts run from cache slots, and on the tiny model (NVFP4) greedy ids
are the same with offload on and off (cache at 0% and 50%, a second generation with hits and streamed
misses in one layer), with the streamed bytes counted as PCIe, streamed from the pinned CPU store and
from the checkpoint (HYBRID_PREFILL_SOURCE); prefill tok/s both ways is printed (`pytest -s`)."""
import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.generate import generate
from hybrid.kernels import QPNExpertSlots, qpn_moe
from hybrid.model import resolve_model_path
from hybrid.model.config import ModelConfig
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.runtime.prefill_stream import PrefillStream, _fill, _raw_shapes
from hybrid.runtime.stage_pack import pack_group
from hybrid.runtime.store_stage import SOURCE_ENV, STAGE_KERNEL_ENV, StoreSource
from hybrid.experts.store import ExpertStore
from hybrid.sampler import Sampler, SamplerConfig
from hybrid.tokenizer import Tokenizer
from tests.quant_layouts import to_nvfp4
from tests.test_prefill_stream import _rand_fp8, _rand_nvfp4

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.cuda]
PROMPT = 256


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    return to_nvfp4(resolve_model_path("tiny"), tmp_path_factory.mktemp("pfsc") / "nvfp4")


def _tok(path):
    cfg = ModelConfig.from_folder(path)
    return Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)


def _ids(path, n=PROMPT):
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200))
    ids = _tok(path).encode(text)
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
def test_device_pack_equals_slot_load(qtype):
    gen = torch.Generator().manual_seed(2)
    g, h, i, dev = 5, 256, 128, torch.device("cuda")
    rand = (lambda n, k: _rand_nvfp4(gen, n, k)) if qtype is QType.NVFP4 else (lambda n, k: _rand_fp8(gen, n, k))
    experts = [(rand(i, h), rand(i, h), rand(h, i)) for _ in range(g)]
    want = QPNExpertSlots(8, h, i, qtype, dev)
    got = QPNExpertSlots(8, h, i, qtype, dev)
    for j, w in enumerate(experts):
        want.load(j, *w)
    raw = {k: torch.zeros(s, dtype=dt) for k, (s, dt) in _raw_shapes(qtype, 8, h, i).items()}
    for j, w in enumerate(experts):
        _fill(raw, j, w, got)
    pack_group(got, g, {k: v.to(dev) for k, v in raw.items()})
    names = ("w13", "w2", "gs") + (("s13", "s2") if qtype is QType.NVFP4 else ())
    for name in names:
        assert torch.equal(getattr(got, name)[:g], getattr(want, name)[:g]), name


def test_staged_layer_equals_cache_slots():
    """PrefillStream.run over 40 experts (3 groups, both buffers reused) against the same experts
    loaded into QPN slots and run by one grouped launch."""
    gen = torch.Generator().manual_seed(3)
    e_n, h, i, t, k, dev = 40, 256, 128, 96, 4, torch.device("cuda")
    rand = lambda n, k: _rand_nvfp4(gen, n, k, scales=(0x20, 0x39))      # noqa: E731 - no fp16 overflow
    experts = [(rand(i, h), rand(i, h), rand(h, i)) for _ in range(e_n)]
    x = (torch.randn(t, h, generator=gen) * 0.1).half().to(dev)
    ids = torch.stack([torch.randperm(e_n, generator=gen)[:k] for _ in range(t)])      # [T, k]
    w = torch.rand(t, k, generator=gen)
    tok = torch.arange(t).repeat_interleave(k)
    ps = PrefillStream(dev)
    got = ps.run(0, x, ids.reshape(-1).numpy(), tok.numpy(), w.reshape(-1).numpy(), lambda l, e: experts[e])
    ref_slots = QPNExpertSlots(e_n, h, i, QType.NVFP4, dev)
    for e, ws in enumerate(experts):
        ref_slots.load(e, *ws)
    want = qpn_moe(x, ref_slots, ids.reshape(-1).int().to(dev), tok.int().to(dev), w.reshape(-1).float().to(dev))
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert ps.stats() == {"experts": e_n, "bytes": sum(q.nbytes for ws in experts for q in ws), "groups": 3,
                          "layers": 1}


def test_staged_from_pinned_store_equals_checkpoint(monkeypatch):
    """The same layer streamed from the pinned CPU store and from the checkpoint: equal outputs (the
    grouped kernel's fp32 atomics aside), the same bytes counted; the arena is pinned for torch."""
    gen = torch.Generator().manual_seed(4)
    e_n, h, i, t, k, dev = 40, 256, 128, 96, 4, torch.device("cuda")
    rand = lambda n, k: _rand_nvfp4(gen, n, k, scales=(0x20, 0x39))      # noqa: E731 - no fp16 overflow
    experts = [(rand(i, h), rand(i, h), rand(h, i)) for _ in range(e_n)]
    store = ExpertStore.build(1, e_n, h, i, lambda l, e: experts[e], QType.NVFP4, progress=False)
    src = StoreSource.pin(store)
    try:
        assert src is not None
        x = (torch.randn(t, h, generator=gen) * 0.1).half().to(dev)
        ids = torch.stack([torch.randperm(e_n, generator=gen)[:k] for _ in range(t)]).reshape(-1).numpy()
        w = torch.rand(t * k, generator=gen).numpy()
        tok = torch.arange(t).repeat_interleave(k).numpy()
        out, stats = {}, {}
        for mode in ("store", "checkpoint", "store", "store+kernel"):
            monkeypatch.setenv(SOURCE_ENV, mode.split("+")[0])
            monkeypatch.setenv(STAGE_KERNEL_ENV, "1" if mode.endswith("kernel") else "0")
            ps = PrefillStream(dev, source=src)
            out[mode] = ps.run(0, x, ids, tok, w, lambda l, e: experts[e])
            stats[mode] = ps.stats()
        for mode in ("store", "store+kernel"):
            torch.testing.assert_close(out[mode], out["checkpoint"], rtol=1e-4, atol=1e-5)   # fp32 atomics
            assert stats[mode] == stats["checkpoint"], stats             # slots + global scales = stored bytes
        assert src.arena.is_pinned()                # torch sees the registered arena as page-locked
    finally:
        if src is not None:
            src.close()
        store.close()


def test_stage_pack_kernel_equals_pack_group():
    """qpn2_stage_pack on the card (store slots -> QPN2) against the torch unpack + pack, bit for bit,
    into slots 2..4 of 6 (the others stay as they were)."""
    from hybrid.kernels.qpn import stage_pack_store
    from hybrid.runtime.prefill_stream import _raw_shapes as shapes

    gen = torch.Generator().manual_seed(5)
    e_n, h, i, dev = 6, 256, 128, torch.device("cuda")
    experts = [(_rand_nvfp4(gen, i, h), _rand_nvfp4(gen, i, h), _rand_nvfp4(gen, h, i)) for _ in range(e_n)]
    store = ExpertStore.build(1, e_n, h, i, lambda l, e: experts[e], QType.NVFP4, progress=False)
    try:
        src = StoreSource(store)
        if src.kind != 2:
            pytest.skip("the stage-pack kernel reads the int16 NVFP4 tile family (an AVX2 host's store)")
        group = [5, 1, 3]
        up = torch.empty(3, src.S, dtype=torch.uint8, device=dev)
        src.upload(0, group, up)
        want = QPNExpertSlots(6, h, i, QType.NVFP4, dev)
        raw = {k: torch.empty(sh, dtype=dt, device=dev) for k, (sh, dt) in shapes(QType.NVFP4, 3, h, i).items()}
        src.unpack(up, raw, 3)
        raw["gs"][:3].copy_(src.global_scales(0, group))
        pack_group(want, 3, raw, first=2)
        got = QPNExpertSlots(6, h, i, QType.NVFP4, dev)
        for t in (got.w13, got.w2, got.s13, got.s2):
            t.fill_(7)
        stage_pack_store(up, got, 2, 3)
        torch.cuda.synchronize()
        for name in ("w13", "s13", "w2", "s2"):
            g, w = getattr(got, name), getattr(want, name)
            assert torch.equal(g[2:5], w[2:5]), name
            assert (g[:2] == 7).all() and (g[5:] == 7).all(), name
    finally:
        store.close()


def _generate(path, slots, offload, ids, times=2, n=8):
    s = open_session(path, RuntimeOptions(device="cuda", cache_slots=(slots,), prefill_offload_min=offload,
                                          cache_warm="profile"))
    try:
        res = [generate(s.model, _tok(path), ids, n, Sampler(SamplerConfig())) for _ in range(times)]
    finally:
        s.close()
    return res, s


@pytest.mark.parametrize("source", ["store", "checkpoint"])
@pytest.mark.parametrize("slots", [0, 64])
def test_greedy_ids_offload_on_off_and_prefill_speed(nvfp4, slots, source, monkeypatch):
    monkeypatch.setenv(SOURCE_ENV, source)
    ids = _ids(nvfp4)
    off, s_off = _generate(nvfp4, slots, 0, ids)
    on, s_on = _generate(nvfp4, slots, 32, ids)
    assert s_on.model.experts.store_source is not None                  # the Numba runner's store, pinned
    assert s_on.report()["prefill_stream"]["source"] == source
    assert [r.generated_ids for r in on] == [r.generated_ids for r in off]
    st = s_on.model.experts.prefill_stream_stats()
    rep = s_on.report()
    assert st["experts"] > 0 and rep["pcie_bytes"]["prefill_stream"] == st["bytes"]
    assert st["bytes"] == st["experts"] * s_on.caches[0].bytes_per_expert and st["staging_bytes"] > 0  # no padding
    assert s_off.model.experts.prefill_stream_stats()["experts"] == 0
    assert rep["pcie_bytes"]["act_d2h"] < s_off.report()["pcie_bytes"]["act_d2h"]   # no prefill activations down
    print(f"\ntiny NVFP4, {PROMPT}-token prompt, --cache-slots {slots}, from the {source}: prefill tok/s offload off "
          f"{off[-1].prefill_tok_s:.1f}, on {on[-1].prefill_tok_s:.1f} (second generation of each session; "
          f"{st['experts']} experts streamed, {st['bytes'] / 2**20:.1f} MiB)")
