"""Architectures (Qwen3-MoE, Qwen2-MoE, Mixtral) as a reference forward over stored weights."""
from hybrid.model.config import ModelConfig
from hybrid.model.registry import resolve_model_path

__all__ = ["ModelConfig", "load_model", "resolve_model_path"]


def __getattr__(name):  # lazy: hybrid.checkpoint imports hybrid.model.config
    if name == "load_model":
        from hybrid.model.loader import load_model

        return load_model
    raise AttributeError(name)
