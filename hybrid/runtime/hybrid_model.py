"""HybridModel: the MoEModel as generate() sees it, with step boundaries for the expert executor
and the --kv-resident limit. Everything else is the wrapped model's."""
from __future__ import annotations

import sys

import torch

from hybrid.errors import HybridError


class HybridModel:
    def __init__(self, model, experts, kv_resident: int | None = None, kv_dtype: str = "fp16",
                 graphs=None):
        self.model, self.experts = model, experts
        self.kv_resident, self.kv_dtype = kv_resident, kv_dtype
        self.prompt_tokens: int | None = None   # set before generate(): positions below are prefill
        devs = model.layer_devices
        self._hops = sum(1 for a, b in zip(devs, devs[1:]) if a != b)
        self.graphs = graphs                    # hybrid.runtime.graphs.DecodeGraphs (CUDA) or None
        self.monitor = None                     # hybrid.runtime.monitor.LiveStats (--stats-every) or None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def new_cache(self, max_tokens: int):
        if self.kv_resident is not None and max_tokens > self.kv_resident:
            raise HybridError(f"--kv-resident {self.kv_resident}: this request needs {max_tokens} tokens "
                              f"of KV (prompt + --max-tokens); raise --kv-resident or shorten it")
        if self.kv_dtype != "int8":
            return self.model.new_cache(max_tokens)
        from hybrid.runtime.kv_int8 import Int8KVCache

        m, cfg = self.model, self.model.cfg
        cache = Int8KVCache(cfg.num_hidden_layers, max_tokens, cfg.num_key_value_heads, cfg.head_dim,
                            m.dtype, m.layer_devices)
        m.cache = cache
        return cache

    def forward(self, ids: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
        """One step: ids [T] at positions start.. -> logits [T or 1, V] fp32."""
        t = int(ids.shape[0])
        prefill = t > 1 if self.prompt_tokens is None else start < self.prompt_tokens
        phase = "prefill" if prefill else "decode"
        self.experts.begin_step(t, phase)
        try:
            logits = self._forward(ids, start, last_only, phase)
        except BaseException:
            self.experts.abort_step()
            raise
        if self._hops and self.model.layer_devices[0].type == "cuda":
            n = self._hops * int(ids.shape[0]) * self.model.cfg.hidden_size * 2
            self.experts.add_pcie("hops", n)
        self.experts.end_step()
        if self.monitor is not None:
            self.monitor.after_step(phase)
        return logits

    def _forward(self, ids: torch.Tensor, start: int, last_only: bool, phase: str) -> torch.Tensor:
        g = self.graphs
        if g is None or not g.usable(ids, start):
            return self.model.forward(ids, start, last_only)
        try:
            logits = g.step(ids, start)
        except Exception as exc:  # noqa: BLE001 - a graph that cannot be captured: eager from now on
            if g.error is None:
                raise
            print(f"hybrid: CUDA graphs off ({g.error}); running eagerly", file=sys.stderr)
            self.experts.abort_step()
            self.experts.begin_step(int(ids.shape[0]), phase)
            del exc
            return self.model.forward(ids, start, last_only)
        self.experts.stats.graph_steps += 1
        return logits

    def forward_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits with a fresh cache: ids [T] -> [T, V] fp32."""
        self.new_cache(ids.shape[0])
        return self.forward(ids, 0)
