"""llama.cpp with its experts on the CPU (tensor_buft_overrides through llama-cpp-python), its decode
timing as hybrid counts it, and the non-GPU parts of tools/gpu_llama_ab.py."""
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybrid.errors import HybridError

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "gpu_llama_ab.py"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from hybrid.baselines.gguf_export import export_gguf
    from hybrid.model.registry import resolve_model_path

    try:
        tiny = resolve_model_path("tiny")
    except HybridError:
        pytest.skip("embedded tiny model not installed")
    out = tmp_path_factory.mktemp("llama_offload") / "tiny.gguf"
    export_gguf(tiny, out, "bf16")
    return out


@pytest.fixture(scope="module")
def runners(tiny_gguf):
    from hybrid.baselines.llama_runner import LlamaRunner

    plain = LlamaRunner(tiny_gguf, n_ctx=96, n_threads=2)
    offload = LlamaRunner(tiny_gguf, n_ctx=96, n_threads=2, n_gpu_layers=-1, cpu_experts=True)
    yield plain, offload
    plain.close()
    offload.close()


def _prompt(r):
    return r.tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n")


def test_cpu_experts_places_every_expert_tensor_on_the_cpu(runners, tiny_gguf):
    import gguf

    from hybrid.baselines.llama_offload import EXPS_PATTERN

    _, offload = runners
    names = {t.name for t in gguf.GGUFReader(str(tiny_gguf)).tensors if "_exps" in t.name}
    assert names and set(offload.load_log.overridden) == names          # every expert tensor, nothing else
    place = offload.placement()
    assert place["cpu_experts_pattern"] == EXPS_PATTERN
    assert place["overridden_to"] == ["CPU"] and place["n_gpu_layers"] == -1
    assert sum(place["model_buffers_mib"].values()) > 0


def test_cpu_experts_same_logits_and_greedy_tokens(runners):
    plain, offload = runners
    ids = _prompt(plain)
    np.testing.assert_array_equal(offload.logits(ids), plain.logits(ids))   # same CPU kernels here
    assert offload.greedy_decode(ids, 12).tokens == plain.greedy_decode(ids, 12).tokens
    assert plain.placement()["overridden_tensors"] == 0


def test_decode_speed_counts_as_hybrid_does(runners):
    plain, _ = runners
    ids = _prompt(plain)
    rec = plain.decode_speed(ids, 10, warmup=3)
    assert rec["prompt_tokens"] == len(ids) and rec["tokens"] == 10 and rec["warmup_tokens"] == 3
    assert rec["prefill_tok_s"] > 0 and rec["decode_tok_s"] > 0 and rec["decode_median_tok_s"] > 0
    t = plain.greedy_decode(ids, 9)                      # tokens - 1 decode steps after the prefill token
    assert rec["generated_ids_head"][:9] == t.tokens and len(rec["generated_ids_head"]) == 10
    assert len(t.step_s) == 9 and t.decode_s >= sum(t.step_s)
    assert t.mean_tok_s == pytest.approx(9 / t.decode_s)
    with pytest.raises(HybridError, match="at least 2"):
        plain.decode_speed(ids, 1)


def test_bad_pattern_is_a_clear_error(tiny_gguf):
    from hybrid.baselines.llama_runner import LlamaRunner

    with pytest.raises(HybridError, match=r"'ffn_\(up': not a valid regular expression"):
        LlamaRunner(tiny_gguf, n_ctx=32, cpu_experts="ffn_(up")
    with pytest.raises(HybridError, match="matched no tensor"):
        LlamaRunner(tiny_gguf, n_ctx=32, cpu_experts=r"\.no_such_tensor")


def test_missing_lib_is_a_clear_error(tmp_path):
    from hybrid.baselines import llama_offload as lo

    with pytest.raises(HybridError, match="cannot load libggml"):
        lo.libggml(tmp_path)


