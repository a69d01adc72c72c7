"""hybrid-run on the hybrid runtime, end to end on the embedded tiny model (CPU mode): same greedy
tokens as the reference path, --stats / --trace / --metrics outputs, bad runtime flags."""
import json

import numpy as np
import pytest

from hybrid.cli.run import main
from hybrid.experts.replay import replay_run, verify
from hybrid.experts.trace import read_trace
from hybrid.model.registry import EMBEDDED

pytestmark = pytest.mark.skipif(not (EMBEDDED["tiny"] / "config.json").is_file(),
                                reason="embedded tiny model not installed")
BASE = ["--prompt", "def fibonacci(n):", "-n", "6", "--json"]


def run(args, capsys):
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def reference_ids():
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(BASE) == 0
    return json.loads(buf.getvalue())["generated_ids"]


@pytest.mark.parametrize("flags", [["--layer-split", "1", "--cache-slots", "0"],
                                   ["--layer-split", "2", "--cache-slots", "32", "--gpus", "0,0"],
                                   ["--layer-split", "3", "--cache-slots", "96,32"],
                                   ["--cache-slots", "128", "--prefill-chunk", "2"]])
def test_tiny_hybrid_matches_reference(flags, reference_ids, capsys):
    rc, out, _ = run(BASE + flags, capsys)
    d = json.loads(out)
    assert rc == 0 and d["generated_ids"] == reference_ids
    st = d["stats"]
    assert st["steps"]["decode"] == 5 and len(st["layers"]) == 4
    assert len(st["cards"]) == (1 if "--layer-split" not in flags else 2)


def test_stats_trace_metrics(tmp_path, capsys):
    trace, prom, dash = tmp_path / "t.jsonl", tmp_path / "m.prom", tmp_path / "m.json"
    args = ["--prompt", "hello", "-n", "5", "--layer-split", "2", "--cache-slots", "24", "--stats",
            "--trace", trace, "--metrics", prom]
    rc, out, err = run(args, capsys)
    assert rc == 0 and out.startswith("hello")
    assert "hit rate" in err and "PCIe" in err and "card 1: layers 2-3" in err
    t = read_trace(trace)
    assert len(t.steps) == 5 and verify(t) == []
    assert 0 <= replay_run(t).hit_rate <= 1 and t.header.meta["git_sha"] is not None
    text = prom.read_text()
    assert "# TYPE hybrid_expert_hits_total counter" in text
    assert 'hybrid_expert_hits_total{card="1",layer="3"}' in text
    rc, _, _ = run(["--prompt", "hello", "-n", "3", "--cache-slots", "8", "--metrics", dash], capsys)
    d = json.loads(dash.read_text())
    assert rc == 0 and d["kind"] == "hybrid-dashboard" and len(d["series"]["hit_rate"]) == 4


def test_stats_every_reports_windows_and_keeps_metrics_current(tmp_path, capsys, monkeypatch):
    """--stats-every 4 over 10 decoded tokens: two window lines (after tokens 4 and 8), each with
    both cards' hit rates; the metrics file is rewritten at each (renamed into place: no temp file
    left) and, at the end, holds the whole run."""
    import re

    from hybrid.metrics import exposition

    prom = tmp_path / "m.prom"
    writes = []
    real = exposition.write_metrics
    monkeypatch.setattr(exposition, "write_metrics", lambda path, report: (writes.append(
        report["steps"]["decode"]), real(path, report))[1])
    monkeypatch.setattr("hybrid.metrics.write_metrics", exposition.write_metrics)
    rc, _, err = run(["--prompt", "hello", "-n", "11", "--layer-split", "2", "--cache-slots", "24",
                      "--stats-every", "4", "--metrics", prom], capsys)
    lines = [x for x in err.splitlines() if x.startswith("[decode")]
    assert rc == 0 and [x.split("]")[0] for x in lines] == ["[decode 4", "[decode 8"]
    pat = r"^\[decode \d+\] [\d.]+ tok/s \| card 0 hit [\d.]+% \| card 1 hit [\d.]+% \| CPU experts "
    assert all(re.match(pat, x) for x in lines)
    assert writes == [4, 8, 10]                           # two live rewrites, then the end of the run
    assert 'hybrid_expert_hits_total{card="1",layer="3"}' in prom.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.prom"]


