"""Write a qwen3moe GGUF from a Hugging Face model folder (BF16/F16/F32, or hybrid's NVFP4/mixed).

Tensor names follow llama.cpp's QWEN3MOE table; experts are stacked [E, N, K] per layer.
Dense source weights are written in `outtype`; norms and the router stay F32 (as llama.cpp's own
converter does). NVFP4 linears are re-packed bit-exactly into GGML NVFP4 plus a `.scale` tensor,
so llama.cpp runs the very weights hybrid runs. FP8 linears (mixed recipe) have no GGML type;
they are written dequantized in F32 (fp8 value * per-tensor scale). An MTP module (`mtp.*`) is
not exported: llama.cpp's qwen3moe has no such head.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hybrid.baselines import nvfp4_gguf
from hybrid.baselines.gguf_vocab import read_vocab, write_vocab
from hybrid.baselines.source import DENSE, FP8, NVFP4, SourceModel
from hybrid.checkpoint.names import Names
from hybrid.errors import CheckpointError, HybridError
from hybrid.model.config import ModelConfig

OUTTYPES = ("f32", "f16", "bf16")
# llama_ftype values written to general.file_type
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32, "nvfp4": 39}
ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
EXPS = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}


@dataclass
class ExportReport:
    path: Path
    n_tensors: int = 0
    kinds: dict[str, int] = field(default_factory=dict)   # source linear kind -> count

    def count(self, kind: str) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


def _dense_array(t: torch.Tensor, outtype: str) -> tuple[np.ndarray, object]:
    """(array, raw_dtype) for gguf.GGUFWriter.add_tensor. bf16 travels as raw bytes."""
    import gguf

    if outtype == "f32":
        return t.float().contiguous().numpy(), None
    if outtype == "f16":
        return t.half().contiguous().numpy(), None
    raw = t.bfloat16().contiguous().view(torch.uint8).numpy()        # [..., K*2] bytes
    return raw, gguf.GGMLQuantizationType.BF16


class _Exporter:
    def __init__(self, src: SourceModel, cfg: ModelConfig, writer, outtype: str, report: ExportReport):
        self.src, self.cfg, self.w, self.outtype, self.report = src, cfg, writer, outtype, report
        self.names = Names(cfg.model_type)

    def add(self, name: str, arr: np.ndarray, raw_dtype=None) -> None:
        self.w.add_tensor(name, arr, raw_dtype=raw_dtype)
        self.report.n_tensors += 1

    def f32(self, name: str, hf_name: str) -> None:
        self.add(name, self.src.tensor(hf_name).float().contiguous().numpy())

    def dense(self, name: str, t: torch.Tensor) -> None:
        arr, raw = _dense_array(t, self.outtype)
        self.add(name, arr, raw)

    def linear(self, gguf_base: str, hf_base: str) -> None:
        """One [N, K] linear: NVFP4 re-pack + .scale, FP8 -> F32, dense -> outtype."""
        lin = self.src.linear(hf_base)
        self.report.count(lin.kind)
        if lin.kind == NVFP4:
            import gguf
            self.add(f"{gguf_base}.weight", nvfp4_gguf.repack_rows(lin.weight, lin.scale, hf_base),
                     gguf.GGMLQuantizationType.NVFP4)
            self.add(f"{gguf_base}.scale", np.array([lin.scale_2], dtype=np.float32))
        elif lin.kind == FP8:
            self.add(f"{gguf_base}.weight", lin.dequantize().numpy())
        else:
            self.dense(f"{gguf_base}.weight", lin.weight)

    def experts(self, L: int, proj: str) -> None:
        """Stack E experts of one projection into [E, N, K] (NVFP4: [E, N, K/64*36] + .scale [E])."""
        lins = [self.src.linear(self.names.expert(L, e, proj)) for e in range(self.cfg.num_experts)]
        kinds = {lin.kind for lin in lins}
        if len(kinds) != 1:
            raise CheckpointError(f"layer {L} {proj}: experts mix storage kinds {sorted(kinds)}; "
                                  "a stacked GGUF tensor needs one")
        kind = kinds.pop()
        base = f"blk.{L}.{EXPS[proj]}"
        for _ in lins:
            self.report.count(kind)
        if kind == NVFP4:
            import gguf
            blocks = [nvfp4_gguf.repack_rows(x.weight, x.scale, base) for x in lins]
            self.add(f"{base}.weight", np.stack(blocks), gguf.GGMLQuantizationType.NVFP4)
            self.add(f"{base}.scale", np.array([x.scale_2 for x in lins], dtype=np.float32))
        elif kind == FP8:
            self.add(f"{base}.weight", np.stack([x.dequantize().numpy() for x in lins]))
        else:
            self.dense(f"{base}.weight", torch.stack([x.weight for x in lins]))

    def layer(self, L: int) -> None:
        n, blk = self.names, f"blk.{L}"
        self.f32(f"{blk}.attn_norm.weight", f"{n.layer('input_norm', L)}.weight")
        self.f32(f"{blk}.ffn_norm.weight", f"{n.layer('post_norm', L)}.weight")
        self.f32(f"{blk}.attn_q_norm.weight", f"{n.layer('q_norm', L)}.weight")
        self.f32(f"{blk}.attn_k_norm.weight", f"{n.layer('k_norm', L)}.weight")
        for hf, gg in ATTN.items():
            self.linear(f"{blk}.{gg}", n.attn(L, hf))
        router = self.src.linear(n.layer("router", L))
        if router.kind != DENSE:
            raise CheckpointError(f"{n.layer('router', L)}: router is {router.kind}; routers are never quantized")
        self.add(f"{blk}.ffn_gate_inp.weight", router.weight.float().contiguous().numpy())
        for proj in ("gate", "up", "down"):
            self.experts(L, proj)

    def tensors(self) -> None:
        n = self.names
        self.dense("token_embd.weight", self.src.tensor(f"{n.embed()}.weight"))
        self.f32("output_norm.weight", f"{n.final_norm()}.weight")
        if self.src.has(f"{n.lm_head()}.weight"):       # tied models may still store a quantized head
            self.linear("output", n.lm_head())
        for L in range(self.cfg.num_hidden_layers):
            self.layer(L)


def write_metadata(writer, cfg: ModelConfig, name: str, file_type: int) -> None:
    """general.* and qwen3moe.* hyperparameters (rope base written explicitly)."""
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(int(cfg.raw.get("intermediate_size") or cfg.moe_intermediate_size))
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))


def _check_supported(cfg: ModelConfig, folder: Path) -> None:
    if cfg.model_type != "qwen3_moe":
        raise HybridError(f"{folder}/config.json: model_type {cfg.model_type!r}; GGUF export supports qwen3_moe")
    if not cfg.norm_topk_prob:
        raise HybridError(f"{folder}/config.json: norm_topk_prob=false; llama.cpp's qwen3moe always renormalizes")
    if cfg.attention_bias:
        raise HybridError(f"{folder}/config.json: attention_bias=true is not part of qwen3moe in llama.cpp")
    if cfg.raw.get("rope_scaling"):
        raise HybridError(f"{folder}/config.json: rope_scaling is not exported; remove it or extend the exporter")


def export_gguf(model_dir: str | Path, out: str | Path, outtype: str = "bf16") -> ExportReport:
    """Write `out` (a qwen3moe GGUF) from the HF folder `model_dir`. Returns what was written."""
    import gguf

    if outtype not in OUTTYPES:
        raise HybridError(f"--outtype {outtype!r}; expected one of {', '.join(OUTTYPES)}")
    folder, out = Path(model_dir), Path(out)
    cfg = ModelConfig.from_folder(folder)
    _check_supported(cfg, folder)
    src = SourceModel(folder)
    vocab = read_vocab(folder, cfg.vocab_size)
    report = ExportReport(out)
    writer = gguf.GGUFWriter(str(out), "qwen3moe")
    _Exporter(src, cfg, writer, outtype, report).tensors()
    file_type = FILE_TYPES["nvfp4"] if report.kinds.get(NVFP4) else FILE_TYPES[outtype]
    write_metadata(writer, cfg, folder.name, file_type)
    write_vocab(writer, vocab)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return report


__all__ = ["export_gguf", "ExportReport", "OUTTYPES"]
