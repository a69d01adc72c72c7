"""hybrid-bench calibrate: measure this machine and write a hardware profile for the planner.

Measures per GPU: device read (a large read-only reduction) and copy bandwidth, pinned PCIe
H2D/D2H, the CUDA context's memory, the router-ids round trip, the GPU time of one small kernel
inside a CUDA graph (a captured chain of tiny kernels, replayed) and the host time to issue one
eager op; on the CPU: a STREAM-like copy with all physical cores, a thread hand-off, the expert
cache's lookup of one layer's routed ids (hybrid.experts.cache.ExpertCache, 48 layers x 128
experts, top-8), and the NVFP4 expert kernel's GB/s through the real CpuExpertRunner on
Qwen3-30B-A3B expert shapes (cpu/bench.py) if the cpu/ package provides it, at M = 1 and at M = 8
rows per expert (their ratio: how the CPU's cost grows with a prefill step's rows). Figures it cannot measure come from --base (a profile) or defaults, marked "assumed".
Without a GPU it writes a CPU-only profile (gpus = []).
"""
from __future__ import annotations

import datetime
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hybrid.baselines.report import git_sha
from hybrid.cli.common import int_at_least
from hybrid.hardware import detect
from hybrid.planner.profile import (SCHEMA, CPUProfile, Figure, GPUProfile, HardwareProfile, HostProfile,
                                    Overheads, load_profile, profile_from_dict)

HELP = "measure GPU/PCIe/CPU bandwidths and write a hardware profile (profiles/NAME.json)"
MIB, GIB = 2**20, 2**30

DEFAULTS = {  # used when neither a measurement nor --base gives the figure
    "kernel_efficiency": (0.7, "default: QPN kernels' share of read bandwidth on decode shapes (calibrate "
                               "measures it on a GPU: EFF_HOW)"),
    "context_mib": (500, "default CUDA context + torch runtime reserve"),
    "graph_kernel_us": (3.0, "default: ~3 us per small kernel inside a CUDA graph (H200: results/runtime.md "
                             "section 7.5)"),
    "launch_us": (8.0, "default: host time of one eager torch op + launch on a current x86 host"),
    "nvfp4_m8_ratio": (2.62, "default: time of an M = 8 call over an M = 1 call of the cpu/ NVFP4 kernels "
                             "measured on the lent H200 host, 16 threads (results/cpu_kernels_h200.md, tenth "
                             "session); the cpu/ benchmark hook could not measure it here"),
    "token_us": (1000, "default per-token host work outside the layers (embed, graph replays, sampler, "
                       "Python): ~1.0 ms measured on the H200 host (results/runtime.md section 7.3)"),
}


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, metavar="FILE", help="profile to write, e.g. profiles/mybox.json")
    p.add_argument("--name", default=None, help="profile name (default: the file name without .json)")
    p.add_argument("--base", default=None, metavar="NAME|FILE",
                   help="profile to take unmeasured figures from (e.g. kernel_efficiency)")
    p.add_argument("--gpu-mib", type=int_at_least(1), default=1024, help="GPU buffer size, MiB (default 1024)")
    p.add_argument("--pcie-mib", type=int_at_least(1), default=256, help="PCIe transfer size, MiB (default 256)")
    p.add_argument("--cpu-mib", type=int_at_least(1), default=512, help="CPU copy buffer size, MiB (default 512)")
    p.add_argument("--repeats", type=int_at_least(1), default=10, help="timed repetitions; the median is kept (default 10)")
    p.add_argument("--ram-usable-gib", type=float, default=None,
                   help="RAM hybrid may use (default: MemAvailable)")


def run(args) -> int:
    out = Path(args.out)
    name = args.name or out.name.removesuffix(".json")
    base = load_profile(args.base) if args.base else None
    stamp = _stamp(args)
    prof = calibrate(name, base, args, stamp)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(prof.to_json())
    for line in summary(prof):
        print(line)
    print(f"wrote {out}")
    return 0


