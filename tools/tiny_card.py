"""Training-curve PNG and MODEL_CARD.md for the tiny model, from the measured stats dict."""
from __future__ import annotations

import math
from pathlib import Path


def plot_curve(history: dict, unigram_val: float, path: Path, uniform_share: float | None = None) -> None:
    """Left: train/val loss vs tokens seen. Right: per-layer routing skew on the val windows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=80, gridspec_kw={"width_ratios": [3, 2]})
    tr = history["train"]
    ax.plot([r["tokens"] / 1e6 for r in tr], [r["loss"] for r in tr], lw=0.8, label="train loss (next token)")
    ax.plot([r["tokens"] / 1e6 for r in tr], [r["mtp_loss"] for r in tr], lw=0.8, label="train loss (MTP, token t+2)")
    va = history["val"]
    ax.plot([r["tokens"] / 1e6 for r in va], [r["loss"] for r in va], "o-", ms=2, label="held-out val loss")
    ax.axhline(unigram_val, color="gray", ls="--", lw=0.8, label="unigram baseline (val)")
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0, max(unigram_val * 1.15, 1.0))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("tiny qwen3_moe + MTP", fontsize=10)
    if va and "routing_top10" in va[0]:
        for layer in range(len(va[0]["routing_top10"])):
            ax2.plot([r["tokens"] / 1e6 for r in va], [100 * r["routing_top10"][layer] for r in va],
                     lw=0.9, label=f"layer {layer}")
        ax2.axhline(20, color="red", ls="--", lw=0.8, label="20% (requirement)")
        if uniform_share:
            ax2.axhline(100 * uniform_share, color="gray", ls=":", lw=0.8, label="uniform")
        ax2.set_xlabel("training tokens seen (millions)")
        ax2.set_ylabel("routing mass in top-10% experts (%)")
        ax2.set_title("routing skew on val windows", fontsize=10)
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=7)
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


def _corpus_section(c: dict) -> str:
    site = {k: v for k, v in c["roots"].items() if k.startswith("site")}
    cap = c["caps"]
    rows = "\n".join(f"| {k} | {v['files']:,} | {v['bytes']:,} | {c['tokens'][k]:,} |" for k, v in sorted(c["splits"].items()))
    pk = ", ".join(f"{name.split(':', 1)[1]} {b / 1e6:.1f} MB" for name, _, b in c["top_packages"])
    return f"""## Corpus

Read offline on the training machine, in one pass:

- the standard library of Python {c['python']} (`.py`, `.txt`, `.rst`) under `{c['roots']['stdlib']}`;
- plain-text docs (`.txt`, `.md`, `.rst`, README*) under `{c['roots']['doc']}`;
- the installed site-packages ({', '.join(f'`{k}` = `{v}`' for k, v in site.items()) or 'none'}): `.py` sources, and the `.md`/`.rst`/`.txt`
  docs and `*.dist-info/METADATA` package descriptions shipped inside packages, visited in a fixed
  pseudo-random order (sha256 of `<root>/<rel>`), at most {cap['max_package_bytes'] / 1e6:g} MB per top-level package and
  {cap['max_site_bytes'] / 1e6:g} MB in all; files over {cap['max_site_file_bytes'] // 1024} KiB, generated files (a "generated"/"do not edit" mark near the top), files
  with lines over 1000 characters, mostly-digit files, licence/changelog texts and space-less
  "prose" skipped.

Exact duplicates (same sha256; the stdlib comes first), non-UTF-8 and empty files skipped;
the train stream is capped at {cap['max_train_tokens']:,} tokens by dropping train files from the end of that order.
Skipped/dropped files: {c['skipped']}. {c['packages']} packages (stdlib and docs count as one each); the largest:
{pk}. The tokenizer (byte-level BPE, vocabulary 8192) was trained on the first
{c['tokenizer_sample']['files']:,} train files ({c['tokenizer_sample']['bytes']:,} bytes: the stdlib, then site files in the fixed order).

Split by a fixed hash of each file's path ({c['split_rule']}); the stdlib rule is the first
model's, so its test split is part of this one. `corpus_manifest.json.gz` holds
path, sha256, bytes and split of every held-out (val and test) file, per-package file counts and bytes, and
corpus sha256 = `{c['corpus_sha256']}` over the sorted (path, sha256) list of every file
(train files alone: `{c['train_sha256']}`).

| split | files | bytes | tokens |
|---|---|---|---|
{rows}
"""


def _replaced_section(s: dict) -> str:
    p, cmp_, t = s.get("previous"), s.get("comparison"), s["training"]
    if not p:
        return ""
    out = [f"""## Replaces the first model

The first embedded model (trained {p['date']} UTC at `{p['git_sha'][:12]}`) saw only the standard library:
{p['corpus_tokens']['train']:,} train tokens, {p['training']['epochs_seen']:.1f} passes, {p['training']['train_seconds']:.0f} s of training
({p['training']['tokens_seen']:,} tokens seen). Its held-out loss was {p['test']['nll']:.3f} nats/token
({p['test']['bpb']:.3f} bits/byte) on its test split, but its greedy `def fibonacci(n):` sample was not code:

```python
{p['sample']}
```

This model keeps its architecture, tensor names, sizes, tied embeddings and MTP module and was
retrained on the corpus below ({s['corpus']['tokens']['train'] / p['corpus_tokens']['train']:.0f}x as many train tokens) for longer
({t['tokens_seen'] / p['training']['tokens_seen']:.1f}x as many tokens seen). Both models, scored in this run on the same texts
(shipped BF16 weights in fp32; per-token figures use each model's own tokenizer, so compare bits per byte):
"""]
    if cmp_ and "sets" in cmp_:
        out.append("| texts | files | first model: bits/byte | tokens | ppl | this model: bits/byte | tokens | ppl |")
        out.append("|---|---|---|---|---|---|---|---|")
        names = {"first_model_test_split": "the first model's test split (stdlib)",
                 "this_test_split": "this model's test split"}
        for k, r in cmp_["sets"].items():
            o, n = r["old"], r["new"]
            out.append(f"| {names.get(k, k)} | {r['files']} | {o['bpb']:.3f} | {o['tokens']:,} | {o['ppl']:.2f} "
                       f"| **{n['bpb']:.3f}** | {n['tokens']:,} | {n['ppl']:.2f} |")
        f = cmp_["first_model_test_files"]
        out.append(f"\nThe first model's test files found byte-identical here: {f['found_identical']} of {f['in_manifest']} "
                   f"(all in this model's test split: {f['all_in_this_test_split']}).\n")
    elif cmp_:
        out.append(f"Comparison FAILED: {cmp_.get('error')}\n")
    return "\n".join(out) + "\n"


def write_card(s: dict, path: Path) -> None:
    a, c, t, te = s["arch"], s["corpus"], s["training"], s["test"]
    hf = s.get("hf_check", {})
    hf_line = (f"max |logit difference| = {hf['max_abs_logit_diff']:.3g} over {hf['tokens']} held-out tokens "
               f"(largest |logit| {hf['max_abs_logit']:.3g}); argmax equal at every position: {hf['argmax_equal']}; "
               f"transformers {hf['transformers_version']}" if "max_abs_logit_diff" in hf
               else f"FAILED: {hf.get('error', 'not run')}")
    passing = sum(r["top10pct_mass_share"] >= 0.2 for r in te["routing"])
    text = f"""# tiny-qwen3-moe-mtp: the embedded default model

A small Qwen3-MoE (`qwen3_moe`, `Qwen3MoeForCausalLM` tensor names) with one multi-token-prediction
(MTP) module, trained from scratch on Python source code and its documentation (the standard library
and the installed site-packages of the training machine) so that routing, cache hit rates and
speculative decoding measured on it mean something. Not a useful assistant.

Everything below was measured in one run of `tools/train_tiny.py`:

- machine: {s['machine']['description']}
- command: `{s['command']}`
- git sha of the training code: `{s['git_sha']}`; date (UTC): {s['date']}

{_replaced_section(s)}## Architecture

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

{_corpus_section(c)}
## Training

Seed {t['seed']}; AdamW (betas 0.9/0.95, weight decay {t['weight_decay']} on matrices), peak LR {t['lr']:g},
{t['warmup']} warm-up steps then cosine to {t['min_lr_frac']:g}x; batch {t['batch']} x {t['seq_len']} tokens; bf16 autocast,
fp32 master weights; loss = next-token CE + {t['mtp_weight']} x MTP CE + {t['aux_coef']} x load-balancing loss
(Switch/Qwen3 form, `E * sum_e f_e P_e`, averaged over layers; the same coefficient as the first model). Windows drawn at seeded random
offsets of the train stream. {t['steps_run']} steps ({t['tokens_seen']:,} tokens seen, {t['epochs_seen']:.2f} passes over the
train split) in {t['train_seconds']:.0f} s (budget {t['budget_s']:.0f} s); the weights kept are those of step {t['best_step']}, the lowest val loss
({t['val_windows']} val windows spread over the val split; the numbers below are on the separate test split).{t['note']}
The right panel tracks, on the same val windows, the routing mass taken by each layer's top-10% experts.

![training curve](training_curve.png)

## Held-out results (test split: {te['tokens']:,} tokens, {te['scored_bytes']:,} bytes, shipped BF16 weights run in fp32)

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
Layers at or above 20%: {passing} of {len(te['routing'])}.

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
