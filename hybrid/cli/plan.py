"""hybrid-plan: print where a model's layers, KV and expert slots go, and the predicted tok/s.

Loads no weights: the model's bytes come from its safetensors headers (or config.json alone with
--assume-quant), the hardware from a profile (profiles/NAME.json or a file).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybrid.cli.common import OneLineParser, add_debug_flag, run_cli
from hybrid.errors import HybridError, PlanError
from hybrid.model.head import HEAD_TYPES
from hybrid.planner import (ModelBytes, Plan, PlanRequest, find_popularity, load_popularity, load_profile,
                            make_plan)
from hybrid.planner.build import AUTO_CHUNK_SLOT_LOSS, AUTO_CHUNKS, BASE_CHUNK
from hybrid.planner.memory import KV_DTYPES, PREFILL_STAGE_GROUP
from hybrid.planner.model_bytes import ASSUMED_QUANTS
from hybrid.planner.prefill import prefill_lines
from hybrid.planner.render import render


def add_plan_arguments(p: argparse.ArgumentParser, profile_required: bool = True) -> None:
    """The placement flags shared by hybrid-plan and hybrid-run (read back by request_from_args)."""
    p.add_argument("--profile", required=profile_required, metavar="NAME|FILE",
                   help="hardware profile: a name in profiles/ (e.g. v100x2-e5v4, h200) or a .json path")
    p.add_argument("--layer-split", default="auto", metavar="N|auto",
                   help="layers [0,N) on the first card, [N,L) on the next (comma list for more cards); "
                        "auto = best predicted tok/s that fits (default)")
    p.add_argument("--gpus", default=None, metavar="0,1",
                   help="profile GPU index per logical card; repeat one (0,0) for logical cards on one GPU; "
                        "'none' = CPU only (default: every GPU of the profile)")
    p.add_argument("--kv-resident", type=int, default=4096, metavar="T", help="KV tokens kept per card (default 4096)")
    p.add_argument("--kv-dtype", default="fp16", choices=KV_DTYPES, help="KV cache type (default fp16)")
    p.add_argument("--lm-head", default="keep", choices=HEAD_TYPES,
                   help="the output head as hybrid-run --lm-head stores it (default keep)")
    p.add_argument("--cache-slots", default="auto", metavar="N|auto",
                   help="expert-cache slots per card (one value or one per card); auto = fill what is left")
    p.add_argument("--vram-cap", default=None, metavar="GIB",
                   help="VRAM each card may use, GiB (one value or one per card); default: the GPU's "
                        "memory shared among its logical cards")
    p.add_argument("--pcie-frac", type=float, default=0.1, metavar="F",
                   help="fraction of the PCIe link promotions may use, 0..0.9 (default 0.1)")
    p.add_argument("--context", type=int, default=1024, metavar="T",
                   help="context length the tok/s prediction is for (default 1024, capped at --kv-resident)")
    p.add_argument("--prefill-chunk", default="auto", metavar="N|auto",
                   help=f"prefill chunk tokens, sizes the workspace (default auto: the largest of "
                        f"{', '.join(map(str, AUTO_CHUNKS))} whose workspace costs no card more than "
                        f"{AUTO_CHUNK_SLOT_LOSS * 100:.0f}%% of its expert slots, else {BASE_CHUNK})")
    p.add_argument("--experts", default=None, metavar="FILE",
                   help="expert-popularity profile (default: profiles/<model folder name>.experts.json if present; "
                        "else uniform routing)")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="hybrid-plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, metavar="DIR", help="Hugging Face model folder")
    add_plan_arguments(p)
    p.add_argument("--assume-quant", default="nvfp4", choices=ASSUMED_QUANTS,
                   help="quantization assumed when the folder has only config.json (default nvfp4)")
    p.add_argument("--prefill-offload-min", default="auto", metavar="N|auto",
                   help="as hybrid-run on CUDA: prefill steps of >= N tokens stream the experts their card "
                        "misses instead of running them on the CPU; auto (default) = the cost model's "
                        "threshold from the hardware profile (hybrid.planner.prefill); N > 0 or auto "
                        f"reserves each card's staging (6 x {PREFILL_STAGE_GROUP} expert slots) unless the "
                        "model says streaming never pays; 0 = offload off, nothing reserved")
    p.add_argument("--per-layer", action="store_true", help="also print the per-layer prediction")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_debug_flag(p)
    return p


def parse_ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise HybridError(f"{flag} {text}: expected an integer or a comma list of integers") from None


def parse_chunk(text: str | None) -> int | None:
    """--prefill-chunk (hybrid-plan and hybrid-run): None or 'auto' -> None (the plan's chunk), else the
    token count."""
    if text in (None, "auto"):
        return None
    n, *more = parse_ints("--prefill-chunk", text)
    if more:
        raise HybridError(f"--prefill-chunk {text}: expected one integer or auto")
    return n


def parse_floats(flag: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise HybridError(f"{flag} {text}: expected a number or a comma list of numbers") from None


def request_from_args(args, num_gpus: int) -> PlanRequest:
    """A PlanRequest from the shared planner flags (hybrid-run uses the same ones)."""
    if args.gpus is None:
        gpus = tuple(range(num_gpus))
    elif args.gpus.lower() in ("none", "cpu", ""):
        gpus = ()
    else:
        gpus = parse_ints("--gpus", args.gpus)
    split = None if args.layer_split == "auto" else parse_ints("--layer-split", args.layer_split)
    slots = None if args.cache_slots == "auto" else parse_ints("--cache-slots", args.cache_slots)
    cap = None if args.vram_cap is None else parse_floats("--vram-cap", args.vram_cap)
    if split is not None and len(gpus) < 2:
        raise PlanError(f"--layer-split {args.layer_split}: needs two or more cards in --gpus "
                        f"(e.g. --gpus 0,0 for two logical cards on one GPU)")
    offload = parse_offload_min(getattr(args, "prefill_offload_min", "0"))
    return PlanRequest(gpus=gpus, layer_split=split, kv_tokens=args.kv_resident, kv_dtype=args.kv_dtype,
                       cache_slots=slots, vram_cap_gib=cap, pcie_frac=args.pcie_frac,
                       context=args.context, prefill_chunk=parse_chunk(args.prefill_chunk),
                       prefill_stage=PREFILL_STAGE_GROUP if offload is None or offload else 0,
                       prefill_offload_min=offload)


def parse_offload_min(text) -> int | None:
    """--prefill-offload-min: 'auto' -> None (the cost model's), else a token count >= 0 (0 = off)."""
    if text is None or str(text).strip().lower() == "auto":
        return None
    try:
        n = int(str(text).strip())
    except ValueError:
        n = -1
    if n < 0:
        raise HybridError(f"--prefill-offload-min {text}: expected auto or a token count >= 0 (0 = off)")
    return n


def plan_from_args(args) -> Plan:
    """The Plan for --model and the placement flags (loads headers and profiles, no weights)."""
    from hybrid.model.registry import EMBEDDED, resolve_model_path

    model = resolve_model_path(args.model) if args.model in EMBEDDED else Path(args.model)
    if not model.is_dir():
        raise HybridError(f"--model {args.model}: no such folder")
    prof = load_profile(args.profile)
    mb = ModelBytes.from_folder(model, assume=getattr(args, "assume_quant", None)).with_head(args.lm_head)
    experts = Path(args.experts) if args.experts else find_popularity(model)
    pop = load_popularity(experts, mb.config) if experts else None
    req = request_from_args(args, len(prof.gpus))
    return make_plan(mb, prof, req, pop, model=model.resolve().name,
                     experts_path=str(experts) if experts else None)


def body(args) -> int:
    plan = plan_from_args(args)
    print(plan.to_json() if args.json else "\n".join([render(plan, per_layer=args.per_layer),
                                                      *prefill_lines(plan.prefill)]))
    return 0


def main(argv=None) -> int:
    return run_cli(body, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
