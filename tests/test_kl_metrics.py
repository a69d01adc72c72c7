"""KL / same-top / perplexity scored as llama.cpp's --kl-divergence, on hand-made logits."""
import math

import numpy as np
import pytest

from hybrid.metrics.kl import (FLOOR, BaseLogProbs, KLAccumulator, chunk_tokens, kl_divergence,
                               mean_and_uncertainty, percentile, score_rows, scored_rows)


def logp(probs):
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def test_scored_rows_are_second_half_minus_last():
    assert scored_rows(8) == slice(4, 7)          # rows 4,5,6 predict tokens 5,6,7
    assert scored_rows(9) == slice(4, 8)
    assert len(range(512)[scored_rows(512)]) == 512 - 1 - 256


def test_chunking_drops_the_tail():
    c = chunk_tokens(range(21), 8)
    assert c.shape == (2, 8) and c[1, 0] == 8 and c[-1, -1] == 15


def test_only_scored_positions_matter():
    rng = np.random.default_rng(0)
    n_ctx, v = 8, 16
    toks = rng.integers(0, v, size=(1, n_ctx))
    base = rng.normal(size=(1, n_ctx, v)).astype(np.float32)
    cand = base + rng.normal(scale=0.3, size=base.shape).astype(np.float32)
    r0 = kl_divergence(base, cand, toks)
    cand2 = cand.copy()
    cand2[0, :4] = rng.normal(size=(4, v))        # first half: not scored
    cand2[0, 7] = rng.normal(size=v)              # last position predicts nothing
    toks2 = toks.copy()
    toks2[0, :5] = (toks2[0, :5] + 1) % v         # tokens 0..4 are never targets
    assert kl_divergence(base, cand2, toks2) == r0
    cand3 = cand.copy()
    cand3[0, 4] += np.linspace(0, 3, v, dtype=np.float32)
    assert kl_divergence(base, cand3, toks).mean_kld != r0.mean_kld
    assert r0.count == 3


def test_known_kl_value():
    base = logp([[0.5, 0.25, 0.25]])
    cand = logp([[1 / 3, 1 / 3, 1 / 3]])
    s = score_rows(BaseLogProbs.from_logits(base), cand, [0])
    expected = 0.5 * math.log(1.5) + 0.5 * math.log(0.75)     # 0.0588915
    assert s.kld[0] == pytest.approx(expected, abs=2e-4)
    assert s.nll[0] == pytest.approx(math.log(3), abs=1e-6)
    assert s.nll_base[0] == pytest.approx(math.log(2), abs=2e-4)


def test_identical_logits_give_zero_kl_within_storage_rounding():
    rng = np.random.default_rng(1)
    lg = rng.normal(scale=3, size=(50, 100)).astype(np.float32)
    s = score_rows(BaseLogProbs.from_logits(lg), lg, rng.integers(0, 100, 50))
    assert np.abs(s.kld).max() < 1e-4 and s.same_top.all()    # uint16 storage noise only


def test_uint16_storage_round_trip():
    rng = np.random.default_rng(2)
    lg = rng.normal(scale=2, size=(4, 300)).astype(np.float32)
    b = BaseLogProbs.from_logits(lg)
    exact = lg - lg.max(1, keepdims=True) - np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1, keepdims=True))
    keep = exact > exact.max(1, keepdims=True) - 16
    err = np.abs(b.log_probs() - exact)[keep]
    assert err.max() <= (b.scale.max() / 2 + 1e-5)


