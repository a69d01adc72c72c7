"""hybrid-profile: run calibration texts through a model and write its expert-popularity profile
(profiles/<model folder>.experts.json) for the planner and the expert cache's warm start."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from hybrid.cli.common import OneLineParser, add_debug_flag, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="hybrid-profile", description=__doc__.splitlines()[0])
    p.add_argument("--model", "-m", default=None, help="model folder, or 'tiny' (default: tiny)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="calibration texts, separated by blank lines (default: the benchmark prompt set)")
    p.add_argument("--max-tokens", type=int, default=0, metavar="N",
                   help="also decode N greedy tokens after each text (default 0: teacher-forced texts only)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="output file (default: profiles/<model folder>.experts.json)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu (default) or cuda")
    add_debug_flag(p)
    return p


def calibration_texts(path: str | None) -> list[str]:
    from hybrid.errors import HybridError

    if path is None:
        from hybrid.bench.prompts import PROMPTS

        return [p + a for texts in PROMPTS.values() for p, a in texts]
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise HybridError(f"--prompts {path}: cannot read ({exc.strerror})") from None
    texts = [t.strip("\n") for t in text.split("\n\n") if t.strip()]
    if not texts:
        raise HybridError(f"--prompts {path}: no text in the file")
    return texts


def count_routing(model, tok, texts: list[str], max_tokens: int = 0) -> tuple[np.ndarray, int]:
    """Routing counts int64 [L, E] and tokens routed, over the texts (+ greedy continuations)."""
    import torch

    cfg = model.cfg
    counts = np.zeros((cfg.num_hidden_layers, cfg.num_experts), dtype=np.int64)
    model.on_route = lambda layer, ids, w: np.add.at(counts[layer], ids.cpu().numpy().ravel(), 1)
    tokens = 0
    try:
        for text in texts:
            ids = tok.encode(text)[: 4096]
            if not ids:
                continue
            model.new_cache(len(ids) + max_tokens)
            logits = model.forward(torch.tensor(ids), 0, last_only=True)
            tokens += len(ids)
            for i in range(max_tokens):
                nxt = int(logits[-1].argmax())
                logits = model.forward(torch.tensor([nxt]), len(ids) + i, last_only=True)
                tokens += 1
    finally:
        model.on_route = None
    return counts, tokens


def body(args) -> int:
    import json

    from hybrid.errors import HybridError
    from hybrid.model import ModelConfig, load_model, resolve_model_path
    from hybrid.tokenizer import Tokenizer

    if args.max_tokens < 0:
        raise HybridError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    path = resolve_model_path(args.model)
    cfg = ModelConfig.from_folder(path)
    tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    texts = calibration_texts(args.prompts)
    model = load_model(path, device=args.device)
    counts, tokens = count_routing(model, tok, texts, args.max_tokens)
    if tokens == 0:
        raise HybridError("hybrid-profile: the calibration texts encode to zero tokens")
    from hybrid.experts.popularity import profile_path

    name = path.resolve().name
    source = {"command": "hybrid-profile " + " ".join(sys.argv[1:]), "texts": len(texts),
              "prompts": args.prompts or "hybrid.bench.prompts"}
    from hybrid.experts.popularity import profile_file_dict

    d = profile_file_dict(name, cfg.model_type, counts, tokens, cfg.num_experts_per_tok, source)
    out = Path(args.out) if args.out else profile_path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(d) + "\n")
    print(f"{out}: {tokens} tokens over {len(texts)} texts, {cfg.num_hidden_layers} layers x "
          f"{cfg.num_experts} experts", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return run_cli(body, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