@pytest.mark.parametrize("args,needle", [(["--layer-split", "9"], "--layer-split"),
                                         (["--gpus", "0", "--layer-split", "2"], "--layer-split"),
                                         (["--cache-slots", "x"], "--cache-slots"),
                                         (["--pcie-frac", "2"], "--pcie-frac"),
                                         (["--profile", "nope"], "nope"),
                                         (["--kv-resident", "4"], "--kv-resident"),
                                         (["--cache-policy", "static"], "expert profile"),
                                         (["--stats-every", "0"], "--stats-every"),
                                         (["--kv-resident", "0"], "--kv-resident"),   # a 0 is a given flag
                                         (["--cpu-threads", "0"], "--cpu-threads")])
def test_bad_runtime_flags_one_line(args, needle, capsys):
    rc, _, err = run(["-n", "2"] + args, capsys)
    assert rc == 2 and needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_zero_valued_flag_turns_the_runtime_on(reference_ids, capsys):
    """--pcie-frac 0 alone runs the hybrid runtime (with no promotions), not the reference path: a flag given
    as 0 is a flag given."""
    rc, out, _ = run(BASE + ["--pcie-frac", "0"], capsys)
    d = json.loads(out)
    assert rc == 0 and d["generated_ids"] == reference_ids and "stats" in d
    assert all(c["promotions"] == 0 for c in d["stats"]["cards"])


def test_save_expert_profile_counts_the_run(tmp_path, capsys):
    """--save-expert-profile FILE: every routed token's experts per layer (the trace's ids, counted), a file the
    planner's strict reader takes (counts sum to tokens x k), written once at the end; the next run with
    --expert-profile FILE fills its slots from it. A folder that does not exist is refused before loading."""
    from hybrid.model import ModelConfig, resolve_model_path
    from hybrid.planner.popularity import load_popularity

    prof, trace = tmp_path / "run.experts.json", tmp_path / "t.jsonl"
    rc, out, err = run(BASE + ["--layer-split", "2", "--cache-slots", "24", "--trace", trace,
                               "--save-expert-profile", prof], capsys)
    d = json.loads(out)
    assert rc == 0 and d["stats"]["expert_profile_saved"] == str(prof)
    saved = json.loads(prof.read_text())
    t = read_trace(trace)
    ids = np.concatenate([s.ids.reshape(s.ids.shape[0], -1) for s in t.steps], axis=1)      # [L, tokens * k]
    want = np.stack([np.bincount(row, minlength=t.header.num_experts) for row in ids])
    assert np.array_equal(np.asarray(saved["counts"]), want)
    assert saved["tokens"] == len(d["prompt_ids"]) + len(d["generated_ids"]) - 1       # the last is not fed back
    cfg = ModelConfig.from_folder(resolve_model_path(None))
    assert load_popularity(prof, cfg).shares                                             # strict reader
    rc, _, err = run(["--prompt", "x", "-n", "2", "--layer-split", "2", "--cache-slots", "24", "--stats",
                      "--expert-profile", prof], capsys)
    assert rc == 0 and "slots filled at load (expert profile)" in err
    rc, _, err = run(["-n", "2", "--save-expert-profile", tmp_path / "no" / "p.json"], capsys)
    assert rc == 2 and "--save-expert-profile" in err and len(err.strip().splitlines()) == 1


def test_quantized_head_same_tokens_on_both_paths(capsys):
    """--lm-head nvfp4 reaches the reference path and the runtime alike: the same greedy tokens from both."""
    rc, out, _ = run(BASE + ["--lm-head", "nvfp4"], capsys)
    assert rc == 0
    ref = json.loads(out)["generated_ids"]
    rc, out, _ = run(BASE + ["--lm-head", "nvfp4", "--cache-slots", "128"], capsys)
    assert rc == 0 and json.loads(out)["generated_ids"] == ref