def calibrate(name: str, base: HardwareProfile | None, args, stamp: str) -> HardwareProfile:
    import torch

    hw = detect()
    measured = lambda v, how: Figure(round(v, 3), "measured", f"{how}; {stamp}")  # noqa: E731
    gpus = ()
    if torch.cuda.is_available():
        gpus = tuple(_gpu_profile(i, hw, base, args, measured) for i in range(torch.cuda.device_count()))
    cpu = _cpu_profile(hw, base, args, measured)
    ram = args.ram_usable_gib or round(hw.memory.available_bytes / GIB, 1)
    host = HostProfile(ram_usable_gib=ram, hugepages_2m_total=hw.memory.hugepages_total
                       if hw.memory.hugepage_size_bytes == 2 * MIB else 0,
                       reserve_gib=base.host.reserve_gib if base else 4.0)
    sync = measured(_router_sync_us(args.repeats), "top-k of a [1, 128] router row + ids to the host, mean") \
        if gpus else _keep(base, "overheads", "layer_sync_us", 10.0, "no GPU: no host round trip")
    base_link, base_hop = (_base_figure(base, "overheads", key) for key in ("link_us", "hop_us"))
    oh = Overheads(layer_sync_us=sync,
                   cpu_dispatch_us=measured(_dispatch_us(), "ThreadPoolExecutor submit+result of a no-op, "
                                                           "mean (proxy for the CPU runner's hand-off)"),
                   token_us=_keep(base, "overheads", "token_us", *DEFAULTS["token_us"]),
                   lookup_us=measured(_lookup_us(), "ExpertCache.lookup + promote_misses of one token's "
                                      "top-8 in a fully resident layer (48 layers x 128 experts, one "
                                      "begin_step per 48 lookups), mean; the runtime's per-layer "
                                      "accounting comes on top"),
                   link_us=_try(lambda: measured(_link_us(0, args.repeats), LINK_HOW), lambda why: base_link, 0)
                   if gpus else base_link,
                   hop_us=_try(lambda: measured(_hop_us(args.repeats), HOP_HOW), lambda why: base_hop, 1)
                   if len(gpus) >= 2 else base_hop)
    desc = (f"measured by hybrid-bench calibrate on {len(gpus)} GPU(s) "
            f"{', '.join(sorted({g.name for g in gpus})) or '(none)'}, {cpu.model}; {stamp}")
    prof = HardwareProfile(name=name, description=desc, gpus=gpus, cpu=cpu, host=host, overheads=oh)
    return profile_from_dict(json.loads(prof.to_json()), "calibrated profile")   # validates


def _base_figure(base: HardwareProfile | None, section: str, key: str, gpu: int | None = None) -> Figure | None:
    """The base profile's figure (of its GPU `gpu`, or its last GPU, for the gpus section), else None."""
    if base is None:
        return None
    obj = getattr(base, section)
    if gpu is not None:
        obj = obj[min(gpu, len(obj) - 1)] if obj else None
    return getattr(obj, key) if obj is not None else None


def _keep(base: HardwareProfile | None, section: str, key: str, default: float, note: str,
          gpu: int | None = None) -> Figure:
    """A figure from the base profile if it has one, else an assumed default."""
    return _base_figure(base, section, key, gpu) or Figure(default, "assumed", note)


# ---------------------------------------------------------------- GPU


def _gpu_profile(i: int, hw, base, args, measured) -> GPUProfile:
    import torch

    info = next((g for g in hw.gpus if g.index == i), None)
    ctx = _context_mib(i)             # first: before anything allocates on GPU i
    props = torch.cuda.get_device_properties(i)
    n, reps = args.gpu_mib * MIB, args.repeats
    read = _gpu_time(i, n, reps, "read")
    copy = _gpu_time(i, n, reps, "copy")
    h2d, d2h = (_pcie_time(i, args.pcie_mib * MIB, reps, d) for d in ("h2d", "d2h"))
    how = f"{args.gpu_mib} MiB, median of {reps}, CUDA events"
    try:
        kus, per = _graph_kernel_us(i, reps)
    except Exception as exc:  # noqa: BLE001 - _try below falls back to the base figure
        kus, per = exc, MIX_OPS
    keep_eff = lambda why: _keep(base, "gpus", "kernel_efficiency", *DEFAULTS["kernel_efficiency"], gpu=i)  # noqa: E731
    try:
        eff = _kernel_efficiency(i, reps, n / read, _value(kus))
    except Exception as exc:  # noqa: BLE001 - _try below falls back to the base figure
        eff = exc
    return GPUProfile(
        name=props.name, compute_capability=f"{props.major}.{props.minor}",
        memory_mib=props.total_memory // MIB,
        pcie_gen=(info.pcie_gen_max or 0) if info else 0, pcie_width=(info.pcie_width_max or 0) if info else 0,
        read_gbs=measured(n / read / 1e9, f"sum over an fp32 buffer, bytes read / time, {how}"),
        copy_gbs=measured(2 * n / copy / 1e9, f"device copy, bytes read + written / time, {how}"),
        kernel_efficiency=_try(lambda: measured(_value(eff)[0], EFF_HOW), keep_eff, i),
        h2d_gbs=measured(args.pcie_mib * MIB / h2d / 1e9, f"pinned host->device, {args.pcie_mib} MiB, median of {reps}"),
        d2h_gbs=measured(args.pcie_mib * MIB / d2h / 1e9, f"pinned device->host, {args.pcie_mib} MiB, median of {reps}"),
        context_mib=measured(ctx, "NVML used memory after CUDA init minus before, minus torch's reserve")
        if ctx else _keep(base, "gpus", "context_mib", *DEFAULTS["context_mib"], gpu=i),
        graph_kernel_us=_try(lambda: measured(_value(kus), f"one CUDA graph of {CYCLES} groups of a decode layer's small "
                             f"kernels on Qwen3-30B-A3B shapes (RMSNorm, q/k norm, RoPE, KV writes, masked SDPA "
                             f"over 256 keys, router softmax/top-k, residuals; {per} kernels a group, counted by "
                             f"torch.profiler), replay time / kernels, median of {reps}, CUDA events"),
                             lambda why: _keep(base, "gpus", "graph_kernel_us", *DEFAULTS["graph_kernel_us"], gpu=i), i),
        launch_us=_try(lambda: measured(_launch_us(i, reps, per), f"the same groups issued eagerly: host time "
                       f"to issue them / kernels, median of {reps}"),
                       lambda why: _keep(base, "gpus", "launch_us", *DEFAULTS["launch_us"], gpu=i), i),
        attn_kv_gbs=_try(lambda: measured(_attn_kv_gbs(i, reps), ATTN_HOW),
                         lambda why: _base_figure(base, "gpus", "attn_kv_gbs", i), i),
        dense_gemv_gbs=_try(lambda: measured(_dense_gemv_gbs(i, reps), DENSE_HOW),
                            lambda why: _base_figure(base, "gpus", "dense_gemv_gbs", i), i),
        fused_layer_us=_try(lambda: measured(_positive(_value(_value(eff)[1]), "fused_layer_us"),
                                             FUSED_HOW.format(keys=FUSED_KEYS)),
                            lambda why: _base_figure(base, "gpus", "fused_layer_us", i), i),
    )


