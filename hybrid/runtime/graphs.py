"""CUDA graphs of the one-token decode step: the host launches a few graphs instead of ~40 kernels
per layer.

Legend: H hidden, k experts per token, n layers in a segment, L keys attended (a bucket).
The layers are cut into segments, each one graph on one device:
    layers whose every expert is resident (HybridExperts.device_only): dense part + grouped expert
        kernel, no host work at all; their routed ids go to a route buffer [n, 1, 2k] that is settled
        (cache counters, trace) at the step's end, as the eager path's deferred lookups are;
    a layer that can miss ends its segment (HYBRID_MISS_GRAPH=1, the default): the graph runs its
        dense part, its router (its card's expert -> slot table, -1 where not in a slot), copies the
        routed row to pinned host memory, records an event, then runs the grouped kernel over the
        hits (-1 pairs dropped). The host waits for the event only, runs the misses (the table's
        -1 pairs) on the CPU runner while the card runs the hits, writes their sum to pinned
        memory, and replays the next segment, which opens with the sum's copy up and
        xm + round(hits + CPU) (hybrid.runtime.miss_link): 2 host operations per such layer
        (MISS_LAYER_HOST_OPS). The layer's cache side (lookup, checked against the table; counters,
        policy, promotions, trace) runs after that launch, while the segment runs
        (HybridExperts.settle_linked), before the next layer's lookup. Before
        a device change the host adds it (eager) and hops. Only where a captured graph can hold the
        hits (QPN slot storage, or no slots); the hits' GPU time is no longer timed (inside the
        graph, like the resident layers'). HYBRID_MISS_GRAPH=0, or the torch reference storage:
        the segment ends after the router and the layer's MoE runs eagerly (ids to the host, CPU
        runner, grouped kernel for the hits, ~14 host operations);
    a device change (layer split over two GPUs) ends a segment; the last one holds norm + lm_head.
The position is a device tensor, KV rows are written with index_copy_, and attention reads a
bucket of L = ceil((pos + 1) / 256) * 256 rows of the KV store with a -inf mask past pos, so one
graph serves 256 positions. The eager CUDA decode step runs these very kernels (Attention._cuda), so
graphs change the host time, not the numbers. Graphs are captured lazily per (segment, L) and dropped when the KV
store or the residency changes. HYBRID_CUDA_GRAPHS=0 turns them off (the eager path, for before /
after numbers). With capture=False the same pieces run eagerly (CPU tests of the static math).

A step whose segments are all resident (runs_ahead) needs the host only to launch it: hybrid.generate's
overlapped decode enqueues it with the sampled id still on the device (HybridModel.enqueue). The id is
then embedded on the first layer's card by fused_embed_rows reading its row from the host's table, pinned and
mapped for the cards at load when the decode overlaps, else at the first such step (hybrid.runtime.host_embed:
the table never takes card memory; the planner keeps it on the host). HYBRID_HOST_EMBED=0, or a table that cannot
be pinned: a copy of the table in the model dtype on that card instead (vocab x hidden x 2 bytes, not in the
plan). Host ids index the host table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybrid.kernels import driver
from hybrid.model.layers import BUCKET, KVCache, attn_keys
from hybrid.runtime.hybrid_experts import pack_route
from hybrid.runtime.host_embed import HostEmbedding, host_embed_enabled, owned_copy
from hybrid.runtime.miss_link import MissLink
from hybrid.switches import env_flag


def graphs_enabled() -> bool:
    return env_flag("HYBRID_CUDA_GRAPHS")


def miss_graph_enabled() -> bool:
    """HYBRID_MISS_GRAPH=0: a can-miss layer's hits run eagerly after the host sync (the old path)."""
    return env_flag("HYBRID_MISS_GRAPH")


# Host operations per can-miss layer with misses in a graphed decode step (tests/test_miss_graph.py
# counts the graph path's): the eager path's ~14 (planner.step_shape.eager_ops) become the segment's
# replay and the wait for its event (the CPU result's upload is the next graph's first node).
MISS_LAYER_HOST_OPS = 2


@dataclass(frozen=True)
class Segment:
    layers: tuple[int, ...]
    device: torch.device
    host_last: bool          # the last layer can miss: its lookup (and CPU experts) run on the host
    head: bool               # final norm + lm_head inside
    linked: bool = False     # host_last, and that layer's hits run inside the graph (MissLink)
    carry_in: int | None = None   # opens with this linked layer's combine (MissLink.combine)

    @property
    def resident(self) -> tuple[int, ...]:
        return self.layers[:-1] if self.host_last else self.layers