def test_overrides_array_and_default_params_restored():
    import llama_cpp.llama_cpp as C

    from hybrid.baselines import llama_offload as lo

    ov = lo.cpu_overrides([lo.EXPS_PATTERN, r"\.attn_q\."])
    assert ov.array[0].pattern == lo.EXPS_PATTERN.encode() and ov.array[1].buft == lo.cpu_buffer_type()
    assert ov.array[2].pattern is None and not ov.array[2].buft                 # NULL-terminated
    default = C.llama_model_default_params
    with pytest.raises(RuntimeError):
        with lo.model_params_with(ov):
            assert C.llama_model_default_params().tensor_buft_overrides == ctypes.addressof(ov.array)
            raise RuntimeError
    assert C.llama_model_default_params is default
    assert not C.llama_model_default_params().tensor_buft_overrides


def test_params_without_extra_buffer_types():
    import llama_cpp.llama_cpp as C

    from hybrid.baselines import llama_offload as lo

    default = C.llama_model_default_params
    assert default().use_extra_bufts                                            # llama.cpp's default
    with lo.model_params_with(None, extra_bufts=False):
        p = C.llama_model_default_params()
        assert not p.use_extra_bufts and not p.tensor_buft_overrides
    assert C.llama_model_default_params is default
    with lo.model_params_with(None):
        assert C.llama_model_default_params is default                          # nothing to change


def test_extra_bufts_switch(monkeypatch):
    import llama_cpp

    from hybrid.baselines import llama_runner as lr

    monkeypatch.setenv(lr.EXTRA_BUFTS_ENV, "off")
    assert lr.extra_bufts() is False and lr.llama_cpp_info()["extra_bufts"] is False
    monkeypatch.setenv(lr.EXTRA_BUFTS_ENV, "on")
    assert lr.extra_bufts() is True
    monkeypatch.setenv(lr.EXTRA_BUFTS_ENV, "auto")
    amx = "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode()
    assert lr.extra_bufts() is (not amx)
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: b"CPU : AVX2 = 1 | AMX_INT8 = 1 |")
    assert lr.extra_bufts() is False
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: b"CPU : AVX2 = 1 | FMA = 1 |")
    assert lr.extra_bufts() is True
    monkeypatch.setenv(lr.EXTRA_BUFTS_ENV, "maybe")
    with pytest.raises(HybridError, match="HYBRID_LLAMA_EXTRA_BUFTS='maybe': expected auto, on or off"):
        lr.extra_bufts()


def test_devices_lists_the_cpu():
    from hybrid.baselines import llama_offload as lo

    devs = lo.devices()
    assert any(d["type"] == "cpu" for d in devs)
    assert all(d["total"] >= d["free"] >= 0 for d in devs)


def test_load_log_parsing():
    from hybrid.baselines.llama_offload import LoadLog

    log = LoadLog(["tensor blk.3.ffn_up_exps.weight (1 MiB nvfp4) buffer type overridden to CUDA_Host",
                   "load_tensors:        CUDA0 model buffer size =  1234.50 MiB",
                   "load_tensors:   CPU_Mapped model buffer size =   10.00 MiB",
                   "load_tensors:   CPU_Mapped model buffer size =    5.00 MiB"])
    assert log.overridden == {"blk.3.ffn_up_exps.weight": "CUDA_Host"}
    assert log.model_buffers_mib == {"CUDA0": 1234.5, "CPU_Mapped": 15.0}


@pytest.fixture(scope="module")
def nvfp4_gguf(tmp_path_factory):
    """A small synthetic NVFP4 checkpoint (tools/make_synthetic.py, the device's generator) as GGUF."""
    from hybrid.baselines.gguf_export import export_gguf

    d = tmp_path_factory.mktemp("nvfp4_small")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "make_synthetic.py"), str(d / "m"), "--skew", "0.25",
                        "--device", "cpu", *_tool().SMALL], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-1000:]
    export_gguf(d / "m", d / "m.gguf", "bf16")
    return d / "m.gguf"