def _positive(v: float, what: str) -> float:
    """v, or a ValueError when a difference of two timings came out <= 0 (noise: it says nothing)."""
    if not v > 0:
        raise ValueError(f"{what}: measured {v:.2f}, not a positive time")
    return v


def _value(v):
    """v, or raise it when a measurement left its exception there."""
    if isinstance(v, BaseException):
        raise v
    return v


def _try(measure, fallback, gpu: int) -> Figure:
    """A measured figure, or (the measurement raised) the fallback, with a warning on stderr."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - one figure failing must not lose the whole profile
        import sys

        why = f"{type(exc).__name__}: {exc}"
        print(f"warning: gpu {gpu}: measurement failed ({why}); kept the base/default figure", file=sys.stderr)
        return fallback(why)


def _context_mib(i: int) -> float | None:
    """VRAM the CUDA context + runtime take, from NVML before/after init; None if unreadable."""
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        before = pynvml.nvmlDeviceGetMemoryInfo(h).used
        torch.zeros(1, device=f"cuda:{i}")
        torch.cuda.synchronize(i)
        after = pynvml.nvmlDeviceGetMemoryInfo(h).used
        pynvml.nvmlShutdown()
    except Exception:   # noqa: BLE001 - NVML missing or not matching CUDA ordinals: fall back
        return None
    ctx = (after - before - torch.cuda.memory_reserved(i)) / MIB
    return round(ctx, 1) if ctx > 0 else None


def _gpu_time(i: int, nbytes: int, reps: int, what: str) -> float:
    """Median seconds of one read (sum) or copy of an nbytes buffer on GPU i."""
    import torch

    dev = f"cuda:{i}"
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    y = torch.empty_like(x) if what == "copy" else None
    op = (lambda: y.copy_(x)) if what == "copy" else (lambda: x.sum())
    t = _events(dev, op, reps)
    del x, y
    torch.cuda.empty_cache()
    return t


def _pcie_time(i: int, nbytes: int, reps: int, direction: str) -> float:
    import torch

    dev = f"cuda:{i}"
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    op = (lambda: gpu.copy_(host, non_blocking=True)) if direction == "h2d" else \
         (lambda: host.copy_(gpu, non_blocking=True))
    return _events(dev, op, reps)


def _events(dev: str, op, reps: int) -> float:
    import torch

    with torch.cuda.device(dev):
        for _ in range(2):
            op()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            op()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


CYCLES = 16          # decode-layer-like groups of small kernels per timed graph / eager burst
MIX_OPS = 30         # torch ops per group in _small_kernels (kernels when the profiler cannot count)


def _small_bufs(dev) -> dict:
    """Buffers shaped like one Qwen3-30B-A3B decode layer's small operands (H 2048, 32 q / 4 kv
    heads of 128, 256 cached keys, 128 experts)."""
    import torch

    f16, f32 = torch.float16, torch.float32
    return {"x": torch.randn(1, 2048, device=dev, dtype=f16), "w": torch.rand(2048, device=dev, dtype=f32),
            "hw": torch.rand(128, device=dev, dtype=f32), "cs": torch.randn(2, 128, device=dev, dtype=f32),
            "k": torch.zeros(256, 4, 128, device=dev, dtype=f16), "v": torch.zeros(256, 4, 128, device=dev, dtype=f16),
            "mask": torch.zeros(1, 1, 1, 256, device=dev, dtype=f16),
            "pos": torch.zeros(1, dtype=torch.long, device=dev), "router": torch.randn(1, 128, device=dev)}


def _small_kernels(b: dict, cycles: int):
    """The small kernels of a decode layer, weights' bytes aside: RMSNorm, per-head q/k norm, RoPE,
    KV row writes, masked SDPA over 256 keys, router softmax / top-k / renormalise, residuals."""
    import torch
    import torch.nn.functional as F

    x = b["x"]                                                                  # [1, H] fp16
    for _ in range(cycles):
        h = F.rms_norm(x.float(), (2048,), b["w"], 1e-6).to(x.dtype)           # [1, H]
        qk = F.rms_norm(h.float().view(16, 128), (128,), b["hw"], 1e-6)        # [16, D]
        qk = qk * b["cs"][0] + torch.cat((-qk[:, 64:], qk[:, :64]), -1) * b["cs"][1]   # RoPE
        kv = qk[:4].to(x.dtype)[None]                                          # [1, Hkv, D]
        b["k"].index_copy_(0, b["pos"], kv)
        b["v"].index_copy_(0, b["pos"], kv)
        q = torch.cat((qk, qk)).to(x.dtype).view(1, 4, 8, 128)                 # [1, Hkv, g, D]
        o = F.scaled_dot_product_attention(q, b["k"].transpose(0, 1)[None], b["v"].transpose(0, 1)[None],
                                           attn_mask=b["mask"])               # [1, Hkv, g, D]
        x = x + o.reshape(1, 4096)[:, :2048]
        p = torch.softmax(b["router"] + x.float()[:, :128], -1)                 # [1, E]
        wts, ids = torch.topk(p, 8, dim=-1)
        wts = wts / wts.sum(-1, keepdim=True)
        x = x + (wts.sum() * ids.float().mean()).to(x.dtype)
    return x


def _count_kernels(b: dict) -> int:
    """CUDA kernels one _small_kernels group launches (torch.profiler); MIX_OPS if it cannot tell."""
    try:
        return _count_cuda_kernels(lambda: _small_kernels(b, 1)) or MIX_OPS
    except Exception:  # noqa: BLE001 - no CUPTI: one kernel per op
        return MIX_OPS


def _count_cuda_kernels(fn) -> int:
    """CUDA kernels fn() launches (torch.profiler; copies and memsets not counted)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.lower().startswith(("memcpy", "memset")))


