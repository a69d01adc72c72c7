"""hybrid-bench quality end to end (small random model, quick mode) and placement invariance."""
import json

import numpy as np
import pytest

from hybrid.testing import write_random_model

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
pytestmark = pytest.mark.llama

DIMS = dict(hidden_size=256, moe_intermediate_size=256, head_dim=64, num_experts=4, num_experts_per_tok=2,
            vocab_size=512, num_hidden_layers=2)
FIELDS = ("candidate", "engine", "same_top_pct", "same_top_unc_pct", "mean_kld", "p99_kld", "ppl",
          "file_bytes", "expert_bytes", "git_sha", "machine", "command", "n_ctx", "count", "tokenizer_parity")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("q") / "m", seed=5, **DIMS)


@pytest.fixture(scope="module")
def quick_run(model_dir, tmp_path_factory):
    from hybrid.cli.bench import main

    out = tmp_path_factory.mktemp("qout")
    rc = main(["quality", "--model", str(model_dir), "--quick", "--against", "Q8_0,bf16,nvfp4,gguf-nvfp4,Q4_K_M",
               "--out", str(out), "--work", str(out / "work")])
    assert rc == 0
    recs = [json.loads(line) for line in (out / "quality.jsonl").read_text().splitlines()]
    return out, {r["candidate"]: r for r in recs}


def test_quick_run_writes_table_records_and_chart(quick_run):
    out, recs = quick_run
    assert list(recs) == ["Q8_0", "bf16", "nvfp4", "gguf-nvfp4", "Q4_K_M"]
    for r in recs.values():
        assert all(f in r for f in FIELDS), set(FIELDS) - set(r)
        assert r["n_ctx"] == 64 and r["count"] == 4 * 31                   # 4 classes x (64 - 1 - 32)
        assert all(r["tokenizer_parity"].values())
    md = (out / "quality.md").read_text()
    assert "| candidate | engine | same-top % |" in md and "git:" in md and "machine:" in md
    assert (out / "quality.png").stat().st_size > 5000


def test_reference_against_itself_is_the_storage_floor(quick_run):
    r = quick_run[1]["Q8_0"]
    assert r["same_top_pct"] == 100.0 and r["mean_kld"] < 1e-4
    assert r["ppl"] == pytest.approx(r["ppl_base"], rel=1e-3)


def test_rows_are_ordered_by_quantization_error(quick_run):
    recs = quick_run[1]
    assert recs["bf16"]["engine"] == "hybrid" and recs["gguf-nvfp4"]["engine"] == "llama.cpp"
    assert recs["bf16"]["mean_kld"] < recs["nvfp4"]["mean_kld"]
    assert recs["bf16"]["same_top_pct"] >= 90.0
    # hybrid NVFP4 and its GGUF re-pack hold the same expert bytes (up to scalar input_scales)
    assert recs["nvfp4"]["expert_bytes"] == pytest.approx(recs["gguf-nvfp4"]["expert_bytes"], rel=1e-3)
    assert recs["nvfp4"]["expert_bytes"] < 0.3 * recs["bf16"]["expert_bytes"]
    # same weights in two engines: KL of one against the other's reference is close
    assert abs(recs["nvfp4"]["mean_kld"] - recs["gguf-nvfp4"]["mean_kld"]) < 0.5 * recs["nvfp4"]["mean_kld"]


def test_unknown_candidate_is_a_user_error(model_dir, tmp_path, capsys):
    from hybrid.cli.bench import main

    assert main(["quality", "--model", str(model_dir), "--quick", "--against", "Q7_X", "--no-write",
                 "--work", str(tmp_path)]) == 2
    assert "--against 'Q7_X'" in capsys.readouterr().err
    assert main(["quality", "--model", str(model_dir), "--quick", "--against", "nvfp4@nowhere", "--no-write",
                 "--work", str(tmp_path)]) == 2
    assert "placement 'nowhere'" in capsys.readouterr().err


def test_heldout_text_is_sha_checked_test_split(tmp_path):
    import gzip
    import hashlib
    import sysconfig
    from pathlib import Path

    from hybrid.bench.prompts import MANIFEST, all_texts, heldout

    std = Path(sysconfig.get_paths()["stdlib"])
    good = (std / "textwrap.py").read_bytes()
    files = [["stdlib", "textwrap.py", hashlib.sha256(good).hexdigest(), len(good), "test"],
             ["stdlib", "string.py", "0" * 64, 1, "test"],                       # sha mismatch: skipped
             ["stdlib", "abc.py", hashlib.sha256((std / "abc.py").read_bytes()).hexdigest(), 1, "train"]]
    (tmp_path / MANIFEST).write_bytes(gzip.compress(json.dumps({"files": files}).encode()))
    text, sources = heldout(tmp_path)
    assert text == good.decode() and sources == [f"stdlib/textwrap.py sha256:{files[0][2][:12]}"]
    assert "heldout" in all_texts(tmp_path) and "heldout" not in all_texts(tmp_path / "nothing")


PLACEMENTS = {   # RuntimeOptions on CPU: expert slots on the "card" vs the CPU runner, layer split, engine
    "default": {},
    "all-experts-on-cpu-runner": {"cache_slots": (0,)},
    "all-experts-in-slots": {"cache_slots": (10_000,)},
    "two-cards-split-at-1": {"gpus": (0, 0), "layer_split": (1,), "cache_slots": (3, 5)},
    "torch-cpu-engine": {"cpu_engine": "torch", "cache_slots": (2,)},
}


