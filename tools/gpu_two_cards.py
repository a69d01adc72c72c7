"""The two-physical-GPU call (issue 8), on `nvidia-h200-x2`. Writes $OUT/two_cards.jsonl + a log.

1. How the GPUs are linked (nvidia-smi topo -m, peer access) and the CUDA tests, the two-GPU ones included.
2. hybrid-bench calibrate on this machine (both GPUs) -> $OUT/h200x2.json; every plan below uses it.
3. Tiny model (NVFP4): hybrid-run --gpus 0,1 --layer-split 1|2|3 (and --gpus 0,0 for comparison): greedy
   ids against the CPU reference made on the dev machine (scratch/tiny_ref.json) and the CUDA reference.
4. Qwen3-30B-A3B-shaped synthetic NVFP4 checkpoint: an all-CPU session routes a calibration text into an
   expert profile, the planner's predictions are recorded, then for each configuration the same flags
   on two GPUs (--gpus 0,1) and on one GPU as two logical cards (--gpus 0,0), in this order:
   --vram-cap 16 per card, then --cache-slots N per card (real CPU misses). Per session: decode tok/s
   (CUDA graphs), per-card hit rates, the prediction, and the hidden state's hop between the cards:
   the GPU time of its peer copy in real graphed decode steps (torch.profiler) and a host-timed probe;
   every session is also teacher-forced on the first session's ids (forced_logits) and its logits compared
   with the first's: a flipped greedy id beside a near-tie and a last-bit difference is summation order
   (the MoE down kernels add the experts' rows with fp32 atomics), not the hop.

    HYBRID_CACHE_DIR=.qpncache HYBRID_GIT_SHA=<sha> PYTHONPATH=. python3 tools/gpu_two_cards.py \\
        --tiny-ref scratch/tiny_ref.json --budget-s 420
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_runtime_check as rc  # noqa: E402  - its log/record/run_cli/tiny/synthetic helpers
from hybrid.hardware import driver_version  # noqa: E402

rc.OUT = OUT = Path(os.environ.get("OUT", "scratch/out"))
JSONL = "two_cards.jsonl"


record = rc.recorder("tools/gpu_two_cards.py", JSONL,
                     ("ok", "decode_tok_s", "measured_over_predicted", "match_cpu_reference",
                      "match_cuda_reference", "skipped", "error", "hop", "summary", "ids_equal_two_gpus",
                      "forced_vs_first"),
                     machine=lambda: {"gpus_seen": gpu_names(), "driver": driver_version()})


rc.record = record                                 # tiny_checks, make_synth, ... record here too


def gpu_names() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def link_info() -> None:
    import torch

    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout.strip()
    rc.log(topo)
    n = torch.cuda.device_count()
    record({"check": "gpu_link", "device_count": n, "topology": topo,
            "peer_access": {f"{a}->{b}": torch.cuda.can_device_access_peer(a, b)
                            for a in range(n) for b in range(n) if a != b}})


def hop_probe(hidden: int, reps: int = 200) -> dict:
    """One token's hidden state [1, H] fp16 from cuda:0 to cuda:1 (x.to, as the runtime hops), host-timed
    to completion (synchronize), median; a same-device clone beside it for the floor."""
    import torch

    x = torch.randn(1, hidden, dtype=torch.float16, device="cuda:0")
    out = {}
    for name, fn, dev in (("peer_to_us", lambda: x.to("cuda:1"), 1), ("same_device_clone_us", lambda: x.clone(), 0)):
        for _ in range(20):
            fn()
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(dev)
            t.append(time.perf_counter() - t0)
        out[name] = round(statistics.median(t) * 1e6, 2)
    return out


def hop_in_decode(session, steps: int = 8) -> dict:
    """GPU time of the copies between devices inside real decode steps (graphs as the session runs
    them), from torch.profiler: per step, the peer memcpys' summed duration and count."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    hm = session.model
    hm.new_cache(64)
    hm.prompt_tokens = 0
    for j in range(3):
        hm.forward(torch.tensor([100 + j]), j, last_only=True)
    torch.cuda.synchronize(0), torch.cuda.synchronize(1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for j in range(3, 3 + steps):
            hm.forward(torch.tensor([100 + j]), j, last_only=True)
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
    hm.prompt_tokens = None
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    peer = [e for e in events if "PtoP" in e.name]             # the hop: cuda:0 -> cuda:1
    dtod = [e for e in events if "DtoD" in e.name]             # copies within one device, for scale
    dur = lambda e: getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)  # noqa: E731  (us)
    return {"steps": steps, "peer_copies_per_step": round(len(peer) / steps, 2),
            "peer_copy_gpu_us_per_step": round(sum(dur(e) for e in peer) / steps, 2),
            "same_device_copies_per_step": round(len(dtod) / steps, 2),
            "same_device_copy_gpu_us_per_step": round(sum(dur(e) for e in dtod) / steps, 2)}


