"""hybrid-run end to end, and one clear line + exit 2 for every bad input."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid.cli.run import main


def run(args, capsys):
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_output(qwen3_dir, capsys):
    rc, out, _ = run(["--model", qwen3_dir, "--prompt", "def fib", "-n", "6", "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    assert len(d["generated_ids"]) == 6 and d["prompt_ids"] and d["decode_tok_s"] > 0
    assert set(d) >= {"prompt_ids", "generated_ids", "text", "prefill_tok_s", "decode_tok_s"}


def test_streams_text_and_summary(qwen3_dir, capsys):
    rc, out, err = run(["--model", qwen3_dir, "--prompt", "hello", "-n", "4"], capsys)
    assert rc == 0 and out.startswith("hello") and "decode" in err


def test_greedy_deterministic_and_seeded_sampling(qwen3_dir, capsys):
    outs = [json.loads(run(["--model", qwen3_dir, "-n", "8", "--json"] + extra, capsys)[1])["generated_ids"]
            for extra in ([], [], ["--temperature", "1", "--seed", "3"], ["--temperature", "1", "--seed", "3"])]
    assert outs[0] == outs[1] and outs[2] == outs[3]


def copy(src, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(src, d)
    return d


def corrupt_missing_config(d):
    (d / "config.json").unlink()


def corrupt_arch(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama4"
    (d / "config.json").write_text(json.dumps(cfg))


def edit_tensor(d, fn):
    for f in d.glob("*.safetensors"):
        sd = load_file(str(f))
        if fn(sd):
            save_file(sd, str(f))
            return


def corrupt_missing_tensor(d):
    edit_tensor(d, lambda sd: sd.pop("model.layers.1.self_attn.o_proj.weight", None) is not None)


def corrupt_shape(d):
    k = "model.layers.0.self_attn.q_proj.weight"
    edit_tensor(d, lambda sd: k in sd and sd.__setitem__(k, sd[k][:-1].contiguous()) is None)


def corrupt_dtype(d):
    k = "model.norm.weight"
    edit_tensor(d, lambda sd: k in sd and sd.__setitem__(k, sd[k].to(torch.int32)) is None)


def corrupt_truncate(d):
    f = sorted(d.glob("*.safetensors"))[0]
    f.write_bytes(f.read_bytes()[:1000])


def corrupt_tokenizer(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 100
    (d / "config.json").write_text(json.dumps(cfg))


CASES = {
    "missing_config": (corrupt_missing_config, "config.json"),
    "unknown_arch": (corrupt_arch, "llama4"),
    "missing_tensor": (corrupt_missing_tensor, "o_proj"),
    "wrong_shape": (corrupt_shape, "q_proj"),
    "wrong_dtype": (corrupt_dtype, "model.norm.weight"),
    "truncated": (corrupt_truncate, "safetensors"),
    "tokenizer_vocab": (corrupt_tokenizer, "vocab_size"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_model_one_line_exit_2(case, qwen3_dir, tmp_path, capsys):
    corrupt, needle = CASES[case]
    d = copy(qwen3_dir, tmp_path)
    corrupt(d)
    rc, _, err = run(["--model", d, "-n", "2"], capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


@pytest.mark.parametrize("args,needle", [(["-n", "0"], "--max-tokens"), (["--top-p", "0"], "--top-p"),
                                         (["--temperature", "-1"], "--temperature"), (["--stop", ""], "--stop")])
def test_bad_flags(args, needle, qwen3_dir, capsys):
    rc, _, err = run(["--model", qwen3_dir] + args, capsys)
    assert rc == 2 and needle in err and "Traceback" not in err


def test_console_script_no_traceback(tmp_path):
    exe = shutil.which("hybrid-run")
    cmd = [exe] if exe else [sys.executable, "-m", "hybrid.cli.run"]
    p = subprocess.run(cmd + ["--model", str(tmp_path / "nope")], capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "model folder not found" in p.stderr


@pytest.mark.parametrize("module,argv,needle", [
    ("hybrid.cli.run", ["--stats-every", "x"], "--stats-every"),
    ("hybrid.cli.run", ["--max-tokens", "many"], "--max-tokens"),
    ("hybrid.cli.bench", ["decode", "--tokens", "x"], "--tokens"),
    ("hybrid.cli.bench", ["nope"], "invalid choice"),
    ("hybrid.cli.quantize", ["a", "b", "--nope"], "--nope"),
    ("hybrid.cli.profile", ["--nope"], "--nope"),
    ("hybrid.cli.gguf", ["nope"], "invalid choice")])
def test_every_console_script_reports_a_bad_flag_in_one_line(module, argv, needle, capsys):
    """argparse's own errors (bad type, unknown flag, unknown subcommand) are one line naming the flag,
    exit code 2, no usage dump — like the errors the scripts raise themselves."""
    import importlib

    with pytest.raises(SystemExit) as ei:
        importlib.import_module(module).main(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and needle in err and err.count("\n") == 1 and err.endswith("(see --help)\n")


def test_device_auto_takes_a_volta_or_newer_gpu(monkeypatch, capsys):
    """hybrid-run's --device auto (the default) runs on CUDA where torch sees a GPU of sm_70 or newer, else on
    the CPU; an older GPU is named in one line after the run's summary (not before: a user error stays one
    line); --device cpu stays on the CPU."""
    import argparse

    import torch

    from hybrid.cli.run import _check_args, _print, build_parser
    from hybrid.generate import GenerationResult

    assert build_parser().parse_args([]).device == "auto"
    res = GenerationResult(prompt_ids=[1], generated_ids=[2], text="x", prefill_s=1.0, decode_s=1.0)
    for device, visible, cap, want, note in (("auto", False, None, "cpu", False), ("auto", True, (7, 0), "cuda", False),
                                             ("auto", True, (9, 0), "cuda", False), ("auto", True, (6, 1), "cpu", True),
                                             ("cpu", True, (9, 0), "cpu", False), (None, True, (8, 6), "cuda", False)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda v=visible: v)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0, c=cap: c)
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: [])   # runs on each (a GPU host's build may not)
        args = argparse.Namespace(max_tokens=4, stats_every=None, device=device, json=False, stats=False)
        _check_args(args)
        assert args.device == want and capsys.readouterr().err == ""
        _print(args, "tiny", res, None, None)
        assert ("sm_61" in capsys.readouterr().err) == note


def test_device_auto_on_a_gpu_torch_cannot_run(monkeypatch, capsys):
    """A V100 under a torch built without sm_70 code (CUDA 12.8+ / 13 wheels): --device auto runs on the CPU and says
    why, with the fix, in one line after the run; --device cuda is one line up front; so is hybrid-quantize's, whose
    auto takes the CPU (the same bytes)."""
    import argparse

    from hybrid.checkpoint.writer import check_device
    from hybrid.cli.run import _check_args, _print
    from hybrid.errors import HybridError
    from hybrid.generate import GenerationResult
    from tests.test_hardware import CU130_ARCHS, fake_torch_gpu

    fake_torch_gpu(monkeypatch, (7, 0), CU130_ARCHS)
    args = argparse.Namespace(max_tokens=4, stats_every=None, device="auto", json=False, stats=False)
    _check_args(args)
    assert args.device == "cpu" and capsys.readouterr().err == ""
    _print(args, "tiny", GenerationResult(prompt_ids=[1], generated_ids=[2], text="x", prefill_s=1.0, decode_s=1.0),
           None, None)
    note = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("hybrid: ran on the CPU")]
    assert len(note) == 1 and "sm_70" in note[0] and "cu126" in note[0]
    with pytest.raises(HybridError, match=r"^--device cuda: GPU 0 \(Tesla V100-SXM2-16GB, sm_70\) cannot run"):
        _check_args(argparse.Namespace(max_tokens=4, stats_every=None, device="cuda", json=False, stats=False))
    assert check_device("auto") == "cpu"
    with pytest.raises(HybridError, match=r"^--device cuda: GPU 0 .* cu126"):
        check_device("cuda")


@pytest.mark.parametrize("free_gib,runtime", [(0.5, True), (64.0, False)])
def test_device_auto_runs_the_runtime_when_the_checkpoint_does_not_fit(monkeypatch, capsys, free_gib, runtime):
    """--device auto on a GPU, no runtime flag: a checkpoint that does not fit the GPU's free memory (plus
    FIT_MARGIN) runs on the hybrid runtime (as --hybrid) with one line saying why; one that fits takes the
    reference path. An explicit --device cuda keeps the reference path (the user asked for it)."""
    import torch

    from hybrid.baselines.report import folder_bytes
    from hybrid.cli import run
    from hybrid.model import resolve_model_path

    class Stop(Exception):
        pass

    def stop(kind):
        def f(*a, **k):
            raise Stop(kind)
        return f

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (int(free_gib * 2**30), 80 * 2**30))
    monkeypatch.setattr(run, "_open", stop("runtime"))
    monkeypatch.setattr(run, "_reference_model", stop("reference"))
    need = folder_bytes(resolve_model_path(None))
    assert need > 0 and run.fits_one_gpu(need, need + run.FIT_MARGIN) and not run.fits_one_gpu(need, need)
    monkeypatch.setattr(run, "FIT_MARGIN", 2**30 - need)   # the tiny model "needs" 1 GiB
    args = run.build_parser().parse_args(["--max-tokens", "2"])
    with pytest.raises(Stop) as ei:
        run.body(args)
    assert ei.value.args[0] == ("runtime" if runtime else "reference") and args.device == "cuda"
    err = capsys.readouterr().err
    assert ("does not fit cuda:0" in err) == runtime and err.count("\n") == int(runtime)
    args = run.build_parser().parse_args(["--max-tokens", "2", "--device", "cuda"])
    with pytest.raises(Stop) as ei:
        run.body(args)
    assert ei.value.args[0] == "reference"
