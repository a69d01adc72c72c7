"""hybrid-bench decode: measured decode tok/s of the hybrid runtime beside the planner's prediction
(and llama.cpp on a GGUF of the same model, when one is given and llama-cpp-python is installed).

One session: a warm-up generation fills the expert caches (with prefill graphs on, a second prefill of the
prompt captures its bucket's graph: a bucket's first prompt runs eagerly, its second captures, so the measured
prefill replays, as every later prompt of that length would), then a measured generation; hit rates, expert
times and PCIe bytes are the measured window's alone. Appends results/runtime.jsonl.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from hybrid.cli.common import int_at_least

HELP = "decode tok/s of the hybrid runtime vs the planner's prediction (optionally llama.cpp beside it)"
CALIBRATION = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


def add_arguments(p) -> None:
    from hybrid.cli.run import _runtime_flags, add_head_flag

    p.add_argument("--model", "-m", default=None, help="model folder or 'tiny' (default)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--prompt-tokens", type=int_at_least(1), default=32, help="prompt length (default 32)")
    p.add_argument("--warmup", type=int_at_least(0), default=16, help="tokens generated first to warm the caches (default 16)")
    p.add_argument("--tokens", type=int_at_least(1), default=32, help="tokens in the measured generation (default 32)")
    p.add_argument("--label", default="", help="free text stored with the record")
    p.add_argument("--llama-gguf", default=None, metavar="FILE", help="also time llama.cpp on this GGUF")
    p.add_argument("--out", default="results", help="folder for runtime.jsonl (default results/)")
    p.add_argument("--no-write", action="store_true", help="print only")
    add_head_flag(p)
    _runtime_flags(p)


def prompt_ids(tok, n: int) -> list[int]:
    """n prompt tokens: the calibration text repeated."""
    ids = tok.encode(CALIBRATION)
    return (ids * (n // max(len(ids), 1) + 1))[:n]


def measure(session, tok, n_prompt: int, warmup: int, tokens: int) -> dict:
    """Warm-up generation, then the measured one; -> record fields."""
    from hybrid.generate import generate
    from hybrid.runtime.monitor import snapshot, window
    from hybrid.sampler import Sampler, SamplerConfig

    ids = prompt_ids(tok, n_prompt)
    session.model.prompt_tokens = len(ids)
    greedy = Sampler(SamplerConfig())
    warm_prefills = 0
    if warmup:
        generate(session.model, tok, ids, warmup, greedy, prefill_chunk=session.prefill_chunk)
        warm_prefills = 1
        pg = getattr(session.model, "prefill_graphs", None)
        if pg is not None and pg.enabled:
            generate(session.model, tok, ids, 1, greedy, prefill_chunk=session.prefill_chunk)
            warm_prefills = 2
    a = snapshot(session)
    n_dec0 = session.stats.steps["decode"]
    res = generate(session.model, tok, ids, tokens, greedy, prefill_chunk=session.prefill_chunk)
    steps = session.stats.steps["decode"] - n_dec0
    rec = {"prompt_tokens": len(ids), "warmup_tokens": warmup, "warmup_prefills": warm_prefills,
           "tokens": len(res.generated_ids),
           "decode_tok_s": round(res.decode_tok_s, 3), "prefill_tok_s": round(res.prefill_tok_s, 3),
           "generated_ids_head": res.generated_ids[:16], **window(session, a, snapshot(session), steps)}
    plan = session.plan
    if plan is not None:
        p = plan.prediction
        at = len(ids) + len(res.generated_ids) // 2     # the measured steps' mean context
        rec["prediction"] = {"tok_s": round(p.tok_s, 3), "hit_rate": round(p.hit_rate, 4),
                             "profile": plan.inputs.profile, "context": p.context,
                             "pcie_bytes_per_token": p.pcie_bytes,
                             "measured_context": at, "tok_s_at_measured_context": round(p.tok_s_at(at), 3)}
        rec["measured_over_predicted"] = round(res.decode_tok_s / p.tok_s, 4) if p.tok_s else None
        rec["measured_over_predicted_at_context"] = round(res.decode_tok_s / p.tok_s_at(at), 4)
    rec["placement"] = session.placement.describe()
    rec["load_s"] = {k: round(v, 2) for k, v in session.load_s.items()}
    return rec


def llama_decode(gguf: str, ids: list[int], tokens: int, threads: int | None) -> dict:
    from hybrid.baselines.llama_runner import LlamaRunner, llama_cpp_info

    r = LlamaRunner(gguf, n_ctx=len(ids) + tokens + 8, n_threads=threads, logits_all=False)
    try:
        t = r.greedy_decode(ids, tokens)
    finally:
        r.close()
    return {"gguf": str(gguf), "median_tok_s": round(t.median_tok_s, 3), "llama_cpp": llama_cpp_info()}


def run(args) -> int:
    from hybrid.baselines.report import append_jsonl, stamp
    from hybrid.cli.run import options_from_args
    from hybrid.model import ModelConfig, resolve_model_path
    from hybrid.runtime import open_session
    from hybrid.tokenizer import Tokenizer

    path = resolve_model_path(args.model)
    cfg = ModelConfig.from_folder(path)
    tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    opts = options_from_args(args, cfg.num_hidden_layers)
    context = args.prompt_tokens + max(args.warmup, args.tokens)
    session = open_session(path, opts, context=context)
    try:
        rec = measure(session, tok, args.prompt_tokens, args.warmup, args.tokens)
    finally:
        session.close()
    rec = {"bench": "decode", "model": path.resolve().name, "device": args.device, "label": args.label,
           **rec, **stamp("hybrid-bench")}
    if args.llama_gguf:
        rec["llama"] = llama_decode(args.llama_gguf, prompt_ids(tok, args.prompt_tokens), args.tokens,
                                    args.cpu_threads)
    print(json.dumps(rec))
    if not args.no_write:
        out = Path(args.out) / "runtime.jsonl"
        append_jsonl(out, [rec])
        print(f"appended {out}", file=sys.stderr)
    return 0
