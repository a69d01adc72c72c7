"""Training-curve PNG and MODEL_CARD.md for the tiny model, from the measured stats dict."""
from __future__ import annotations

import math
from pathlib import Path


def plot_curve(history: dict, unigram_val: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
    tr = history["train"]
    ax.plot([r["tokens"] / 1e6 for r in tr], [r["loss"] for r in tr], lw=0.8, label="train loss (next token)")
    ax.plot([r["tokens"] / 1e6 for r in tr], [r["mtp_loss"] for r in tr], lw=0.8, label="train loss (MTP, token t+2)")
    va = history["val"]
    ax.plot([r["tokens"] / 1e6 for r in va], [r["loss"] for r in va], "o-", ms=3, label="held-out val loss")
    ax.axhline(unigram_val, color="gray", ls="--", lw=0.8, label="unigram baseline (val)")
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0, max(unigram_val * 1.15, 1.0))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("tiny qwen3_moe + MTP")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _routing_table(rows: list[dict]) -> str:
    out = ["| layer | top-10% experts | share of routing mass | share of picks | uniform share "
           "| entropy (bits) | uniform entropy | max / min expert share |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['layer']} | {r['top10pct_experts']} | {r['top10pct_mass_share']:.1%} "
                   f"| {r['top10pct_pick_share']:.1%} | {r['uniform_share']:.1%} | {r['entropy_bits']:.2f} "
                   f"| {r['uniform_entropy_bits']:.2f} | {r['max_expert_share']:.1%} / {r['min_expert_share']:.2%} |")
    return "\n".join(out)


