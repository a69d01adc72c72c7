"""hybrid-run: generate text from an NVFP4 / FP8 / mixed / BF16 MoE checkpoint.

Without runtime flags the model runs on one device through the reference path. Any of the hybrid
runtime flags (--gpus, --layer-split, --cache-slots, --profile, --stats, --trace, ...) runs it on
the hybrid runtime: layers split over logical cards, hot experts in per-card caches, the rest on
the CPU expert runner (DESIGN §1). On --device cpu the same orchestration runs with torch on the
CPU standing in for the GPUs. --device auto (the default) takes the GPU where there is one of sm_70
or newer, and there a checkpoint that does not fit the GPU without runtime flags runs on the runtime.
"""
from __future__ import annotations

import argparse
import json
import sys

from hybrid.cli.common import OneLineParser, add_debug_flag, run_cli
from hybrid.hardware import require_gpus, torch_arch_problem
from hybrid.model.head import HEAD_TYPES

RUNTIME_FLAGS = ("gpus", "layer_split", "kv_resident", "cache_slots", "cpu_threads", "hugepages",
                 "pcie_frac", "profile", "vram_cap", "stats", "stats_every", "trace", "expert_profile",
                 "cache_policy", "cache_warm", "cpu_engine", "metrics", "hybrid", "prefill_offload_min",
                 "save_expert_profile")


