"""Held-out statistics for the tiny model: loss/perplexity vs a unigram baseline, per-layer
routing skew, MTP agreement, greedy samples, and the transformers cross-check.

Legend: S window length, V vocabulary, L layers, E experts, K top-k.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def windows(stream: torch.Tensor, seq: int) -> list[torch.Tensor]:
    """Non-overlapping windows of S+1 tokens (stride S): every position 1..N-1 is a target once."""
    n = stream.numel()
    return [stream[i:i + seq + 1] for i in range(0, n - 1, seq) if min(n, i + seq + 1) - i >= 2]


def unigram_nll(train: torch.Tensor, targets: torch.Tensor, vocab: int) -> float:
    """Mean -log p(x) with add-one smoothed unigram counts from the train stream."""
    counts = torch.bincount(train.cpu().long(), minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[targets.cpu().long()].mean())


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq: int, max_windows: int | None = None) -> dict:
    """Main-model NLL, MTP agreement and routing mass on a token stream (one window at a time)."""
    cfg = model.cfg
    dev = next(model.parameters()).device
    nll = 0.0
    n_tok = 0
    agree = mtp_hit = main_hit = n_mtp = 0
    mass = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.float64)
    picks = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.float64)
    for w in windows(stream, seq)[:max_windows]:
        w = w.to(dev).long()
        out = model(w[None, :-1], mtp=True)
        logits = out["logits"][0].float()                              # [S, V]
        nll += float(F.cross_entropy(logits, w[1:], reduction="sum"))
        n_tok += w.numel() - 1
        greedy = logits.argmax(-1)                                     # [S] greedy x_{t+1}
        main_hit += int((greedy == w[1:]).sum())
        if "mtp_logits" in out:
            m = out["mtp_logits"][0].float().argmax(-1)                # [S-1] guesses x_{t+2}
            agree += int((m == greedy[1:]).sum())
            mtp_hit += int((m == w[2:]).sum())
            n_mtp += m.numel()
        for layer, (_, top_w, top_i) in enumerate(out["routes"]):
            mass[layer].index_add_(0, top_i.reshape(-1).cpu(), top_w.reshape(-1).double().cpu())
            picks[layer] += torch.bincount(top_i.reshape(-1).cpu(), minlength=cfg.num_experts).double()
    return {
        "nll": nll / max(n_tok, 1), "tokens": n_tok, "main_top1": main_hit / max(n_tok, 1),
        "mtp_agree_greedy": agree / max(n_mtp, 1), "mtp_top1": mtp_hit / max(n_mtp, 1),
        "mtp_positions": n_mtp, "routing": routing_stats(mass, picks),
    }


def routing_stats(mass: torch.Tensor, picks: torch.Tensor) -> list[dict]:
    """Per layer: share of routing mass in the top 10% of experts (floor(0.1*E), at least 1),
    entropy of the mass distribution in bits vs log2(E), and the same share by pick counts."""
    e = mass.shape[1]
    top = max(1, int(0.1 * e))
    rows = []
    for layer in range(mass.shape[0]):
        p = mass[layer] / mass[layer].sum().clamp_min(1e-30)
        q = picks[layer] / picks[layer].sum().clamp_min(1e-30)
        ent = float(-(p[p > 0] * p[p > 0].log2()).sum())
        rows.append({
            "layer": layer, "top10pct_experts": top,
            "top10pct_mass_share": float(p.sort(descending=True).values[:top].sum()),
            "top10pct_pick_share": float(q.sort(descending=True).values[:top].sum()),
            "uniform_share": top / e,
            "entropy_bits": ent, "uniform_entropy_bits": math.log2(e),
            "max_expert_share": float(p.max()), "min_expert_share": float(p.min()),
        })
    return rows


@torch.no_grad()
def greedy(model, ids: list[int], n_new: int, eos: int | None = None) -> list[int]:
    """Greedy continuation by full recompute (no cache): the plainest reference."""
    dev = next(model.parameters()).device
    out = list(ids)
    for _ in range(n_new):
        logits = model(torch.tensor([out], device=dev), mtp=False)["logits"][0, -1]
        nxt = int(logits.argmax())
        out.append(nxt)
        if eos is not None and nxt == eos:
            break
    return out[len(ids):]


@torch.no_grad()
def hf_cross_check(folder: str, model_fp32, ids: list[int], prompt: list[int], n_new: int) -> dict:
    """Load the folder with transformers' Qwen3MoeForCausalLM (fp32, eager, CPU); compare logits
    with our fp32 model on `ids`; greedy-generate from `prompt` with transformers."""
    import transformers
    from transformers import Qwen3MoeForCausalLM
    hf = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    x = torch.tensor([ids])
    ref = hf(x).logits[0].float()                                             # [S, V]
    cpu_model = model_fp32.to("cpu")
    mine = cpu_model(x, mtp=False)["logits"][0].float()
    gen = hf.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False,
                      eos_token_id=hf.config.eos_token_id, pad_token_id=hf.config.eos_token_id)
    return {
        "transformers_version": transformers.__version__, "tokens": len(ids),
        "max_abs_logit_diff": float((ref - mine).abs().max()),
        "max_abs_logit": float(ref.abs().max()),
        "argmax_equal": bool((ref.argmax(-1) == mine.argmax(-1)).all()),
        "hf_greedy_ids": gen[0, len(prompt):].tolist(),
    }
