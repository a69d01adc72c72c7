"""Render speed records as markdown: prefill tok/s by context length, decode tok/s by prompt class."""
from __future__ import annotations

NOTES = """\
How these were measured
- Wall clock (`time.perf_counter`) around each synchronized call, never llama.cpp's own counters.
- Prefill: one forward over the first L tokens of the prompt stream from an empty cache, median of
  the repeats after one warm-up; tok/s = L / time. Decode: greedy, one token per call after the
  prompt; the median step time over every step of every prompt of the class, as tok/s.
- Engines are interleaved within each repetition; llama.cpp and hybrid's CPU expert runner get `--threads`,
  hybrid's torch dense path gets `--torch-threads` (default: the rule `hybrid-run` uses).
- This is a shared CPU machine: compare engines within this run (ratios), not absolute numbers
  across runs. `loadavg` in speed.jsonl shows how busy it was.
- hybrid runs as `hybrid-run --device cpu` opens it (`open_session`): dense layers through the
  torch reference linear (a CPU card decodes its dense weights once at open, capped at 1 GiB;
  beyond the cap per call), experts split between the "card" slots and
  the CPU expert runner (Numba NVFP4/FP8 kernels; torch for BF16 experts) — see `placement`.
"""


def _ratio_line(records: list[dict]) -> str:
    by = {r["candidate"]: r for r in records}
    if "nvfp4" in by and "gguf-nvfp4" in by:
        h, g = by["nvfp4"]["decode_tok_s"], by["gguf-nvfp4"]["decode_tok_s"]
        parts = ", ".join(f"{c} {h[c] / g[c]:.2f}x" for c in h)
        return f"Same NVFP4 weights, hybrid / llama.cpp decode speed: {parts}."
    return ""


def markdown(records: list[dict]) -> str:
    if not records:
        return "(no candidates)\n"
    r0 = records[0]
    ladder = list(r0["prefill_tok_s"])
    classes = list(r0["decode_tok_s"])
    lc = r0["llama_cpp"]
    lines = [
        "# Speed: prefill and decode, hybrid vs llama.cpp (same machine, same run)", "",
        f"- machine: {r0['machine']}",
        f"- command: `{r0['command']}`",
        f"- git: {r0['git_sha']}, {r0['time_utc']}; load average at the end {r0['loadavg']:.2f}",
        f"- model: {r0['model']}; threads {r0['threads']} (torch {r0['torch_threads']}); "
        f"{r0['new_tokens']} new tokens per prompt; {r0['repeats']} prefill repeats",
        f"- llama-cpp-python {lc['llama_cpp_python']} (libllama {lc['libllama']}), flash attention off",
        "", "Prefill tok/s by context length:", "",
        "| candidate | engine | " + " | ".join(ladder) + " |",
        "|---|---|" + "---|" * len(ladder),
        *[f"| {r['candidate']} | {r['engine']} | " + " | ".join(f"{r['prefill_tok_s'][L]:.0f}" for L in ladder)
          + " |" for r in records],
        "", "Median decode tok/s by prompt class:", "",
        "| candidate | engine | " + " | ".join(classes) + " |",
        "|---|---|" + "---|" * len(classes),
        *[f"| {r['candidate']} | {r['engine']} | " + " | ".join(f"{r['decode_tok_s'][c]:.1f}" for c in classes)
          + " |" for r in records],
        "", _ratio_line(records), "",
        *[f"- {r['candidate']} placement: {r['placement']}; CPU expert runner {r.get('cpu_runner')}"
          for r in records if r.get("placement")],
        "", NOTES,
    ]
    return "\n".join(lines)
