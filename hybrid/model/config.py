"""ModelConfig: the architecture fields hybrid needs, read from a Hugging Face config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hybrid.errors import CheckpointError

SUPPORTED_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")


@dataclass(slots=True)
class ModelConfig:
    """Legend: H hidden, I expert intermediate, E experts, L layers."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = True
    shared_expert_intermediate_size: int = 0   # qwen2_moe
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    raw: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_ARCHS:
            raise CheckpointError(f"config.json: unknown architecture model_type={self.model_type!r}; "
                                  f"expected one of {', '.join(SUPPORTED_ARCHS)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("config.json: num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise CheckpointError(f"config.json: num_experts_per_tok={self.num_experts_per_tok} "
                                  f"must be in 1..num_experts={self.num_experts}")

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "ModelConfig":
        mt = d.get("model_type")
        if mt not in SUPPORTED_ARCHS:
            raise CheckpointError(f"{where}: unknown architecture model_type={mt!r}; "
                                  f"expected one of {', '.join(SUPPORTED_ARCHS)}")
        try:
            h = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            if mt == "mixtral":
                inter, n_exp, topk = d["intermediate_size"], d["num_local_experts"], d["num_experts_per_tok"]
                norm_topk = True
            else:
                inter, n_exp, topk = d["moe_intermediate_size"], d["num_experts"], d["num_experts_per_tok"]
                norm_topk = bool(d.get("norm_topk_prob", mt == "qwen3_moe"))
            eos = d.get("eos_token_id")
            eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            return cls(
                model_type=mt, vocab_size=int(d["vocab_size"]), hidden_size=h,
                num_hidden_layers=int(d["num_hidden_layers"]), num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                head_dim=int(d.get("head_dim") or h // heads), moe_intermediate_size=int(inter),
                num_experts=int(n_exp), num_experts_per_tok=int(topk), norm_topk_prob=norm_topk,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", 1e6 if mt == "qwen3_moe" else 1e4)),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", mt == "qwen2_moe")),
                qk_norm=(mt == "qwen3_moe"),
                shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 0) or 0),
                bos_token_id=d.get("bos_token_id"), eos_token_id=eos, raw=d,
            )
        except KeyError as exc:
            raise CheckpointError(f"{where}: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: bad field value ({exc})") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: missing config.json (not a Hugging Face model folder)")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_dict(d, str(path))
