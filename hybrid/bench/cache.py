"""hybrid-bench cache: replay a routing trace against the cache policies for several slot counts.

Rows: lru (cold start), lfu-decay (decayed frequency without the promotion margin, cold start),
static (top experts of --profile, fixed), ours (the runtime default: lfu-decay with its margin,
warm-started from --profile when one is given), belady (offline optimum with its best warm start
and no PCIe budget: the upper bound). One cache holds every layer with --slots experts per layer;
--budget-experts caps promotions per step over all layers (the others are unbounded).
If the trace carries the run's own caches (a `hybrid-run --trace` file), a first line says
whether their replay reproduces the hits the run recorded.
"""
from __future__ import annotations

import argparse
import json

from hybrid.cli.common import int_at_least
from hybrid.errors import HybridError
from hybrid.experts.policy import OURS
from hybrid.experts.popularity import load_profile
from hybrid.experts.replay import ReplayResult, belady, replay, verify
from hybrid.experts.trace import Trace, read_trace

HELP = "expert-cache what-if: hit rates of lru, lfu-decay, static, ours and Belady on a routing trace"
ROWS = ("lru", "lfu-decay", "static", "ours", "belady")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, metavar="FILE",
                   help="routing trace (JSONL) from hybrid-run --trace")
    p.add_argument("--slots", default=None, metavar="N,N,...",
                   help="slots per layer to try (default: top_k, 2x, 4x, ... up to the expert count)")
    p.add_argument("--profile", metavar="FILE", help="expert-popularity profile (<model>.experts.json) "
                   "for the static row and the warm start of ours")
    p.add_argument("--budget-experts", type=int_at_least(0), default=None, metavar="N",
                   help="promotions allowed per step over all layers (default: unbounded)")
    p.add_argument("--half-life", type=float, default=OURS["half_life"],
                   help="ours: score half-life in steps (default %(default)s)")
    p.add_argument("--margin", type=float, default=OURS["margin"],
                   help="ours: promotion margin, in uses (default %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON record per (policy, slots) instead of a table")


def slot_counts(arg: str | None, trace: Trace) -> list[int]:
    e, k = trace.header.num_experts, trace.header.top_k
    if arg is None:
        out, n = [], k
        while n < e:
            out.append(n)
            n *= 2
        return out + [e]
    try:
        out = [int(x) for x in arg.split(",") if x.strip()]
    except ValueError:
        raise HybridError(f"--slots: expected comma-separated integers, got {arg!r}") from None
    if not out or any(not 0 <= n <= e for n in out):
        raise HybridError(f"--slots: each count must be in 0..{e} (experts per layer), got {arg!r}")
    return out


def rows_for(trace: Trace, slots: int, args, profile) -> list[ReplayResult]:
    b = args.budget_experts
    ours = {"name": "lfu-decay", "half_life": args.half_life, "margin": args.margin}
    out = [replay(trace, "lru", slots, budget_experts=b),
           replay(trace, {"name": "lfu-decay", "half_life": args.half_life, "margin": 0.0}, slots,
                  budget_experts=b, name="lfu-decay")]
    if profile is not None:
        out.append(replay(trace, "static", slots, profile=profile, warm=True, budget_experts=b))
    out.append(replay(trace, ours, slots, profile=profile, warm=profile is not None,
                      budget_experts=b, name="ours"))
    out.append(belady(trace, slots))
    return out


def run(args) -> int:
    trace = read_trace(args.trace)
    profile = load_profile(args.profile) if args.profile else None
    if profile is not None and (profile.num_layers, profile.num_experts) != (
            trace.header.num_layers, trace.header.num_experts):
        raise HybridError(f"{args.profile}: profile is {profile.num_layers} layers x "
                          f"{profile.num_experts} experts, trace {args.trace} is "
                          f"{trace.header.num_layers} x {trace.header.num_experts}")
    if trace.header.cards and not args.json:
        bad = verify(trace)
        print(f"run replay: {'matches the recorded hits' if not bad else bad[0]}")
    records = []
    for slots in slot_counts(args.slots, trace):
        for r in rows_for(trace, slots, args, profile):
            records.append({"policy": r.name, "slots": slots, "hit_rate": r.hit_rate,
                            "promotions_per_step": r.promotions_per_step,
                            "steps": len(trace.steps), "budget_experts": args.budget_experts})
    print(json.dumps({"trace": args.trace, "model": trace.header.model, "results": records})
          if args.json else table(records, trace))
    return 0


def table(records: list[dict], trace: Trace) -> str:
    h = trace.header
    names = [n for n in ROWS if any(r["policy"] == n for r in records)]
    lines = [f"{h.model}: {len(trace.steps)} steps, {h.num_layers} layers x {h.num_experts} experts, "
             f"top-{h.top_k}; hit rate (promotions/step)",
             f"{'slots':>6} " + " ".join(f"{n:>16}" for n in names)]
    for slots in sorted({r["slots"] for r in records}):
        cells = {r["policy"]: r for r in records if r["slots"] == slots}
        lines.append(f"{slots:>6} " + " ".join(
            f"{cells[n]['hit_rate']:>8.1%} ({cells[n]['promotions_per_step']:>5.1f})" for n in names))
    return "\n".join(lines)