def test_nvfp4_cpu_experts_same_logits(nvfp4_gguf):
    from hybrid.baselines.llama_runner import LlamaRunner

    plain = LlamaRunner(nvfp4_gguf, n_ctx=64, n_threads=2)
    off = LlamaRunner(nvfp4_gguf, n_ctx=64, n_threads=2, n_gpu_layers=-1, cpu_experts=True)
    ids = list(range(3, 35))
    np.testing.assert_array_equal(off.logits(ids), plain.logits(ids))
    assert off.placement()["overridden_tensors"] == 4 * 6             # weight + .scale of gate/up/down
    plain.close()
    off.close()


def _gpu_offload() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


@pytest.mark.cuda
@pytest.mark.skipif(not _gpu_offload(), reason="needs llama-cpp-python built with a GPU backend")
def test_cuda_placements_on_nvfp4(nvfp4_gguf):
    """All layers on the GPU vs experts on the CPU: where the weights went (llama.cpp's own log),
    and the logits of both against the CPU-only run (GPU kernels differ in rounding)."""
    from hybrid.baselines.llama_runner import LlamaRunner
    from hybrid.baselines.report import gguf_expert_bytes

    ids = list(range(3, 35))
    cpu = LlamaRunner(nvfp4_gguf, n_ctx=64)
    ref = cpu.logits(ids)
    cpu.close()
    out = {}
    for name, kw in (("gpu", {}), ("cpu_experts", {"cpu_experts": True})):
        r = LlamaRunner(nvfp4_gguf, n_ctx=64, n_gpu_layers=-1, **kw)
        out[name] = (r.placement(), r.logits(ids))
        r.close()
    gpu_buf = {k: v for k, v in out["gpu"][0]["model_buffers_mib"].items() if k.startswith("CUDA") and "Host" not in k}
    off_buf = {k: v for k, v in out["cpu_experts"][0]["model_buffers_mib"].items()
               if k.startswith("CUDA") and "Host" not in k}
    exps_mib = gguf_expert_bytes(nvfp4_gguf) / 2**20                  # what moved off the GPU
    assert gpu_buf and sum(gpu_buf.values()) - sum(off_buf.values()) == pytest.approx(exps_mib, rel=0.1, abs=0.1)
    assert out["cpu_experts"][0]["overridden_tensors"] == 4 * 6
    for _, logits in out.values():
        np.testing.assert_allclose(logits, ref, atol=0.1 * np.abs(ref).max())  # q8_1 activations on CUDA
        assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


# ---------------------------------------------------------------- tools/gpu_llama_ab.py

def _tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_llama_ab", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tool_finds_cuda_libs_and_builds_child_env(tmp_path, monkeypatch):
    tool = _tool()
    lib = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcublas.so.13").write_bytes(b"")
    (tmp_path / "site" / "nvidia" / "empty" / "lib").mkdir(parents=True)
    assert tool.cuda_lib_dirs([str(tmp_path / "site"), str(tmp_path / "nope")]) == [str(lib)]
    monkeypatch.setattr(tool, "cuda_lib_dirs", lambda: [str(lib)])
    monkeypatch.setenv("LD_LIBRARY_PATH", "/x")
    env = tool.child_env("/tmp/site")
    assert env["LD_LIBRARY_PATH"] == f"{lib}:/tmp/site:/x"
    assert env["PYTHONPATH"].split(":")[:2] == ["/tmp/site", str(ROOT)]


def test_tool_child_runs_llama_with_cpu_experts(tiny_gguf):
    tool = _tool()
    spec = {"what": "decode", "gguf": str(tiny_gguf), "n_ctx": 64, "threads": 2, "prompts": [list(range(5, 21)), list(range(5, 45))],
            "tokens": 6, "warmup": 2, "n_gpu_layers": -1, "cpu_experts": True, "use_mmap": False}
    d = tool.run_child(spec, tool.child_env(None), 120)
    assert "error" not in d, d.get("error")
    assert [r["prompt_tokens"] for r in d["runs"]] == [16, 40]      # one load, both prompt lengths
    assert all(r["tokens"] == 6 and r["decode_tok_s"] > 0 for r in d["runs"])
    assert d["placement"]["overridden_tensors"] == 12 and d["n_ubatch"] == 64
    assert d["placement"]["model_buffers_mib"]          # "CPU" (not mapped) with use_mmap False
    bad = tool.run_child({**spec, "cpu_experts": "ffn_("}, tool.child_env(None), 60)
    assert "not a valid regular expression" in bad["error"]


