"""Render quality records: one console line each, the markdown table, the bar chart."""
from __future__ import annotations

from pathlib import Path

MIB = 2**20

NOTES = """\
How to read this table
- Teacher-forced: the same token stream (tokenized once with `tokenizers`) is fed to every engine;
  each chunk of n_ctx tokens starts from an empty KV cache.
- Reference: llama.cpp (llama-cpp-python) on the Q8_0 GGUF of the same model.
- Scoring exactly as llama.cpp `perplexity --kl-divergence`: only the second half of each chunk is
  scored; reference log-probs stored as uint16 over [max-16, max]; KL sums tokens above the -16
  floor; same-top compares argmaxes (first index on ties); ± is one standard error.
- PPL is the candidate's perplexity on the scored tokens (the reference's is PPL(Q8_0)).
- file = download size (GGUF file, or the checkpoint's safetensors); experts = bytes of all expert
  tensors, i.e. the RAM needed to hold every expert as stored (hybrid never dequantizes them).
  hybrid checkpoints also carry the model's MTP module (`mtp.*`), which the GGUF export drops
  (llama.cpp's qwen3moe has none); GGUF files of the mixed recipe hold FP8 weights as F32.
- engine `hybrid` rows run through hybrid's runtime as `hybrid-run --device cpu` opens it
  (`open_session(...).model.forward_logits`); `@slots=N` / `@split=L` pick the placement (expert
  slots on the card vs the CPU expert runner; two logical cards split at layer L);
  `gguf-<recipe>` rows are hybrid's own quantized weights re-packed into a GGUF and run by
  llama.cpp (NVFP4 tensors bit-identical, GGML type 40 + per-tensor `.scale`), an engine A/B on
  identical weights. llama.cpp's CPU backend multiplies NVFP4 (and Q*/IQ*) weights with
  activations quantized to Q8_0/Q8_K; hybrid keeps activations in fp32 on CPU.
- Flash attention is off in llama.cpp; its KV cache is F16.
- NVFP4 in llama.cpp: the bundled llama.cpp (llama-cpp-python 0.3.36 vendors llama.cpp commit
  0c1e570) loads GGML type 40 (NVFP4: 64-element blocks, four UE4M3 sub-scales) and multiplies
  each weight's `.scale` tensor (ModelOpt's weight_scale_2; per expert for stacked experts) after
  the matmul, so hybrid's NVFP4 weights run unchanged in both engines (gguf-nvfp4). Its quantizer
  cannot *produce* NVFP4 ("invalid output file type 39"); MXFP4_MOE is its own FP4 option.
- `<TYPE>-imat` rows: importance matrix = mean squared matmul inputs per column (per expert),
  computed by hybrid's forward on the model's validation-split text (never the scored test
  split), as llama-imatrix defines it;
  other llama.cpp rows use no imatrix (IQ3_S / IQ4_XS do not require one in llama.cpp).
"""


def one_line(r: dict) -> str:
    return (f"{r['candidate']:>12} [{r['engine']}]  same-top {r['same_top_pct']:6.2f} ± {r['same_top_unc_pct']:.2f} %"
            f"  KLD {r['mean_kld']:.5f} (p99 {r['p99_kld']:.5f})  PPL {r['ppl']:.3f}"
            f"  file {r['file_bytes'] / MIB:.2f} MiB  experts {r['expert_bytes'] / MIB:.2f} MiB")


def _row(r: dict) -> str:
    return (f"| {r['candidate']} | {r['engine']} | {r['same_top_pct']:.2f} ± {r['same_top_unc_pct']:.2f} "
            f"| {r['mean_kld']:.5f} ± {r['mean_kld_unc']:.5f} | {r['p99_kld']:.5f} | {r['ppl']:.3f} "
            f"| {r['file_bytes'] / MIB:.2f} | {r['expert_bytes'] / MIB:.2f} | {r['weights']} |")


