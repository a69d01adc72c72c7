"""Predicted decode speed of a placement: per layer, GPU kernels (bytes and a fixed cost per
kernel) plus the host work its mode needs, overlapped as the runtime overlaps them.

Per layer l on a card (k = top-k, h = expected hit rate, b = mean expert bytes of the layer,
B_gpu = read_gbs × kernel_efficiency, B_cpu = CPU NVFP4 kernel GB/s, B_link = slower PCIe direction
× (1 - pcie_frac), the rest of the link being left to promotions; κ = graph_kernel_us, λ = launch_us,
n_d / n_e = the step's dense / expert kernels per layer, n_o its eager ops (planner.step_shape)):
    dense   = attention/router/norm bytes / B_gpu + context × KV bytes per token / B_kv + n_d·κ
              (B_kv = the profile's attn_kv_gbs: the attention's cost per extra key, B_gpu if absent;
              n_d·κ is fused_layer_us + 2κ where the profile measured the fused kernels' time per layer
              and the step runs them all: step_shape.DENSE_QPN)
  a fully resident layer (its card holds all E experts) runs inside the step's CUDA graph:
    layer   = dense + k·b / B_gpu + n_e·κ + lookup          no sync; its lookup is deferred
  a layer that can miss ends its graph segment after the router and runs its MoE eagerly:
    gpu(m)  = (k - m)·b / B_gpu + [m < k]·n_e·κ              its hits, grouped QPN kernel
    cpu(m)  = m·b / B_cpu + [m > 0]·(dispatch + 2·H·2 / B_link)   m misses of one token
              (activations fp16 down, the combined expert output fp16 up)
    layer   = dense + layer_sync + lookup + n_o·λ + E_m[max(gpu(m), cpu(m))]
  with its hits inside the decode graph (step shape miss_nodes > 0) and a profile that measured
  the path's host round trip (overheads.link_us: replay, wait for the routed row, the CPU's sum to
  pinned memory), layer_sync + n_o·λ become link_us, the lookup runs while the next segment runs
  (it costs max(0, lookup - dense)), and the path's graph nodes outside that round trip and the
  grouped kernel (the saves, the next graph's cast and add) cost miss_nodes·κ.
              m ~ Binomial(k, 1 - h): each of the token's k choices misses independently with
              probability 1 - h (an approximation when routing is skewed).
token = Σ layers + head ((final norm + lm_head) / B_head + n_head·κ) + hops (H·2 / B_link + hop_us per
boundary between two physical GPUs, and the sampled token's 8 bytes back to the first layer's GPU; logical
cards on one GPU share its device; hop_us = λ of the receiving card where the profile has none) + token_us;
B_head = the profile's dense_gemv_gbs for a head stored at 16 bits (a dense matmul; B_gpu if absent),
B_gpu for a quantized one.
With the overlapped decode (req.overlap) and every layer resident, step t + 1 runs while the host
does step t's work (reading the token, lookups, token_us), so token = max(GPU part, host part).
On a CPU-only plan every byte goes through B_cpu, no syncs, no kernels counted.
Promotion budget per token = pcie_frac × link × token time (the most promotions may use).
"""
from __future__ import annotations

import math

from hybrid.planner.memory import kv_bytes_per_token_layer
from hybrid.planner.model_bytes import ModelBytes
from hybrid.planner.plan import CardPlan, LayerPrediction, Prediction
from hybrid.planner.profile import HardwareProfile
from hybrid.planner.step_shape import DENSE_QPN, ROUTE_PLAN_MAX_K, StepShape, decode_shape

US = 1e6