def add_head_flag(p) -> None:
    """--lm-head, on hybrid-run and hybrid-bench decode (RuntimeOptions.lm_head; not a flag that turns the runtime on)."""
    p.add_argument("--lm-head", default="keep", choices=HEAD_TYPES,
                   help="the output head's storage: keep (default: as the checkpoint stores it; ModelOpt's NVFP4 / "
                        "FP8 exports keep it in BF16) or fp8 / nvfp4: a 16-bit head quantized once at load, so "
                        "its card holds and reads 2x / 3.6x fewer bytes per token (results/quality.md)")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="hybrid-run", description=__doc__.splitlines()[0])
    p.add_argument("--model", "-m", default=None,
                   help="model folder, or 'tiny' for the embedded model (default: tiny)")
    p.add_argument("--prompt", "-p", default="def fibonacci(n):", help="prompt text")
    p.add_argument("--max-tokens", "-n", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto (default: cuda where torch sees a GPU of sm_70 or newer, else cpu), cpu or cuda")
    p.add_argument("--torch-threads", type=int, default=None, metavar="N",
                   help="torch intra-op threads for the dense path in CPU mode (default: 1 per 1024 of "
                        "hidden size, at most the physical cores; small ops only lose time to more threads)")
    add_head_flag(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x max prob (0 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtract from seen tokens' logits")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="divide seen tokens' logits (1 = off)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    _runtime_flags(p)
    add_debug_flag(p)
    return p


def _runtime_flags(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("hybrid runtime (any of these turns it on)")
    r.add_argument("--gpus", default=None, metavar="0,1",
                   help="GPU per logical card; repeat one (0,0) for two logical cards on one GPU "
                        "(default: one card per --layer-split part)")
    r.add_argument("--layer-split", default=None, metavar="N|auto",
                   help="layers [0,N) on the first card, [N,L) on the next (comma list for more cards); "
                        "auto = the planner's best split (or an even one without --profile)")
    r.add_argument("--kv-resident", type=int, default=None, metavar="TOKENS",
                   help="KV tokens each card holds (default: prompt + --max-tokens)")
    r.add_argument("--kv-dtype", default="fp16", choices=["fp16", "int8"],
                   help="KV cache type: fp16 (default; fp32 on CPU) or int8 (per token-head scales)")
    r.add_argument("--cache-slots", default=None, metavar="N|auto",
                   help="expert-cache slots per card (one value or one per card); auto = what the "
                        "planner fits in VRAM (in CPU mode without --profile: half of each card's experts)")
    r.add_argument("--cache-policy", default=None, choices=["lfu-decay", "lru", "static"],
                   help="expert-cache policy (default lfu-decay: decayed frequency with a promotion margin)")
    r.add_argument("--cache-warm", default=None, choices=["auto", "profile", "off"],
                   help="what the expert slots hold at load: auto (default) = the expert profile's most used "
                        "experts, else experts in id order until the slots are full (every expert where they "
                        "all fit); profile = the profile's, else nothing; off = nothing (the cache warms up "
                        "online)")
    r.add_argument("--save-expert-profile", default=None, metavar="FILE",
                   help="after the run, write the routing it saw (every prompt and generated token's experts, "
                        "per layer) as an expert-popularity profile, hybrid-profile's format: the next run's "
                        "--expert-profile (as profiles/<model folder>.experts.json it is found on its own)")
    r.add_argument("--expert-profile", default=None, metavar="FILE",
                   help="expert-popularity profile for the warm start (default: "
                        "profiles/<model folder>.experts.json if present; without one see --cache-warm)")
    r.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="threads of the CPU expert runner (default: physical cores)")
    r.add_argument("--cpu-engine", default=None, choices=["auto", "numba", "torch"],
                   help="CPU expert kernels: numba for NVFP4/FP8, torch reference otherwise (default auto)")
    r.add_argument("--hugepages", default=None, choices=["auto", "on", "off"],
                   help="back the CPU expert store with 2 MiB hugepages (default auto)")
    r.add_argument("--prefill-chunk", default=None, metavar="N|auto",
                   help="prompt tokens per forward pass (default auto: the plan's chunk, else the whole prompt)")
    r.add_argument("--prefill-offload-min", default=None, metavar="N|auto",
                   help="prefill steps of at least N tokens copy the experts they miss to the card and run "
                        "them there instead of on the CPU (0 = never; default auto: the planner's cost model from "
                        "the hardware profile, 128 on CUDA without one, never with --device cpu)")
    r.add_argument("--pcie-frac", type=float, default=None, metavar="F",
                   help="fraction of the PCIe link expert promotions may use per step (default 0.1; the link "
                        "is the plan's: without a hardware profile, as in CPU mode, only 0 limits them: none)")
    r.add_argument("--profile", default=None, metavar="NAME|FILE",
                   help="hardware profile for the planner (profiles/NAME.json or a path)")
    r.add_argument("--vram-cap", default=None, metavar="GB",
                   help="VRAM each logical card may use, GiB (one value or one per card)")
    r.add_argument("--stats", action="store_true",
                   help="end with per-layer hit rates, CPU vs GPU expert time, PCIe bytes, tok/s vs the plan")
    r.add_argument("--stats-every", type=int, default=None, metavar="N",
                   help="every N decoded tokens print a line (tok/s, each card's hit rate, CPU expert time, PCIe) "
                        "to stderr, and rewrite --metrics FILE, so a dashboard follows the run")
    r.add_argument("--trace", default=None, metavar="FILE", help="write per-step routing and timings (JSONL)")
    r.add_argument("--metrics", default=None, metavar="FILE",
                   help="write the run's counters: Prometheus text, or dashboard JSON if FILE ends in .json")
    r.add_argument("--hybrid", action="store_true", help="use the hybrid runtime with all defaults")


def _check_args(args) -> None:
    from hybrid.errors import HybridError

    if args.max_tokens < 1:
        raise HybridError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if any(s == "" for s in getattr(args, "stop", None) or []):
        raise HybridError("--stop: expected a non-empty string (an empty one would end the run at its first token)")
    if getattr(args, "stats_every", None) is not None and args.stats_every < 1:
        raise HybridError(f"--stats-every must be >= 1 (tokens between reports), got {args.stats_every}")
    import torch

    if args.device == "cuda":
        require_gpus("--device cuda")   # one visible, and torch's build runs on it
    args.old_gpu = None          # auto on a GPU it cannot use: the CPU, and _print says why after the run
    args.auto_device = args.device in (None, "auto")
    if args.auto_device:
        args.device = "cpu"
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            args.old_gpu = (f"the GPU is sm_{major}{minor}, the QPN kernels need sm_70 (Volta) or newer"
                            if (major, minor) < (7, 0) else torch_arch_problem(0))
            if args.old_gpu is None:
                args.device = "cuda"


FIT_MARGIN = 2**30   # bytes a reference-path run needs beside its weights (KV cache, activations, allocator)


def fits_one_gpu(need: int, free: int) -> bool:
    """Whether a checkpoint of `need` bytes runs on one GPU with `free` bytes free through the reference path."""
    return need + FIT_MARGIN <= free


def uses_runtime(args) -> bool:
    """Whether any runtime flag was given (a given 0, as --pcie-frac 0 or --kv-resident 0, counts: `0 in
    (None, False)` is true in Python, so identity, not equality)."""
    return (any(getattr(args, f) is not None and getattr(args, f) is not False for f in RUNTIME_FLAGS)
            or args.kv_dtype != "fp16")


def body(args) -> int:
    from hybrid.generate import generate
    from hybrid.model import ModelConfig, resolve_model_path
    from hybrid.sampler import Sampler, SamplerConfig
    from hybrid.tokenizer import Tokenizer

    _check_args(args)
    sampler = Sampler(SamplerConfig(args.temperature, args.top_k, args.top_p, args.min_p,
                                    args.presence_penalty, args.repetition_penalty, args.seed))
    path = resolve_model_path(args.model)
    cfg = ModelConfig.from_folder(path)
    if getattr(args, "auto_device", False) and args.device == "cuda" and not uses_runtime(args):
        import torch

        from hybrid.baselines.report import folder_bytes

        need, free = folder_bytes(path), torch.cuda.mem_get_info(0)[0]   # the weights as the GPU would hold them
        if not fits_one_gpu(need, free):   # the reference path would not fit: the hybrid runtime plans it
            args.hybrid = True
            print(f"hybrid: the checkpoint ({need / 2**30:.1f} GiB) does not fit cuda:0 ({free / 2**30:.1f} GiB "
                  f"free): running the hybrid runtime (--hybrid)", file=sys.stderr)
    _set_torch_threads(args, cfg)
    tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    prompt = tok.apply_chat(args.prompt, args.system) if args.chat else args.prompt
    ids = tok.encode(prompt)
    if not ids:
        from hybrid.errors import HybridError
        raise HybridError("--prompt: the prompt encodes to zero tokens")
    session = _open(args, path, cfg, len(ids) + args.max_tokens) if uses_runtime(args) else None
    model = session.model if session else _reference_model(args, path)
    chunk = session.prefill_chunk if session else _chunk(args.prefill_chunk)
    if session:
        session.model.prompt_tokens = len(ids)
        if args.stats_every:
            from hybrid.runtime.monitor import LiveStats

            session.model.monitor = LiveStats(session, args.stats_every, args.metrics)
    if not args.json:
        sys.stdout.write(prompt)
        sys.stdout.flush()
    on_text = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    try:
        res = generate(model, tok, ids, args.max_tokens, sampler, args.stop, on_text, prefill_chunk=chunk)
    finally:
        if session:
            session.close()
    report = session.report(res.decode_tok_s) if session else None
    _print(args, path, res, session, report)
    if session and args.metrics:
        from hybrid.metrics import write_metrics

        write_metrics(args.metrics, report)
    return 0


def _set_torch_threads(args, cfg) -> None:
    import os

    import torch

    from hybrid.errors import HybridError

    if args.torch_threads is not None and args.torch_threads < 1:
        raise HybridError(f"--torch-threads must be >= 1, got {args.torch_threads}")
    if args.device != "cpu" or (args.torch_threads is None and "OMP_NUM_THREADS" in os.environ):
        return
    from hybrid.hardware import physical_cores

    cores = physical_cores()
    torch.set_num_threads(args.torch_threads or max(1, min(cores, cfg.hidden_size // 1024)))


def _reference_model(args, path):
    from hybrid.model import load_model

    return load_model(path, device=args.device, lm_head=args.lm_head)


def _chunk(text):
    from hybrid.cli.plan import parse_chunk

    return parse_chunk(text) or 0


def _open(args, path, cfg, context: int):
    from hybrid.runtime import open_session

    opts = options_from_args(args, cfg.num_hidden_layers)
    from hybrid.baselines.report import git_sha

    meta = {"command": "hybrid-run " + " ".join(sys.argv[1:]), "git_sha": git_sha(short=False, dirty=False)}
    return open_session(path, opts, context=context, meta=meta)


def options_from_args(args, num_layers: int):
    """RuntimeOptions from the hybrid-run flags."""
    from hybrid.cli.plan import parse_chunk, parse_floats, parse_ints
    from hybrid.errors import HybridError
    from hybrid.runtime import RuntimeOptions

    split = None if args.layer_split in (None, "auto") else parse_ints("--layer-split", args.layer_split)
    if args.gpus is not None:
        gpus = parse_ints("--gpus", args.gpus)
    else:
        gpus = _default_gpus(args, 1 if split is None else len(split) + 1)
    if args.layer_split == "auto" and len(gpus) == 1 and args.gpus is None:
        gpus = _default_gpus(args, 2)
    if split is not None and len(split) != len(gpus) - 1:
        raise HybridError(f"--layer-split {args.layer_split}: {len(gpus)} card(s) in --gpus need "
                          f"{len(gpus) - 1} boundary(ies)")
    slots = None if args.cache_slots in (None, "auto") else parse_ints("--cache-slots", args.cache_slots)
    cap = None if args.vram_cap is None else parse_floats("--vram-cap", args.vram_cap)
    chunk = parse_chunk(args.prefill_chunk)
    offload = {} if args.prefill_offload_min is None else {"prefill_offload_min": _tokens(args.prefill_offload_min)}
    return RuntimeOptions(device=args.device, gpus=gpus, layer_split=split, kv_resident=args.kv_resident,
                          kv_dtype=args.kv_dtype, cache_slots=slots, cpu_threads=args.cpu_threads,
                          hugepages=args.hugepages or "auto", prefill_chunk=chunk,
                          pcie_frac=0.1 if args.pcie_frac is None else args.pcie_frac,
                          profile=args.profile, vram_cap_gib=cap, expert_profile=args.expert_profile,
                          policy=args.cache_policy or "lfu-decay", cpu_engine=args.cpu_engine or "auto",
                          trace=args.trace, cache_warm=args.cache_warm or "auto",
                          save_expert_profile=args.save_expert_profile, lm_head=args.lm_head, **offload)


def _tokens(text: str) -> int:
    """--prefill-offload-min's value: None for auto (RuntimeOptions checks the range)."""
    from hybrid.errors import HybridError

    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise HybridError(f"--prefill-offload-min {text}: expected auto or a token count >= 0 (0 = off)") from None


def _default_gpus(args, cards: int) -> tuple[int, ...]:
    """One card per GPU while there are GPUs, then logical cards on GPU 0."""
    n = 1
    if args.device == "cuda":
        import torch

        n = max(torch.cuda.device_count(), 1)
    return tuple(i if cards <= n else 0 for i in range(cards))


def _print(args, path, res, session, report) -> None:
    if args.json:
        d = {"model": str(path), "prompt_ids": res.prompt_ids, "generated_ids": res.generated_ids,
             "text": res.text, "stop_reason": res.stop_reason, "prefill_tok_s": round(res.prefill_tok_s, 3),
             "decode_tok_s": round(res.decode_tok_s, 3)}
        if report is not None:
            d["stats"] = report
        print(json.dumps(d))
        return
    print(f"\n\nprompt: {len(res.prompt_ids)} tokens, {res.prefill_tok_s:.1f} tok/s prefill | "
          f"generated: {len(res.generated_ids)} tokens, {res.decode_tok_s:.1f} tok/s decode "
          f"| stop: {res.stop_reason}", file=sys.stderr)
    if session is not None and args.stats:
        for line in session.summary(res.decode_tok_s):
            print(line, file=sys.stderr)
    if session is not None and session.saved_profile is not None:
        print(f"expert profile: this run's routing written to {session.saved_profile} (--expert-profile "
              f"{session.saved_profile} warms the next run from it)", file=sys.stderr)
    if getattr(args, "old_gpu", None):
        print(f"hybrid: ran on the CPU: {args.old_gpu}", file=sys.stderr)


def main(argv=None) -> int:
    return run_cli(body, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
