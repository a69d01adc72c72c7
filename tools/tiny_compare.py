"""Old-vs-new comparison of tiny-model folders on the same held-out texts: per token under each
model's own tokenizer, and tokenizer-independent in bits per UTF-8 byte.

Legend: B windows per batch, S window length, V vocabulary.
"""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import tiny_corpus
import tiny_eval
import tiny_model


def config_from_folder(folder: Path) -> tiny_model.TinyConfig:
    """TinyConfig from a saved folder's config.json (the inverse of TinyConfig.hf_config)."""
    c = json.loads((Path(folder) / "config.json").read_text())
    return tiny_model.TinyConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
        num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
        num_experts=c["num_experts"], top_k=c["num_experts_per_tok"],
        moe_intermediate_size=c["moe_intermediate_size"], mtp_intermediate_size=c["intermediate_size"],
        rope_theta=c["rope_theta"], rms_norm_eps=c["rms_norm_eps"],
        max_position_embeddings=c["max_position_embeddings"])


def load_folder(folder: Path, device) -> tuple[tiny_model.TinyMoE, object]:
    """(fp32 model in eval mode, tokenizers.Tokenizer) from a saved folder."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    folder = Path(folder)
    tensors = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        tensors.update(load_file(str(f)))
    m = tiny_model.TinyMoE(config_from_folder(folder))
    tiny_model.load_hf_state_dict(m, {k: v.float() for k, v in tensors.items()})
    return m.to(device).eval(), Tokenizer.from_file(str(folder / "tokenizer.json"))


@torch.no_grad()
def score_texts(model, tok, texts: list[str], seq: int, batch: int = 16) -> dict:
    """NLL of the stream [EOT, text0, EOT, text1, ...] (every token after the first is a target).
    Bytes are those the target tokens stand for, so bpb compares across tokenizers."""
    dev = next(model.parameters()).device
    enc = [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch_fast(texts)]
    stream = torch.from_numpy(tiny_corpus.join_stream(tok, enc)).long()
    nbytes = torch.from_numpy(tiny_corpus.token_bytes(tok))
    ws = tiny_eval.windows(stream, seq)
    full = [w for w in ws if w.numel() == seq + 1]
    groups = [torch.stack(full[i:i + batch]) for i in range(0, len(full), batch)]
    groups += [w[None] for w in ws if w.numel() != seq + 1]
    nll = 0.0
    for g in groups:
        g = g.to(dev)                                                   # [B, S+1]
        logits = model(g[:, :-1], mtp=False)["logits"].float()          # [B, S, V]
        nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), g[:, 1:].reshape(-1),
                                     reduction="sum"))
    tokens = stream.numel() - 1
    b = int(nbytes[stream[1:]].sum())
    return {"tokens": tokens, "bytes": b, "nll": nll / max(tokens, 1),
            "ppl": math.exp(nll / max(tokens, 1)), "bpb": nll / (math.log(2) * max(b, 1))}


def old_test_split(folder: Path) -> set[tuple[str, str, str]]:
    """(root, rel, sha256) of the test-split files in a folder's corpus manifest."""
    m = json.loads(gzip.decompress((Path(folder) / "corpus_manifest.json.gz").read_bytes()))
    return {(r[0], r[1], r[2]) for r in m["files"] if r[4] == "test"}


def compare(old_folder: Path, new_model, new_tok, sets: dict[str, list[str]], seq: int,
            prompt: str, gen_tokens: int) -> dict:
    """Both models scored on every text set, plus the old model's greedy sample of `prompt`."""
    dev = next(new_model.parameters()).device
    old, old_tok = load_folder(old_folder, dev)
    out = {"sets": {}}
    for name, texts in sets.items():
        if not texts:
            continue
        out["sets"][name] = {"files": len(texts), "old": score_texts(old, old_tok, texts, seq),
                             "new": score_texts(new_model, new_tok, texts, seq)}
    eot = old_tok.token_to_id(tiny_corpus.EOT)
    ids = tiny_eval.greedy(old, [eot] + old_tok.encode(prompt).ids, gen_tokens, eos=eot)
    out["old_sample"] = prompt + old_tok.decode(ids)
    return out
