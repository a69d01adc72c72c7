"""Train the embedded tiny Qwen3-MoE (+ MTP) and write its Hugging Face folder, card and stats.

    PYTHONPATH=. python3 tools/train_tiny.py --out /tmp/tiny --git-sha $(git rev-parse HEAD)
    python3 tools/train_tiny.py --out /tmp/tiny-smoke --smoke      # a few CPU steps, whole pipeline

Deterministic given the seed, the machine's files and the step count (printed, and written into
the card). The training budget is min(--max-train-s, --deadline-s - time already spent -
--eval-reserve-s); if the step-time probe finds the planned steps would overrun it, the step count
is cut before the cosine phase starts and the card says so. With --compare-old, the folder it
names (the model being replaced) is scored on the same held-out texts in the same run.
Legend: B batch, S sequence, V vocabulary.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import tiny_card
import tiny_compare
import tiny_corpus
import tiny_eval
import tiny_model

SHARD_LIMIT = 15_000_000
FOLDER_LIMIT = 56 * 2**20
SAMPLE_PROMPT = "def fibonacci(n):"
REPO = Path(__file__).resolve().parents[1]
TEST_WINDOWS = 1000         # held-out windows scored by tiny_eval.evaluate at most


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output model folder")
    p.add_argument("--smoke", action="store_true", help="tiny corpus subset, a few steps (CPU check)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=2048, help="training window length")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--epochs", type=float, default=8.0, help="planned passes over the train split")
    p.add_argument("--max-steps", type=int, default=4000)
    p.add_argument("--max-train-s", type=float, default=190.0, help="wall-clock cap for the training loop")
    p.add_argument("--deadline-s", type=float, default=275.0,
                   help="wall-clock budget of the whole run; training gets what is left minus --eval-reserve-s")
    p.add_argument("--eval-reserve-s", type=float, default=45.0, help="seconds kept for evaluation and saving")
    p.add_argument("--max-train-tokens", type=int, default=60_000_000, help="cap on the train stream")
    p.add_argument("--max-site-mb", type=float, default=tiny_corpus.MAX_SITE_BYTES / 1e6,
                   help="site-packages bytes read at most (MB)")
    p.add_argument("--no-site", dest="site", action="store_false", help="standard library (and docs) only")
    p.add_argument("--compare-old", default=str(REPO / "hybrid" / "assets" / "tiny"),
                   help="folder of the model being replaced, scored on the same held-out texts ('' for none)")
    p.add_argument("--previous-record", default=str(REPO / "results" / "tiny_model.jsonl"),
                   help="JSONL whose first record is the replaced model's ('' for none)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--aux-coef", type=float, default=0.001)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--val-windows", type=int, default=40, help="val windows (spread over the split) per eval")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--doc-root", default="/usr/share/doc", help="plain-text docs to add ('' for none)")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--git-sha", default="unknown")
    a = p.parse_args(argv)
    if a.smoke:
        a.seq, a.batch, a.max_steps, a.eval_every, a.log_every, a.warmup = 64, 2, 4, 2, 1, 2
        a.gen_tokens, a.val_windows, a.max_site_mb = 12, 4, min(a.max_site_mb, 3.0)
    return a


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- data
def prepare_data(args, out: Path):
    t0 = time.time()
    docs, info = tiny_corpus.collect(args.doc_root or None, limit=60 if args.smoke else None,
                                     with_site=args.site, max_site_bytes=int(args.max_site_mb * 1e6))
    log(f"corpus read: {len(docs)} files, {sum(d.nbytes for d in docs):,} bytes in {time.time() - t0:.1f}s; "
        f"skipped {info['skipped']}")
    t1 = time.time()
    sample = tiny_corpus.tokenizer_sample(docs)
    tok = tiny_corpus.train_tokenizer(sample, args.vocab)
    tok.save(str(out / "tokenizer.json"), pretty=False)
    (out / "tokenizer_config.json").write_text(json.dumps(tiny_corpus.tokenizer_config(args.seq), indent=2))
    t2 = time.time()
    enc = tiny_corpus.encode_docs(tok, docs)
    docs, enc, dropped = tiny_corpus.trim_train(docs, enc, args.max_train_tokens)
    info["skipped"]["over_token_cap"] = dropped
    info["caps"]["max_train_tokens"] = args.max_train_tokens
    streams, nbytes = {}, {}
    for split in ("train", "val", "test"):
        part = [e for d, e in zip(docs, enc) if d.split == split]
        streams[split] = torch.from_numpy(tiny_corpus.join_stream(tok, part))
        nbytes[split] = sum(d.nbytes for d in docs if d.split == split)
    tokens = {k: v.numel() for k, v in streams.items()}
    man = tiny_corpus.manifest(docs, info, tokens)
    man["tokenizer_sample"] = {"files": len(sample), "bytes": sum(len(t.encode()) for t in sample)}
    size = tiny_corpus.write_manifest(man, out / "corpus_manifest.json.gz")
    log(f"tokenizer {t2 - t1:.1f}s (sample {len(sample)} files), encode+trim {time.time() - t2:.1f}s; "
        f"tokens {tokens}; dropped {dropped} train files over the token cap; manifest {size:,} bytes; "
        f"sha {man['corpus_sha256'][:16]}")
    prep = {"read_s": t1 - t0, "tokenizer_s": t2 - t1, "encode_s": time.time() - t2, "manifest_bytes": size}
    return tok, man, streams, nbytes, docs, prep


# ---------------------------------------------------------------- training
def lr_at(step: int, total: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, total - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def make_optimizer(model, args):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed_tokens" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=args.device.startswith("cuda"))


def losses(model, w: torch.Tensor, args):
    """w [B, S+1] -> (total, main CE, MTP CE, aux)."""
    v = model.cfg.vocab_size
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=args.device.startswith("cuda")):
        out = model(w[:, :-1])
    main = F.cross_entropy(out["logits"].float().reshape(-1, v), w[:, 1:].reshape(-1))
    mtp = F.cross_entropy(out["mtp_logits"].float().reshape(-1, v), w[:, 2:].reshape(-1))
    aux = tiny_model.aux_loss(out["routes"], model.cfg.num_experts)
    return main + args.mtp_weight * mtp + args.aux_coef * aux, main, mtp, aux


@torch.no_grad()
def val_loss(model, stream, args, max_windows: int) -> tuple[float, list[float]]:
    """Loss on max_windows windows spread evenly over the val split, and per layer the share of
    routing mass taken by the top 10% of experts on them."""
    was = model.training
    model.eval()
    cfg = model.cfg
    ws = tiny_eval.windows(stream, args.seq)
    ws = ws[:: max(1, len(ws) // max_windows)][:max_windows]
    mass = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.float64, device=args.device)
    tot = n = 0
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=args.device.startswith("cuda")):
        for w in ws:
            w = w.to(args.device).long()
            out = model(w[None, :-1], mtp=False)
            tot += float(F.cross_entropy(out["logits"][0].float(), w[1:], reduction="sum"))
            n += w.numel() - 1
            for layer, (_, top_w, top_i) in enumerate(out["routes"]):
                mass[layer].index_add_(0, top_i.reshape(-1), top_w.reshape(-1).double())
    model.train(was)
    shares = [r["top10pct_mass_share"] for r in tiny_eval.routing_stats(mass.cpu(), mass.cpu())]
    return tot / max(n, 1), shares


def train(model, streams, args, budget_s: float):
    """Train in place; keeps the weights of the lowest val loss. budget_s: wall-clock seconds."""
    train_s = streams["train"].to(args.device).long()
    n = train_s.numel()
    tps = args.batch * args.seq
    total = max(1, min(args.max_steps, math.ceil(args.epochs * n / tps)))
    note = ""
    log(f"train: {n:,} tokens; {tps:,} tokens/step; planned {total} steps")
    opt = make_optimizer(model, args)
    gen = torch.Generator().manual_seed(args.seed)
    ar = torch.arange(args.seq + 1, device=args.device)
    hist = {"train": [], "val": []}
    best = (float("inf"), -1, None)
    t0 = time.time()
    step = 0
    while step < total:
        offs = torch.randint(0, n - args.seq - 1, (args.batch,), generator=gen).to(args.device)
        w = train_s[offs[:, None] + ar[None, :]]                         # [B, S+1]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args)
        loss, main, mtp, aux = losses(model, w, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 10:
            t10 = time.time()
        if step == 40 and not args.smoke:
            per = (time.time() - t10) / 30
            fit = int((budget_s - (time.time() - t0)) / (per * 1.1)) + 40
            if fit < total:
                note = f" The step-time probe ({per * 1e3:.0f} ms/step) cut the plan from {total} to {fit} steps."
                total = max(fit, args.warmup + 1)
            log(f"probe: {per * 1e3:.1f} ms/step -> {total} steps")
        if step % args.log_every == 0 or step == total:
            rec = {"step": step, "tokens": step * tps, "loss": main.item(), "mtp_loss": mtp.item(),
                   "aux": aux.item(), "lr": lr_at(step - 1, total, args), "s": time.time() - t0}
            hist["train"].append(rec)
            if step % (args.log_every * 10) == 0 or args.smoke:
                log(f"step {step}/{total} loss {rec['loss']:.3f} mtp {rec['mtp_loss']:.3f} aux {rec['aux']:.3f} "
                    f"lr {rec['lr']:.2e} {rec['s']:.0f}s")
        if step % args.eval_every == 0 or step == total:
            vl, shares = val_loss(model, streams["val"], args, args.val_windows)
            hist["val"].append({"step": step, "tokens": step * tps, "loss": vl, "routing_top10": shares})
            log(f"val step {step}: {vl:.4f} routing top-10% " + " ".join(f"{x:.3f}" for x in shares))
            if vl < best[0]:
                best = (vl, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
        if time.time() - t0 > budget_s * 1.15:
            note += f" Stopped by the wall-clock cap at step {step}."
            break
    model.load_state_dict(best[2])
    info = {"steps_run": step, "planned_steps": total, "best_step": best[1], "best_val": best[0],
            "tokens_seen": step * tps, "epochs_seen": step * tps / n, "train_seconds": time.time() - t0,
            "note": note, "val_windows": args.val_windows, "budget_s": budget_s}
    return hist, info


# ---------------------------------------------------------------- saving
def save_folder(model, tok, args, out: Path) -> dict:
    from safetensors.torch import save_file
    sd = {k: v.to(torch.bfloat16).cpu() for k, v in tiny_model.hf_state_dict(model).items()}
    groups = [[k for k in sd if not k.startswith("model.layers.")]]
    groups += [[k for k in sd if k.startswith(f"model.layers.{i}.")] for i in range(model.cfg.num_layers)]
    nshard, weight_map, sizes = len(groups), {}, []
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{nshard:05d}.safetensors"
        save_file({k: sd[k] for k in keys}, str(out / name), metadata={"format": "pt"})
        sizes.append((out / name).stat().st_size)
        weight_map.update({k: name for k in keys})
        if sizes[-1] > SHARD_LIMIT:
            raise SystemExit(f"{name}: {sizes[-1]} bytes > shard limit {SHARD_LIMIT}")
    total = sum(v.numel() * 2 for v in sd.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    eot = tok.token_to_id(tiny_corpus.EOT)
    (out / "config.json").write_text(json.dumps(model.cfg.hf_config(eot, eot), indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot, "do_sample": True,
        "temperature": 0.7, "top_p": 0.95, "top_k": 20}, indent=2))
    return {"shards": nshard, "weights_bytes": total, "largest_shard_bytes": max(sizes),
            "shard_file_bytes": sum(sizes)}


def load_saved(out: Path, cfg, device) -> tiny_model.TinyMoE:
    """Our model in fp32 from the saved BF16 shards (proves the save/load round trip)."""
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(out.glob("model-*.safetensors")):
        tensors.update(load_file(str(f)))
    m = tiny_model.TinyMoE(cfg)
    tiny_model.load_hf_state_dict(m, {k: v.float() for k, v in tensors.items()})
    return m.to(device).eval()


# ---------------------------------------------------------------- main
def machine() -> dict:
    d = {"host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
         "torch": torch.__version__}
    if torch.cuda.is_available():
        d["gpu"] = torch.cuda.get_device_name(0)
    d["description"] = (f"{d.get('gpu', 'CPU only')}, {d['cpu_count']} CPU cores, host {d['host']}, "
                        f"Python {d['python']}, torch {d['torch']}")
    return d


def param_counts(cfg) -> dict:
    h, e, k, i, v, L = (cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size,
                        cfg.vocab_size, cfg.num_layers)
    attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * cfg.head_dim * h
    total = sum(p.numel() for p in tiny_model.TinyMoE(cfg).parameters())
    active = v * h + L * (attn + e * h + k * 3 * h * i)
    return {"total": total, "active_per_token": active}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    tok, man, streams, nbytes, docs, prep = prepare_data(args, out)
    cfg = tiny_model.TinyConfig(vocab_size=args.vocab, max_position_embeddings=args.seq)
    torch.manual_seed(args.seed)
    model = tiny_model.TinyMoE(cfg).to(args.device).train()
    budget = min(args.max_train_s, args.deadline_s - (time.time() - t_start) - args.eval_reserve_s)
    log(f"training budget {budget:.0f}s ({time.time() - t_start:.0f}s spent before training)")
    hist, tinfo = train(model, streams, args, max(budget, 10.0))
    files = save_folder(model, tok, args, out)
    log(f"saved: {files}")
    del model
    stats = run_eval(args, out, cfg, tok, streams, nbytes, docs)
    stats.update({"files": files, "training": {**vars_subset(args), **tinfo}, "history": hist, "prep": prep})
    finish(args, out, man, stats, streams, t_start)
    return 0


def vars_subset(args) -> dict:
    keys = ("seed", "seq", "batch", "epochs", "lr", "min_lr_frac", "warmup", "weight_decay",
            "mtp_weight", "aux_coef", "smoke", "max_train_s", "deadline_s", "max_train_tokens")
    d = {k: getattr(args, k) for k in keys}
    d["seq_len"] = d.pop("seq")
    return d


def run_eval(args, out: Path, cfg, tok, streams, nbytes, docs) -> dict:
    m = load_saved(out, cfg, args.device)
    t0 = time.time()
    te = tiny_eval.evaluate(m, streams["test"], args.seq, max_windows=2 if args.smoke else TEST_WINDOWS)
    te["unigram_nll"] = tiny_eval.unigram_nll(streams["train"], streams["test"][1:1 + te["tokens"]], cfg.vocab_size)
    te["unigram_nll_val"] = tiny_eval.unigram_nll(streams["train"], streams["val"][1:], cfg.vocab_size)
    tb = torch.from_numpy(tiny_corpus.token_bytes(tok))
    scored_bytes = int(tb[streams["test"][1:1 + te["tokens"]].long()].sum())   # bytes of the scored targets
    te["scored_bytes"], te["covered"] = scored_bytes, te["tokens"] == streams["test"].numel() - 1
    te["bpb"] = te["nll"] * te["tokens"] / (math.log(2) * scored_bytes)
    te["unigram_bpb"] = te["unigram_nll"] * te["tokens"] / (math.log(2) * scored_bytes)
    log(f"test: nll {te['nll']:.4f} (ppl {math.exp(te['nll']):.2f}) bpb {te['bpb']:.3f} unigram {te['unigram_nll']:.4f} "
        f"mtp agree {te['mtp_agree_greedy']:.3f} ({time.time() - t0:.1f}s)")
    for r in te["routing"]:
        log(f"routing L{r['layer']}: top10% {r['top10pct_mass_share']:.3f} entropy {r['entropy_bits']:.2f}")
    eot = tok.token_to_id(tiny_corpus.EOT)
    prompt = [eot] + tok.encode(SAMPLE_PROMPT).ids
    mine = tiny_eval.greedy(m, prompt, args.gen_tokens, eos=eot)
    text = SAMPLE_PROMPT + tok.decode(mine)
    log("sample:\n" + text)
    comparison = compare_old(args, m, tok, docs)
    check_ids = streams["test"][: min(256, streams["test"].numel())].tolist()
    try:
        hf = tiny_eval.hf_cross_check(str(out), m, check_ids, prompt, len(mine))
    except Exception as exc:  # recorded in the card, never fatal: the weights are already saved
        hf = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"hf check: { {k: v for k, v in hf.items() if k != 'hf_greedy_ids'} }")
    sample = {"prompt": SAMPLE_PROMPT, "new_tokens": len(mine), "text": text,
              "hf_equal": hf.get("hf_greedy_ids") == mine}
    tokens = {k: v.numel() for k, v in streams.items()}
    return {"test": te, "hf_check": hf, "sample": sample, "tokens": tokens, "comparison": comparison,
            "previous": previous_record(args), "tokenizer": {"vocab": tok.get_vocab_size(), "eot_id": eot}}


def compare_old(args, model, tok, docs) -> dict | None:
    """The replaced model and this one on the same texts: the replaced model's test split (the
    stdlib test files, checked against its manifest) and this corpus's whole test split."""
    old = Path(args.compare_old) if args.compare_old else None
    if old is None or not (old / "config.json").is_file():
        return None
    t0 = time.time()
    try:
        old_test = tiny_compare.old_test_split(old)
        mine = [d for d in docs if (d.root, d.rel, d.sha256) in old_test]
        sets = {"first_model_test_split": [d.text for d in mine],
                "this_test_split": [d.text for d in docs if d.split == "test"]}
        if args.smoke:
            sets = {k: v[:3] for k, v in sets.items()}
        res = tiny_compare.compare(old, model, tok, sets, args.seq, SAMPLE_PROMPT, args.gen_tokens)
        res["first_model_test_files"] = {"in_manifest": len(old_test), "found_identical": len(mine),
                                         "all_in_this_test_split": all(d.split == "test" for d in mine)}
    except Exception as exc:  # never fatal: recorded
        return {"error": f"{type(exc).__name__}: {exc}"}
    for name, r in res["sets"].items():
        log(f"compare {name}: old bpb {r['old']['bpb']:.3f} (ppl {r['old']['ppl']:.2f}/{r['old']['tokens']} tok) "
            f"new bpb {r['new']['bpb']:.3f} (ppl {r['new']['ppl']:.2f}/{r['new']['tokens']} tok)")
    log(f"compare: {res['first_model_test_files']} in {time.time() - t0:.1f}s; old sample:\n{res['old_sample']}")
    return res