def _graph_kernel_us(i: int, reps: int) -> tuple[float, int]:
    """GPU µs per kernel of a captured graph of CYCLES groups of a decode layer's small kernels
    (replay time / kernels), and the kernels per group."""
    import torch

    dev = f"cuda:{i}"
    with torch.cuda.device(dev):
        b = _small_bufs(dev)
        graph = _captured(dev, lambda: _small_kernels(b, CYCLES))
        per = _count_kernels(b)
        t = _events(dev, graph.replay, reps)
    return t / (CYCLES * per) * 1e6, per


def _captured(dev, body):
    """A CUDA graph of body() on device dev: run once eagerly on a side stream (warm-up, lazy
    allocations), then captured on a fresh stream (not torch's once-made capture stream, which
    belongs to the first device it met)."""
    import torch

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(dev)):
        body()
    return graph


def _launch_us(i: int, reps: int, per: int) -> float:
    """Host µs to issue one eager kernel of the same groups (the GPU drains between bursts)."""
    import torch

    dev = f"cuda:{i}"
    with torch.cuda.device(dev):
        b = _small_bufs(dev)
        times = []
        for j in range(reps + 2):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            _small_kernels(b, CYCLES)
            t = time.perf_counter() - t0
            if j >= 2:
                times.append(t)
        torch.cuda.synchronize(dev)
    return statistics.median(times) / (CYCLES * per) * 1e6


ATTN_HEADS = (32, 4, 128)          # query heads, KV heads, head dim: Qwen3-30B-A3B
ATTN_KEYS = (2048, 8192)           # the two key counts whose time difference gives the per-key cost
ATTN_LAYERS = 16                   # launches per timed graph, each on its own KV store
ATTN_HOW = (f"one-token attention as the decode step runs it (hybrid.kernels.fused.rope_attn: q/k norm, RoPE, K/V row, "
            f"attention; {ATTN_HEADS[0]} query / {ATTN_HEADS[1]} KV heads of {ATTN_HEADS[2]}, fp16), {ATTN_LAYERS} launches "
            f"on their own KV stores in one CUDA graph at {ATTN_KEYS[0]} and {ATTN_KEYS[1]} keys: K and V bytes per key / "
            f"the time per extra key, median of the replays")


def kv_rate(t_us: tuple[float, float], keys: tuple[int, int], hkv: int, d: int) -> float:
    """GB/s of K and V (fp16) one attention launch reads per extra key, from its time at two key
    counts; a ValueError where the time did not grow (noise, or a plan that hid the keys)."""
    slope = (t_us[1] - t_us[0]) / (keys[1] - keys[0])
    if not slope > 0:
        raise ValueError(f"attention time did not grow with the keys ({t_us[0]:.2f} us at {keys[0]}, "
                         f"{t_us[1]:.2f} us at {keys[1]})")
    return 2 * hkv * d * 2 / (slope * 1e-6) / 1e9


