"""CUDA graphs of the one-token decode step: the host launches a few graphs instead of ~40 kernels
per layer.

Legend: H hidden, k experts per token, n layers in a segment, L keys attended (a bucket).
The layers are cut into segments, each one graph on one device:
    layers whose every expert is resident (HybridExperts.device_only): dense part + grouped expert
        kernel, no host work at all; their routed ids go to a route buffer [n, 1, 2k] that is settled
        (cache counters, trace) at the step's end, as the eager path's deferred lookups are;
    a layer that can miss ends its segment after its router: its MoE runs eagerly (ids to the host,
        CPU runner, grouped kernel for hits), then the next segment starts;
    a device change (layer split over two GPUs) ends a segment; the last one holds norm + lm_head.
The position is a device tensor, KV rows are written with index_copy_, and attention reads a
bucket of L = ceil((pos + 1) / 256) * 256 rows of the KV store with a -inf mask past pos, so one
graph serves 256 positions. The eager CUDA decode step runs these very kernels (Attention._cuda), so
graphs change the host time, not the numbers. Graphs are captured lazily per (segment, L) and dropped when the KV
store or the residency changes. HYBRID_CUDA_GRAPHS=0 turns them off (the eager path, for before /
after numbers). With capture=False the same pieces run eagerly (CPU tests of the static math).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from hybrid.model.layers import BUCKET, KVCache, attn_keys
from hybrid.runtime.hybrid_experts import pack_route


def graphs_enabled() -> bool:
    return os.environ.get("HYBRID_CUDA_GRAPHS", "1") not in ("0", "off", "false", "no")


@dataclass(frozen=True)
class Segment:
    layers: tuple[int, ...]
    device: torch.device
    host_last: bool          # the last layer's MoE runs eagerly (it can miss)
    head: bool               # final norm + lm_head inside

    @property
    def resident(self) -> tuple[int, ...]:
        return self.layers[:-1] if self.host_last else self.layers


def plan_segments(layer_devices: list[torch.device], device_only, head_device: torch.device) -> list[Segment]:
    """Cut layers into segments (see the module doc). device_only(layer) -> bool."""
    segs, cur = [], []

    def close(host_last: bool, head: bool = False) -> None:
        if cur:
            segs.append(Segment(tuple(cur), layer_devices[cur[0]], host_last, head))
            cur.clear()

    for i, dev in enumerate(layer_devices):
        if cur and layer_devices[cur[0]] != dev:
            close(False)
        cur.append(i)
        if not device_only(i):
            close(True)
    close(False, head=bool(cur) and layer_devices[cur[0]] == head_device)
    return segs


@dataclass
class _Runner:
    """One segment at one bucket: static input x_in [1, H], route_buf, and what run() leaves in out."""

    x_in: torch.Tensor
    route_buf: torch.Tensor
    fn: object = None                        # eager body (capture=False)
    graph: object = None                     # torch.cuda.CUDAGraph
    out: object = field(default=None)

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out = self.fn()


class DecodeGraphs:
    """Runs HybridModel's T = 1 steps through graphs (see the module doc)."""

    def __init__(self, model, experts, capture: bool = True, enabled: bool | None = None,
                 bucket: int = BUCKET):
        self.model, self.experts = model, experts
        self.capture, self.bucket = capture, bucket
        self.enabled = graphs_enabled() if enabled is None else enabled
        self.error: str | None = None
        self.captures = 0
        self._runners: dict = {}
        self._plan: tuple | None = None
        self._pos: dict = {}
        self._kv_key = None

    def usable(self, ids: torch.Tensor, start: int) -> bool:
        m = self.model
        if not self.enabled or self.error is not None or ids.shape[0] != 1 or m.on_route is not None:
            return False
        if not isinstance(m.cache, KVCache) or start + 1 > m.cache.max_tokens:
            return False
        devs = set(m.layer_devices) | {m.lm_head.device}
        return not self.capture or all(d.type == "cuda" for d in devs)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """One token at position start -> logits [1, V] fp32 (the cache holds [0, start))."""
        m, cache = self.model, self.model.cache
        m.prepare()
        kv_key = (cache.k_store[0].data_ptr(), cache.capacity)
        if kv_key != self._kv_key:                   # a new KV store: graphs captured on the old die
            self._runners.clear()
            self._kv_key = kv_key
        keys = attn_keys(start, cache.capacity, self.bucket)
        segs = self._segments()
        for dev in {s.device for s in segs}:
            self._pos_buf(dev).fill_(start)
        x, logits = m.embed_tokens(ids), None                                # [1, H]
        for seg in segs:
            if x.device != seg.device:
                x = x.to(seg.device)                                         # layer-split hop
            r = self._runner(seg, keys, x)
            r.x_in.copy_(x)
            self.experts.prepare_device(seg.resident)
            r.run()
            if seg.resident:
                self.experts.note_device(seg.resident, r.route_buf)
            if seg.host_last:
                xm, h, rid, rw, packed = r.out
                i = seg.layers[-1]
                x = xm + m.moe_out(i, h, self.experts(i, h, rid, rw, packed=packed))
            elif seg.head:
                logits = r.out.clone()               # the graph's buffer is rewritten next step
            else:
                x = r.out
        cache.length = start + 1
        return logits if logits is not None else m.head(x)

    # ---- segments and runners ----------------------------------------------------------------
    def _segments(self) -> list[Segment]:
        v = self.experts.version
        if self._plan is None or self._plan[0] != v:
            m = self.model
            segs = plan_segments(list(m.layer_devices), self.experts.device_only, m.lm_head.device)
            keep = set(segs)                         # residency changed: drop graphs of old segments
            self._runners = {key: r for key, r in self._runners.items() if key[0] in keep}
            self._plan = (v, segs)
        return self._plan[1]

    def _pos_buf(self, dev: torch.device) -> torch.Tensor:
        p = self._pos.get(dev)
        if p is None:
            p = self._pos[dev] = torch.zeros(1, dtype=torch.int64, device=dev)
        return p

    def _runner(self, seg: Segment, keys: int, x: torch.Tensor) -> _Runner:
        r = self._runners.get((seg, keys))
        if r is None:
            r = self._make(seg, keys, x)
            self._runners[(seg, keys)] = r
        return r

    def _body(self, seg: Segment, x: torch.Tensor, pos: torch.Tensor, keys: int, route_buf: torch.Tensor):
        m, last = self.model, len(seg.layers) - 1
        mask = m.decode_mask(pos, keys)                                      # [1, 1, 1, L] or None
        moe = None                                                           # the last layer's MoE output
        for j, i in enumerate(seg.layers):
            host = seg.host_last and j == last
            out = None if host else self.experts.route_out(i, 1, route_buf[j])   # ids/weights into route_buf
            x, h, rid, rw = m.decode_dense(i, x, pos, keys, mask, residual=moe, route_out=out)
            if host:                         # ids, weights, h in one row: one copy to the host
                return x, h, rid, rw, pack_route(rid, rw, h)
            y = self.experts.moe_slots(i, h, out.slots, rw)                 # [1, H] fp32
            moe = m.moe_out(i, h, y if m.layers[i].shared is None else y.to(x.dtype))
        x = x + moe.to(x.dtype)                                              # x + round(moe), as before
        return m.head(x) if seg.head else x

    def _make(self, seg: Segment, keys: int, x: torch.Tensor) -> _Runner:
        dev, k = seg.device, self.model.cfg.num_experts_per_tok
        x_in = x.clone()
        route_buf = torch.zeros(max(len(seg.resident), 1), 1, 2 * k, dtype=torch.float32, device=dev)
        pos = self._pos_buf(dev)
        body = lambda: self._body(seg, x_in, pos, keys, route_buf)  # noqa: E731
        if not self.capture:
            return _Runner(x_in, route_buf, fn=body)
        try:
            with torch.cuda.device(dev):     # torch.cuda.graph captures on the current device's stream
                return self._capture(dev, body, x_in, route_buf, seg)
        except Exception as exc:  # noqa: BLE001 - fall back to the eager path for good
            self.error = f"{type(exc).__name__}: {exc}"
            raise

    def _capture(self, dev, body, x_in, route_buf, seg) -> _Runner:
        self.experts.prepare_device(seg.resident)
        cur = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            body()                          # warm-up: lazy packing, library handles (same values)
        cur.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(dev)):   # its default stream is made once, on
            out = body()                                             # the first device it met
        self.captures += 1
        return _Runner(x_in, route_buf, graph=graph, out=out)