def plan_segments(layer_devices: list[torch.device], device_only, head_device: torch.device,
                  linked=None) -> list[Segment]:
    """Cut layers into segments (see the module doc). device_only(layer) -> bool. linked(layer) ->
    bool (None: never) for a can-miss layer whose hits run in its graph: the segment after it on the
    same device opens with its combine (a head-only segment when it is the last layer and the head
    is on its device); before a device change the host combines it."""
    segs, cur, pending = [], [], None

    def close(host_last: bool, head: bool = False) -> None:
        nonlocal pending
        if cur or (head and pending is not None):
            dev = layer_devices[cur[0]] if cur else head_device
            link = host_last and linked is not None and bool(linked(cur[-1]))
            segs.append(Segment(tuple(cur), dev, host_last, head, link, pending))
            cur.clear()
            pending = None

    for i, dev in enumerate(layer_devices):
        if cur and layer_devices[cur[0]] != dev:
            close(False)
        if pending is not None and layer_devices[pending] != dev:
            pending = None                   # the combine runs eagerly, before the hop
        cur.append(i)
        if not device_only(i):
            close(True)
            pending = i if segs[-1].linked else None
    if pending is not None and layer_devices[pending] != head_device:
        pending = None
    close(False, head=(bool(cur) and layer_devices[cur[0]] == head_device) or (not cur and pending is not None))
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


class SegmentGraphs:
    """What the decode and prefill graphs share: the segments of the current residency, their runners
    keyed (segment, shape), dropped with their segment or with the KV store they were captured on."""

    def __init__(self, model, experts, capture: bool, enabled: bool):
        self.model, self.experts = model, experts
        self.capture, self.enabled = capture, enabled
        self.error: str | None = None
        self.captures = 0
        self._runners: dict = {}
        self._plan: tuple | None = None
        self._kv_key = None

    def _linked_rule(self):
        """plan_segments' `linked` argument (None: a can-miss layer's hits never run in a graph)."""
        return None

    def _segments(self) -> list[Segment]:
        v = self.experts.version
        if self._plan is None or self._plan[0] != v:
            m = self.model
            segs = plan_segments(list(m.layer_devices), self.experts.device_only, m.lm_head.device,
                                 self._linked_rule())
            keep = set(segs)                         # residency changed: drop graphs of old segments
            self._runners = {key: r for key, r in self._runners.items() if key[0] in keep}
            self._plan = (v, segs)
        return self._plan[1]

    def _on_cards(self) -> bool:
        """Capturing needs every layer and the head on CUDA (capture=False runs the bodies anywhere)."""
        m = self.model
        return not self.capture or all(d.type == "cuda" for d in set(m.layer_devices) | {m.lm_head.device})

    def _check_kv(self, cache) -> None:
        """A new KV store: the graphs captured on the old one die."""
        kv_key = (cache.k_store[0].data_ptr(), cache.capacity)
        if kv_key != self._kv_key:
            self._runners.clear()
            self._kv_key = kv_key


def device_scalar(bufs: dict, dev: torch.device) -> torch.Tensor:
    """bufs[dev]: an int64 [1] on dev that a graph reads (made zero on first use, then refilled)."""
    p = bufs.get(dev)
    if p is None:
        p = bufs[dev] = torch.zeros(1, dtype=torch.int64, device=dev)
    return p