def _attn_kv_gbs(i: int, reps: int) -> float:
    """kv_rate of fused.rope_attn (the decode step's attention kernel) on GPU i (ATTN_HEADS, ATTN_KEYS,
    ATTN_LAYERS per graph)."""
    import torch

    from hybrid.kernels import fused
    from hybrid.model.layers import Rotary

    dev = f"cuda:{i}"
    hq, hkv, d = ATTN_HEADS
    cap = max(ATTN_KEYS)
    with torch.cuda.device(dev):
        g = torch.Generator(device=dev).manual_seed(0)
        ks = [torch.randn(cap, hkv, d, generator=g, device=dev).half() for _ in range(ATTN_LAYERS)]
        vs = [torch.randn(cap, hkv, d, generator=g, device=dev).half() for _ in range(ATTN_LAYERS)]
        qkv = torch.randn(1, (hq + 2 * hkv) * d, generator=g, device=dev).half()
        norm = torch.ones(d, device=dev)
        table = Rotary(d, 1e6).table(torch.device(dev), cap)
        times = []
        for keys in ATTN_KEYS:
            pos = torch.tensor([keys - 1], device=dev)
            graph = _captured(dev, lambda: [fused.rope_attn(qkv, norm, norm, table, k, v, hq, hkv, d, 1e-6, keys,
                                                            pos=pos) for k, v in zip(ks, vs)])
            times.append(_events(dev, graph.replay, reps) * 1e6 / ATTN_LAYERS)
        del ks, vs
    return kv_rate(tuple(times), ATTN_KEYS, hkv, d)


EFF_LAYERS = 12          # decode layers per timed graph, each with its own weights (past the L2)
EFF_HOW = (f"the QPN kernels of {EFF_LAYERS} Qwen3-30B-A3B decode layers at M = 1 in one CUDA graph, launched as "
           f"the runtime's decode step launches them (NVFP4: the fused q/k/v and o through qpn_linear, 8 experts' "
           f"gate/up/down through qpn_moe; each layer its own weights): packed bytes / (replay time - kernels x "
           f"graph_kernel_us) / read_gbs, median")


def efficiency(nbytes: int, t_us: float, kernels: int, kernel_us: float, read_bytes_per_s: float) -> float:
    """The planner's B_gpu / read_gbs from one timed run: bytes over the time left after each kernel's
    fixed cost (which the planner charges apart, n x graph_kernel_us); a ValueError when the fixed
    costs leave no time (the measurement says nothing about the bandwidth then)."""
    stream_us = t_us - kernels * kernel_us
    if not stream_us > 0.05 * t_us:
        raise ValueError(f"{kernels} kernels x {kernel_us:.2f} us leave no streaming time of {t_us:.1f} us")
    return min(1.0, nbytes / (stream_us * 1e-6) / read_bytes_per_s)


FUSED_HOW = (f"the same {EFF_LAYERS} layers with the fused kernels between their QPN kernels as the runtime's "
             f"decode step launches them (add + RMSNorm, q/k norm + RoPE + KV row + attention over "
             f"{{keys}} keys, add + RMSNorm + router over 128 experts; fp32 norms and router): (that graph's replay "
             f"time - the QPN kernels' graph's) / layers, median")


def _kernel_efficiency(i: int, reps: int, read_bytes_per_s: float, kernel_us: float) -> tuple[float, float]:
    """(efficiency() of EFF_LAYERS decode layers' QPN kernels on GPU i (EFF_HOW), the GPU µs per layer that
    the fused kernels between them add (FUSED_HOW); the second an exception object where it failed)."""
    import torch

    from hybrid.bench.cuda_kernels import random_qweight
    from hybrid.checkpoint.formats import QType
    from hybrid.kernels import QPNExpertSlots, QPNWeight, qpn_linear, qpn_moe

    dev = torch.device("cuda", i)
    h, hq, hkv, d, inter, k = 2048, 32, 4, 128, 768, 8
    nv = QType.NVFP4
    with torch.cuda.device(dev):
        layers = []
        for _ in range(EFF_LAYERS):
            lin = [QPNWeight.from_qweight(random_qweight(nv, n, kk, dev), dev)       # the fused q/k/v, o
                   for n, kk in (((hq + 2 * hkv) * d, h), (h, hq * d))]
            sl = QPNExpertSlots(k, h, inter, nv, dev)
            for s in range(k):
                sl.load(s, random_qweight(nv, inter, h, dev), random_qweight(nv, inter, h, dev),
                        random_qweight(nv, h, inter, dev))
            layers.append((lin, sl))
        x = torch.randn(1, h, device=dev, dtype=torch.float16) * 0.1
        xo = torch.randn(1, hq * d, device=dev, dtype=torch.float16) * 0.1
        ids = torch.arange(k, device=dev, dtype=torch.int32)
        tok = torch.zeros(k, device=dev, dtype=torch.int32)
        rw = torch.full((k,), 1.0 / k, device=dev)

        def body(n_layers=EFF_LAYERS):
            for lin, sl in layers[:n_layers]:
                qpn_linear(x, lin[0])
                qpn_linear(xo, lin[1])
                qpn_moe(x, sl, ids, tok, rw)

        nbytes = sum(sum(w.nbytes for w in lin) + k * sl.nbytes_per_slot for lin, sl in layers)
        graph = _captured(dev, body)
        t_us = _events(str(dev), graph.replay, reps) * 1e6
        kernels = EFF_LAYERS * _count_cuda_kernels(lambda: body(1))
        del graph
        try:
            fused = (_fused_graph_us(dev, reps, layers, ids, tok, rw) - t_us) / EFF_LAYERS
        except Exception as exc:  # noqa: BLE001 - the efficiency stands without it
            fused = exc
        del layers
        torch.cuda.empty_cache()
    return efficiency(nbytes, t_us, kernels, kernel_us, read_bytes_per_s), fused


