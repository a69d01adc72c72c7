"""Importance matrix for llama.cpp's quantizer, computed with hybrid's own forward.

llama.cpp's `llama-imatrix` records, for every weight matrix, the mean of x_j² over the tokens
that reach it, per input column j (per expert for the stacked expert tensors: layout [E, K]).
The quantizer weighs rounding errors by it. llama-cpp-python ships no imatrix tool, so we compute
the same statistic with hybrid's reference forward on calibration text (the model's training
or validation split when the model folder says where that is) and pass it through `llama_model_quantize`.
Experts no calibration token reached get uniform importance (ones).
Legend: T tokens, H hidden, I expert intermediate, E experts, K in-features.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hybrid.model.moe import expert_sum

ATTN = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}


class _Stats:
    """Σx² and token counts per (tensor, expert)."""

    def __init__(self):
        self.sum2: dict[str, np.ndarray] = {}
        self.count: dict[str, np.ndarray] = {}

    def add(self, name: str, x: torch.Tensor, n_expert: int = 1, e: int = 0) -> None:
        """x [T, K] inputs of `name` (expert e of n_expert)."""
        k = x.shape[-1]
        if name not in self.sum2:
            self.sum2[name] = np.zeros((n_expert, k), dtype=np.float64)
            self.count[name] = np.zeros(n_expert, dtype=np.int64)
        self.sum2[name][e] += (x.double() ** 2).sum(0).cpu().numpy()
        self.count[name][e] += x.shape[0]

    def result(self) -> dict[str, np.ndarray]:
        out = {}
        for name, s in self.sum2.items():
            c = self.count[name][:, None]
            mean = np.where(c > 0, s / np.maximum(c, 1), 1.0)              # unseen expert -> ones
            out[name] = mean.astype(np.float32).reshape(-1)                # [E*K]
        return out


class _RecordingLinear:
    def __init__(self, inner, name: str, stats: _Stats):
        self.inner, self.name, self.stats = inner, name, stats

    def __call__(self, x):
        self.stats.add(self.name, x)
        return self.inner(x)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


class _RecordingExperts:
    """Expert executor that runs every routed expert and records its gate/up and down inputs."""

    def __init__(self, get_expert, n_expert: int, stats: _Stats):
        self.get_expert, self.n_expert, self.stats = get_expert, n_expert, stats

    def __call__(self, layer, x, ids, weights):
        T, k = ids.shape
        tokens = torch.arange(T, device=ids.device).repeat_interleave(k)  # [T*k], row-major as ids

        def expert(e: int):
            sw = self.get_expert(layer, e)

            def run(xe):                                                   # [t_e, H]
                h = F.silu(sw.gate(xe)) * sw.up(xe)                        # [t_e, I]
                for proj in ("gate", "up"):
                    self.stats.add(f"blk.{layer}.ffn_{proj}_exps.weight", xe, self.n_expert, e)
                self.stats.add(f"blk.{layer}.ffn_down_exps.weight", h, self.n_expert, e)
                return sw.down(h)
            return run

        return expert_sum(x, ids.reshape(-1), tokens, weights.reshape(-1), expert).to(x.dtype)


def compute_imatrix(model_dir: str | Path, token_chunks: list[list[int]]) -> dict[str, np.ndarray]:
    """{GGUF tensor name: float32 [E*K] mean squared input} over the given token chunks."""
    from hybrid.model import load_model

    model = load_model(model_dir, device="cpu")
    stats = _Stats()
    for L, layer in enumerate(model.layers):
        for attr, gg in ATTN.items():
            setattr(layer.attn, attr, _RecordingLinear(getattr(layer.attn, attr), f"blk.{L}.{gg}.weight", stats))
    model.experts = _RecordingExperts(model.weights.expert, model.cfg.num_experts, stats)
    for chunk in token_chunks:
        model.forward_logits(torch.as_tensor(chunk, dtype=torch.long))
    return stats.result()


def calibration_chunks(model_dir: str | Path, tokenizer, n_ctx: int, max_chunks: int) -> list[list[int]]:
    """Token chunks of calibration text: the model's validation split, else its training split
    (sha256-checked local files named by its corpus manifest), else the prompt set. Never the
    test split, which the quality bench scores on."""
    from hybrid.bench.prompts import MANIFEST, class_texts, manifest_text

    manifest = Path(model_dir) / MANIFEST
    text = ""
    for split in ("val", "train"):
        if not text and manifest.is_file():
            text = manifest_text(manifest, split, n_ctx * max_chunks * 8)[0]
    if not text:
        text = "\n".join(class_texts().values())
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return [ids[i:i + n_ctx] for i in range(0, len(ids) - n_ctx + 1, n_ctx)][:max_chunks]


def module_importance(imatrix: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    """The GGUF-named statistic as {Hugging Face Linear module name: float32 [K]} for hybrid-quantize's NVFP4
    scale search (--imatrix): attention q/k/v/o and each expert's gate/up/down; tensors it lacks are left out."""
    from hybrid.checkpoint.names import Names

    names, out = Names(cfg.model_type), {}
    for L in range(cfg.num_hidden_layers):
        for attr, gg in ATTN.items():
            v = imatrix.get(f"blk.{L}.{gg}.weight")
            if v is not None:
                out[names.attn(L, f"{attr}_proj")] = np.asarray(v, dtype=np.float32).reshape(-1)
        for proj in ("gate", "up", "down"):
            v = imatrix.get(f"blk.{L}.ffn_{proj}_exps.weight")
            if v is not None:
                rows = np.asarray(v, dtype=np.float32).reshape(cfg.num_experts, -1)
                out.update({names.expert(L, e, proj): rows[e] for e in range(cfg.num_experts)})
    return out


def save(path: Path, imatrix: dict[str, np.ndarray]) -> None:
    np.savez(path, **{k.replace(".", "__"): v for k, v in imatrix.items()})


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k.replace("__", "."): z[k] for k in z.files}