def test_floor_excludes_tokens_at_or_below_minus_16():
    # base: token 1 is e^-30 below token 0 -> stored at the floor, excluded from KL.
    base = np.array([[0.0, -30.0]], dtype=np.float32)
    b = BaseLogProbs.from_logits(base)
    assert b.q[0, 1] == 0 and b.log_probs()[0, 1] <= FLOOR
    cand = np.array([[0.0, 0.0]], dtype=np.float32)
    s = score_rows(b, cand, [0])
    # only token 0 counts: p0 * (log p0 - log q0) = 1 * (0 - log 0.5)
    assert s.kld[0] == pytest.approx(math.log(2), abs=1e-4)
    # a token 15.9 below the top is above the floor and counts
    base2 = np.array([[0.0, -15.9]], dtype=np.float32)
    cand2 = np.array([[0.0, 10.0]], dtype=np.float32)
    k_with = score_rows(BaseLogProbs.from_logits(base2), cand2, [0]).kld[0]
    p1 = math.exp(-15.9) / (1 + math.exp(-15.9))
    q = np.exp(cand2[0] - cand2[0].max()); q /= q.sum()
    exact = (1 - p1) * math.log((1 - p1) / q[0]) + p1 * math.log(p1 / q[1])
    assert k_with == pytest.approx(exact, rel=1e-3)


def test_same_top_ties_go_to_first_index():
    b = BaseLogProbs.from_logits(np.array([[1.0, 5.0, 0.0, 5.0]], dtype=np.float32))   # base top: index 1
    assert score_rows(b, np.array([[0.0, 2.0, 0.0, 2.0]], np.float32), [0]).same_top[0]   # cand tie -> 1
    assert not score_rows(b, np.array([[0.0, 2.0, 0.0, 2.5]], np.float32), [0]).same_top[0]
    b2 = BaseLogProbs.from_logits(np.array([[5.0, 1.0, 5.0]], dtype=np.float32))         # base tie -> 0
    assert not score_rows(b2, np.array([[0.0, 0.0, 1.0]], np.float32), [0]).same_top[0]
    assert score_rows(b2, np.array([[1.0, 0.0, 1.0]], np.float32), [0]).same_top[0]


def test_perplexity_and_same_top_uncertainty():
    n = 100
    acc = KLAccumulator()
    base = np.tile(np.array([[0.0, 0.0, -1.0]], np.float32), (n, 1))
    cand = base.copy()
    cand[:10, 2] = 5.0                             # 10 rows pick another top token
    cand[10:, :2] = 0.0                            # rows 10.. give p=1/2 to tokens 0 and 1
    cand[10:, 2] = -60.0
    acc.add_rows(BaseLogProbs.from_logits(base), cand, np.zeros(n, dtype=np.int64))
    r = acc.result()
    assert r.count == n
    assert r.same_top_pct == pytest.approx(90.0)
    assert r.same_top_unc_pct == pytest.approx(100 * math.sqrt(0.9 * 0.1 / 99))
    nll = np.r_[np.full(10, math.log(math.exp(5) + 2)), np.full(90, math.log(2))]
    assert r.ppl == pytest.approx(math.exp(nll.mean()), rel=1e-5)


def test_mean_uncertainty_and_percentile_match_llama_formulas():
    v = np.arange(1, 21, dtype=np.float64)
    m, u = mean_and_uncertainty(v)
    assert m == pytest.approx(10.5) and u == pytest.approx(math.sqrt((np.mean(v**2) - 10.5**2) / 19))
    assert mean_and_uncertainty(v[:10])[1] == 0.0          # n <= 10 -> no uncertainty
    x = np.random.default_rng(3).random(1000).astype(np.float32)
    assert percentile(x, 0.99) == pytest.approx(float(np.percentile(x, 99)), rel=1e-5)
    assert percentile(x, 1.0) == x.max() and percentile(x, 0.0) == x.min()


def test_kl_grows_with_noise():
    rng = np.random.default_rng(4)
    base = rng.normal(scale=3, size=(2, 64, 50)).astype(np.float32)
    toks = rng.integers(0, 50, size=(2, 64))
    small = kl_divergence(base, base + rng.normal(scale=0.1, size=base.shape).astype(np.float32), toks)
    big = kl_divergence(base, base + rng.normal(scale=1.0, size=base.shape).astype(np.float32), toks)
    assert 0 < small.mean_kld < big.mean_kld and small.same_top_pct >= big.same_top_pct
    assert small.p99_kld >= small.median_kld
