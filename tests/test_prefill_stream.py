"""Prefill offload in CPU mode (hybrid.runtime.prefill_stream): the staging pack equals a slot load bit
for bit; greedy output is identical with offload on and off on the tiny model (BF16 and NVFP4, cache at
0% and 50%); what it streams is what the routing says, and the cache sees the same lookups; decode steps
and short prompts never stream; the planner reserves the staging bytes; bad flag values are one line."""
import numpy as np
import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.checkpoint.qweight import QWeight
from hybrid.cli.run import main
from hybrid.errors import HybridError
from hybrid.experts.trace import read_trace
from hybrid.generate import generate
from hybrid.kernels import QPNExpertSlots, layout
from hybrid.model import resolve_model_path
from hybrid.model.config import ModelConfig
from hybrid.planner import ModelBytes, PlanRequest, load_profile, make_plan
from hybrid.planner.memory import PREFILL_STAGE_GROUP, prefill_stage_bytes
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.runtime.options import PREFILL_OFFLOAD_MIN
from hybrid.runtime.prefill_stream import _fill, _raw_shapes
from hybrid.runtime.stage_pack import pack_fp8_rows, pack_group, pack_nvfp4_rows
from hybrid.sampler import Sampler, SamplerConfig
from hybrid.tokenizer import Tokenizer
from tests.quant_layouts import to_nvfp4

MIN = 16                      # --prefill-offload-min of the runs below
N_DECODE = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    bf16 = resolve_model_path("tiny")
    return {"bf16": bf16, "nvfp4": to_nvfp4(bf16, tmp_path_factory.mktemp("pfs") / "nvfp4")}


def _tok(path):
    cfg = ModelConfig.from_folder(path)
    return Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)


def _prompt(path, n=32):
    ids = _tok(path).encode("import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n"
                            "        print(os.path.basename(name), len(name))\n    return 0\n\n\n"
                            "if __name__ == '__main__':\n    sys.exit(main(sys.argv))\n")
    assert len(ids) >= n
    return ids[:n]


def _run(path, ids, times=1, **kw):
    """`times` greedy generations from `ids` in one session (the later ones' prefills find the experts
    the earlier ones promoted: hits and streamed misses in one layer) -> their ids, session, lookups."""
    s = open_session(path, RuntimeOptions(**{"cache_warm": "profile", **kw}))
    lookups = _spy_lookups(s)
    s.cpu_submits = _spy_cpu_submits(s)
    try:
        out = [generate(s.model, _tok(path), ids, N_DECODE, Sampler(SamplerConfig()),
                        prefill_chunk=s.prefill_chunk).generated_ids for _ in range(times)]
    finally:
        s.close()
    return out if times > 1 else out[0], s, lookups


def _spy_lookups(s) -> list:
    """Record (phase, layer, routed ids, slots) of every cache lookup of the session."""
    out = []
    for card in s.cards:
        orig = card.cache.lookup

        def lookup(layer, ids, _orig=orig):
            lk = _orig(layer, ids)
            out.append((s.model.experts._step["phase"], layer, np.array(ids), np.array(lk.slots)))
            return lk
        card.cache.lookup = lookup
    return out


def _spy_cpu_submits(s) -> list:
    """Record (phase, expert pairs) of every piece of work handed to the CPU expert runner."""
    out, experts = [], s.model.experts
    orig = experts.cpu.submit

    def submit(layer, ids, rows, weights, x, _orig=orig):
        out.append((experts._step["phase"], len(ids)))
        return _orig(layer, ids, rows, weights, x)
    experts.cpu.submit = submit
    return out


def _counters(s):
    return [(c.hits.tolist(), c.misses.tolist(), c.stats().promotions.tolist()) for c in s.caches]


