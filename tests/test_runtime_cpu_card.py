"""CPU-mode speed paths give the numbers of the paths they replace, bit for bit: held slots
(hybrid.runtime.slots.host_moe vs the QPN torch reference), held dense weights
(hybrid.runtime.cpu_card vs the per-call dequantize), and the CPU runner's inline calls vs its
thread pool."""
import numpy as np
import pytest
import torch

from hybrid.checkpoint.formats import QType, quantize_fp8, quantize_nvfp4
from hybrid.checkpoint.qweight import QWeight
from hybrid.experts.cpu_runner import CpuExpertRunner
from hybrid.experts.store import ExpertStore
from hybrid.kernels import QPNExpertSlots, qpn_moe
from hybrid.model.loader import load_model
from hybrid.runtime.cpu_card import dense_linears, hold_dense
from hybrid.runtime.slots import QPNSlots, TorchExpertSlots
from hybrid.testing import write_random_model
from tests.quant_layouts import to_nvfp4

H, I, S = 128, 64, 6


def _qw(qtype: QType, n: int, k: int, gen) -> QWeight:
    w = torch.randn(n, k, generator=gen) * 0.05
    if qtype is QType.NVFP4:
        packed, scale, scale_2 = quantize_nvfp4(w)
        return QWeight(QType.NVFP4, (n, k), packed, scale, scale_2)
    data, scale = quantize_fp8(w)
    return QWeight(QType.FP8, (n, k), data, scale)


def _experts(qtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(_qw(qtype, I, H, gen), _qw(qtype, I, H, gen), _qw(qtype, H, I, gen)) for _ in range(S)]


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
@pytest.mark.parametrize("t", [1, 5])
def test_held_slots_equal_qpn_reference(qtype, t):
    ex = _experts(qtype)
    held, ref = QPNSlots(S, H, I, qtype, torch.device("cpu")), QPNExpertSlots(S, H, I, qtype, torch.device("cpu"))
    for s, w in enumerate(ex):
        held.load(s, *w)
        ref.load(s, *w)
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, H, generator=gen)
    tok = torch.arange(t, dtype=torch.int32).repeat_interleave(3)                       # [3T]
    slot_ids = torch.stack([torch.randperm(S, generator=gen)[:3] for _ in range(t)]).reshape(-1).int()
    route_w = torch.rand(3 * t, generator=gen)
    got = held.moe(x, slot_ids, tok, route_w)
    want = qpn_moe(x.half(), ref, slot_ids, tok, route_w)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_empty_slot_is_an_error():
    held = QPNSlots(S, H, I, QType.NVFP4, torch.device("cpu"))
    held.load(0, *_experts(QType.NVFP4)[0])
    with pytest.raises(ValueError, match="slot 2 is empty"):
        held.moe(torch.zeros(1, H), torch.tensor([0, 2], dtype=torch.int32),
                 torch.zeros(2, dtype=torch.int32), torch.ones(2))


def test_torch_slots_hold_fp32_with_the_same_numbers():
    gen = torch.Generator().manual_seed(1)
    w = [QWeight(QType.BF16, s, (torch.randn(*s, generator=gen) * 0.05).bfloat16())
         for s in ((I, H), (I, H), (H, I))]
    slots = TorchExpertSlots(2, torch.device("cpu"))
    slots.load(1, *w)
    assert all(lin.weight.qtype is QType.F32 for lin in slots.slots[1])
    x = torch.randn(3, H, generator=gen)
    got = slots.moe(x, torch.tensor([1, 1]), torch.tensor([0, 2]), torch.tensor([0.25, 0.5]))
    g, u, d = (q.dequantize(torch.float32) for q in w)
    y = (torch.nn.functional.silu(x[[0, 2]] @ g.T) * (x[[0, 2]] @ u.T)) @ d.T
    assert torch.equal(got[[0, 2]], y * torch.tensor([[0.25], [0.5]])) and not got[1].any()
    from hybrid.runtime.slots import HoldBudget

    stored = TorchExpertSlots(2, torch.device("cpu"), HoldBudget(0))     # no budget: as stored
    stored.load(1, *w)
    assert all(lin.weight.qtype is QType.BF16 for lin in stored.slots[1])
    assert torch.equal(stored.moe(x, torch.tensor([1, 1]), torch.tensor([0, 2]), torch.tensor([0.25, 0.5])), got)