FUSED_KEYS = 64   # cached keys of the calibration's attention (its KV read: 128 KiB per layer)


def _fused_graph_us(dev, reps: int, layers, ids, tok, rw) -> float:
    """Replay µs of a CUDA graph of _decode_layers(dev, layers, ids, tok, rw)."""
    graph = _captured(dev, _decode_layers(dev, layers, ids, tok, rw))
    t = _events(str(dev), graph.replay, reps) * 1e6
    del graph
    return t


def _decode_layers(dev, layers, ids, tok, rw):
    """A function running one token through the decode layers in `layers` ([q/k/v, o] QPNWeights, expert
    slots) as the runtime's decode step does: add + RMSNorm, q/k/v QPN, fused q/k norm + RoPE + attention,
    o QPN, add + RMSNorm + router, the grouped MoE (over the slots' ids, whatever the router picks)."""
    import torch

    from hybrid.kernels import fused, qpn_linear, qpn_moe

    h, hq, hkv, d, e, k = 2048, 32, 4, 128, 128, 8
    f32 = torch.float32
    cap = FUSED_KEYS
    norm = torch.rand(h, device=dev, dtype=f32) + 0.5
    qkn = torch.rand(d, device=dev, dtype=f32) + 0.5
    table = torch.rand(cap, 2, d, device=dev, dtype=f32)
    pos = torch.tensor([cap - 1], device=dev, dtype=torch.long)
    per = [(torch.randn(e, h, device=dev, dtype=f32) * 0.02,
            torch.randn(cap, hkv, d, device=dev, dtype=torch.float16) * 0.1,
            torch.randn(cap, hkv, d, device=dev, dtype=torch.float16) * 0.1) for _ in layers]
    x0 = torch.randn(1, h, device=dev, dtype=torch.float16) * 0.1
    y0 = torch.zeros(1, h, device=dev, dtype=f32)

    def body():
        x, y = x0, y0
        for (lin, sl), (router, ks, vs) in zip(layers, per):
            x, hn, _ = fused.add_rms_norm(x, norm, 1e-6, delta=y)
            a = fused.rope_attn(qpn_linear(hn, lin[0]), qkn, qkn, table, ks, vs, hq, hkv, d, 1e-6, cap, pos=pos)
            x, hn, _, _ = fused.add_norm_router(x, norm, 1e-6, router, k, True, qpn_linear(a, lin[1]))
            y = qpn_moe(hn, sl, ids, tok, rw)
        return x

    return body


DENSE_SHAPE = (151936, 2048)       # Qwen3's lm_head: the unquantized weight a decode step reads
DENSE_HOW = (f"one token through an fp16 [{DENSE_SHAPE[0]}, {DENSE_SHAPE[1]}] weight (torch.nn.functional.linear, "
             f"cuBLAS: a BF16 lm_head as the runtime runs it), weight bytes / time, median, CUDA events")


def _dense_gemv_gbs(i: int, reps: int) -> float:
    """GB/s of DENSE_SHAPE's fp16 weight in a one-token matmul on GPU i (the weight is past any L2)."""
    import torch
    import torch.nn.functional as F

    dev = f"cuda:{i}"
    with torch.cuda.device(dev):
        w = torch.randn(DENSE_SHAPE, device=dev, dtype=torch.float16) * 0.02
        x = torch.randn(1, DENSE_SHAPE[1], device=dev, dtype=torch.float16)
        t = _events(dev, lambda: F.linear(x, w), reps)
        nbytes = w.numel() * 2
        del w
        torch.cuda.empty_cache()
    return nbytes / t / 1e9


LINK_HOW = ("one graphed can-miss layer's host round trip (hybrid.runtime.miss_link.MissLink, k 8, "
            "H 2048): replay of a graph holding the next layer's add and the routed row's copy to "
            "pinned memory + its external event and the copy up of the last [1, H] fp32 CPU sum, wait "
            "for the event, read the row, write the next sum to pinned memory; mean over a loop, GPU 0")


HOP_WORK = 32           # small kernels per graph: a decode segment's latency-bound work on each card
HOP_ROUNDS = 64         # rounds enqueued ahead per timing (the GPU sets the pace)
HOP_HOW = (f"a decode step's crossing between GPUs 0 and 1: rounds of two CUDA graphs ({HOP_WORK} small kernels "
           f"each on a [1, 2048] fp16 state), the state copied from one card to the other after each graph (as "
           f"the hidden state crosses at the split and the sampled token crosses back), {HOP_ROUNDS} rounds "
           f"enqueued ahead; (time per round - the same rounds with both graphs on GPU 0) / 2 crossings, median")


