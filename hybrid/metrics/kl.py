"""Same-top-token, KL divergence and perplexity exactly as llama.cpp's `perplexity --kl-divergence`.

What llama.cpp (tools/perplexity/perplexity.cpp) does, reproduced here step by step:
- The token stream is cut into chunks of n_ctx tokens (a shorter tail is dropped); each chunk is
  evaluated from an empty KV cache. Only the second half is scored: with first = n_ctx // 2, the
  logits of positions first .. n_ctx-2 are compared, each predicting the next token
  (n_ctx - 1 - first positions per chunk).
- The base (reference) logits are stored per position as uint16 log-probabilities: the range is
  [max - 16, max] of the logits (the -16 floor); logits at or below max-16 are stored as 0, i.e. at
  the floor; q = nearest_int((logit - min) / scale), scale = (max - min) / 65535, and
  log p = scale * q + min_log_prob.
- KL(base || candidate) sums only tokens whose stored base log-prob is > -16.
- "Same top": argmax of the candidate logits equals argmax of the stored base log-probs; both take
  the first index on ties (strict > scan).
- Means carry the uncertainty sqrt((E[x^2] - E[x]^2) / (n - 1)) (0 when n <= 10); same-top's is
  sqrt(p (1 - p) / (n - 1)); percentiles interpolate linearly between sorted values.
Arithmetic follows the C source's float32 / float64 split so numbers match to float rounding.
Legend: R scored rows, V vocab.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

FLOOR = -16.0
F32 = np.float32


def scored_rows(n_ctx: int) -> slice:
    """Rows of a chunk's [n_ctx, V] logits that llama.cpp scores: first .. n_ctx-2, first = n_ctx//2."""
    if n_ctx < 4:
        raise ValueError(f"n_ctx={n_ctx}: need at least 4 tokens per chunk")
    return slice(n_ctx // 2, n_ctx - 1)


def chunk_tokens(tokens, n_ctx: int) -> np.ndarray:
    """Token stream -> int32 [C, n_ctx] full chunks (llama.cpp drops the tail)."""
    t = np.asarray(tokens, dtype=np.int32)
    n_chunk = len(t) // n_ctx
    return t[: n_chunk * n_ctx].reshape(n_chunk, n_ctx)


def _log_sum_exp(logits: np.ndarray, max_logit: np.ndarray) -> np.ndarray:
    """float32 log(sum(expf(l - max))) with the sum in float64, per row. [R, V] -> [R]."""
    e = np.exp((logits - max_logit[:, None]).astype(F32), dtype=F32)
    return np.log(e.sum(axis=1, dtype=np.float64)).astype(F32)


@dataclass(slots=True)
class BaseLogProbs:
    """llama.cpp's stored reference: per row scale and min_log_prob (float32), q uint16 [R, V]."""

    scale: np.ndarray
    min_log_prob: np.ndarray
    q: np.ndarray

    @classmethod
    def from_logits(cls, logits: np.ndarray) -> "BaseLogProbs":
        """float32 [R, V] reference logits -> stored uint16 log-probs (the -16 floor applied)."""
        lg = np.ascontiguousarray(logits, dtype=F32)
        max_l = lg.max(axis=1)
        min_l = np.maximum(lg.min(axis=1), (max_l - F32(16)).astype(F32))
        lse = _log_sum_exp(lg, max_l)
        min_log_prob = ((min_l - max_l).astype(F32) - lse).astype(F32)
        scale = ((max_l - min_l).astype(F32) / F32(65535)).astype(F32)
        with np.errstate(divide="ignore"):
            inv = np.where(scale > 0, F32(1) / np.where(scale > 0, scale, F32(1)), F32(0)).astype(F32)
        x = (inv[:, None] * (lg - min_l[:, None]).astype(F32)).astype(F32)
        q = (np.rint(x).astype(np.int64) & 0xFFFF).astype(np.uint16)
        q = np.where(lg > min_l[:, None], q, np.uint16(0))
        return cls(scale.astype(F32), min_log_prob, q.astype(np.uint16))

    def log_probs(self) -> np.ndarray:
        """float32 [R, V] stored log-probabilities."""
        return (self.scale[:, None] * self.q.astype(F32) + self.min_log_prob[:, None]).astype(F32)


@dataclass(slots=True)
class RowScores:
    """Per scored row: KL, candidate and base NLL, Δp, same-top flag."""

    kld: np.ndarray        # float64 [R]
    nll: np.ndarray        # float32 [R]
    nll_base: np.ndarray   # float32 [R]
    p_diff: np.ndarray     # float32 [R]
    same_top: np.ndarray   # bool [R]


def score_rows(base: BaseLogProbs, logits: np.ndarray, next_tokens) -> RowScores:
    """Score candidate logits [R, V] against stored base log-probs for the tokens that follow."""
    lg = np.ascontiguousarray(logits, dtype=F32)
    tok = np.asarray(next_tokens, dtype=np.int64)
    rows = np.arange(lg.shape[0])
    max_l = lg.max(axis=1)
    imax = lg.argmax(axis=1)                                       # first index on ties
    lse = _log_sum_exp(lg, max_l)
    nll = ((max_l + lse).astype(F32) - lg[rows, tok]).astype(F32)
    plb = base.log_probs()                                         # [R, V]
    nll_base = (-plb[rows, tok]).astype(F32)
    top = (max_l + lse).astype(F32)                                # max_logit += log_sum_exp
    terms = (np.exp(plb, dtype=F32) * ((plb - lg).astype(F32) + top[:, None]).astype(F32)).astype(F32)
    kld = np.where(plb > F32(FLOOR), terms, F32(0)).sum(axis=1, dtype=np.float64)
    p_diff = (np.exp(-nll, dtype=F32) - np.exp(-nll_base, dtype=F32)).astype(F32)
    return RowScores(kld, nll, nll_base, p_diff, imax == plb.argmax(axis=1))


def mean_and_uncertainty(values: np.ndarray) -> tuple[float, float]:
    """llama.cpp's mean ± sqrt((E[x²] - E[x]²)/(n-1)); uncertainty 0 for n <= 10."""
    n = len(values)
    if n < 1:
        return 0.0, 0.0
    v = np.asarray(values, dtype=np.float64)
    f = float(v.sum() / n)
    df = float((v * v).sum() / n - f * f)
    return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)