def write_card(s: dict, path: Path) -> None:
    a, c, t, te = s["arch"], s["corpus"], s["training"], s["test"]
    hf = s.get("hf_check", {})
    hf_line = (f"max |logit difference| = {hf['max_abs_logit_diff']:.3g} over {hf['tokens']} held-out tokens "
               f"(largest |logit| {hf['max_abs_logit']:.3g}); argmax equal at every position: {hf['argmax_equal']}; "
               f"transformers {hf['transformers_version']}" if "max_abs_logit_diff" in hf
               else f"FAILED: {hf.get('error', 'not run')}")
    text = f"""# tiny-qwen3-moe-mtp: the embedded default model

A small Qwen3-MoE (`qwen3_moe`, `Qwen3MoeForCausalLM` tensor names) with one multi-token-prediction
(MTP) module, trained from scratch on the Python standard library so that routing, cache hit
rates and speculative decoding measured on it mean something. Not a useful assistant.

Everything below was measured in one run of `tools/train_tiny.py`:

- machine: {s['machine']['description']}
- command: `{s['command']}`
- git sha of the training code: `{s['git_sha']}`; date (UTC): {s['date']}

## Architecture

| field | value |
|---|---|
| layers | {a['num_layers']} (all sparse MoE; `decoder_sparse_step` 1, `mlp_only_layers` []) |
| hidden size | {a['hidden_size']} |
| attention | {a['num_heads']} query heads x head_dim {a['head_dim']} (width {a['num_heads'] * a['head_dim']}), {a['num_kv_heads']} KV heads (GQA), q/k RMSNorm, RoPE theta {a['rope_theta']:g} |
| experts | {a['num_experts']} routed, top-{a['top_k']}, softmax -> top-k -> renormalise (`norm_topk_prob` true), no shared expert |
| expert intermediate | {a['moe_intermediate_size']} (SwiGLU) |
| vocabulary | {a['vocab_size']} (byte-level BPE, `<|endoftext|>` = id {s['tokenizer']['eot_id']} is bos/eos/pad), tied embeddings |
| context trained | {t['seq_len']} tokens (`max_position_embeddings` {a['max_position_embeddings']}) |
| parameters | {s['params']['total']:,} total; ~{s['params']['active_per_token']:,} active per token (main model, incl. the tied head) |
| weights | BF16, {s['files']['weights_bytes']:,} bytes in {s['files']['shards']} shards (largest {s['files']['largest_shard_bytes']:,} bytes) |
| folder | {s['files']['folder_bytes']:,} bytes ({s['files']['folder_bytes'] / 2**20:.2f} MiB) with tokenizer, manifest and curve, this card not counted |

MTP module (`mtp.*`, DeepSeek-V3 / Qwen3-Next design, `num_nextn_predict_layers` 1):
`h'_t = mtp.eh_proj([mtp.hnorm(h_t) ; mtp.enorm(embed(x_(t+1)))])` where `h_t` is the last decoder
layer's output at position t BEFORE `model.norm`, and the concatenation puts the hidden state in
input columns 0..{a['hidden_size'] - 1} and the embedding in columns {a['hidden_size']}..{2 * a['hidden_size'] - 1} of `eh_proj.weight` [{a['hidden_size']}, {2 * a['hidden_size']}];
then one pre-norm transformer block `mtp.layers.0.*` (same attention as the main layers, its own
positions = t, causal) whose MLP is a DENSE SwiGLU of intermediate {a['mtp_intermediate_size']}
(`mtp.layers.0.mlp.{{gate,up,down}}_proj`; config `intermediate_size`) rather than a full MoE
block, which does not fit the size budget; then `mtp.norm` and the shared (tied) head, giving
logits for token t+2. Trained jointly with weight {t['mtp_weight']} on its loss.
transformers ignores the `mtp.*` tensors (it warns that they are unused).

## Corpus

The standard library of Python {c['python']} (`.py`, `.txt`, `.rst`; no site-packages) under
`{c['roots']['stdlib']}`, plus plain-text docs (`.txt`, `.md`, `.rst`, README*) under
`{c['roots']['doc']}`. Duplicates (same sha256), non-UTF-8 and >1 MiB files skipped
({c['skipped']}). Files are split by a fixed hash of their path ({c['split_rule']}).
Every file's path, sha256, size and split are in `corpus_manifest.json.gz`;
corpus sha256 = `{c['corpus_sha256']}`.

| split | files | bytes | tokens |
|---|---|---|---|
""" + "\n".join(f"| {k} | {v['files']:,} | {v['bytes']:,} | {c['tokens'][k]:,} |" for k, v in sorted(c["splits"].items())) + f"""

## Training

Seed {t['seed']}; AdamW (betas 0.9/0.95, weight decay {t['weight_decay']} on matrices), peak LR {t['lr']:g},
{t['warmup']} warm-up steps then cosine to {t['min_lr_frac']:g}x; batch {t['batch']} x {t['seq_len']} tokens; bf16 autocast,
fp32 master weights; loss = next-token CE + {t['mtp_weight']} x MTP CE + {t['aux_coef']} x load-balancing loss
(Switch/Qwen3 form, `E * sum_e f_e P_e`, averaged over layers). Windows drawn at seeded random
offsets of the train stream. {t['steps_run']} steps ({t['tokens_seen']:,} tokens seen, {t['epochs_seen']:.1f} passes over the
train split) in {t['train_seconds']:.0f} s; the weights kept are those of step {t['best_step']}, the lowest val loss
(val split; the numbers below are on the separate test split).{t['note']}

![training curve](training_curve.png)

## Held-out results (test split: {te['tokens']:,} tokens, shipped BF16 weights run in fp32)

| model | loss (nats/token) | perplexity | bits per byte |
|---|---|---|---|
| this model | {te['nll']:.3f} | {math.exp(te['nll']):.2f} | {te['bpb']:.3f} |
| unigram baseline (train-split counts, add-one) | {te['unigram_nll']:.3f} | {math.exp(te['unigram_nll']):.1f} | {te['unigram_bpb']:.3f} |

Main-model top-1 next-token accuracy: {te['main_top1']:.1%}.
MTP head: top-1 agreement with the model's own greedy next-next token = **{te['mtp_agree_greedy']:.1%}**
({te['mtp_positions']:,} positions; the MTP guess for t+2 from h_t and the true x_(t+1), against the
main model's argmax at t+1 given the true prefix); MTP top-1 accuracy against the true token t+2: {te['mtp_top1']:.1%}.

### Routing on the test split

"Top-10% experts" = the {te['routing'][0]['top10pct_experts']} experts (of {a['num_experts']}) with the most routing mass
(sum over tokens of their renormalised top-k weights); uniform routing would give them {te['routing'][0]['uniform_share']:.1%}.

{_routing_table(te['routing'])}

## transformers cross-check

`Qwen3MoeForCausalLM.from_pretrained(<this folder>, dtype=float32, attn_implementation="eager")` on CPU
vs the training code's model with the same BF16 weights in fp32: {hf_line}.

## Greedy sample

Prompt `def fibonacci(n):` (prefixed by `<|endoftext|>` as bos), {s['sample']['new_tokens']} new tokens, greedy
(transformers' `generate` and the training model agree: {s['sample']['hf_equal']}):

```python
{s['sample']['text']}
```
"""
    path.write_text(text)
