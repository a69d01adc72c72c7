"""Bytes of a model, by where they will live, from safetensors headers (no weight is read).

Legend: L layers, E experts per layer. Only each safetensors file's JSON header is read
(hybrid.checkpoint.files.read_header).
With no safetensors in the folder, `from_config` estimates the same table from config.json and an
assumed quantization (what `hybrid-quantize --recipe` would write).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from hybrid.checkpoint.files import read_header, shard_files
from hybrid.checkpoint.names import Names
from hybrid.errors import CheckpointError
from hybrid.model.config import ModelConfig

ASSUMED_QUANTS = ("nvfp4", "fp8", "bf16")


@dataclass(frozen=True)
class ModelBytes:
    """Stored bytes (packed weights + scales) per placement unit.

    layer_dense[l]: attention, norms, router (+ shared expert) of layer l.
    experts[l][e]:  gate + up + down of expert e in layer l, scales included.
    lm_head is 0 when the head is tied to the embedding (tied = True).
    """

    config: ModelConfig
    embed: int
    lm_head: int
    final_norm: int
    layer_dense: tuple[int, ...]
    experts: tuple[tuple[int, ...], ...]
    other: int = 0
    source: str = "safetensors"
    tied: bool = False

    def __post_init__(self) -> None:
        L, E = self.config.num_hidden_layers, self.config.num_experts
        if len(self.layer_dense) != L or len(self.experts) != L or any(len(r) != E for r in self.experts):
            raise ValueError(f"ModelBytes: expected {L} layers x {E} experts")

    @property
    def slot_bytes(self) -> int:
        """Bytes of one GPU cache slot: the largest expert (slots are uniform)."""
        return max(max(r) for r in self.experts)

    @property
    def expert_store(self) -> int:
        return sum(sum(r) for r in self.experts)

    def expert_mean(self, layer: int) -> float:
        row = self.experts[layer]
        return sum(row) / len(row)

    @property
    def head_bytes(self) -> int:
        """Bytes the output head reads per token (the embedding when tied)."""
        return self.embed if self.tied else self.lm_head

    @property
    def head_unquantized(self) -> bool:
        """Whether the head is stored at 16 bits or more (ModelOpt's BF16 lm_head, a tied embedding): the
        runtime runs it as a dense matmul (torch / cuBLAS), not a QPN kernel."""
        return self.head_bytes >= self.config.vocab_size * self.config.hidden_size * 2

    def with_head(self, quant: str) -> "ModelBytes":
        """These bytes with a 16/32-bit head quantized at load (`--lm-head fp8 / nvfp4`: hybrid.model.head; a tied
        head becomes a quantized copy beside the embedding); "keep", or a head stored quantized: unchanged."""
        if quant == "keep" or not self.head_unquantized:
            return self
        cfg = self.config
        return replace(self, lm_head=linear_bytes(cfg.vocab_size, cfg.hidden_size, quant), tied=False)

    @property
    def total(self) -> int:
        return self.embed + self.lm_head + self.final_norm + sum(self.layer_dense) + self.expert_store

    @classmethod
    def from_folder(cls, folder: str | Path, assume: str | None = None) -> "ModelBytes":
        """From the folder's safetensors headers; with none, estimate with `assume` (else error)."""
        folder = Path(folder)
        cfg = ModelConfig.from_folder(folder)
        files = shard_files(folder)
        if files:
            return cls.from_headers(cfg, {n: t for f in files for n, t in read_header(f).items()})
        if assume is None:
            raise CheckpointError(f"{folder}: no *.safetensors files (give an assumed quantization "
                                  f"to plan from config.json alone)")
        return cls.from_config(cfg, assume)

    @classmethod
    def from_headers(cls, cfg: ModelConfig, tensors: dict[str, int]) -> "ModelBytes":
        """tensors: tensor name -> stored bytes."""
        acc = _Accumulator(cfg)
        for name, nbytes in tensors.items():
            acc.add(name, nbytes)
        return acc.result()

    @classmethod
    def from_config(cls, cfg: ModelConfig, quant: str = "nvfp4") -> "ModelBytes":
        """Estimate: attention, experts (and shared expert) in `quant`; router, norms, embeddings
        and lm_head in BF16 (ModelOpt's default exclusions)."""
        if quant not in ASSUMED_QUANTS:
            raise CheckpointError(f"--assume-quant {quant}: expected one of {', '.join(ASSUMED_QUANTS)}")
        h, v, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
        lin = lambda n, k: linear_bytes(n, k, quant)  # noqa: E731
        attn = lin(cfg.q_dim, h) + 2 * lin(cfg.kv_dim, h) + lin(h, cfg.q_dim)
        if cfg.attention_bias:
            attn += (cfg.q_dim + 2 * cfg.kv_dim) * 2
        dense = attn + 2 * h * 2 + (2 * hd * 2 if cfg.qk_norm else 0) + cfg.num_experts * h * 2
        si = cfg.shared_expert_intermediate_size
        if si:
            dense += 2 * lin(si, h) + lin(h, si) + h * 2
        i = cfg.moe_intermediate_size
        expert = 2 * lin(i, h) + lin(h, i)
        L, E = cfg.num_hidden_layers, cfg.num_experts
        tied = cfg.tie_word_embeddings
        return cls(cfg, embed=v * h * 2, lm_head=0 if tied else v * h * 2, final_norm=h * 2,
                   layer_dense=(dense,) * L, experts=((expert,) * E,) * L,
                   source=f"config.json (assumed {quant})", tied=tied)


def linear_bytes(n: int, k: int, quant: str) -> int:
    """Stored bytes of a Linear [n, k]: nvfp4 = packed + e4m3 block scales + weight_scale_2 +
    input_scale; fp8 = e4m3 + weight_scale + input_scale; bf16 = 2 bytes an element."""
    if quant == "nvfp4":
        return n * k // 2 + n * k // 16 + 4 + 4
    if quant == "fp8":
        return n * k + 4 + 4
    return n * k * 2


class _Accumulator:
    """Sorts tensor names into embed / lm_head / final norm / per-layer dense / per-expert bytes."""

    def __init__(self, cfg: ModelConfig):
        self.cfg, self.names = cfg, Names(cfg.model_type)
        L, E = cfg.num_hidden_layers, cfg.num_experts
        self.dense, self.experts = [0] * L, [[0] * E for _ in range(L)]
        self.embed = self.lm_head = self.final_norm = self.other = 0
        t = self.names.t
        self.expert_re = re.compile("^" + re.escape(t["expert"]).replace(r"\{L\}", r"(\d+)")
                                    .replace(r"\{E\}", r"(\d+)").replace(r"\{p\}", r"(\w+)") + "$")
        self.layer_re = re.compile("^" + re.escape(t["attn"].split("{L}")[0]) + r"(\d+)\.")

    def add(self, name: str, nbytes: int) -> None:
        module = name.rsplit(".", 1)[0]
        m = self.expert_re.match(module)
        if m:
            layer, e = self._layer(int(m.group(1)), name), int(m.group(2))
            if e >= self.cfg.num_experts:
                raise CheckpointError(f"tensor {name}: expert {e} >= num_experts {self.cfg.num_experts}")
            self.experts[layer][e] += nbytes
            return
        m = self.layer_re.match(name)
        if m:
            if ".experts." in name or name.endswith(".experts"):
                raise CheckpointError(f"tensor {name}: unrecognised expert layout (expected "
                                      f"{self.names.t['expert']}.*)")
            self.dense[self._layer(int(m.group(1)), name)] += nbytes
        elif module == self.names.embed():
            self.embed += nbytes
        elif module == self.names.lm_head():
            self.lm_head += nbytes
        elif module == self.names.final_norm():
            self.final_norm += nbytes
        else:
            self.other += nbytes   # e.g. mtp.* heads: not placed by the runtime

    def _layer(self, layer: int, name: str) -> int:
        if layer >= self.cfg.num_hidden_layers:
            raise CheckpointError(f"tensor {name}: layer {layer} >= num_hidden_layers "
                                  f"{self.cfg.num_hidden_layers}")
        return layer

    def result(self) -> ModelBytes:
        for layer, row in enumerate(self.experts):
            if 0 in row:
                raise CheckpointError(f"layer {layer} expert {row.index(0)}: no tensors in the checkpoint")
            if not self.dense[layer]:
                raise CheckpointError(f"layer {layer}: no attention/norm/router tensors in the checkpoint")
        if not self.embed:
            raise CheckpointError(f"no {self.names.embed()} tensor in the checkpoint")
        tied = self.lm_head == 0
        if tied and not self.cfg.tie_word_embeddings:
            raise CheckpointError(f"no {self.names.lm_head()} tensor and config.json does not tie embeddings")
        return ModelBytes(self.cfg, self.embed, self.lm_head, self.final_norm, tuple(self.dense),
                          tuple(tuple(r) for r in self.experts), self.other, "safetensors headers", tied)