def _hop_us(reps: int) -> float:
    """HOP_HOW: µs one crossing between GPUs 0 and 1 adds to a round of graph work."""
    import torch

    def ring(devs) -> float:
        stages = []
        for dev in devs:
            with torch.cuda.device(dev):
                x_in = torch.zeros(1, 2048, dtype=torch.float16, device=dev)
                box = {}

                def body(x_in=x_in, box=box):
                    y = x_in
                    for _ in range(HOP_WORK):
                        y = y + 0.001
                    box["out"] = y

                graph = _captured(dev, body)
                stages.append((x_in, graph, box["out"]))

        def rounds():
            for _ in range(HOP_ROUNDS):
                for j, (x_in, graph, _) in enumerate(stages):
                    x_in.copy_(stages[j - 1][2])           # from the other stage: a crossing when on two cards
                    graph.replay()

        times = []
        for _ in range(reps + 1):
            for d in set(devs):
                torch.cuda.synchronize(d)
            t0 = time.perf_counter()
            rounds()
            for d in set(devs):
                torch.cuda.synchronize(d)
            times.append((time.perf_counter() - t0) / HOP_ROUNDS)
        return statistics.median(times[1:]) * 1e6

    two, one = ring(["cuda:0", "cuda:1"]), ring(["cuda:0", "cuda:0"])
    if not two > one:
        raise ValueError(f"rounds on two GPUs ({two:.1f} us) not slower than on one ({one:.1f} us): nothing to charge")
    return (two - one) / 2


def _link_us(i: int, reps: int) -> float:
    """Host µs per can-miss layer on the graphed miss path, the layer's own kernels aside (the
    planner counts them as graph kernels): what hybrid.runtime.graphs does between two segments."""
    import numpy as np
    import torch

    from hybrid.runtime.miss_link import MissLink

    dev = torch.device(f"cuda:{i}")
    with torch.cuda.device(dev):
        link = MissLink(8, 2048, torch.float16, dev)
        h = torch.zeros(1, 2048, dtype=torch.float16, device=dev)
        slots = torch.zeros(8, dtype=torch.int32, device=dev)
        y = np.ones((1, 2048), np.float32)

        def body():
            link.yc.copy_(link.stage, non_blocking=True)   # the next graph's combine: put()'s sum up
            link.yh.add_(link.yc)
            link.send(h, slots)

        graph = _captured(dev, body)

        def layer():
            graph.replay()
            link.after_replay()
            link.fetch()
            link.put(y)

        for _ in range(20):
            layer()
        torch.cuda.synchronize(dev)
        n = max(reps * 50, 200)
        t0 = time.perf_counter()
        for _ in range(n):
            layer()
        torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) / n * 1e6


def _router_sync_us(reps: int) -> float:
    import torch

    logits = torch.randn(1, 128, device="cuda")
    for _ in range(10):
        torch.topk(logits, 8).indices.cpu()
    n = max(reps * 20, 100)
    t0 = time.perf_counter()
    for _ in range(n):
        torch.topk(logits, 8).indices.cpu()
    return (time.perf_counter() - t0) / n * 1e6


# ---------------------------------------------------------------- CPU


def _cpu_profile(hw, base, args, measured) -> CPUProfile:
    copy = _cpu_copy_gbs(args.cpu_mib * MIB, args.repeats, hw.cpu.physical_cores)
    stream = measured(copy, f"torch copy of {args.cpu_mib} MiB fp32, bytes read + written / time, "
                            f"{hw.cpu.physical_cores} threads, median of {args.repeats}")
    kernel = _cpu_kernel_gbs(hw.cpu.physical_cores)
    nvfp4 = measured(kernel, "cpu/ NVFP4 expert kernel, M = 1, all physical cores") if kernel else \
        Figure(round(copy * 0.5, 3), "assumed", "half the measured STREAM copy: the cpu/ NVFP4 kernel "
                                                 "benchmark hook was not importable")
    m8 = _cpu_kernel_gbs(hw.cpu.physical_cores, M=8) if kernel else None
    ratio = measured(kernel / m8, "time of an M = 8 call over an M = 1 call: cpu/ NVFP4 expert kernel "
                                  "GB/s at M = 1 / at M = 8 (8 rows to each of a call's top-8 experts), "
                                  "all physical cores") if m8 else \
        (base and base.cpu.nvfp4_m8_ratio) or Figure(*DEFAULTS["nvfp4_m8_ratio"][:1], "assumed",
                                                     DEFAULTS["nvfp4_m8_ratio"][1])
    return CPUProfile(model=hw.cpu.model, physical_cores=hw.cpu.physical_cores, avx2=hw.cpu.avx2,
                      avx512=hw.cpu.avx512, stream_copy_gbs=stream, nvfp4_kernel_gbs=nvfp4,
                      nvfp4_m8_ratio=ratio)


