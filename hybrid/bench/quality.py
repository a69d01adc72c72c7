"""hybrid-bench quality: same-top-token %, KL and perplexity of quantizations vs the Q8_0 GGUF.

One token stream (the fixed prompt set + held-out model text, tokenized once with `tokenizers`)
is fed teacher-forced to every engine: llama-cpp-python for GGUFs, hybrid's runtime (`open_session`,
as `hybrid-run` opens it) for hybrid's checkpoints. The reference is llama.cpp on the Q8_0 GGUF; scoring is llama.cpp's
`--kl-divergence` (hybrid.metrics.kl). Writes results/quality.{md,jsonl,png}.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from hybrid.baselines import candidates as qc
from hybrid.bench.prompts import all_texts, heldout
from hybrid.cli.common import int_at_least
from hybrid.errors import HybridError
from hybrid.metrics.kl import BaseLogProbs, KLAccumulator, chunk_tokens, score_rows, scored_rows

HELP = "same-top-token %, KL divergence and perplexity vs the Q8_0 GGUF, llama.cpp-style"
DEFAULT_AGAINST = ("bf16,nvfp4,nvfp4-mse,nvfp4@head=fp8,nvfp4@head=nvfp4,mixed,mixed-mse,gguf-nvfp4,gguf-mixed,"
                   "Q4_K_M,IQ4_XS,IQ3_S,MXFP4_MOE,Q4_K_M-imat,IQ4_XS-imat,IQ3_S-imat")
REFERENCE = "Q8_0"


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="model folder (BF16 safetensors) or 'tiny' (default)")
    p.add_argument("--against", default=DEFAULT_AGAINST,
                   help="comma list of candidates: hybrid recipes (bf16, nvfp4, mixed, fp8; nvfp4-mse, mixed-mse = "
                        "hybrid-quantize --nvfp4-scales mse) run by hybrid, "
                        "optionally @slots=N, @split=L or @torch to pick the placement, or @head=fp8 / @head=nvfp4 "
                        "(hybrid-run --lm-head); "
                        "gguf-<recipe> = hybrid's weights exported to GGUF, run by llama.cpp; llama.cpp "
                        f"types (Q8_0, Q4_K_M, IQ4_XS, IQ3_S, MXFP4_MOE, ...). Default: {DEFAULT_AGAINST}")
    p.add_argument("--quick", action="store_true", help="CI size: n_ctx 64, one chunk per prompt class")
    p.add_argument("--n-ctx", type=int_at_least(2), default=None, help="tokens per chunk (default 128, quick 64; "
                   "capped at the model's context)")
    p.add_argument("--out", default="results", help="folder for quality.md/.jsonl/.png (default results/)")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    p.add_argument("--work", default=None, help="folder for GGUFs and quantized checkpoints "
                   "(reused when present; default: a temporary folder)")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="llama.cpp threads (default: its own)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="hybrid runtime device (default cpu)")


def token_stream(src: Path, n_ctx: int, quick: bool) -> tuple[np.ndarray, list[str], dict[str, list[int]]]:
    """Chunks int32 [C, n_ctx], the class of each chunk, and each text's token ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    ids = {c: tok.encode(t, add_special_tokens=False).ids for c, t in all_texts(src).items()}
    chunks, classes = [], []
    for c, t in ids.items():
        ch = chunk_tokens(t, n_ctx)
        ch = ch[:1] if quick else ch
        chunks.extend(ch)
        classes.extend([c] * len(ch))
    if not chunks:
        raise HybridError(f"no text class has {n_ctx} tokens; use a smaller --n-ctx")
    return np.stack(chunks), classes, ids


def score(cand: qc.Candidate, chunks: np.ndarray, classes: list[str], bases: list[BaseLogProbs]) -> dict:
    """Feed every chunk to `cand`; llama.cpp statistics overall and same-top per class."""
    rows = scored_rows(chunks.shape[1])
    total, per_class = KLAccumulator(), {}
    for chunk, cls, base in zip(chunks, classes, bases):
        logits = cand.logits(chunk)[rows]                                     # [R, V]
        nxt = chunk[rows.start + 1:]
        rows_scored = score_rows(base, logits, nxt)                            # once, for both tallies
        total.add(rows_scored)
        per_class.setdefault(cls, KLAccumulator()).add(rows_scored)
    res = total.result().as_dict()
    by_class = {c: a.result() for c, a in per_class.items()}
    res["same_top_by_class"] = {c: round(r.same_top_pct, 3) for c, r in by_class.items()}
    res["ppl_by_class"] = {c: round(r.ppl, 4) for c, r in by_class.items()}
    res["ppl_base_by_class"] = {c: round(r.ppl_base, 4) for c, r in by_class.items()}
    return res


def reference(maker: qc.CandidateMaker, src: Path, chunks: np.ndarray, ids: dict) -> tuple[list, dict]:
    """Q8_0 reference: stored log-probs of every chunk's scored rows, and tokenizer parity per text."""
    ref = maker.make(REFERENCE)
    parity = {c: ref.runner.tokenize(t) == ids[c] for c, t in all_texts(src).items()}
    if not all(parity.values()):
        bad = ", ".join(c for c, ok in parity.items() if not ok)
        raise HybridError(f"{ref.path}: llama.cpp tokenizes the {bad} text differently from "
                          f"{src}/tokenizer.json; the GGUF does not match the model (stale --work?)")
    rows = scored_rows(chunks.shape[1])
    bases = [BaseLogProbs.from_logits(ref.logits(ch)[rows]) for ch in chunks]
    ref.close()
    return bases, parity


def write(records: list[dict], out: Path) -> None:
    from hybrid.baselines import quality_report, report

    report.append_jsonl(out / "quality.jsonl", records)
    (out / "quality.md").write_text(quality_report.markdown(records))
    quality_report.chart(records, out / "quality.png")
    print(f"wrote {out / 'quality.md'}, {out / 'quality.jsonl'}, {out / 'quality.png'}")


def run(args) -> int:
    from hybrid.baselines import quality_report, report
    from hybrid.model import resolve_model_path
    from hybrid.model.config import ModelConfig

    src = resolve_model_path(args.model)
    cfg = ModelConfig.from_folder(src)
    n_ctx = min(args.n_ctx or (64 if args.quick else 128), cfg.max_position_embeddings)
    names = [n.strip() for n in args.against.split(",") if n.strip()]
    with tempfile.TemporaryDirectory(prefix="hybrid-quality-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        maker = qc.CandidateMaker(src, work, n_ctx, args.threads, {"device": args.device})
        cands = [maker.make(n) for n in names]                       # fail fast on bad names
        chunks, classes, ids = token_stream(src, n_ctx, args.quick)
        bases, parity = reference(maker, src, chunks, ids)
        stamp = report.stamp("hybrid-bench")
        meta = {"model": str(args.model), "n_ctx": n_ctx, "chunks": len(chunks), "reference": REFERENCE,
                "tokenizer_parity": parity, "quick": bool(args.quick), **qc.llama_info(),
                "heldout_sources": (heldout(src) or ("", []))[1]}
        records = []
        for cand in cands:
            scores = score(cand, chunks, classes, bases)
            rec = {**stamp, **meta, **cand.describe(), **scores}
            records.append(rec)
            print(quality_report.one_line(rec), flush=True)
            cand.close()
    print(quality_report.markdown(records))
    if not args.no_write:
        write(records, Path(args.out))
    return 0