def previous_record(args) -> dict | None:
    """The replaced model's record (first line of --previous-record), the fields the card quotes."""
    path = Path(args.previous_record) if args.previous_record else None
    if path is None or not path.is_file():
        return None
    r = json.loads(path.read_text().splitlines()[0])
    keep = ("nll", "tokens", "bpb", "unigram_nll", "unigram_bpb", "main_top1", "mtp_agree_greedy")
    return {"date": r.get("date"), "git_sha": r.get("git_sha"), "corpus_tokens": r["corpus"]["tokens"],
            "training": {k: r["training"][k] for k in ("tokens_seen", "epochs_seen", "train_seconds", "batch")},
            "test": {k: r["test"][k] for k in keep},
            "routing_top10": [x["top10pct_mass_share"] for x in r["test"]["routing"]],
            "sample": r["sample"]["text"]}


def folder_bytes(out: Path, skip: str = "") -> int:
    return sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != skip)


def finish(args, out: Path, man: dict, stats: dict, streams, t_start: float) -> None:
    cfg = tiny_model.TinyConfig(vocab_size=args.vocab, max_position_embeddings=args.seq)
    stats.update({
        "record": "tiny_model", "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": machine(), "git_sha": args.git_sha,
        "command": "python3 tools/train_tiny.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "arch": cfg.to_dict(), "params": param_counts(cfg),
        "corpus": {k: man[k] for k in ("corpus_sha256", "train_sha256", "python", "roots", "skipped", "caps",
                                       "split_rule", "splits", "tokenizer_sample")},
    })
    stats["corpus"]["tokens"] = stats.pop("tokens")
    pk = sorted(man["packages"].items(), key=lambda kv: -kv[1][3])
    stats["corpus"]["packages"] = len(pk)
    stats["corpus"]["top_packages"] = [[k, sum(v[:3]), v[3]] for k, v in pk[:16]]
    tiny_card.plot_curve(stats["history"], stats["test"]["unigram_nll_val"], out / "training_curve.png",
                         stats["test"]["routing"][0]["uniform_share"])
    stats["files"]["folder_bytes"] = folder_bytes(out, skip="MODEL_CARD.md")
    tiny_card.write_card(stats, out / "MODEL_CARD.md")
    stats["total_seconds"] = time.time() - t_start
    total = folder_bytes(out)
    Path(str(out) + "_stats.json").write_text(json.dumps(stats, indent=1))
    rec = {k: v for k, v in stats.items() if k != "history"}
    rec["files"] = {**stats["files"], "folder_bytes_with_card": total}
    Path(str(out) + "_record.jsonl").write_text(json.dumps(rec, separators=(",", ":")) + "\n")
    log(f"folder {total:,} bytes (limit {FOLDER_LIMIT:,}); total {stats['total_seconds']:.0f}s")
    if total > FOLDER_LIMIT:
        log("WARNING: folder over the size limit")


if __name__ == "__main__":
    sys.exit(main())