def forced_logits(session, prompt: list[int], follow: list[int]) -> "torch.Tensor":
    """Teacher-forced decode: the prompt's prefill, then one graphed decode step per id of `follow`;
    -> the logits after the prompt and after each step, [1 + len(follow), V] fp32 on the host."""
    import torch

    hm = session.model
    hm.new_cache(len(prompt) + len(follow) + 16)
    hm.prompt_tokens = len(prompt)
    rows = [hm.forward(torch.tensor(prompt), 0, last_only=True)[-1].float().cpu()]
    for j, t in enumerate(follow):
        rows.append(hm.forward(torch.tensor([t]), len(prompt) + j, last_only=True)[-1].float().cpu())
    hm.prompt_tokens = None
    return torch.stack(rows)


def compare_logits(ref, other) -> dict:
    """Two sessions' forced logits: the largest difference, where their top tokens differ, and the
    reference's smallest top-2 margin (a near-tie that a last-bit difference can flip)."""
    import torch

    top2 = ref.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1])
    return {"max_abs_diff": float((ref - other).abs().max()), "bitwise_equal": bool(torch.equal(ref, other)),
            "argmax_differs_at": (ref.argmax(-1) != other.argmax(-1)).nonzero().flatten().tolist(),
            "ref_min_top2_margin": round(float(margin.min()), 6), "ref_min_margin_at": int(margin.argmin())}


def configs(miss_slots: int, order: str = "") -> list[tuple[str, dict]]:
    """(label, RuntimeOptions fields) of the measured sessions; `order` (comma-separated labels, repeats
    allowed) picks and orders them, default: each flag set on two GPUs, then on one."""
    out = {}
    for tag, kw in (("cap16", dict(vram_cap_gib=(16.0,))), (f"slots{miss_slots}", dict(cache_slots=(miss_slots,))),
                    (f"slots{miss_slots}_split24", dict(cache_slots=(miss_slots,), layer_split=(24,)))):
        out[f"synth_two_gpus_{tag}"] = dict(gpus=(0, 1), **kw)
        out[f"synth_one_gpu_{tag}"] = dict(gpus=(0, 0), **kw)
    labels = order.split(",") if order else [k for k in out if "split24" not in k]
    return [(k, out[k]) for k in labels]


def predictions(path: Path, profile: str, eprof: Path, ctx: int, miss_slots: int, order: str) -> dict:
    from hybrid.experts.popularity import load_profile as load_expert_profile
    from hybrid.model.config import ModelConfig
    from hybrid.runtime import RuntimeOptions
    from hybrid.runtime.session import _hardware_profile, _plan

    cfg = ModelConfig.from_folder(path)
    ep = load_expert_profile(eprof, cfg)
    out = {}
    for label, kw in dict(configs(miss_slots, order)).items():
        opts = RuntimeOptions(device="cuda", profile=profile, **kw)
        plan = _plan(path, cfg, opts, _hardware_profile(opts), ep, eprof, ctx)
        p = plan.prediction
        out[label] = {"tok_s": round(p.tok_s, 2), "token_ms": round(p.token_us / 1e3, 3),
                      "hop_us": round(p.hop_us, 2), "hit_rate": round(p.hit_rate, 4),
                      "split": list(plan.inputs.layer_split), "slots": [c.slots for c in plan.cards]}
        rc.log(f"prediction {label}: {json.dumps(out[label])}")
    record({"check": "predictions_before_decode", "profile": profile, "context": ctx, "predictions": out})
    return out


def expert_profile_session(path: Path, profile: str, tokens: int, device: str = "cuda"):
    """An all-CPU session that builds the expert store and routes the profile text into an expert
    profile; -> (cfg, tokenizer, context, the CPU runner kept for the next sessions, profile path).
    device "cpu": the same on a machine without a GPU (smoke runs of the tools)."""
    from hybrid.model.config import ModelConfig
    from hybrid.runtime import RuntimeOptions, open_session
    from hybrid.tokenizer import Tokenizer

    cfg = ModelConfig.from_folder(path)
    tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    ctx = 32 + tokens
    rc.log("session: all experts on the CPU runner (builds the expert store, routes the profile text)")
    s0 = open_session(path, RuntimeOptions(device=device, gpus=(0,), cache_slots=(0,), profile=profile), context=ctx)
    cpu = s0.cpu
    eprof = OUT / "synth30.experts.json"
    rc.calibrate_profile(s0, tok, path, eprof)
    s0.owns_cpu = False
    s0.close()
    return cfg, tok, ctx, cpu, eprof