def test_nvfp4_rows_identical_whatever_the_placement(model_dir, tmp_path):
    from hybrid.baselines.candidates import CandidateMaker, HybridCandidate
    from hybrid.bench.quality import score, token_stream
    from hybrid.metrics.kl import BaseLogProbs, scored_rows

    maker = CandidateMaker(model_dir, tmp_path, 64)
    chunks, classes, _ = token_stream(model_dir, 64, quick=True)
    ref = maker.make("Q8_0")
    bases = [BaseLogProbs.from_logits(ref.logits(c)[scored_rows(64)]) for c in chunks]
    folder = maker.hybrid_checkpoint("nvfp4")
    rows, logits, described = {}, {}, set()
    for name, opts in PLACEMENTS.items():
        cand = HybridCandidate("nvfp4", "", folder, **opts)
        logits[name] = cand.logits(chunks[0])
        r = score(cand, chunks, classes, bases)
        described.add(cand.describe()["placement"])
        rows[name] = r
        cand.close()
    assert len(described) == len(PLACEMENTS)                             # the placements really differ
    base = rows["default"]
    n = base["count"]
    for name, r in rows.items():
        # identical up to float summation order: the kernels of the card slots and of the CPU
        # runner add in different orders, which may flip an argmax at a near-tie (at most one here;
        # 2 of 4788 on the tiny model, see results/quality.md); KL and PPL agree to printed digits
        flips = abs(round(r["same_top_pct"] * n / 100) - round(base["same_top_pct"] * n / 100))
        assert flips <= 1, (name, r["same_top_pct"], base["same_top_pct"])
        for k in ("mean_kld", "p99_kld", "ppl"):
            assert r[k] == pytest.approx(base[k], rel=2e-3, abs=5e-6), (name, k)
        np.testing.assert_allclose(logits[name], logits["default"], rtol=0, atol=1e-3, err_msg=name)


@pytest.mark.slow
def test_full_table_on_tiny(tmp_path):
    from hybrid.cli.bench import main
    from hybrid.errors import HybridError
    from hybrid.model.registry import resolve_model_path

    try:
        resolve_model_path("tiny")
    except HybridError:
        pytest.skip("embedded tiny model not installed")
    assert main(["quality", "--out", str(tmp_path), "--work", str(tmp_path / "w")]) == 0
    recs = {json.loads(x)["candidate"]: json.loads(x) for x in (tmp_path / "quality.jsonl").read_text().splitlines()}
    assert recs["bf16"]["same_top_pct"] > 97 and recs["bf16"]["count"] > 2000
    assert all(r["same_top_pct"] > 60 for r in recs.values())
    assert recs["IQ3_S"]["mean_kld"] > recs["Q4_K_M"]["mean_kld"]


def test_speed_quick(model_dir, tmp_path):
    from hybrid.cli.bench import main

    rc = main(["speed", "--model", str(model_dir), "--quick", "--against", "bf16,Q8_0", "--ladder", "8,32",
               "--new-tokens", "3", "--out", str(tmp_path), "--work", str(tmp_path / "w")])
    assert rc == 0
    recs = [json.loads(x) for x in (tmp_path / "speed.jsonl").read_text().splitlines()]
    assert [r["engine"] for r in recs] == ["hybrid", "llama.cpp"]
    for r in recs:
        assert set(r["prefill_tok_s"]) == {"8", "32"} and all(v > 0 for v in r["prefill_tok_s"].values())
        assert set(r["decode_tok_s"]) == {"code", "essay", "translate", "explain"}
        assert all(v > 0 for v in r["decode_tok_s"].values()) and r["git_sha"] and r["machine"]
    md = (tmp_path / "speed.md").read_text()
    assert "Prefill tok/s" in md and "| bf16 | hybrid |" in md


def test_work_cache_is_keyed_by_the_model(model_dir, tmp_path):
    import shutil

    from hybrid.baselines.candidates import CandidateMaker, source_fingerprint

    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    a = source_fingerprint(copy)
    assert source_fingerprint(copy) == a
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "rope_theta": 5e5}))
    assert source_fingerprint(copy) != a
    assert CandidateMaker(copy, tmp_path / "w", 64).work != CandidateMaker(model_dir, tmp_path / "w", 64).work


def test_nvfp4_mse_candidate_is_its_own_checkpoint(model_dir, tmp_path):
    """`nvfp4-mse` (and gguf-nvfp4-mse) are hybrid-quantize --nvfp4-scales mse: the nvfp4 layout with other block
    scales, in a folder of its own, named in the row's weights."""
    import torch

    from hybrid.baselines.candidates import CandidateMaker
    from hybrid.checkpoint.reader import Checkpoint

    maker = CandidateMaker(model_dir, tmp_path, 64)
    a, m = maker.hybrid_checkpoint("nvfp4"), maker.hybrid_checkpoint("nvfp4-mse")
    assert a != m
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    sa, sm = Checkpoint(a).tensor(name), Checkpoint(m).tensor(name)
    assert sa.shape == sm.shape and not torch.equal(sa.view(torch.uint8), sm.view(torch.uint8))
    cand = maker.make("nvfp4-mse")
    assert "--nvfp4-scales mse" in cand.weights and cand.path == m
    cand.close()