def predict(mb: ModelBytes, prof: HardwareProfile, cards: tuple[CardPlan, ...], hits: list[float],
            req, shape: StepShape | None = None) -> Prediction:
    shape = decode_shape() if shape is None else shape
    cfg = mb.config
    ctx = min(req.context, req.kv_tokens) if cards else req.context
    kv_tok = kv_bytes_per_token_layer(cfg, req.kv_dtype)                 # one layer's K and V of one token
    kvread = ctx * kv_tok
    cpu_bw = prof.cpu.nvfp4_kernel_gbs.value * 1e9
    layers, gpu_bytes, cpu_bytes, pcie_bytes, kv_us = [], 0.0, 0.0, 0.0, 0.0
    card_of = {layer: c for c in cards for layer in range(*c.layers)}
    for layer in range(cfg.num_hidden_layers):
        c = card_of.get(layer)
        dense, b = mb.layer_dense[layer] + kvread, mb.expert_mean(layer)
        if c is None:
            k = cfg.num_experts_per_tok
            t = (dense + k * b) / cpu_bw * US
            cpu_bytes += dense + k * b
            layers.append(LayerPrediction(layer, -1, 0, 0.0, 0.0, 0.0, t, t))
            continue
        x = _card_layer(mb, prof, c, layer, hits[layer], mb.layer_dense[layer], kvread, req, shape)
        layers.append(x)
        kv_us += kv_tok / prof.gpus[c.device].kv_bytes_per_s * US
        k, h = cfg.num_experts_per_tok, hits[layer]
        gpu_bytes += dense + k * h * b
        cpu_bytes += k * (1 - h) * b
        pcie_bytes += (1.0 - miss_distribution(k, h)[0]) * _act_bytes(cfg)
    head = mb.head_bytes + mb.final_norm
    if cards:
        last = prof.gpus[cards[-1].device]
        head_kern = shape.head_kernels * last.graph_kernel_us.value
        head_bw = last.dense_bytes_per_s if mb.head_unquantized else last.kernel_bytes_per_s
        t_head = head / head_bw * US + head_kern
        gpu_bytes += head
        t_hops, hop_bytes = _hops(prof, cards, cfg.hidden_size * 2, req.pcie_frac)
        pcie_bytes += hop_bytes
        link_min = min(prof.gpus[c.device].link_bytes_per_s for c in cards)
    else:
        t_head, t_hops, link_min, head_kern = head / cpu_bw * US, 0.0, 0.0, 0.0
        cpu_bytes += head
    host_us = sum(x.host_us for x in layers) + prof.overheads.token_us.value
    token_us = sum(x.total_us for x in layers) + t_head + t_hops + prof.overheads.token_us.value
    if req.overlap and cards and all(x.resident for x in layers):
        token_us = max(token_us - host_us, host_us)
    return Prediction(
        context=ctx, tok_s=US / token_us, token_us=token_us,
        hit_rate=sum(hits) / len(hits), gpu_bytes=int(gpu_bytes), cpu_bytes=int(cpu_bytes),
        pcie_bytes=int(pcie_bytes),
        promotion_budget_bytes=int(req.pcie_frac * link_min * token_us / US),
        layers=tuple(layers), host_us=host_us, kernel_us=sum(x.kernel_us for x in layers) + head_kern,
        hop_us=t_hops, kv_us=kv_us)


