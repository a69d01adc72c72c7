"""hybrid-bench speed: prefill tok/s over a context ladder and median decode tok/s per prompt class,
for hybrid's runtime and llama-cpp-python, same machine, same run, same threads.

Every timing is wall clock around a synchronized call (llama.cpp computes synchronously on CPU;
hybrid synchronizes CUDA when it runs there), never llama.cpp's internal counters. Engines are
interleaved inside each repetition so drift on a shared machine hits them alike; medians are kept.
Writes results/speed.md and results/speed.jsonl.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from hybrid.cli.common import int_at_least
from hybrid.errors import HybridError

HELP = "prefill tok/s over a context ladder and median decode tok/s per prompt class, hybrid vs llama.cpp"
DEFAULT_AGAINST = "bf16,nvfp4,gguf-nvfp4,Q8_0,Q4_K_M"


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="model folder or 'tiny' (default)")
    p.add_argument("--against", default=DEFAULT_AGAINST,
                   help=f"candidates as in `hybrid-bench quality` (default {DEFAULT_AGAINST})")
    p.add_argument("--ladder", default=None, help="prefill context lengths, comma list (default 32,64,128,256,512; "
                   "quick 16,64)")
    p.add_argument("--new-tokens", type=int_at_least(1), default=None, help="decode steps per prompt (default 32, quick 8)")
    p.add_argument("--repeats", type=int_at_least(1), default=None, help="prefill repetitions, median kept (default 3, quick 1)")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="threads for both engines (default: all cores)")
    p.add_argument("--torch-threads", type=int_at_least(1), default=None,
                   help="torch intra-op threads of hybrid's dense path (default: as hybrid-run sets them, "
                        "1 per 1024 of hidden size, at most --threads; hybrid's CPU expert runner gets --threads)")
    p.add_argument("--quick", action="store_true", help="CI size")
    p.add_argument("--out", default="results", help="folder for speed.md/.jsonl (default results/)")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--work", default=None, help="folder for GGUFs and checkpoints (reused; default temporary)")


class HybridSpeed:
    """hybrid's runtime as `hybrid-run` opens it; prefill = one forward over the prompt, decode =
    one token per forward."""

    def __init__(self, cand):
        self.cand = cand
        self.model = cand.session.model

    def _sync(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def prefill_seconds(self, ids) -> float:
        import torch

        x = torch.as_tensor(np.asarray(ids), dtype=torch.long)
        self.model.new_cache(len(ids))
        self.model.prompt_tokens = len(ids)
        t0 = time.perf_counter()
        self.model.forward(x, 0, last_only=True)
        self._sync()
        return time.perf_counter() - t0

    def greedy_decode(self, prompt, n_new: int):
        import torch

        from hybrid.baselines.llama_runner import DecodeTiming

        self.model.new_cache(len(prompt) + n_new + 1)
        self.model.prompt_tokens = len(prompt)
        t0 = time.perf_counter()
        logits = self.model.forward(torch.as_tensor(list(prompt), dtype=torch.long), 0, last_only=True)
        self._sync()
        prefill, pos, out, steps = time.perf_counter() - t0, len(prompt), [], []
        tok = int(logits[-1].argmax())
        for _ in range(n_new):
            out.append(tok)
            t0 = time.perf_counter()
            logits = self.model.forward(torch.tensor([tok]), pos, last_only=True)
            tok = int(logits[-1].argmax())                    # argmax reads the result: synchronized
            steps.append(time.perf_counter() - t0)
            pos += 1
        return DecodeTiming(out, prefill, steps)


def make_engine(cand, n_ctx: int, threads: int):
    from hybrid.baselines.candidates import GGUFCandidate
    from hybrid.baselines.llama_runner import LlamaRunner

    if isinstance(cand, GGUFCandidate):
        return LlamaRunner(cand.path, n_ctx=n_ctx, n_threads=threads, logits_all=False)
    return HybridSpeed(cand)


def _settings(args) -> dict:
    q = args.quick
    ladder = [int(x) for x in (args.ladder or ("16,64" if q else "32,64,128,256,512")).split(",")]
    s = {"ladder": ladder, "new_tokens": args.new_tokens or (8 if q else 32),
         "repeats": args.repeats or (1 if q else 3), "threads": args.threads or os.cpu_count() or 1}
    if min(ladder) < 1 or s["new_tokens"] < 1 or s["repeats"] < 1:
        raise HybridError("--ladder entries, --new-tokens and --repeats must be >= 1")
    if args.torch_threads is not None and args.torch_threads < 1:
        raise HybridError(f"--torch-threads must be >= 1, got {args.torch_threads}")
    return s


def torch_threads(args, threads: int, hidden: int) -> int:
    """--torch-threads, else hybrid-run's default: 1 per 1024 of hidden size, within [1, threads]
    (tiny ops only lose time to more threads)."""
    return args.torch_threads or max(1, min(threads, hidden // 1024))


def measure_prefill(engines: dict, stream: list[int], ladder: list[int], repeats: int) -> dict:
    """{candidate: {L: tok/s}} median over repeats, engines interleaved; one warm-up each."""
    times = {n: {L: [] for L in ladder} for n in engines}
    for n, e in engines.items():
        e.prefill_seconds(stream[: ladder[0]])
    for L in ladder:
        for _ in range(repeats):
            for n, e in engines.items():
                times[n][L].append(e.prefill_seconds(stream[:L]))
    return {n: {L: L / statistics.median(v) for L, v in t.items()} for n, t in times.items()}


def measure_decode(engines: dict, prompts: dict[str, list[list[int]]], n_new: int) -> dict:
    """{candidate: {class: median decode tok/s}} over every step of every prompt of the class."""
    steps = {n: {c: [] for c in prompts} for n in engines}
    for c, plist in prompts.items():
        for ids in plist:
            for n, e in engines.items():
                steps[n][c].extend(e.greedy_decode(ids, n_new).step_s)
    return {n: {c: 1.0 / statistics.median(v) for c, v in t.items()} for n, t in steps.items()}


def run(args) -> int:
    import torch
    from tokenizers import Tokenizer

    from hybrid.baselines import report
    from hybrid.baselines.candidates import CandidateMaker, llama_info
    from hybrid.baselines import speed_report
    from hybrid.bench.prompts import all_texts, class_prompts
    from hybrid.model import ModelConfig, resolve_model_path

    s = _settings(args)
    src = resolve_model_path(args.model)
    torch.set_num_threads(torch_threads(args, s["threads"], ModelConfig.from_folder(src).hidden_size))
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    enc = lambda t: tok.encode(t, add_special_tokens=False).ids          # noqa: E731
    stream = [i for t in all_texts(src).values() for i in enc(t)]
    if len(stream) < max(s["ladder"]):
        raise HybridError(f"--ladder {max(s['ladder'])} exceeds the {len(stream)}-token prompt stream")
    prompts = {c: [enc(p) for p in (ps[:1] if args.quick else ps)] for c, ps in class_prompts().items()}
    n_ctx = max(max(s["ladder"]), max(len(p) for ps in prompts.values() for p in ps) + s["new_tokens"] + 1)
    names = [n.strip() for n in args.against.split(",") if n.strip()]
    with tempfile.TemporaryDirectory(prefix="hybrid-speed-") as tmp:
        maker = CandidateMaker(src, Path(args.work) if args.work else Path(tmp), n_ctx, s["threads"],
                               {"device": "cpu", "cpu_threads": s["threads"]})
        cands = {n: maker.make(n) for n in names}
        engines = {n: make_engine(c, n_ctx, s["threads"]) for n, c in cands.items()}
        prefill = measure_prefill(engines, stream, s["ladder"], s["repeats"])
        decode = measure_decode(engines, prompts, s["new_tokens"])
        described = {n: c.describe() for n, c in cands.items()}
        for c in cands.values():
            c.close()
    stamp = report.stamp("hybrid-bench")
    records = [{**stamp, **s, **llama_info(), **described[n], "model": str(args.model), "candidate": n,
                "prefill_tok_s": {str(k): v for k, v in prefill[n].items()},
                "decode_tok_s": decode[n], "loadavg": os.getloadavg()[0], "torch_threads": torch.get_num_threads()}
               for n in names]
    text = speed_report.markdown(records)
    print(text)
    if not args.no_write:
        out = Path(args.out)
        report.append_jsonl(out / "speed.jsonl", records)
        (out / "speed.md").write_text(text)
        print(f"wrote {out / 'speed.md'}, {out / 'speed.jsonl'}")
    return 0