def placement_lines(records: list[dict]) -> list[str]:
    """One line per hybrid recipe measured under several placements: the spread of its row (an @head= row is other
    weights, not a placement: left out)."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        if r["engine"] == "hybrid" and "@head=" not in r["candidate"]:
            groups.setdefault(r["candidate"].split("@")[0], []).append(r)
    out = []
    for recipe, rs in groups.items():
        if len(rs) < 2:
            continue
        n = rs[0]["count"]
        tops = [round(r["same_top_pct"] * n / 100) for r in rs]
        kl = [r["mean_kld"] for r in rs]
        ppl = [r["ppl"] for r in rs]
        out.append(f"- {recipe} under {len(rs)} placements ({', '.join(r['candidate'] for r in rs)}): same top "
                   f"token at {min(tops)}..{max(tops)} of {n} positions (spread {max(tops) - min(tops)}); "
                   f"mean KLD {min(kl):.5f}..{max(kl):.5f}; PPL {min(ppl):.3f}..{max(ppl):.3f}")
    return out


def markdown(records: list[dict]) -> str:
    if not records:
        return "(no candidates)\n"
    r0 = records[0]
    parity = r0["tokenizer_parity"]
    lc = r0["llama_cpp"]
    by_class = sorted({c for r in records for c in r["same_top_by_class"]})
    lines = [
        "# Quality vs Q8_0: same-top-token, KL divergence, perplexity", "",
        f"- machine: {r0['machine']}",
        f"- command: `{r0['command']}`",
        f"- git: {r0['git_sha']}, {r0['time_utc']}",
        f"- model: {r0['model']}; n_ctx {r0['n_ctx']}, {r0['chunks']} chunks, {r0['count']} scored tokens",
        f"- llama-cpp-python {lc['llama_cpp_python']} (libllama {lc['libllama']}), NVFP4 type known: "
        f"{lc['nvfp4']}; {lc['system']}",
        f"- reference PPL(Q8_0): {r0['ppl_base']:.3f}; tokenizer parity llama.cpp vs tokenizers: "
        + ", ".join(f"{c} {'ok' if ok else 'MISMATCH'}" for c, ok in parity.items()),
        "",
        "| candidate | engine | same-top % | mean KLD | p99 KLD | PPL | file MiB | experts MiB | weights |",
        "|---|---|---|---|---|---|---|---|---|",
        *[_row(r) for r in records],
        "",
        *(["Placement invariance (same weights, different expert placement / layer split):", "",
           *placement_lines(records), ""] if placement_lines(records) else []),
        "Same-top % (and PPL) by prompt class; the reference PPL(Q8_0) of each class in the header:", "",
        "| candidate | " + " | ".join(f"{c} (PPL {r0.get('ppl_base_by_class', {}).get(c, float('nan')):.2f})"
                                      for c in by_class) + " |",
        "|---|" + "---|" * len(by_class),
        *[f"| {r['candidate']} | " + " | ".join(
            f"{r['same_top_by_class'].get(c, float('nan')):.1f} ({r.get('ppl_by_class', {}).get(c, float('nan')):.2f})"
            for c in by_class) + " |" for r in records],
        "", NOTES,
    ]
    return "\n".join(lines)


def chart(records: list[dict], path: Path) -> None:
    """Bars: same-top % and mean KLD, each with ±1 s.e.; hybrid rows green, llama.cpp rows blue."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{r['candidate']} ({r['engine']})" for r in records]
    y = range(len(records))
    colors = ["tab:green" if r["engine"] == "hybrid" else "tab:blue" for r in records]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.45 * len(records) + 1.8), sharey=True)
    a1.barh(y, [r["same_top_pct"] for r in records], xerr=[r["same_top_unc_pct"] for r in records],
            color=colors, capsize=3)
    lo = min(r["same_top_pct"] - r["same_top_unc_pct"] for r in records)
    a1.set_xlim(max(0.0, lo - 5), 100.5)
    a1.set_xlabel("same top token vs Q8_0 (%)")
    a1.set_yticks(list(y), names)
    a1.invert_yaxis()
    kl = [r["mean_kld"] for r in records]
    a2.barh(y, kl, xerr=[r["mean_kld_unc"] for r in records], color=colors, capsize=3)
    for yi, (v, r) in enumerate(zip(kl, records)):
        a2.text(v + r["mean_kld_unc"], yi, f"  {v:.4f}  p99 {r['p99_kld']:.3f}", va="center", fontsize=8)
    a2.set_xlim(0, max(kl) * 1.6 if max(kl) > 0 else 1)
    a2.set_xlabel("mean KL divergence vs Q8_0 (nats)")
    r0 = records[0]
    fig.suptitle(f"{r0['model']}: {r0['count']} scored tokens, git {r0['git_sha']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