def synth(path: Path, deadline: float, tokens: int, profile: str, miss_slots: int, order: str = "") -> None:
    import torch

    from hybrid.bench.decode import measure, prompt_ids
    from hybrid.runtime import RuntimeOptions, open_session

    cfg, tok, ctx, cpu, eprof = expert_profile_session(path, profile, tokens)
    predictions(path, profile, eprof, ctx, miss_slots, order)
    if torch.cuda.device_count() >= 2:
        record({"check": "hop_probe", "hidden": cfg.hidden_size, "hop": hop_probe(cfg.hidden_size)})
    two_gpu_ids = {}
    ref_ids = ref_logits = ref_label = None
    for label, kw in configs(miss_slots, order):
        if time.perf_counter() > deadline:
            record({"check": label, "skipped": "device-time deadline"})
            continue
        rc.log(f"session {label}: {kw}")
        s = open_session(path, RuntimeOptions(device="cuda", profile=profile, expert_profile=str(eprof), **kw),
                         context=ctx, cpu=cpu)
        try:
            rc.log(f"  loaded {s.load_s}; {s.placement.describe()}")
            rec = measure(s, tok, 32, 16, tokens)
            rec["prediction"]["hop_us"] = round(s.plan.prediction.hop_us, 2)
            rec.update({"flags": kw, "plan_split": list(s.plan.inputs.layer_split),
                        "layer_devices": sorted({str(d) for d in s.model.layer_devices}),
                        "vram_allocated_gib": [round(torch.cuda.memory_allocated(i) / 2**30, 2)
                                               for i in range(torch.cuda.device_count())],
                        "slot_storage_gib": [round(c.slots.nbytes / 2**30, 2) for c in s.cards],
                        **rc.graph_info(s)})
            forced = forced_logits(s, prompt_ids(tok, 32), rec["generated_ids_head"] if ref_ids is None else ref_ids)
            if ref_ids is None:                    # every later session is teacher-forced on the first's ids
                ref_ids, ref_logits, ref_label = rec["generated_ids_head"], forced, label
            rec["forced_vs_first"] = {"first": ref_label, **compare_logits(ref_logits, forced)}
            if kw["gpus"][0] != kw["gpus"][1]:
                rec["hop"] = hop_in_decode(s)
                two_gpu_ids[label] = rec["generated_ids_head"]
            else:                                  # the same flags on one GPU: the same greedy ids?
                other = two_gpu_ids.get(label.replace("one_gpu", "two_gpus"))
                rec["ids_equal_two_gpus"] = None if other is None else other == rec["generated_ids_head"]
            record({"check": label, **rec})
        finally:
            s.close()
            del s
            for i in range(torch.cuda.device_count()):   # both cards' cached blocks and graph pools
                with torch.cuda.device(i):
                    torch.cuda.empty_cache()
    cpu.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", type=Path, default=Path("/tmp/tiny_nvfp4"))
    p.add_argument("--tiny-ref", type=Path, default=Path("scratch/tiny_ref.json"))
    p.add_argument("--synth", type=Path, default=Path("/tmp/synth30"))
    p.add_argument("--skew", type=float, default=0.25)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--budget-s", type=float, default=420, help="stop starting new parts after this")
    p.add_argument("--miss-slots", type=int, default=1024, help="expert slots per card of the sessions with misses")
    p.add_argument("--pytest", default="tests/test_runtime_cuda.py tests/test_decode_graphs.py")
    p.add_argument("--profile", default=None, help="plan with this hardware profile instead of calibrating here")
    p.add_argument("--order", default="", help="synthetic sessions to measure, comma-separated labels, in order")
    p.add_argument("--skip", default="", help="parts to leave out, comma-separated (gpu_link,pytest,tiny_two_gpus,...)")
    a = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    deadline = rc.T0 + a.budget_s
    state = {"profile": a.profile or "h200x2"}       # calibrate replaces it; h200 alone lists one GPU

    ref = json.loads(a.tiny_ref.read_text())
    parts = [("gpu_link", link_info), ("pytest", lambda: rc.run_pytest(a.pytest.split(), timeout=200, lines=30))]
    parts += [] if a.profile else [("calibrate", lambda: rc.calibrate_h200(state, "h200x2"))]
    parts += [("tiny_two_gpus", lambda: rc.tiny_checks(a.tiny, ref, "cuda", state["profile"], gpus="0,1")),
              ("synth_write", lambda: rc.make_synth(a.synth, a.skew, False)),
              ("synth_runs", lambda: synth(a.synth, deadline, a.tokens, state["profile"], a.miss_slots, a.order)),
              ("tiny_one_gpu", lambda: rc.tiny_checks(a.tiny, ref, "cuda", state["profile"], gpus="0,0"))]
    parts = [(n, f) for n, f in parts if n not in a.skip.split(",")]
    rc.run_parts(parts, deadline, record, rc.log)
    rc.log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
