"""hybrid-run: generate text from an NVFP4 / FP8 / mixed / BF16 MoE checkpoint."""
from __future__ import annotations

import argparse
import json
import sys

from hybrid.cli.common import add_debug_flag, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybrid-run", description=__doc__)
    p.add_argument("--model", "-m", default=None,
                   help="model folder, or 'tiny' for the embedded model (default: tiny)")
    p.add_argument("--prompt", "-p", default="def fibonacci(n):", help="prompt text")
    p.add_argument("--max-tokens", "-n", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu (default) or cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x max prob (0 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtract from seen tokens' logits")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="divide seen tokens' logits (1 = off)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    add_debug_flag(p)
    return p


def _check_args(args) -> None:
    from hybrid.errors import HybridError

    if args.max_tokens < 1:
        raise HybridError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise HybridError("--device cuda: no CUDA GPU is visible to torch; use --device cpu")


def body(args) -> int:
    from hybrid.generate import generate
    from hybrid.model import ModelConfig, load_model, resolve_model_path
    from hybrid.sampler import Sampler, SamplerConfig
    from hybrid.tokenizer import Tokenizer

    _check_args(args)
    sampler = Sampler(SamplerConfig(args.temperature, args.top_k, args.top_p, args.min_p,
                                    args.presence_penalty, args.repetition_penalty, args.seed))
    path = resolve_model_path(args.model)
    cfg = ModelConfig.from_folder(path)
    tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    model = load_model(path, device=args.device)
    prompt = tok.apply_chat(args.prompt, args.system) if args.chat else args.prompt
    ids = tok.encode(prompt)
    if not ids:
        from hybrid.errors import HybridError
        raise HybridError("--prompt: the prompt encodes to zero tokens")
    if not args.json:
        sys.stdout.write(prompt)
        sys.stdout.flush()
    on_text = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    res = generate(model, tok, ids, args.max_tokens, sampler, args.stop, on_text)
    if args.json:
        print(json.dumps({"model": str(path), "prompt_ids": res.prompt_ids,
                          "generated_ids": res.generated_ids, "text": res.text,
                          "stop_reason": res.stop_reason, "prefill_tok_s": round(res.prefill_tok_s, 3),
                          "decode_tok_s": round(res.decode_tok_s, 3)}))
    else:
        print(f"\n\nprompt: {len(res.prompt_ids)} tokens, {res.prefill_tok_s:.1f} tok/s prefill | "
              f"generated: {len(res.generated_ids)} tokens, {res.decode_tok_s:.1f} tok/s decode "
              f"| stop: {res.stop_reason}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return run_cli(body, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