class DecodeGraphs(SegmentGraphs):
    """Runs HybridModel's T = 1 steps through graphs (see the module doc)."""

    def __init__(self, model, experts, capture: bool = True, enabled: bool | None = None,
                 bucket: int = BUCKET, miss_graph: bool | None = None):
        super().__init__(model, experts, capture, graphs_enabled() if enabled is None else enabled)
        self.bucket = bucket
        self.miss_graph = miss_graph_enabled() if miss_graph is None else miss_graph
        self.links: dict[int, MissLink] = {}         # can-miss layer -> its MissLink (miss_graph)
        self._pos: dict = {}
        self._host_embed: HostEmbedding | None = None   # the host table, pinned and mapped (_embed)
        self._embed_table = None             # or its copy [V, H] in the model dtype on the first layer's card

    def usable(self, ids: torch.Tensor, start: int) -> bool:
        return self._usable(int(ids.shape[0]), start)

    def runs_ahead(self, start: int) -> bool:
        """Whether a one-token step at `start` runs with no host work between its launches: graphed,
        and no segment ends at a layer that can miss (its ids may stay on the device)."""
        return self._usable(1, start) and not any(s.host_last for s in self._segments())

    def _usable(self, t: int, start: int) -> bool:
        m = self.model
        if not self.enabled or self.error is not None or t != 1 or m.on_route is not None:
            return False
        if not isinstance(m.cache, KVCache) or start + 1 > m.cache.max_tokens:
            return False
        return self._on_cards()

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """One token at position start -> logits [1, V] fp32 (the cache holds [0, start))."""
        m, cache = self.model, self.model.cache
        m.prepare()
        self._check_kv(cache)
        keys = attn_keys(start, cache.capacity, self.bucket)
        segs = self._segments()
        for dev in {s.device for s in segs}:
            self._pos_buf(dev).fill_(start)
        x, logits = self._embed(ids), None                                   # [1, H]
        carry = None                          # a linked can-miss layer whose combine is still due
        for seg in segs:
            if seg.carry_in is None:
                if carry is not None:         # the next segment is on another device: combine here
                    x = self._combine(carry)
                if x.device != seg.device:
                    x = x.to(seg.device)                                     # layer-split hop
            carry = None
            with driver.current(seg.device):   # its eager work (misses) on its card: no switch per launch
                r = self._runner(seg, keys, x)
                if seg.carry_in is None:
                    r.x_in.copy_(x)
                self.experts.prepare_device(self._device_layers(seg))
                r.run()
                if seg.resident:
                    self.experts.note_device(seg.resident, r.route_buf)
                self.experts.settle_linked()     # the last linked layer's cache side, while this segment runs
                if seg.linked:
                    carry = seg.layers[-1]
                    link = self.links[carry]
                    link.after_replay()
                    self.experts.linked(carry, link)
                elif seg.host_last:
                    xm, h, rid, rw, packed = r.out
                    i = seg.layers[-1]
                    x = xm + m.moe_out(i, h, self.experts(i, h, rid, rw, packed=packed))
                elif seg.head:
                    logits = r.out.clone()               # the graph's buffer is rewritten next step
                else:
                    x = r.out
        if carry is not None:
            x = self._combine(carry)
        cache.length = start + 1
        if logits is not None:
            return logits
        with driver.current(m.lm_head.device):
            return m.head(x)

    def _combine(self, layer: int) -> torch.Tensor:
        """A linked layer's output (MissLink.combine), eagerly with its card current."""
        with driver.current(self.model.layer_devices[layer]):
            return self.links[layer].combine(self.model, layer)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [1] -> [1, H]: the model's own lookup for host ids; ids on a device are embedded on the first
        layer's card with no host sync, from the pinned host table (or its copy on that card: see the module
        doc), the same values either way (the model dtype's rounding of each row)."""
        m = self.model
        if ids.device == m.embed.device:
            return m.embed_tokens(ids)
        self.pin_embed()                     # once (the session's load usually did)
        if self._host_embed is not None:
            return self._host_embed.rows(ids.to(m.layer_devices[0]), m.dtype)
        return self._embed_table[ids.to(m.layer_devices[0])]

    def pin_embed(self) -> None:
        """Make the table that steps running ahead read: the model's table registered for the cards
        (HYBRID_HOST_EMBED, a model dtype the kernel writes; the model then indexes that copy on the host too, the
        same values, so the file-backed table it replaces is let go), else its copy on the first layer's card.
        Once; the session calls it at load where the decode overlaps (a copy and registration of the whole table,
        622 MB for 30B-A3B, which the first run-ahead step would otherwise pay), else the first such step does."""
        m = self.model
        if self._host_embed is not None or self._embed_table is not None:
            return
        if host_embed_enabled() and m.dtype in (torch.float16, torch.float32):
            self._host_embed = HostEmbedding.pin(owned_copy(m.embed))
        if self._host_embed is not None:
            m.embed = self._host_embed.table
        else:
            self._embed_table = m.embed.to(m.layer_devices[0], m.dtype)

    # ---- segments and runners ----------------------------------------------------------------
    def _linked_rule(self):
        return self._linkable if self.miss_graph else None

    def _pos_buf(self, dev: torch.device) -> torch.Tensor:
        return device_scalar(self._pos, dev)

    def _device_layers(self, seg: Segment) -> tuple[int, ...]:
        """Layers whose slots the segment's graph reads (their pending promotions must land first)."""
        return seg.layers if seg.linked else seg.resident

    def _linkable(self, layer: int) -> bool:
        """A captured graph can hold the layer's hits: no slots, or the QPN grouped kernel (which
        drops absent slots itself; the torch reference storage needs a host sync)."""
        return not self.capture or self.experts.graph_hits(layer)

    def _link(self, layer: int, dev: torch.device) -> MissLink:
        link = self.links.get(layer)
        if link is None:
            m = self.model
            link = self.links[layer] = MissLink(m.cfg.num_experts_per_tok, m.cfg.hidden_size, m.dtype, dev)
        return link

    def _runner(self, seg: Segment, keys: int, x: torch.Tensor) -> _Runner:
        r = self._runners.get((seg, keys))
        if r is None:
            r = self._make(seg, keys, x)
            self._runners[(seg, keys)] = r
        return r

    def _body(self, seg: Segment, x: torch.Tensor, pos: torch.Tensor, keys: int, route_buf: torch.Tensor):
        m, last = self.model, len(seg.layers) - 1
        if seg.carry_in is not None:         # the last segment's can-miss layer: hits + CPU + residual
            x = self.links[seg.carry_in].combine(m, seg.carry_in)
        if not seg.layers:
            return m.head(x)
        mask = m.decode_mask(pos, keys)                                      # [1, 1, 1, L] or None
        moe = None                                                           # the last layer's MoE output
        for j, i in enumerate(seg.layers):
            host = seg.host_last and j == last
            if host and seg.linked:
                return self._linked(i, x, pos, keys, mask, moe)
            out = None if host else self.experts.route_out(i, 1, route_buf[j])   # ids/weights into route_buf
            x, h, rid, rw = m.decode_dense(i, x, pos, keys, mask, residual=moe, route_out=out)
            if host:                         # ids, weights, h in one row: one copy to the host
                return x, h, rid, rw, pack_route(rid, rw, h)
            y = self.experts.moe_slots(i, h, out.slots, rw, out.plan)       # [1, H] fp32
            moe = m.moe_out(i, h, y if m.layers[i].shared is None else y.to(x.dtype))
        x = x + moe.to(x.dtype)                                              # x + round(moe), as before
        return m.head(x) if seg.head else x

    def _linked(self, i: int, x, pos, keys: int, mask, moe) -> None:
        """A can-miss layer inside the graph: dense part + router (its slot table: -1 = not in a
        slot), the row to the host + event, then the grouped kernel over the hits (the -1 pairs
        dropped); the next graph adds the CPU's part (MissLink)."""
        link = self.links[i]
        # no RoutePlan here: the router's launch is what the host waits for (the row), the plan would
        # lengthen it; the hits' own route launch runs while the host works on the misses
        out = self.experts.route_out(i, 1, link.row, plan=False)             # slots [k], row [1, 2k]
        x, h, _, rw = self.model.decode_dense(i, x, pos, keys, mask, residual=moe, route_out=out)
        link.send(h, out.slots)
        y = self.experts.moe_slots(i, h, out.slots, rw) if self.experts.has_slots(i) else None  # [1, H]
        link.keep(x, y)

    def _make(self, seg: Segment, keys: int, x: torch.Tensor) -> _Runner:
        m, dev, k = self.model, seg.device, self.model.cfg.num_experts_per_tok
        for i in [seg.carry_in] + ([seg.layers[-1]] if seg.linked else []):
            if i is not None:
                self._link(i, m.layer_devices[i])                            # buffers before any capture
        x_in = x.clone() if seg.carry_in is None else torch.zeros(1, m.cfg.hidden_size, dtype=m.dtype, device=dev)
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
        self.experts.prepare_device(self._device_layers(seg))
        r = capture_runner(dev, body, x_in, route_buf)
        self.captures += 1
        return r


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(dev: torch.device) -> torch.cuda.Stream | None:
    """The stream every graph of this device is warmed up and captured on, kept for the process
    (None with HYBRID_GRAPH_STREAM=0: a new side stream and capture stream per capture, as before).
    torch keeps one cuBLAS workspace per (handle, stream), allocated at the stream's first cuBLAS call:
    on a new capture stream that call is inside the capture, so each graph's pool held a workspace of
    its own and each side stream another (H200, 30B-A3B: ~106 MiB per later-chunk prefill graph; with
    the kept stream none, results/runtime.md §23). On the kept stream the first warm-up, outside any
    capture, puts it in the ordinary pool once and every capture reuses it (the graphs replay one
    after another on the caller's stream)."""
    if not env_flag("HYBRID_GRAPH_STREAM"):
        return None
    if dev.index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[dev.index] = torch.cuda.Stream(dev)
    return _CAPTURE_STREAMS[dev.index]


def capture_runner(dev: torch.device, body, x_in: torch.Tensor, route_buf: torch.Tensor, pool=None) -> _Runner:
    """body() once on the device's kept capture stream (capture_stream; else a new side stream) as a
    warm-up (lazy packing, library handles and workspaces; the same values), then captured on it into a
    graph (in `pool`, else its own) -> the _Runner replaying it, body's outputs in out."""
    cur = torch.cuda.current_stream(dev)
    kept = capture_stream(dev)
    side = kept or torch.cuda.Stream(dev)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        body()
    cur.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=kept or torch.cuda.Stream(dev)):
        out = body()
    return _Runner(x_in, route_buf, graph=graph, out=out)
