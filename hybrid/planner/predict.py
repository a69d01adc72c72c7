"""Predicted decode speed of a placement: a roofline per layer, overlapped as the runtime overlaps.

Per layer l on a card (k = top-k, h = expected hit rate, b = mean expert bytes of the layer,
B_gpu = read_gbs × kernel_efficiency, B_cpu = CPU NVFP4 kernel GB/s, B_link = slower PCIe direction
× (1 - pcie_frac), the rest of the link being left to promotions):
    dense   = (attention/router/norm bytes + context × KV bytes per token) / B_gpu
    cpu(m)  = m·b / B_cpu + [m > 0]·(dispatch + 2·H·2 / B_link)   m misses of one token
              (activations fp16 down, the combined expert output fp16 up)
    gpu(m)  = (k - m)·b / B_gpu                                   its hits, grouped QPN kernel
    layer   = dense + layer_sync + E_m[max(gpu(m), cpu(m))]       hits and misses run concurrently
              m ~ Binomial(k, 1 - h): each of the token's k choices misses independently with
              probability 1 - h (an approximation when routing is skewed).
token = Σ layers + head (final norm + lm_head) / B_gpu + hops (H·2 / B_link + layer_sync per
card boundary) + token overhead.  On a CPU-only plan every byte goes through B_cpu, no syncs.
Promotion budget per token = pcie_frac × link × token time (the most promotions may use).
"""
from __future__ import annotations

import math

from hybrid.planner.memory import kv_bytes_per_token_layer
from hybrid.planner.model_bytes import ModelBytes
from hybrid.planner.plan import CardPlan, LayerPrediction, Prediction
from hybrid.planner.profile import HardwareProfile

US = 1e6


def predict(mb: ModelBytes, prof: HardwareProfile, cards: tuple[CardPlan, ...], hits: list[float],
            req) -> Prediction:
    cfg = mb.config
    ctx = min(req.context, req.kv_tokens) if cards else req.context
    kvread = ctx * kv_bytes_per_token_layer(cfg, req.kv_dtype)
    cpu_bw = prof.cpu.nvfp4_kernel_gbs.value * 1e9
    oh = prof.overheads
    layers, gpu_bytes, cpu_bytes, pcie_bytes = [], 0.0, 0.0, 0.0
    card_of = {layer: c for c in cards for layer in range(*c.layers)}
    k, act = cfg.num_experts_per_tok, 2 * cfg.hidden_size * 2
    for layer in range(cfg.num_hidden_layers):
        b, dense = mb.expert_mean(layer), mb.layer_dense[layer] + kvread
        c = card_of.get(layer)
        if c is None:
            t = (dense + k * b) / cpu_bw * US
            cpu_bytes += dense + k * b
            layers.append(LayerPrediction(layer, -1, 0, 0.0, 0.0, 0.0, t, t))
            continue
        gpu = prof.gpus[c.device]
        bw, link = gpu.kernel_bytes_per_s, gpu.link_bytes_per_s * (1 - req.pcie_frac)
        h = hits[layer]
        t_dense = dense / bw * US
        gpu_t = lambda m: (k - m) * b / bw * US  # noqa: E731  m = misses of one token
        cpu_t = lambda m: m * b / cpu_bw * US + (m > 0) * (oh.cpu_dispatch_us.value + act / link * US)  # noqa: E731
        probs = miss_distribution(k, h)
        t_gpu = sum(p * gpu_t(m) for m, p in enumerate(probs))
        t_cpu = sum(p * cpu_t(m) for m, p in enumerate(probs))
        t_both = sum(p * max(gpu_t(m), cpu_t(m)) for m, p in enumerate(probs))
        p_miss = 1.0 - probs[0]
        total = t_dense + oh.layer_sync_us.value + t_both
        layers.append(LayerPrediction(layer, c.card, c.slots_per_layer[layer - c.layers[0]], h,
                                      t_dense, t_gpu, t_cpu, total))
        gpu_bytes += dense + k * h * b
        cpu_bytes += k * (1 - h) * b
        pcie_bytes += p_miss * act
    head = mb.head_bytes + mb.final_norm
    if cards:
        last = prof.gpus[cards[-1].device]
        t_head = head / last.kernel_bytes_per_s * US
        gpu_bytes += head
        hop_bytes = cfg.hidden_size * 2
        link_min = min(prof.gpus[c.device].link_bytes_per_s for c in cards)
        t_hops = (len(cards) - 1) * (hop_bytes / (link_min * (1 - req.pcie_frac)) * US
                                     + oh.layer_sync_us.value)
        pcie_bytes += (len(cards) - 1) * hop_bytes
    else:
        t_head, t_hops, link_min = head / cpu_bw * US, 0.0, 0.0
        cpu_bytes += head
    token_us = sum(x.total_us for x in layers) + t_head + t_hops + oh.token_us.value
    return Prediction(
        context=ctx, tok_s=US / token_us, token_us=token_us,
        hit_rate=sum(hits) / len(hits), gpu_bytes=int(gpu_bytes), cpu_bytes=int(cpu_bytes),
        pcie_bytes=int(pcie_bytes),
        promotion_budget_bytes=int(req.pcie_frac * link_min * token_us / US),
        layers=tuple(layers))


def miss_distribution(k: int, h: float) -> list[float]:
    """P(m misses among a token's k choices), m = 0..k, each missing with probability 1 - h."""
    q = 1.0 - h
    return [math.comb(k, m) * q**m * h ** (k - m) for m in range(k + 1)]