@pytest.fixture(scope="module")
def nvfp4_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpucard")
    bf16 = write_random_model(root / "bf16", "qwen3_moe", seed=5, num_hidden_layers=2, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=64)
    return to_nvfp4(bf16, root / "nvfp4", "modelopt")


def test_held_dense_weights_give_identical_logits(nvfp4_model):
    ids = torch.arange(1, 12)
    want = load_model(nvfp4_model).forward_logits(ids)
    m = load_model(nvfp4_model)
    assert any(lin.weight.qtype is QType.NVFP4 for lin in dense_linears(m))
    held = hold_dense(m)
    assert held > 0 and all(lin.weight.qtype is QType.F32 for lin in dense_linears(m))
    assert torch.equal(m.forward_logits(ids), want)


def test_hold_dense_respects_its_budget(nvfp4_model):
    m = load_model(nvfp4_model)
    lins = dense_linears(m)
    first = 4 * lins[0].weight.shape[0] * lins[0].weight.shape[1]
    assert hold_dense(m, budget=first) == first
    assert lins[0].weight.qtype is QType.F32 and lins[1].weight.qtype is not QType.F32


@pytest.fixture(scope="module")
def store():
    ex = _experts(QType.NVFP4, seed=2)
    s = ExpertStore.build(1, S, H, I, lambda l, e: ex[e], "nvfp4", progress=False)
    yield s
    s.close()


@pytest.mark.parametrize("t", [1, 7])
def test_inline_calls_equal_the_pool(store, t):
    rng = np.random.default_rng(t)
    x = rng.standard_normal((t, H)).astype(np.float32)
    e = np.concatenate([rng.choice(S, 3, replace=False) for _ in range(t)]).astype(np.int32)
    rows = np.repeat(np.arange(t), 3).astype(np.int32)
    w = rng.uniform(0.1, 1, 3 * t).astype(np.float32)
    with CpuExpertRunner(store, threads=2, inline_bytes=0) as pool, CpuExpertRunner(store, threads=2) as inl:
        hp, hi = pool.submit(0, e, rows, w, x), inl.submit(0, e, rows, w, x)
        assert not hp.inline and hi.inline and not hi.done.is_set()     # inline work waits for sync
        yp, yi = pool.sync(hp), inl.sync(hi)
    assert hi.done.is_set() and np.array_equal(yp, yi) and yi.any()


def test_torch_runner_big_and_small_calls_agree_and_read_once():
    from hybrid.runtime.cpu_side import TorchCpuRunner

    gen = torch.Generator().manual_seed(4)
    ex = [tuple(QWeight(QType.BF16, s, (torch.randn(*s, generator=gen) * 0.05).bfloat16())
                for s in ((I, H), (I, H), (H, I))) for _ in range(S)]
    reads = []
    get = lambda l, e: reads.append((l, e)) or ex[e]                                     # noqa: E731
    x = np.random.default_rng(0).standard_normal((2, H)).astype(np.float32)
    e, rows, w = np.array([1, 3, 1]), np.array([0, 0, 1]), np.array([0.5, 0.25, 1.0], np.float32)
    big, small = TorchCpuRunner(get, threads=2, inline_bytes=0), TorchCpuRunner(get, threads=2)
    before = torch.get_num_threads()
    hb, hs = big.submit(0, e, rows, w, x), small.submit(0, e, rows, w, x)
    assert np.array_equal(big.sync(hb), small.sync(hs))
    assert torch.get_num_threads() == before                 # a big call's thread count is undone
    small.sync(small.submit(0, e, rows, w, x))
    assert sorted(set(reads)) == [(0, 1), (0, 3)] and len(reads) == 4     # once per runner


