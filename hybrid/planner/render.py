"""Plain-text rendering of a Plan (tables aligned with spaces; no colour, pipes well)."""
from __future__ import annotations

from hybrid.planner.memory import GIB, MIB
from hybrid.planner.plan import Plan


def _g(n: float) -> str:
    return f"{n / GIB:.2f}"


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """Columns before `left` are left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < left else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    return [fmt(header), *(fmt(r) for r in rows)]


def render(plan: Plan, per_layer: bool = False) -> str:
    i, p, h = plan.inputs, plan.prediction, plan.host
    lines = [f"model    {i.model}   (bytes from {i.bytes_source})",
             f"profile  {i.profile}   gpus {','.join(map(str, i.gpus)) or 'none (CPU only)'}   "
             f"split {','.join(map(str, i.layer_split)) or '-'}   KV {i.kv_tokens} tokens {i.kv_dtype}   "
             f"prefill chunk {i.prefill_chunk}" + (f" ({i.prefill_chunk_note})" if i.prefill_chunk_note else ""), ""]
    rows = [[str(c.card), str(c.device), c.name, f"{c.layers[0]}-{c.layers[1] - 1}", _g(c.dense_bytes),
             _g(c.kv_bytes), _g(c.workspace_bytes), f"{c.slots}", f"{c.slot_bytes / MIB:.2f}",
             _g(c.cache_bytes), _g(c.used_bytes), _g(c.cap_bytes), _g(c.free_bytes)]
            for c in plan.cards]
    if rows:
        lines += _table(["card", "gpu", "name", "layers", "dense", "KV", "work", "slots", "slot MiB",
                         "cache", "used", "cap", "free"], rows, left=4)
        lines.append("(GiB unless marked)")
    lines += ["", f"host     expert store {_g(h.expert_store_bytes)} GiB"
              + (f" + embedding {_g(h.dense_bytes)} GiB" if plan.cards else
                 f" + dense {_g(h.dense_bytes)} GiB + KV {_g(h.kv_bytes)} GiB")
              + f" + reserve {_g(h.reserve_bytes)} GiB = {_g(h.used_bytes)} of {_g(h.ram_cap_bytes)} GiB usable; "
              f"{h.hugepages_2m} x 2 MiB hugepages ({h.hugepages_2m_reserved} reserved)", ""]
    lines += [f"predicted decode @ {p.context} tokens context: {p.tok_s:.1f} tok/s "
              f"({p.token_us / 1000:.2f} ms/token), expert hit rate {100 * p.hit_rate:.1f}%",
              f"  per token: GPU reads {p.gpu_bytes / 1e9:.3f} GB, CPU reads {p.cpu_bytes / 1e9:.3f} GB, "
              f"PCIe {p.pcie_bytes / 1e3:.1f} kB (+ up to {p.promotion_budget_bytes / 1e6:.2f} MB promotions "
              f"at --pcie-frac {i.pcie_frac})",
              f"  of the {p.token_us / 1000:.2f} ms: host work {p.host_us / 1000:.2f} ms (syncs, cache lookups, "
              f"eager ops, per-token), fixed kernel cost {p.kernel_us / 1000:.2f} ms; resident (graphed, "
              f"no sync) layers {sum(x.resident for x in p.layers)} of {len(p.layers)}"
              + (f"; crossings between GPUs (hidden state, sampled token) {p.hop_us:.1f} us" if p.hop_us else "")]
    if per_layer:
        lines += [""] + _table(["layer", "card", "slots", "hit %", "dense us", "gpu exp us", "cpu exp us",
                                "host us", "total us"],
                               [[str(x.layer), str(x.card), str(x.slots), f"{100 * x.hit_rate:.1f}",
                                 f"{x.dense_us:.1f}", f"{x.gpu_experts_us:.1f}", f"{x.cpu_experts_us:.1f}",
                                 f"{x.host_us:.1f}", f"{x.total_us:.1f}"] for x in p.layers])
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
