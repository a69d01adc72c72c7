"""HybridModel: the MoEModel as generate() sees it, with step boundaries for the expert executor
and the --kv-resident limit. Everything else is the wrapped model's.

Steps run ahead (hybrid.generate's overlapped decode): enqueue() launches a decode step that needs no
host work between its launches (can_run_ahead: graphed, every layer's experts resident) and returns at
once; its routing goes to pinned host memory behind it (HybridExperts.stage_step). finish() later waits
for that copy and does the step's bookkeeping as forward() would have at its end (cache lookups,
counters, trace, stats, --stats-every); discard() drops a step that will not be used (its KV row is
not committed, nothing of it is counted).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from hybrid.errors import HybridError


@dataclass
class AheadStep:
    """A decode step enqueued by HybridModel.enqueue. record: HybridExperts' staged step (None: it
    ran synchronously, already committed)."""

    start: int
    logits: torch.Tensor                 # [1, V] fp32 on the device, being computed
    record: dict | None = None
    phase: str = "decode"


class HybridModel:
    def __init__(self, model, experts, kv_resident: int | None = None, kv_dtype: str = "fp16",
                 graphs=None, prefill_graphs=None):
        self.model, self.experts = model, experts
        self.kv_resident, self.kv_dtype = kv_resident, kv_dtype
        self.prompt_tokens: int | None = None   # set before generate(): positions below are prefill
        devs = model.layer_devices
        self._hops = sum(1 for a, b in zip(devs, devs[1:]) if a != b)
        self.graphs = graphs                    # hybrid.runtime.graphs.DecodeGraphs (CUDA) or None
        self.prefill_graphs = prefill_graphs    # hybrid.runtime.prefill_graphs.PrefillGraphs (CUDA) or None
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
        phase = self._phase(t, start)
        self.experts.begin_step(t, phase)
        try:
            logits = self._forward(ids, start, last_only, phase)
        except BaseException:
            self.experts.abort_step()
            raise
        self._commit(t, phase)
        return logits

    def prefill_step(self, n: int, chunk: int) -> int:
        """The prefill step size for an n-token prompt given the session's chunk: a prompt that would run
        as one eager step just past the largest prefill graph runs in graph-sized steps instead
        (PrefillGraphs.split_step), else chunk."""
        pg = self.prefill_graphs
        step = pg.split_step(n) if pg is not None and chunk >= n else None
        return step or chunk

    def _phase(self, t: int, start: int) -> str:
        prefill = t > 1 if self.prompt_tokens is None else start < self.prompt_tokens
        return "prefill" if prefill else "decode"

    def _commit(self, t: int, phase: str) -> None:
        """The step's end: hop bytes, the experts' bookkeeping (end_step), the live stats."""
        if self._hops and self.model.layer_devices[0].type == "cuda":
            self.experts.add_pcie("hops", self._hops * t * self.model.cfg.hidden_size * 2)
        self.experts.end_step()
        if self.monitor is not None:
            self.monitor.after_step(phase)

    # ---- steps run ahead (module doc) ----------------------------------------------------------
    def can_run_ahead(self, start: int) -> bool:
        """Whether the one-token step at `start` can be enqueued with no host work until finish()."""
        g = self.graphs
        return g is not None and self._phase(1, start) == "decode" and g.runs_ahead(start)

    def enqueue(self, ids: torch.Tensor, start: int) -> AheadStep:
        """ids [1] (on the device: the sampled id) at position start; returns once launched."""
        self.experts.begin_step(1, "decode", ahead=True)
        try:
            logits = self.graphs.step(ids, start)
        except Exception:
            self.experts.abort_step()
            if self.graphs.error is None:
                raise
            print(f"hybrid: CUDA graphs off ({self.graphs.error}); running eagerly", file=sys.stderr)
            return AheadStep(start, self.forward(ids, start, last_only=True))   # eager from now on
        return AheadStep(start, logits, self.experts.stage_step())

    def finish(self, step: AheadStep) -> None:
        """Wait for the step's routing on the host, then its bookkeeping (forward()'s end)."""
        if step.record is None:
            return
        rec, step.record = step.record, None
        self.experts.resume_step(rec)
        self.experts.stats.graph_steps += 1
        self._commit(1, step.phase)

    def discard(self, step: AheadStep) -> None:
        """Drop a step enqueued ahead that will not be used: nothing counted, its KV row uncommitted."""
        if step.record is not None:
            self.experts.drop_step(step.record)
            step.record = None
        if self.model.cache is not None:
            self.model.cache.length = min(self.model.cache.length, step.start)

    def _forward(self, ids: torch.Tensor, start: int, last_only: bool, phase: str) -> torch.Tensor:
        pg = self.prefill_graphs
        if pg is not None and last_only and pg.usable(int(ids.shape[0]), start):
            return self._prefill_graphed(pg, ids, start, phase)
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

    def _prefill_graphed(self, pg, ids: torch.Tensor, start: int, phase: str) -> torch.Tensor:
        """A prompt from position 0 through hybrid.runtime.prefill_graphs (its last token's logits)."""
        try:
            return pg.step(ids, start)
        except Exception:
            if pg.error is None:
                raise
            print(f"hybrid: prefill graphs off ({pg.error}); prefill runs eagerly", file=sys.stderr)
            self.experts.abort_step()
            self.experts.begin_step(int(ids.shape[0]), phase)
            return self.model.forward(ids, start, True)

    def forward_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits with a fresh cache: ids [T] -> [T, V] fp32."""
        self.new_cache(ids.shape[0])
        return self.forward(ids, 0)
