"""Train the embedded tiny Qwen3-MoE (+ MTP) and write its Hugging Face folder, card and stats.

    PYTHONPATH=. python3 tools/train_tiny.py --out /tmp/tiny --git-sha $(git rev-parse HEAD)
    python3 tools/train_tiny.py --out /tmp/tiny-smoke --smoke      # a few CPU steps, whole pipeline

Deterministic given the seed and the step count (printed, and written into the card). If the
step-time probe finds the planned steps would overrun --max-train-s, the step count is cut
before the cosine phase starts and the card says so.
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
import tiny_corpus
import tiny_eval
import tiny_model

SHARD_LIMIT = 15_000_000
FOLDER_LIMIT = 56 * 2**20
SAMPLE_PROMPT = "def fibonacci(n):"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output model folder")
    p.add_argument("--smoke", action="store_true", help="tiny corpus subset, a few steps (CPU check)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=2048, help="training window length")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=float, default=8.0, help="planned passes over the train split")
    p.add_argument("--max-steps", type=int, default=4000)
    p.add_argument("--max-train-s", type=float, default=320.0, help="wall-clock cap for the training loop")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--aux-coef", type=float, default=0.001)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--doc-root", default="/usr/share/doc", help="plain-text docs to add ('' for none)")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--git-sha", default="unknown")
    a = p.parse_args(argv)
    if a.smoke:
        a.seq, a.batch, a.max_steps, a.eval_every, a.log_every, a.warmup = 64, 2, 4, 2, 1, 2
        a.gen_tokens = 12
    return a


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- data
def prepare_data(args, out: Path):
    docs, info = tiny_corpus.collect(args.doc_root or None, limit=60 if args.smoke else None)
    man = tiny_corpus.manifest(docs, info)
    tiny_corpus.write_manifest(man, out / "corpus_manifest.json.gz")
    log(f"corpus: {len(docs)} files {man['splits']} skipped {info['skipped']} sha {man['corpus_sha256'][:16]}")
    train_docs = [d for d in docs if d.split == "train"]
    tok = tiny_corpus.train_tokenizer([d.text for d in train_docs], args.vocab)
    tok.save(str(out / "tokenizer.json"), pretty=False)
    (out / "tokenizer_config.json").write_text(json.dumps(tiny_corpus.tokenizer_config(args.seq), indent=2))
    streams, nbytes = {}, {}
    for split in ("train", "val", "test"):
        ids, nb = tiny_corpus.encode_stream(tok, [d for d in docs if d.split == split])
        streams[split], nbytes[split] = torch.tensor(ids, dtype=torch.int32), nb
    log(f"tokenizer: vocab {tok.get_vocab_size()}; tokens " + str({k: v.numel() for k, v in streams.items()}))
    return tok, man, streams, nbytes


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
def val_loss(model, stream, args, max_windows: int) -> float:
    was = model.training
    model.eval()
    tot = n = 0
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=args.device.startswith("cuda")):
        for w in tiny_eval.windows(stream, args.seq)[:max_windows]:
            w = w.to(args.device).long()
            logits = model(w[None, :-1], mtp=False)["logits"][0].float()
            tot += float(F.cross_entropy(logits, w[1:], reduction="sum"))
            n += w.numel() - 1
    model.train(was)
    return tot / max(n, 1)


def train(model, streams, args):
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
            fit = int((args.max_train_s - (time.time() - t0)) / (per * 1.1)) + 40
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
            vl = val_loss(model, streams["val"], args, 4 if args.smoke else 32)
            hist["val"].append({"step": step, "tokens": step * tps, "loss": vl})
            log(f"val step {step}: {vl:.4f}")
            if vl < best[0]:
                best = (vl, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
        if time.time() - t0 > args.max_train_s * 1.15:
            note += f" Stopped by the wall-clock cap at step {step}."
            break
    model.load_state_dict(best[2])
    info = {"steps_run": step, "planned_steps": total, "best_step": best[1], "best_val": best[0],
            "tokens_seen": step * tps, "epochs_seen": step * tps / n, "train_seconds": time.time() - t0,
            "note": note, "val_windows": 4 if args.smoke else 32}
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
    tok, man, streams, nbytes = prepare_data(args, out)
    cfg = tiny_model.TinyConfig(vocab_size=args.vocab, max_position_embeddings=args.seq)
    torch.manual_seed(args.seed)
    model = tiny_model.TinyMoE(cfg).to(args.device).train()
    hist, tinfo = train(model, streams, args)
    files = save_folder(model, tok, args, out)
    log(f"saved: {files}")
    del model
    stats = run_eval(args, out, cfg, tok, streams, nbytes)
    stats.update({"files": files, "training": {**vars_subset(args), **tinfo}, "history": hist})
    finish(args, out, man, stats, streams, t_start)
    return 0


def vars_subset(args) -> dict:
    keys = ("seed", "seq", "batch", "epochs", "lr", "min_lr_frac", "warmup", "weight_decay",
            "mtp_weight", "aux_coef", "smoke")
    d = {k: getattr(args, k) for k in keys}
    d["seq_len"] = d.pop("seq")
    return d


def run_eval(args, out: Path, cfg, tok, streams, nbytes) -> dict:
    m = load_saved(out, cfg, args.device)
    te = tiny_eval.evaluate(m, streams["test"], args.seq, max_windows=2 if args.smoke else None)
    te["unigram_nll"] = tiny_eval.unigram_nll(streams["train"], streams["test"][1:], cfg.vocab_size)
    te["unigram_nll_val"] = tiny_eval.unigram_nll(streams["train"], streams["val"][1:], cfg.vocab_size)
    bits = math.log(2) * nbytes["test"]
    covered = te["tokens"] == streams["test"].numel() - 1      # every test token scored (not in --smoke)
    te["bpb"] = te["nll"] * te["tokens"] / bits if covered else float("nan")
    te["unigram_bpb"] = te["unigram_nll"] * te["tokens"] / bits if covered else float("nan")
    log(f"test: nll {te['nll']:.4f} (ppl {math.exp(te['nll']):.2f}) unigram {te['unigram_nll']:.4f} "
        f"mtp agree {te['mtp_agree_greedy']:.3f}")
    for r in te["routing"]:
        log(f"routing L{r['layer']}: top10% {r['top10pct_mass_share']:.3f} entropy {r['entropy_bits']:.2f}")
    eot = tok.token_to_id(tiny_corpus.EOT)
    prompt = [eot] + tok.encode(SAMPLE_PROMPT).ids
    mine = tiny_eval.greedy(m, prompt, args.gen_tokens, eos=eot)
    check_ids = streams["test"][: min(256, streams["test"].numel())].tolist()
    try:
        hf = tiny_eval.hf_cross_check(str(out), m, check_ids, prompt, len(mine))
    except Exception as exc:  # recorded in the card, never fatal: the weights are already saved
        hf = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"hf check: { {k: v for k, v in hf.items() if k != 'hf_greedy_ids'} }")
    text = SAMPLE_PROMPT + tok.decode(mine)
    log("sample:\n" + text)
    sample = {"prompt": SAMPLE_PROMPT, "new_tokens": len(mine), "text": text,
              "hf_equal": hf.get("hf_greedy_ids") == mine}
    tokens = {k: v.numel() for k, v in streams.items()}
    return {"test": te, "hf_check": hf, "sample": sample, "tokens": tokens,
            "tokenizer": {"vocab": tok.get_vocab_size(), "eot_id": eot}}


def folder_bytes(out: Path, skip: str = "") -> int:
    return sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != skip)


def finish(args, out: Path, man: dict, stats: dict, streams, t_start: float) -> None:
    cfg = tiny_model.TinyConfig(vocab_size=args.vocab, max_position_embeddings=args.seq)
    stats.update({
        "record": "tiny_model", "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": machine(), "git_sha": args.git_sha,
        "command": "python3 tools/train_tiny.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "arch": cfg.to_dict(), "params": param_counts(cfg),
        "corpus": {k: man[k] for k in ("corpus_sha256", "python", "roots", "skipped", "split_rule", "splits")},
    })
    stats["corpus"]["tokens"] = stats.pop("tokens")
    tiny_card.plot_curve(stats["history"], stats["test"]["unigram_nll_val"], out / "training_curve.png")
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