def _card_layer(mb: ModelBytes, prof: HardwareProfile, c: CardPlan, layer: int, h: float, dense: float,
                kvread: float, req, shape: StepShape) -> LayerPrediction:
    """One layer on a card: graphed and sync-free when all its experts are resident, else eager MoE."""
    cfg, oh, gpu = mb.config, prof.overheads, prof.gpus[c.device]
    k, b, slots = cfg.num_experts_per_tok, mb.expert_mean(layer), c.slots_per_layer[layer - c.layers[0]]
    bw, link = gpu.kernel_bytes_per_s, gpu.link_bytes_per_s * (1 - req.pcie_frac)
    kus = gpu.graph_kernel_us.value
    dense_fixed = dense_fixed_us(gpu, shape)
    t_dense = dense / bw * US + kvread / gpu.kv_bytes_per_s * US + dense_fixed
    if slots >= cfg.num_experts:                                   # resident: inside the graph
        nk = shape.resident_expert_kernels if k <= ROUTE_PLAN_MAX_K else shape.expert_kernels
        t_gpu = k * b / bw * US + nk * kus
        host = oh.lookup_us.value
        return LayerPrediction(layer, c.card, slots, h, t_dense, t_gpu, 0.0, t_dense + t_gpu + host,
                               host_us=host, kernel_us=dense_fixed + nk * kus, resident=True)
    gpu_t = lambda m: (k - m) * b / bw * US + (m < k) * shape.expert_kernels * kus  # noqa: E731
    cpu_t = lambda m: (m * b / (prof.cpu.nvfp4_kernel_gbs.value * 1e9) * US  # noqa: E731
                       + (m > 0) * (oh.cpu_dispatch_us.value + _act_bytes(cfg) / link * US))
    probs = miss_distribution(k, h)
    t_gpu = sum(p * gpu_t(m) for m, p in enumerate(probs))
    t_cpu = sum(p * cpu_t(m) for m, p in enumerate(probs))
    t_both = sum(p * max(gpu_t(m), cpu_t(m)) for m, p in enumerate(probs))
    if shape.miss_nodes and oh.link_us is not None:   # hits in the graph: one measured round trip; the
        host = oh.link_us.value + max(0.0, oh.lookup_us.value - t_dense)   # lookup hides behind the next dense part
    else:
        host = oh.layer_sync_us.value + oh.lookup_us.value + shape.eager_ops * gpu.launch_us.value
    nodes = shape.miss_nodes * kus                       # the linked path's extra graph nodes
    kern = dense_fixed + (1.0 - probs[k]) * shape.expert_kernels * kus + nodes
    return LayerPrediction(layer, c.card, slots, h, t_dense, t_gpu, t_cpu, t_dense + host + t_both + nodes,
                           host_us=host, kernel_us=kern, resident=False)


def dense_fixed_us(gpu, shape: StepShape) -> float:
    """The fixed GPU µs of a layer's dense part: the profile's measured fused kernels per layer plus the two
    dense QPN launches where every fused part is in effect and the profile has the figure, else n_d·κ."""
    kus = gpu.graph_kernel_us.value
    if shape.fused_dense and gpu.fused_layer_us is not None:
        return gpu.fused_layer_us.value + DENSE_QPN * kus
    return shape.dense_kernels * kus


def _hops(prof: HardwareProfile, cards: tuple[CardPlan, ...], hop_bytes: int, pcie_frac: float):
    """(us, PCIe bytes) of a decode step's crossings between physical GPUs: the hidden state at each
    layer split, and the sampled token back from the head's GPU to the first layer's for the next
    step's embedding (8 bytes). Each costs its bytes over the link plus overheads.hop_us (the
    receiving card's launch_us where the profile has no crossing figure)."""
    t, n = 0.0, 0
    pairs = [(a, b, hop_bytes) for a, b in zip(cards, cards[1:])] + [(cards[-1], cards[0], 8)]
    for a, b, nbytes in pairs:
        if a.device == b.device:
            continue                              # logical cards on one GPU: the same device
        link = min(prof.gpus[a.device].link_bytes_per_s, prof.gpus[b.device].link_bytes_per_s)
        fixed = prof.overheads.hop_us.value if prof.overheads.hop_us else prof.gpus[b.device].launch_us.value
        t += nbytes / (link * (1 - pcie_frac)) * US + fixed
        n += nbytes
    return t, n


def _act_bytes(cfg) -> int:
    """fp16 activations down + the combined expert output up, one token."""
    return 2 * cfg.hidden_size * 2


def miss_distribution(k: int, h: float) -> list[float]:
    """P(m misses among a token's k choices), m = 0..k, each missing with probability 1 - h."""
    q = 1.0 - h
    return [math.comb(k, m) * q**m * h ** (k - m) for m in range(k + 1)]