# ---- the staging pack -------------------------------------------------------------------------
def _rand_nvfp4(gen, n, k, name="", scales=(0, 256)):
    """Random NVFP4 weight; scales: the range of its e4m3 group-scale bytes (the default takes every
    byte, negative and huge ones included: for the pack; (0x20, 0x39) = 1/8..1 to compute with)."""
    data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(*scales, (n, k // 16), dtype=torch.uint8, generator=gen)
    scale[(scale & 0x7F) == 0x7F] = 0x38                          # no NaN codes
    return QWeight(QType.NVFP4, (n, k), data, scale.view(torch.float8_e4m3fn),
                   torch.rand((), generator=gen) + 0.5, name=name)


def _rand_fp8(gen, n, k):
    data = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    data[(data & 0x7F) == 0x7F] = 0x38
    return QWeight(QType.FP8, (n, k), data.view(torch.float8_e4m3fn), torch.rand((), generator=gen) + 0.5)


def test_pack_rows_bit_exact_with_layout():
    """Negative group scales included (the pack folds their sign into the codes, as layout does)."""
    gen = torch.Generator().manual_seed(0)
    for n, k in ((16, 64), (64, 256), (48, 192)):
        qw = _rand_nvfp4(gen, n, k)
        w_ref, s_ref = layout.pack_nvfp4(qw)
        w, s = torch.empty_like(w_ref), torch.empty_like(s_ref)
        pack_nvfp4_rows(qw.data, qw.scale.view(torch.uint8), w, s)
        assert torch.equal(w, w_ref) and torch.equal(s, s_ref)
        q8 = _rand_fp8(gen, n, k)
        ref = layout.pack_fp8(q8)
        w8 = torch.empty_like(ref)
        pack_fp8_rows(q8.data.view(torch.uint8), w8)
        assert torch.equal(w8, ref)


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
def test_pack_group_equals_slot_load(qtype):
    """A staged group's slots hold what QPNExpertSlots.load packs for each expert (the CUDA path's
    words, scales and folded global scales), from the stored bytes as _fill copies them."""
    gen = torch.Generator().manual_seed(1)
    g, h, i = 3, 128, 64
    rand = (lambda n, k: _rand_nvfp4(gen, n, k)) if qtype is QType.NVFP4 else (lambda n, k: _rand_fp8(gen, n, k))
    experts = [(rand(i, h), rand(i, h), rand(h, i)) for _ in range(g)]
    slots = QPNExpertSlots(4, h, i, qtype, torch.device("cpu"))
    slots._alloc()                                                 # the CUDA storage's tensors, on the CPU
    raw = {k: torch.zeros(s, dtype=dt) for k, (s, dt) in _raw_shapes(qtype, 4, h, i).items()}
    for j, w in enumerate(experts):
        _fill(raw, j, w, slots)
    pack_group(slots, g, raw)
    for j, (gate, up, down) in enumerate(experts):
        if qtype is QType.NVFP4:
            (wg, sg), (wu, su), (wd, sd) = (layout.pack_nvfp4(q) for q in (gate, up, down))
            assert torch.equal(slots.s13[j], torch.cat([sg, su])) and torch.equal(slots.s2[j], sd)
        else:
            wg, wu, wd = (layout.pack_fp8(q) for q in (gate, up, down))
        assert torch.equal(slots.w13[j], torch.cat([wg, wu])) and torch.equal(slots.w2[j], wd)
        assert slots.gs[j].tolist() == pytest.approx([layout.global_scale(q) for q in (gate, up, down)], rel=0)


# ---- end to end in CPU mode ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("slots", [0, 64])                          # 0% and 50% of the 4 x 32 experts
def test_greedy_identical_and_streamed_what_routing_says(tiny, kind, slots, tmp_path):
    path = tiny[kind]
    ids = _prompt(path)
    off, s_off, look_off = _run(path, ids, 2, cache_slots=(slots,), prefill_offload_min=0)
    on, s_on, look_on = _run(path, ids, 2, cache_slots=(slots,), prefill_offload_min=MIN,
                             trace=str(tmp_path / "t.jsonl"))
    assert on == off
    # the cache saw the same lookups, counted and promoted the same, up to near ties: streamed experts
    # run the card's numerics (fp16 activations), missed ones the CPU engine's, so an expert ranked
    # k-th by a margin below their difference can swap places with the next (a Sapphire Rapids VM:
    # 4 tokens of 3 prefill lookups per generation; an EPYC VM: none). Lookups agree up to the first
    # swap, swaps are rare, and with none the counters agree too.
    assert len(look_on) == len(look_off)
    rows = swapped = 0
    for a, b in zip(look_on, look_off):
        assert a[:2] == b[:2] and a[2].shape == b[2].shape
        if swapped == 0 and np.array_equal(a[2], b[2]):
            assert np.array_equal(a[3], b[3])                            # same history, same slots
        rows += len(a[2])
        swapped += int((a[2] != b[2]).any(axis=1).sum())
    assert swapped <= rows // 20, f"{swapped} of {rows} routed tokens differ"
    if swapped == 0:
        assert _counters(s_on) == _counters(s_off)
    # streamed: each prefill lookup's distinct missed experts, their stored bytes; nothing else
    want = sum(len(np.unique(i[sl < 0])) for ph, _, i, sl in look_on if ph == "prefill")
    st = s_on.model.experts.prefill_stream_stats()
    assert want > 0 and st["experts"] == want
    assert st["bytes"] == want * s_on.caches[0].bytes_per_expert
    assert st["layers"] == sum(1 for ph, _, _, sl in look_on if ph == "prefill" and (sl < 0).any())
    assert st["groups"] >= st["layers"]
    assert s_off.model.experts.prefill_stream_stats()["experts"] == 0
    # CPU mode moves nothing over PCIe; the trace's prefill step says how many experts streamed
    assert s_on.report()["pcie_bytes"]["prefill_stream"] == 0
    assert s_on.report()["prefill_stream"]["source"] is None          # no CUDA card: nothing pinned or DMA'd
    assert s_on.report()["prefill_stream"]["offload_min"] == MIN and s_off.report()["prefill_stream"]["offload_min"] == 0
    assert any(f"prefill offload (steps of >= {MIN} tokens): {want} experts" in line for line in s_on.summary())
    assert s_on.report()["prefill_graphs"] is None                    # CPU mode: no graphs
    per_step = [sum(len(np.unique(i[sl < 0])) for ph, _, i, sl in look_on[n:n + 4] if ph == "prefill")
                for n in range(0, len(look_on), 4)]                   # 4 layers, one lookup each per step
    steps = read_trace(tmp_path / "t.jsonl").steps
    assert [r.timings.get("streamed_experts", 0) for r in steps] == per_step
    assert [r.phase for r in steps].count("prefill") == 2 and sum(per_step) == want
    if slots:                                                     # the second prefill hit and streamed
        second = [sl for ph, _, _, sl in look_on[-4 * (N_DECODE - 1) - 4:] if ph == "prefill"]
        assert len(second) == 4 and any((sl >= 0).any() and (sl < 0).any() for sl in second)
    # the CPU runner got no prefill work with offload on (without it, the prefill's misses went there)
    assert not [n for ph, n in s_on.cpu_submits if ph == "prefill"]
    assert sum(n for ph, n in s_off.cpu_submits if ph == "prefill") > 0


def test_short_prompts_and_decode_never_stream(tiny):
    path = tiny["nvfp4"]
    ids = _prompt(path, MIN - 1)
    _, s, look = _run(path, ids, cache_slots=(0,), prefill_offload_min=MIN)
    assert s.model.experts.prefill_stream_stats()["experts"] == 0
    _, s, look = _run(path, _prompt(path, MIN), cache_slots=(0,), prefill_offload_min=1)
    want = sum(len(np.unique(i[sl < 0])) for ph, _, i, sl in look if ph == "prefill")
    assert s.model.experts.prefill_stream_stats()["experts"] == want    # decode steps (T = 1) not counted


def test_chunked_prefill_streams_each_chunk(tiny):
    path = tiny["bf16"]
    ids = _prompt(path, 32)
    off, _, _ = _run(path, ids, cache_slots=(0,), prefill_offload_min=0, prefill_chunk=16)
    on, s, look = _run(path, ids, cache_slots=(0,), prefill_offload_min=16, prefill_chunk=16)
    assert on == off
    assert s.stats.steps["prefill"] == 2
    assert s.model.experts.prefill_stream_stats()["layers"] == 2 * 4


# ---- planner reserve, flags ---------------------------------------------------------------------
def test_planner_reserves_staging(tiny):
    mb = ModelBytes.from_folder(tiny["nvfp4"])
    prof = load_profile("v100x2-e5v4")
    base = dict(gpus=(0,), layer_split=(), cache_slots=(8,))
    p0 = make_plan(mb, prof, PlanRequest(**base))
    p1 = make_plan(mb, prof, PlanRequest(**base, prefill_stage=PREFILL_STAGE_GROUP))
    extra = p1.cards[0].workspace_bytes - p0.cards[0].workspace_bytes
    assert extra == prefill_stage_bytes(mb.slot_bytes) == 6 * PREFILL_STAGE_GROUP * mb.slot_bytes
    s_on = open_session(tiny["nvfp4"], RuntimeOptions(profile="v100x2-e5v4", cache_slots=(8,),
                                                      prefill_offload_min=MIN))
    s_off = open_session(tiny["nvfp4"], RuntimeOptions(profile="v100x2-e5v4", cache_slots=(8,),
                                                       prefill_offload_min=0))
    s_on.close(), s_off.close()
    assert s_on.plan.cards[0].workspace_bytes - s_off.plan.cards[0].workspace_bytes == extra


@pytest.mark.parametrize("value,needle", [("x", "expected auto or a token count"), ("-3", "must be a token count >= 0"),
                                          ("1.5", "expected auto or a token count")])
def test_bad_flag_one_line(value, needle, capsys):
    rc = main(["--prefill-offload-min", value, "-n", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: --prefill-offload-min") and needle in err


def test_flag_auto_is_the_cost_model():
    from hybrid.cli.run import _tokens

    assert _tokens("auto") is None and _tokens("Auto") is None and _tokens("0") == 0 and _tokens("48") == 48


def test_bad_option_value():
    with pytest.raises(HybridError, match="--prefill-offload-min"):
        RuntimeOptions(prefill_offload_min=-1)


def test_default_on_for_cuda_cards_only():
    """Unset, offload is on for CUDA cards (PREFILL_OFFLOAD_MIN tokens) and off in CPU mode; a value given
    is used on both; 0 turns it off."""
    assert RuntimeOptions().offload_min == 0
    assert RuntimeOptions(device="cuda").offload_min == PREFILL_OFFLOAD_MIN > 0
    assert RuntimeOptions(prefill_offload_min=7).offload_min == 7
    assert RuntimeOptions(device="cuda", prefill_offload_min=0).offload_min == 0