def _cpu_copy_gbs(nbytes: int, reps: int, threads: int) -> float:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        y = torch.empty_like(x)
        y.copy_(x)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            y.copy_(x)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return 2 * nbytes / statistics.median(times) / 1e9


def _cpu_kernel_gbs(threads: int, M: int = 1) -> float | None:
    """GB/s of packed NVFP4 expert bytes from cpu/'s benchmark hook at M rows per expert, if present.

    Expected hook (written with the CPU engine): `cpu.bench.nvfp4_expert_gbs(threads=N, M=1) -> float`
    (a hook without M gives None for M > 1).
    """
    try:
        from cpu import bench as cpu_bench   # noqa: PLC0415 - optional, lazily imported
        fn = cpu_bench.nvfp4_expert_gbs
    except (ImportError, AttributeError):
        return None
    if M == 1:
        return float(fn(threads=threads))
    try:
        return float(fn(threads=threads, M=M))
    except TypeError:                        # an older hook: M = 1 only
        return None


def _lookup_us(tokens: int = 200, layers: int = 48, experts: int = 128, k: int = 8) -> float:
    """Mean µs of one layer's ExpertCache lookup (+ promote_misses) of one token, fully resident."""
    import numpy as np

    from hybrid.experts.cache import ExpertCache

    cache = ExpertCache(range(layers), experts, experts)
    cache.warm_start({l: range(experts) for l in range(layers)})
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens * layers)])[:, None, :]  # [N, 1, k]
    t0 = time.perf_counter()
    for t in range(tokens):
        cache.begin_step()
        for l in range(layers):
            lk = cache.lookup(l, ids[t * layers + l])
            cache.promote_misses(l, lk)
    return (time.perf_counter() - t0) / (tokens * layers) * 1e6


def _dispatch_us(n: int = 2000) -> float:
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(int).result()
        t0 = time.perf_counter()
        for _ in range(n):
            pool.submit(int).result()
        return (time.perf_counter() - t0) / n * 1e6


# ---------------------------------------------------------------- output


def _stamp(args) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    sha = git_sha(dirty=False)   # a device copy has no .git: HYBRID_GIT_SHA
    return f"{now}, git {sha}, host {_hostname()}"


def _hostname() -> str:
    import socket

    return socket.gethostname()


def summary(prof: HardwareProfile) -> list[str]:
    lines = [f"profile {prof.name} (schema {SCHEMA})"]
    for i, g in enumerate(prof.gpus):
        lines.append(f"  gpu {i} {g.name} sm_{g.compute_capability.replace('.', '')} {g.memory_mib} MiB: "
                     f"read {g.read_gbs.value:.0f} GB/s, copy {g.copy_gbs.value:.0f} GB/s, "
                     f"H2D {g.h2d_gbs.value:.1f} GB/s, D2H {g.d2h_gbs.value:.1f} GB/s, "
                     f"context {g.context_mib.value:.0f} MiB ({g.context_mib.source}), "
                     f"graph kernel {g.graph_kernel_us.value:.2f} us, eager op {g.launch_us.value:.2f} us, "
                     f"QPN kernels {100 * g.kernel_efficiency.value:.0f}% of read ({g.kernel_efficiency.source})"
                     + (f", attention KV {g.attn_kv_gbs.value:.0f} GB/s per extra key ({g.attn_kv_gbs.source})"
                        if g.attn_kv_gbs else "")
                     + (f", dense GEMV {g.dense_gemv_gbs.value:.0f} GB/s ({g.dense_gemv_gbs.source})"
                        if g.dense_gemv_gbs else "")
                     + (f", fused kernels {g.fused_layer_us.value:.1f} us per layer ({g.fused_layer_us.source})"
                        if g.fused_layer_us else ""))
    c = prof.cpu
    lines.append(f"  cpu {c.model}, {c.physical_cores} cores, avx2={c.avx2} avx512={c.avx512}: "
                 f"copy {c.stream_copy_gbs.value:.1f} GB/s, NVFP4 kernel {c.nvfp4_kernel_gbs.value:.1f} GB/s "
                 f"({c.nvfp4_kernel_gbs.source})"
                 + (f", M = 8 call {c.nvfp4_m8_ratio.value:.2f}x an M = 1 call ({c.nvfp4_m8_ratio.source})"
                    if c.nvfp4_m8_ratio else ""))
    o = prof.overheads
    lines.append(f"  overheads: layer sync {o.layer_sync_us.value:.1f} us ({o.layer_sync_us.source}), "
                 f"cpu dispatch {o.cpu_dispatch_us.value:.1f} us, lookup {o.lookup_us.value:.1f} us, "
                 f"token {o.token_us.value:.0f} us ({o.token_us.source})"
                 + (f", graphed miss layer {o.link_us.value:.1f} us ({o.link_us.source})" if o.link_us else "")
                 + (f", GPU crossing {o.hop_us.value:.1f} us ({o.hop_us.source})" if o.hop_us else ""))
    return lines