def test_torch_runner_starts_no_thread():
    import threading

    from hybrid.runtime.cpu_side import TorchCpuRunner

    ex = [tuple(QWeight(QType.F32, s, torch.randn(*s) * 0.05) for s in ((I, H), (I, H), (H, I)))]
    n = threading.active_count()
    r = TorchCpuRunner(lambda l, e: ex[e], threads=2, inline_bytes=0)
    y = r.sync(r.submit(0, np.array([0]), np.array([0]), np.array([1.0], np.float32),
                        np.ones((1, H), np.float32)))
    assert threading.active_count() == n and y.shape == (1, H) and y.any()


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
def test_slots_past_the_hold_budget_keep_stored_weights_same_numbers(qtype):
    from hybrid.runtime.slots import HoldBudget

    ex = _experts(qtype, seed=3)
    one = 4 * 3 * H * I                                   # fp32 bytes of one expert
    held = QPNSlots(S, H, I, qtype, torch.device("cpu"), HoldBudget(2 * one))
    full = QPNSlots(S, H, I, qtype, torch.device("cpu"))
    for s, w in enumerate(ex):
        held.load(s, *w)
        full.load(s, *w)
    assert held.held == [one, one, 0, 0, 0, 0] and held.hold.left == 0
    assert isinstance(held.host[0][0], torch.Tensor) and isinstance(held.host[2][0], QWeight)
    held.load(0, *ex[5])                                  # replacing a held slot keeps its bytes
    assert held.held[0] == one and held.hold.left == 0
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(0))
    sid, tok = torch.tensor([1, 2, 4, 3], dtype=torch.int32), torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    rw = torch.tensor([0.5, 0.25, 1.0, 0.75])
    assert torch.equal(held.moe(x, sid, tok, rw), full.moe(x, sid, tok, rw))


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.BF16])
def test_reference_experts_slots_and_torch_runner_sum_alike(qtype):
    """ReferenceExperts, TorchExpertSlots and TorchCpuRunner share hybrid.model.moe.expert_sum: the
    same routing gives the same bits through each, and the float64 per-pair sum within fp32 rounding."""
    from hybrid.model.linear import Linear
    from hybrid.model.moe import ReferenceExperts, SwiGLU
    from hybrid.runtime.cpu_side import TorchCpuRunner
    from hybrid.runtime.slots import HoldBudget

    gen = torch.Generator().manual_seed(6)
    ex = _experts(QType.NVFP4, seed=6) if qtype is QType.NVFP4 else \
        [tuple(QWeight(QType.BF16, s, (torch.randn(*s, generator=gen) * 0.05).bfloat16())
               for s in ((I, H), (I, H), (H, I))) for _ in range(S)]
    T, k = 5, 3
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(S, generator=gen)[:k] for _ in range(T)])            # [T, k]
    w = torch.rand(T, k, generator=gen)
    tok = torch.arange(T).repeat_interleave(k)                                             # [T*k]
    ref = ReferenceExperts(lambda l, e: SwiGLU(*(Linear(q) for q in ex[e])))(0, x, ids, w)
    slots = TorchExpertSlots(S, torch.device("cpu"), HoldBudget(0))
    for s, q in enumerate(ex):
        slots.load(s, *q)
    runner = TorchCpuRunner(lambda l, e: ex[e])
    cpu = runner.sync(runner.submit(0, ids.reshape(-1).numpy(), tok.numpy(), w.reshape(-1).numpy(), x.numpy()))
    assert torch.equal(slots.moe(x, ids.reshape(-1), tok, w.reshape(-1)), ref)
    assert np.array_equal(cpu, ref.numpy())
    want = torch.zeros(T, H, dtype=torch.float64)
    for t, e, r in zip(tok.tolist(), ids.reshape(-1).tolist(), w.reshape(-1).tolist()):
        g, u, d = (q.dequantize(torch.float32).double() for q in ex[e])
        want[t] += r * (d @ (torch.nn.functional.silu(g @ x[t].double()) * (u @ x[t].double())))
    torch.testing.assert_close(ref.double(), want, rtol=1e-4, atol=1e-5)
