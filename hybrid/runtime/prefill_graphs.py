"""CUDA graphs of a short prompt's prefill: the host replays one graph per device segment instead of
launching ~20 kernels per layer from Python.

Legend: T prompt tokens, B the bucket (T padded up), H hidden, k experts per token, n layers in a segment.

An eager prefill of a few dozen tokens is host-bound: every expert resident on an H200, a 32-token
prompt takes ~35 ms of host time for ~1000 launches while the card is busy ~7 ms (tools/gpu_prefill_host.py,
results/runtime.md §20). A prefill step from position 0 whose layers are all fully resident (the same
condition as a decode step that runs ahead, HybridExperts.device_only) instead runs a graph captured
for its bucket B (16, 32, ..., PREFILL_GRAPH_MAX tokens, the smallest that holds T). The prompt's
embedded rows are copied into the segment's static input [B, H]; the B - T rows past the prompt repeat
its last row. Padding is harmless: attention is causal (the prompt's rows never see the rows after
them), every other op is row-wise (norms, projections, the router, the grouped expert kernel's rows),
and the padded KV rows [T, B) are past the cache's length: the decode steps overwrite them before any
query attends to them. B may pass the request's max_tokens (prompt + new tokens) as long as the KV
store holds B rows (on CUDA it holds the session's context): the cache's views are widened to B rows
while the step runs (rows_for). Only the prompt's routing [n, T, 2k] is settled (cache counters,
trace: HybridExperts.note_device, as the decode graphs do), and the head runs on row T - 1 only (its
index is a device buffer set before the replay).

The segment's body is the eager forward's CUDA path (Attention._cuda: fused RoPE + KV write, SDPA
causal, at start > 0 lower-right causal; add+norm, the router, the grouped QPN kernel), so the graph changes host time,
not the math; the one difference is that the kernels see B rows instead of T. Graphs are captured
lazily per (segment, B) into one memory pool per device, at the bucket's second prompt (a capture
costs about two eager prefills, so a bucket used once runs eagerly: PREFILL_GRAPH_AFTER), and dropped
when the KV store or the residency changes (the next prompt of the bucket captures again).
HYBRID_PREFILL_GRAPHS=0 turns them off (the eager path), as HYBRID_CUDA_GRAPHS=0 does with every
graph.

Later chunks (on by default; HYBRID_PREFILL_GRAPH_CHUNKS=0 runs them eagerly): a long prompt's prefill
steps from a position start > 0 (the prefill chunks after the first) run through graphs too, one per
(bucket, start), at most PREFILL_CHUNK_GRAPHS_MAX of them, and new ones only while every card keeps
PREFILL_CHUNK_GRAPH_FREE_MIB free (a graph's pool keeps what an eager chunk gives back; chunk starts repeat
from prompt to prompt: 0, C, 2C, ...). Such a graph has its positions start .. start + B - 1 and KV rows
fixed; its attention reads the cache's rows 0 .. start + B - 1 causally (row i sees rows 0 .. start + i), so the padded rows
still see nothing of the prompt's future and are overwritten by the next chunk or the decode steps.

With capture=False the same bodies run eagerly (the CPU tests of the padding, the settled routing and the
capture rule).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from hybrid.kernels import driver
from hybrid.model.layers import KVCache, rms_norm
from hybrid.runtime.graphs import Segment, SegmentGraphs, _Runner, capture_runner, device_scalar, graphs_enabled
from hybrid.switches import env_flag

PREFILL_GRAPH_MIN = 16      # the smallest bucket (prompts of 2..16 tokens share it)
PREFILL_GRAPH_MAX = 512     # longer prefill steps run eagerly: the card, not the host, sets their time
                            # (H200, 30B-A3B, all resident: 512 tokens graph 48 vs eager 53-55 ms, 1024
                            # tokens 101-102 vs 102-105; results/runtime.md §21)
PREFILL_GRAPH_AFTER = 1     # prompts of a bucket that run eagerly before it is captured (capture costs ~2
                            # eager prefills: a one-prompt run would only pay it)
PREFILL_GRAPH_SPLIT_MAX = 768   # a prompt of PREFILL_GRAPH_MAX + 1 .. this many tokens, whose prefill would be
                                # one eager step, runs in PREFILL_GRAPH_MAX-row graph steps instead (split_step;
                                # H200, 30B-A3B, all resident: 600 tokens 33.4 ms vs 44-68 eager, 1024 tokens
                                # 44.1 vs 44.8, 1500 67.1 vs 48.8; results/runtime.md §25)
PREFILL_CHUNK_GRAPHS_MAX = 32   # later chunks: the most (bucket, start) pairs with graphs (then eager)
PREFILL_CHUNK_GRAPH_FREE_MIB = 256    # later chunks: a new graph is captured only while every card has this
                                      # much memory free (their pools hold memory an eager chunk would return;
                                      # each held ~106 MiB of cuBLAS workspace until the graphs shared one
                                      # capture stream, now ~0: results/runtime.md §23)


def prefill_graphs_enabled() -> bool:
    """HYBRID_PREFILL_GRAPHS=0 turns the prefill graphs off; HYBRID_CUDA_GRAPHS=0 turns off every graph."""
    return graphs_enabled() and env_flag("HYBRID_PREFILL_GRAPHS")


def prefill_chunk_graphs_enabled() -> bool:
    """A long prompt's later chunks (start > 0) run through graphs too, one per (bucket, start), unless
    HYBRID_PREFILL_GRAPH_CHUNKS=0 (H200, 2048 tokens in chunks of 512: 94 vs 137 ms with them eager)."""
    return env_flag("HYBRID_PREFILL_GRAPH_CHUNKS")


def bucket_for(t: int, lo: int = PREFILL_GRAPH_MIN, hi: int = PREFILL_GRAPH_MAX) -> int | None:
    """The bucket of a T-token prefill: the smallest power of two >= max(T, lo); None past hi."""
    b = lo
    while b < t:
        b *= 2
    return b if b <= hi else None


@contextmanager
def rows_for(cache: KVCache, b: int):
    """The cache's k/v views (and max_tokens) widened to b rows of its stores while a padded prompt
    runs (module doc); as they were afterwards. Nothing past the prompt is committed."""
    if b <= cache.max_tokens:
        yield
        return
    if b > cache.capacity:
        raise ValueError(f"prefill bucket of {b} rows > the KV store's {cache.capacity}")
    saved = cache.max_tokens, cache.k, cache.v
    cache.max_tokens = b
    cache.k, cache.v = [s[:b] for s in cache.k_store], [s[:b] for s in cache.v_store]
    try:
        yield
    finally:
        cache.max_tokens, cache.k, cache.v = saved


class PrefillGraphs(SegmentGraphs):
    """Runs HybridModel's prefill steps from position 0 through graphs (see the module doc)."""

    def __init__(self, model, experts, capture: bool = True, enabled: bool | None = None,
                 lo: int = PREFILL_GRAPH_MIN, hi: int = PREFILL_GRAPH_MAX, after: int = PREFILL_GRAPH_AFTER,
                 chunks: bool | None = None):
        super().__init__(model, experts, capture, prefill_graphs_enabled() if enabled is None else enabled)
        self.lo, self.hi, self.after = lo, hi, after
        self.chunks = prefill_chunk_graphs_enabled() if chunks is None else chunks   # later chunks too
        self._seen: dict[tuple[int, int], int] = {}   # (bucket, start) -> steps that asked (the `after` rule)
        self.steps = 0                       # prefill steps that replayed graphs
        self._last: dict = {}                # device -> [1] int64: the prompt's last row (head input)
        self._pools: dict = {}               # device -> graph memory pool (the buckets never run at once)

    def usable(self, t: int, start: int) -> bool:
        """Whether this prefill step runs through the graphs; called once per step (it counts the
        bucket's prompts: the first `after` of them run eagerly, module doc)."""
        b = bucket_for(t, self.lo, self.hi)
        if t < 2 or b is None or not self._graphable(start, b):
            return False
        key = (b, start)
        if any(k[1:] == key for k in self._runners):
            return True
        if start and len({k[1:] for k in self._runners if k[2]}) >= PREFILL_CHUNK_GRAPHS_MAX:
            return False                     # enough later-chunk graphs held: the rest run eagerly
        self._seen[key] = self._seen.get(key, 0) + 1
        if self._seen[key] <= self.after:
            return False
        return not (start and self.capture and not self._room())

    def _graphable(self, start: int, b: int) -> bool:
        """Whether a b-row step at start can run through a graph at all (usable's rules that count nothing)."""
        m = self.model
        if not self.enabled or self.error is not None or m.on_route is not None:
            return False
        if start != 0 and not self.chunks:
            return False
        if not isinstance(m.cache, KVCache) or start + b > m.cache.capacity:
            return False
        if any(s.host_last for s in self._segments()):
            return False                     # a layer that can miss needs the host mid-step
        return self._on_cards()

    def split_step(self, n: int) -> int | None:
        """The step size for an n-token prompt (from an empty cache) whose prefill would be one eager step
        longer than the largest bucket: `hi` where n <= PREFILL_GRAPH_SPLIT_MAX and both steps can run
        through graphs (two replays, once captured, beat one eager step's host time), else None."""
        if not self.hi < n <= PREFILL_GRAPH_SPLIT_MAX:
            return None
        rest = bucket_for(n - self.hi, self.lo, self.hi)
        return self.hi if rest is not None and self._graphable(0, self.hi) and self._graphable(self.hi, rest) else None

    def _room(self) -> bool:
        """Whether every card of the model has PREFILL_CHUNK_GRAPH_FREE_MIB free for another later-chunk graph."""
        m = self.model
        devs = {d for d in set(m.layer_devices) | {m.lm_head.device} if d.type == "cuda"}
        return all(torch.cuda.mem_get_info(d)[0] >= PREFILL_CHUNK_GRAPH_FREE_MIB * 2**20 for d in devs)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """The prompt's ids [T] from position start -> logits of its last token [1, V] fp32."""
        m, cache = self.model, self.model.cache
        m.prepare()
        self._check_kv(cache)
        t = int(ids.shape[0])
        b = bucket_for(t, self.lo, self.hi)
        x = m.embed_tokens(ids)                                             # [T, H]
        with rows_for(cache, start + b):
            x, logits = self._run(x, t, b, start)
        cache.length = start + t
        self.steps += 1
        return logits if logits is not None else m.head(x[t - 1:t])

    def _run(self, x: torch.Tensor, t: int, b: int, start: int):
        """The segments' graphs on the prompt's rows x [T, H] -> (x [B, H], logits [1, V] or None)."""
        logits = None
        for seg in self._segments():
            if x.device != seg.device:
                x = x.to(seg.device)                                         # layer-split hop
            if seg.head:     # before _runner: a capture's eager warm-up selects this row of its B rows
                self._last_buf(seg.device).fill_(t - 1)
            with driver.current(seg.device):
                r = self._runner(seg, b, start)
                if x.shape[0] == b:
                    r.x_in.copy_(x)
                else:                                                        # the prompt, then its last row
                    r.x_in[:t].copy_(x[:t])
                    r.x_in[t:].copy_(x[t - 1:t].expand(b - t, -1))
                self.experts.prepare_device(seg.layers)
                r.run()
                if seg.layers:
                    self.experts.note_device(seg.layers, r.route_buf[:, :t])
            if seg.head:
                logits = r.out.clone()                                       # rewritten by the next replay
            else:
                x = r.out
        return x, logits

    # ---- segments and runners ------------------------------------------------------------------
    def _last_buf(self, dev: torch.device) -> torch.Tensor:
        return device_scalar(self._last, dev)

    def _runner(self, seg: Segment, b: int, start: int) -> _Runner:
        r = self._runners.get((seg, b, start))
        if r is None:
            r = self._runners[(seg, b, start)] = self._make(seg, b, start)
        return r

    def _body(self, seg: Segment, x: torch.Tensor, route_buf: torch.Tensor, start: int):
        """The eager forward's layers for B rows at positions start .. start + B - 1 (module doc) -> x [B, H],
        or the head's logits [1, V] of row _last_buf."""
        m, cache, eps = self.model, self.model.cache, self.model.cfg.rms_norm_eps
        b = x.shape[0]
        if seg.device.type == "cuda":
            cos, sin = m.rope_table(seg.device), None                        # Attention's CUDA path
        else:
            cos, sin = m.rotary.cos_sin(torch.arange(start, start + b), seg.device)
        for j, i in enumerate(seg.layers):
            layer = m.layers[i]
            h = rms_norm(x, layer.input_norm, eps)
            out = self.experts.route_out(i, b, route_buf[j])                # slot ids + routing rows
            x, h, routed = m._post_attn(i, x, layer.attn(h, i, start, cache, cos, sin), out)
            _, weights = m.route(i, h, out) if routed is None else routed
            y = self.experts.moe_slots(i, h, out.slots, weights, out.plan).to(x.dtype)  # [B, H], as the eager path
            x = x + m.moe_out(i, h, y)
        if seg.head:
            return m.head(x.index_select(0, self._last_buf(seg.device)))    # [1, V] fp32
        return x

    def _make(self, seg: Segment, b: int, start: int) -> _Runner:
        m, dev, k = self.model, seg.device, self.model.cfg.num_experts_per_tok
        x_in = torch.zeros(b, m.cfg.hidden_size, dtype=m.dtype, device=dev)
        route_buf = torch.zeros(max(len(seg.layers), 1), b, 2 * k, dtype=torch.float32, device=dev)
        self._last_buf(dev)
        body = lambda: self._body(seg, x_in, route_buf, start)  # noqa: E731
        if not self.capture:
            return _Runner(x_in, route_buf, fn=body)
        try:
            with torch.cuda.device(dev):
                return self._capture(dev, body, x_in, route_buf, seg)
        except Exception as exc:  # noqa: BLE001 - the eager prefill from now on
            self.error = f"{type(exc).__name__}: {exc}"
            raise

    def _capture(self, dev, body, x_in, route_buf, seg) -> _Runner:
        self.experts.prepare_device(seg.layers)
        pool = self._pools.get(dev)
        if pool is None:
            pool = self._pools[dev] = torch.cuda.graph_pool_handle()
        r = capture_runner(dev, body, x_in, route_buf, pool)
        self.captures += 1
        return r