def test_tool_table():
    tool = _tool()
    res = {("hybrid_all_cpu", 32): {"decode_tok_s": 3.3, "prefill_tok_s": 20.0, "generated_ids_head": [1, 2, 3],
                              "prediction": {"tok_s": 9.0, "tok_s_at_measured_context": 10.0},
                              "measured_over_predicted": 0.37, "measured_over_predicted_at_context": 0.33},
           ("llama_cpu_experts", 32): {"decode_tok_s": 20.0, "decode_median_tok_s": 21.0, "prefill_tok_s": 80.0, "generated_ids_head": [1, 2, 4],
                                 "gpu_used_gib_by_load": 1.5},
           ("llama_all_gpu", 32): {"error": "child exited 1: boom"},
           ("llama_all_gpu", 512): {"decode_tok_s": 9.0, "prefill_tok_s": 900.0}}
    text = tool.table(res, [32, 512, 512])
    row = ("| 32 | llama.cpp | `n_gpu_layers=-1` + `ffn_*_exps` on the CPU | CPU | **20.00** | 80.0 "
           "|  |  | 1.5 | 2 |")
    assert row in text
    assert "– (child exited 1: boom)" in text and "– (not run)" in text
    assert "median" not in text                      # a CUDA step time is not a speed (JSONL only)
    assert "| **3.30** | 20.0 | 10.00 | 0.33 |" in text
    assert "| 512 | llama.cpp | all layers on the GPU | GPU | **9.00** | 900.0 |" in text
    assert text.count("| 512 |") == 4 and "| 512 | hybrid | 1 card, `--cache-slots 0` | CPU (runner) | – (not run)" in text


@pytest.mark.slow
def test_tool_dry_run_small(tmp_path):
    """The whole script on a small synthetic NVFP4 model, CPU only (~1 min on 2 cores)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--small", "--synth", str(tmp_path / "s"),
                        "--tokens", "8", "--warmup", "2", "--prompt-tokens", "8,24"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = list(map(json.loads, (tmp_path / "out" / "llama_ab.jsonl").read_text().splitlines()))
    recs = {r["check"]: r for r in rows}
    assert recs["gguf_export"]["ok"] and recs["gguf_export"]["expert_tensor_types"] == ["NVFP4"]
    for k in ("llama_all_gpu", "llama_cpu_experts", "hybrid_all_cpu", "hybrid_cap16"):
        assert recs[k]["decode_tok_s"] > 0, recs[k]
        assert sorted(r["prompt_tokens"] for r in rows if r["check"] == k) == [8, 24]
    assert recs["llama_cpu_experts"]["placement"]["overridden_tensors"] == 4 * 6    # weight + scale, 3 projections
    assert (tmp_path / "out" / "llama_ab.md").read_text().count("| llama.cpp |") == 4


def test_pack_llama_site_keeps_one_copy_per_library(tmp_path):
    """tools/pack_llama_site.py: of a wheel's lib*.so / .so.0 / .so.0.x.y copies it keeps .so.0 and the plain
    names llama_cpp opens, not libggml-cuda.so (only ever loaded as libggml-cuda.so.0)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pack_llama_site", ROOT / "tools" / "pack_llama_site.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = ["libllama.so", "libllama.so.0", "libllama.so.0.5.0", "libggml-cuda.so", "libggml-cuda.so.0",
             "libggml-cuda.so.0.25.3", "libggml-base.so.0", "libggml-base.so.0.25.3"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    dropped = mod.prune(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["libggml-base.so.0", "libggml-cuda.so.0", "libllama.so",
                                                          "libllama.so.0"]
    assert sorted(dropped) == ["libggml-base.so.0.25.3", "libggml-cuda.so", "libggml-cuda.so.0.25.3",
                               "libllama.so.0.5.0"]