def percentile(values: np.ndarray, fraction: float) -> float:
    """llama.cpp's percentile: linear interpolation on sorted float32 values."""
    v = np.sort(np.asarray(values, dtype=F32))
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = F32(fraction) * F32(len(v) - 1)
    ip = int(p)
    p = F32(p - F32(ip))
    return float((F32(1) - p) * v[ip] + p * v[min(ip + 1, len(v) - 1)])


@dataclass(slots=True)
class KLResult:
    count: int
    same_top_pct: float
    same_top_unc_pct: float
    mean_kld: float
    mean_kld_unc: float
    median_kld: float
    p99_kld: float
    max_kld: float
    ppl: float
    ppl_unc: float
    ppl_base: float
    rms_dp_pct: float

    def as_dict(self) -> dict:
        return asdict(self)


class KLAccumulator:
    """Collect RowScores over chunks; `result()` gives llama.cpp's final statistics."""

    def __init__(self) -> None:
        self.parts: list[RowScores] = []

    def add_chunk(self, base_chunk_logits: np.ndarray, cand_chunk_logits: np.ndarray, chunk_tokens_) -> None:
        """Score one chunk: full [n_ctx, V] logits of base and candidate, tokens [n_ctx]."""
        n_ctx = len(chunk_tokens_)
        rows = scored_rows(n_ctx)
        base = BaseLogProbs.from_logits(np.asarray(base_chunk_logits)[rows])
        self.add_rows(base, np.asarray(cand_chunk_logits)[rows], np.asarray(chunk_tokens_)[rows.start + 1:])

    def add_rows(self, base: BaseLogProbs, cand_logits: np.ndarray, next_tokens) -> None:
        self.add(score_rows(base, cand_logits, next_tokens))

    def add(self, scores: RowScores) -> None:
        """Rows already scored (one score_rows result may feed several accumulators)."""
        self.parts.append(scores)

    def _cat(self, field: str) -> np.ndarray:
        return np.concatenate([getattr(p, field) for p in self.parts]) if self.parts else np.zeros(0)

    def result(self) -> KLResult:
        kld, same = self._cat("kld"), self._cat("same_top")
        nll, nll_base, p_diff = self._cat("nll"), self._cat("nll_base"), self._cat("p_diff")
        n = len(kld)
        if n < 2:
            raise ValueError(f"{n} scored tokens; need at least 2 (use longer text or a smaller n_ctx)")
        m_kld, u_kld = mean_and_uncertainty(kld)
        log_ppl, u_log_ppl = mean_and_uncertainty(nll.astype(np.float64))
        log_ppl_b, _ = mean_and_uncertainty(nll_base.astype(np.float64))
        dp2 = p_diff.astype(np.float64) ** 2
        p = float(same.sum()) / n
        kf = kld.astype(F32)
        return KLResult(
            count=n, same_top_pct=100.0 * p, same_top_unc_pct=100.0 * math.sqrt(p * (1 - p) / (n - 1)),
            mean_kld=m_kld, mean_kld_unc=u_kld, median_kld=float(np.median(kf)),
            p99_kld=percentile(kf, 0.99), max_kld=float(kf.max()),
            ppl=math.exp(log_ppl), ppl_unc=math.exp(log_ppl) * u_log_ppl, ppl_base=math.exp(log_ppl_b),
            rms_dp_pct=100.0 * math.sqrt(mean_and_uncertainty(dp2)[0]))


def kl_divergence(base_chunks: np.ndarray, cand_chunks: np.ndarray, tokens: np.ndarray) -> KLResult:
    """Whole-run convenience: logits [C, n_ctx, V] of base and candidate, tokens [C, n_ctx]."""
    acc = KLAccumulator()
    for b, c, t in zip(base_chunks, cand_chunks, tokens):
        acc.add_chunk(b, c, t)
    return acc.result()
