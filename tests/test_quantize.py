"""hybrid-quantize: output accepted by the ModelOpt / compressed-tensors layout rules, read back by the
reader, close to the source; every bad input exits 2 with one line and leaves no DST behind."""
import json
import re
import shutil
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hybrid.checkpoint.formats import GROUP, dequant_fp8, dequant_nvfp4
from hybrid.cli.quantize import main
from hybrid.errors import CheckpointError
from hybrid.testing import write_random_model

ARCHS = {"qwen3_moe": 2, "qwen2_moe": 1, "mixtral": 3}   # arch -> source shards
RECIPES = ("nvfp4", "fp8", "mixed")
SCALE_KEYS = ("weight_scale", "weight_scale_2", "input_scale", "weight_packed", "weight_global_scale")


# ----- helpers ----------------------------------------------------------------------------------
def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def linear_modules(src_sd: dict) -> list[str]:
    """Every Linear of the source: 2-D `.weight` tensors except the embedding."""
    return sorted(k[: -len(".weight")] for k, t in src_sd.items()
                  if k.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in k)


def expected_algo(recipe: str, module: str) -> str | None:
    """The recipe rules written out independently of hybrid.checkpoint.recipes."""
    if module.endswith(("mlp.gate", "block_sparse_moe.gate", "shared_expert_gate")):
        return None                                   # routers and the shared-expert gate stay BF16
    if module == "lm_head":
        return "NVFP4" if recipe == "mixed" else None
    if ".self_attn." in module:
        return {"nvfp4": "NVFP4", "fp8": "FP8", "mixed": "FP8"}[recipe]
    return {"nvfp4": "NVFP4", "fp8": "FP8", "mixed": "NVFP4"}[recipe]   # routed + shared experts


def scale_group(module: str) -> str | None:
    """Linears sharing an input share NVFP4 weight_scale_2: q/k/v; an expert's gate/up."""
    for pat, key in ((r"(.*self_attn)\.[qkv]_proj$", "qkv"), (r"(.*experts\.\d+)\.(gate_proj|up_proj|w1|w3)$", "gu"),
                     (r"(.*shared_expert)\.(gate|up)_proj$", "gu")):
        m = re.match(pat, module)
        if m:
            return f"{m.group(1)}.{key}"
    return None


def nvfp4_bound(w, scale, s2):
    s = (scale.float() * float(s2)).repeat_interleave(GROUP, dim=1)
    x = torch.where(s > 0, w.abs() / s.clamp(min=1e-38), torch.zeros_like(w)).clamp(max=6)
    half = torch.where(x < 2, 0.25, torch.where(x < 4, 0.5, 1.0))
    return half * s + (w.abs() - 6 * s).clamp(min=0) + 1e-6 * w.abs()


def no_leftovers(dst: Path) -> bool:
    return not any(p.name.startswith(f".{dst.name}.partial") for p in dst.parent.iterdir())


def run_ok(*argv) -> None:
    assert main([str(a) for a in argv] + ["--no-progress"]) == 0


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("src")
    return {mt: write_random_model(base / mt, mt, seed=3, shards=n) for mt, n in ARCHS.items()}


@pytest.fixture(scope="module")
def outputs(sources, tmp_path_factory):
    """(arch, recipe) -> quantized folder, made once through the CLI in-process."""
    base = tmp_path_factory.mktemp("out")
    out = {}
    for mt, src in sources.items():
        for r in RECIPES:
            dst = base / f"{mt}-{r}"
            run_ok(src, dst, "--recipe", r, "--shard-size", "0.08")
            out[mt, r] = dst
    return out


# ----- the ModelOpt layout's rules ---------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_modelopt_layout_rules(arch, recipe, sources, outputs):
    src, dst = sources[arch], outputs[arch, recipe]
    src_sd, out = read_folder(src), read_folder(dst)
    mods = linear_modules(src_sd)
    plan = {m: expected_algo(recipe, m) for m in mods}
    for m, algo in plan.items():
        w = src_sd[f"{m}.weight"].float()
        n, k = w.shape
        keys = {key for key in out if key.startswith(m + ".") and key[len(m) + 1:] in SCALE_KEYS + ("weight",)}
        if algo == "NVFP4":
            assert keys == {f"{m}.{s}" for s in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
            q, sc, s2 = out[f"{m}.weight"], out[f"{m}.weight_scale"], out[f"{m}.weight_scale_2"]
            assert (q.dtype, tuple(q.shape)) == (torch.uint8, (n, k // 2))
            assert (sc.dtype, tuple(sc.shape)) == (torch.float8_e4m3fn, (n, k // GROUP))
            assert (s2.dtype, s2.dim()) == (torch.float32, 0) and float(s2) > 0
            err = (dequant_nvfp4(q, sc, s2) - w).abs()
            assert bool((err <= nvfp4_bound(w, sc, s2)).all()), m
        elif algo == "FP8":
            assert keys == {f"{m}.{s}" for s in ("weight", "weight_scale", "input_scale")}
            q, sc = out[f"{m}.weight"], out[f"{m}.weight_scale"]
            assert (q.dtype, tuple(q.shape)) == (torch.float8_e4m3fn, (n, k))
            assert (sc.dtype, sc.dim()) == (torch.float32, 0)
            assert float(sc) == pytest.approx(float(w.abs().max()) / 448, rel=1e-6)
            err = (dequant_fp8(q, sc) - w).abs()
            assert bool((err <= w.abs() * 2 ** -4 + 2 ** -10 * float(sc) + 1e-7).all()), m
        else:
            assert keys == {f"{m}.weight"}
            assert torch.equal(out[f"{m}.weight"], src_sd[f"{m}.weight"])   # untouched, same dtype
        if algo is not None:
            assert out[f"{m}.input_scale"].dtype == torch.float32 and out[f"{m}.input_scale"].dim() == 0
    # every non-Linear tensor (norms, embeddings, biases) copied bit for bit
    for key, t in src_sd.items():
        if key[: -len(".weight")] not in plan:
            assert torch.equal(out[key], t) and out[key].dtype == t.dtype, key
    assert len(out) == len(src_sd) + sum({"NVFP4": 3, "FP8": 2, None: 0}[a] for a in plan.values())


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_shared_weight_scale_2_within_groups(arch, recipe, sources, outputs):
    src_sd, out = read_folder(sources[arch]), read_folder(outputs[arch, recipe])
    groups: dict[str, list[str]] = {}
    for m in linear_modules(src_sd):
        if expected_algo(recipe, m) == "NVFP4" and scale_group(m):
            groups.setdefault(scale_group(m), []).append(m)
    if recipe != "fp8":
        assert groups and all(len(g) >= 2 for g in groups.values())
    for members in groups.values():
        s2 = {out[f"{m}.weight_scale_2"].item() for m in members}
        assert len(s2) == 1, members
        amax = max(float(src_sd[f"{m}.weight"].float().abs().max()) for m in members)
        assert s2.pop() == pytest.approx(amax / (6 * 448), rel=1e-6)


@pytest.mark.parametrize("recipe", RECIPES)
def test_config_fields(recipe, sources, outputs):
    arch = "qwen2_moe"
    src, dst = sources[arch], outputs[arch, recipe]
    mods = linear_modules(read_folder(src))
    plan = {m: expected_algo(recipe, m) for m in mods}
    hq = json.loads((dst / "hf_quant_config.json").read_text())
    assert hq["producer"]["name"] == "modelopt" and hq["producer"]["version"]
    q = hq["quantization"]
    algo = {"nvfp4": "NVFP4", "fp8": "FP8", "mixed": "MIXED_PRECISION"}[recipe]
    assert q["quant_algo"] == algo and q["kv_cache_quant_algo"] is None
    if recipe != "fp8":
        assert q["group_size"] == 16
    excl = q["exclude_modules"]
    for m, a in plan.items():   # exclusions honoured, and consistent with what is stored
        matched = any(m == p or fnmatchcase(m, p) for p in excl)
        assert matched == (a is None), (m, a, excl)
    if recipe == "mixed":
        want = {m: ({"quant_algo": "NVFP4", "group_size": 16} if a == "NVFP4" else {"quant_algo": "FP8"})
                for m, a in plan.items() if a}
        assert q["quantized_layers"] == want
    else:
        assert "quantized_layers" not in q
    src_cfg = json.loads((src / "config.json").read_text())
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert cfg == src_cfg
    assert qc["quant_method"] == "modelopt"
    for key in ("quant_algo", "kv_cache_quant_algo", "exclude_modules"):
        assert qc[key] == q[key]
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / f).read_bytes() == (src / f).read_bytes()


def test_shards_and_index(sources, outputs, tmp_path):
    dst = outputs["mixtral", "nvfp4"]
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(files) > 1 and files == sorted(set(idx["weight_map"].values()))
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(files):05d}\.safetensors", f) for f in files)
    total = 0
    for f in files:
        with safe_open(str(dst / f), "pt") as h:
            for k in h.keys():
                assert idx["weight_map"][k] == f
                t = h.get_tensor(k)
                total += t.numel() * t.element_size()
    assert len(idx["weight_map"]) == len(read_folder(dst)) and idx["metadata"]["total_size"] == total
    one = tmp_path / "one"
    run_ok(sources["mixtral"], one, "--recipe", "nvfp4")
    assert [p.name for p in one.glob("*.safetensors")] == ["model.safetensors"]
    assert not (one / "model.safetensors.index.json").exists()
    a, b = read_folder(one), read_folder(dst)
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn
                                                    else a[k], b[k].view(torch.uint8) if b[k].dtype ==
                                                    torch.float8_e4m3fn else b[k]) for k in a)


# ----- read back through the reader ----------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_reader_round_trip(arch, recipe, sources, outputs):
    from hybrid.checkpoint.formats import QType
    from hybrid.checkpoint.reader import Checkpoint

    src_sd, dst = read_folder(sources[arch]), outputs[arch, recipe]
    ck, out = Checkpoint(dst), read_folder(dst)
    assert ck.config.model_type == arch and ck.quant.method == "modelopt"
    want_type = {"NVFP4": QType.NVFP4, "FP8": QType.FP8, None: QType.BF16}
    for m in linear_modules(src_sd):
        w = src_sd[f"{m}.weight"]
        qw = ck.linear(m, tuple(w.shape))
        a = expected_algo(recipe, m)
        assert qw.qtype is want_type[a], m
        if a == "NVFP4":
            ref = dequant_nvfp4(out[f"{m}.weight"], out[f"{m}.weight_scale"], out[f"{m}.weight_scale_2"])
        elif a == "FP8":
            ref = dequant_fp8(out[f"{m}.weight"], out[f"{m}.weight_scale"])
        else:
            ref = w.float()
        assert torch.equal(qw.dequantize(), ref), m


def test_compressed_tensors_output_matches_modelopt(sources, outputs, tmp_path):
    from hybrid.checkpoint.reader import Checkpoint

    src, mo = sources["qwen2_moe"], outputs["qwen2_moe", "nvfp4"]
    ct = tmp_path / "ct"
    run_ok(src, ct, "--recipe", "nvfp4", "--format", "compressed-tensors")
    assert not (ct / "hf_quant_config.json").exists()
    qc = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    wq = qc["config_groups"]["group_0"]["weights"]
    assert (wq["num_bits"], wq["type"], wq["group_size"], wq["strategy"]) == (4, "float", 16, "tensor_group")
    a, b = read_folder(mo), read_folder(ct)
    mods = linear_modules(read_folder(src))
    assert sorted(qc["ignore"]) == sorted(m for m in mods if expected_algo("nvfp4", m) is None)
    ck_mo, ck_ct = Checkpoint(mo), Checkpoint(ct)
    for m in mods:
        if expected_algo("nvfp4", m) is None:
            assert torch.equal(a[f"{m}.weight"], b[f"{m}.weight"])
            continue
        assert f"{m}.weight" not in b and f"{m}.weight_scale_2" not in b
        assert torch.equal(b[f"{m}.weight_packed"], a[f"{m}.weight"])
        assert torch.equal(b[f"{m}.weight_scale"].view(torch.uint8), a[f"{m}.weight_scale"].view(torch.uint8))
        g = b[f"{m}.weight_global_scale"]
        assert g.dtype == torch.float32 and tuple(g.shape) == (1,)
        assert float(g) == pytest.approx(1 / float(a[f"{m}.weight_scale_2"]), rel=1e-7)
        shape = tuple(read_folder(src)[f"{m}.weight"].shape) if m.endswith("q_proj") else None
        if shape:
            torch.testing.assert_close(ck_ct.linear(m, shape).dequantize(), ck_mo.linear(m, shape).dequantize(),
                                       rtol=1e-6, atol=0)


# ----- options ------------------------------------------------------------------------------------
def test_exclude_flag_and_empty_existing_dst(sources, tmp_path):
    from hybrid.checkpoint.reader import Checkpoint

    dst = tmp_path / "x"
    dst.mkdir()                                          # an empty DST the user made is fine
    run_ok(sources["qwen3_moe"], dst, "--recipe", "nvfp4", "--exclude", "model.layers.0.*")
    q = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]
    assert "model.layers.0.*" in q["exclude_modules"]
    ck = Checkpoint(dst)
    assert ck.linear("model.layers.0.self_attn.q_proj", (64, 64)).qtype.value == "bf16"
    assert ck.linear("model.layers.1.self_attn.q_proj", (64, 64)).qtype.value == "nvfp4"


def test_nvfp4_scales_flag(sources, tmp_path):
    """--nvfp4-scales mse: the same layout and global scales, block scales chosen for less error (each linear's
    weight error lower than with amax, the default)."""
    from hybrid.checkpoint.reader import Checkpoint

    src = sources["qwen3_moe"]
    run_ok(src, tmp_path / "amax", "--recipe", "nvfp4")
    run_ok(src, tmp_path / "mse", "--recipe", "nvfp4", "--nvfp4-scales", "mse")
    a, m, ref = Checkpoint(tmp_path / "amax"), Checkpoint(tmp_path / "mse"), Checkpoint(src)
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.0.mlp.experts.3.down_proj"):
        qa, qm = a.linear(name, ref.tensor(f"{name}.weight").shape), m.linear(name, ref.tensor(f"{name}.weight").shape)
        assert qa.data.shape == qm.data.shape and torch.equal(qa.scale_2, qm.scale_2)
        w = ref.tensor(f"{name}.weight").float()
        assert float((qm.dequantize() - w).norm()) < float((qa.dequantize() - w).norm())
    with pytest.raises(SystemExit) as exc:                    # argparse: a choice it does not know
        main([str(src), str(tmp_path / "x"), "--nvfp4-scales", "best"])
    assert exc.value.code == 2 and not (tmp_path / "x").exists()


def test_imatrix_flag(capsys, sources, tmp_path):
    """--imatrix (hybrid-gguf imatrix's file): implies mse, changes the chosen scales of the linears it covers and
    only theirs; a missing / corrupt / mismatched file or --nvfp4-scales amax with it: one line, nothing written."""
    import numpy as np

    from hybrid.baselines import imatrix as im
    from hybrid.checkpoint.reader import Checkpoint
    from hybrid.model.config import ModelConfig

    src = sources["qwen3_moe"]
    cfg = ModelConfig.from_folder(src)
    rng = np.random.default_rng(0)
    mat = {"blk.0.attn_q.weight": rng.random(cfg.hidden_size, dtype=np.float32) ** 6 * 100,
           "blk.1.ffn_down_exps.weight": rng.random(cfg.num_experts * cfg.moe_intermediate_size,
                                                     dtype=np.float32) ** 6 * 100}
    f = tmp_path / "imat.npz"
    im.save(f, mat)
    run_ok(src, tmp_path / "mse", "--recipe", "nvfp4", "--nvfp4-scales", "mse")
    run_ok(src, tmp_path / "imat", "--recipe", "nvfp4", "--imatrix", f)
    m, i = Checkpoint(tmp_path / "mse"), Checkpoint(tmp_path / "imat")
    scale = lambda ck, name: ck.tensor(f"{name}.weight_scale").view(torch.uint8)  # noqa: E731
    assert not torch.equal(scale(m, "model.layers.0.self_attn.q_proj"), scale(i, "model.layers.0.self_attn.q_proj"))
    assert not torch.equal(scale(m, "model.layers.1.mlp.experts.0.down_proj"),
                           scale(i, "model.layers.1.mlp.experts.0.down_proj"))
    assert torch.equal(scale(m, "model.layers.0.self_attn.k_proj"), scale(i, "model.layers.0.self_attn.k_proj"))
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    short = tmp_path / "short.npz"
    im.save(short, {"blk.0.attn_q.weight": np.ones(8, dtype=np.float32)})
    for extra, match in ((["--imatrix", tmp_path / "none.npz"], r"--imatrix .*none.npz: file not found"),
                         (["--imatrix", bad], r"--imatrix .*bad.npz: not an importance matrix"),
                         (["--imatrix", short], r"--imatrix: model.layers.0.self_attn.q_proj has \[8\] importances"),
                         (["--imatrix", f, "--nvfp4-scales", "amax"], r"--imatrix .* needs --nvfp4-scales mse")):
        expect_error(capsys, src, tmp_path / "x", *map(str, extra), match=match)


def test_device_flag(capsys, sources, tmp_path):
    """--device: cpu and auto the default's bytes; a device that does not exist here (or a bad name) one line, nothing
    written. On a GPU (skipped elsewhere): --device cuda gives the CPU's bytes exactly, amax's and mse's."""
    src = sources["qwen3_moe"]
    run_ok(src, tmp_path / "a", "--recipe", "mixed")
    run_ok(src, tmp_path / "b", "--recipe", "mixed", "--device", "cpu")
    files = sorted(f.name for f in (tmp_path / "a").iterdir())
    assert files == sorted(f.name for f in (tmp_path / "b").iterdir())
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    expect_error(capsys, src, tmp_path / "x", "--device", "tpu",
                 match=r"--device tpu: expected auto, cpu, cuda or cuda:N")
    run_ok(src, tmp_path / "f", "--recipe", "mixed", "--device", "auto")   # the GPU where there is one: same bytes
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "f" / f).read_bytes() for f in files
               if f.endswith(".safetensors"))
    if not torch.cuda.is_available():
        expect_error(capsys, src, tmp_path / "x", "--device", "cuda", match=r"--device cuda: no CUDA GPU is visible")
    else:
        expect_error(capsys, src, tmp_path / "x", "--device", "cuda:99", match=r"--device cuda:99: GPU 99 does not")
        run_ok(src, tmp_path / "c", "--recipe", "mixed", "--device", "cuda")
        assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "c" / f).read_bytes() for f in files
                   if f.endswith(".safetensors"))
        run_ok(src, tmp_path / "d", "--recipe", "mixed", "--nvfp4-scales", "mse", "--device", "cpu")
        run_ok(src, tmp_path / "e", "--recipe", "mixed", "--nvfp4-scales", "mse", "--device", "cuda")
        assert all((tmp_path / "d" / f).read_bytes() == (tmp_path / "e" / f).read_bytes() for f in files
                   if f.endswith(".safetensors"))


def test_device_out_of_memory(capsys, sources, tmp_path, monkeypatch):
    """A GPU that runs out of memory mid-checkpoint (--device auto picks the GPU by default): one line naming the
    Linears and --device cpu, nothing written."""
    from hybrid.checkpoint import writer

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(writer, "quantize_group", oom)
    monkeypatch.setattr(writer, "check_device", lambda d: "cuda")      # what auto picks where there is a GPU
    expect_error(capsys, sources["qwen3_moe"], tmp_path / "x",
                 match=r"^error: cuda: out of GPU memory quantizing model\.layers\.\d+\.\S+; free the GPU or "
                       r"pass --device cpu \(the same bytes\)$")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_and_fp16_sources(dtype, tmp_path):
    src = write_random_model(tmp_path / "src", "qwen3_moe", seed=5)
    sd = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(dtype) for k, v in sd.items()}, str(src / "model.safetensors"))
    run_ok(src, tmp_path / "dst", "--recipe", "mixed")
    out = read_folder(tmp_path / "dst")
    assert out["model.norm.weight"].dtype == dtype
    assert out["model.layers.1.mlp.experts.2.up_proj.weight"].dtype == torch.uint8
    assert out["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn


def test_console_script_subprocess(sources, tmp_path):
    exe = shutil.which("hybrid-quantize")
    cmd = [exe] if exe else [sys.executable, "-m", "hybrid.cli.quantize"]
    dst = tmp_path / "sub"
    r = subprocess.run(cmd + [str(sources["qwen3_moe"]), str(dst), "--recipe", "mixed"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {dst}") and "NVFP4" in r.stdout
    assert (dst / "hf_quant_config.json").is_file() and no_leftovers(dst)
    bad = subprocess.run(cmd + [str(tmp_path / "nope"), str(tmp_path / "d2")], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "Traceback" not in bad.stderr and not (tmp_path / "d2").exists()


def test_tiny_source_when_installed(tmp_path):
    from hybrid.model.registry import resolve_model_path
    try:
        resolve_model_path("tiny")
    except CheckpointError:
        pytest.skip("embedded tiny model not installed yet")
    run_ok("tiny", tmp_path / "t", "--recipe", "nvfp4")
    assert (tmp_path / "t" / "hf_quant_config.json").is_file()


# ----- bad input: exit 2, one line naming the file/tensor, no DST --------------------------------
@pytest.fixture
def src(tmp_path):
    return write_random_model(tmp_path / "src", "qwen3_moe", seed=1)


def rewrite(src: Path, edit) -> None:
    sd = load_file(str(src / "model.safetensors"))
    edit(sd)
    save_file(sd, str(src / "model.safetensors"))


def expect_error(capsys, src, dst, *extra, match: str) -> None:
    rc = main([str(src), str(dst), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(match, err[0]), err[0]
    assert not dst.exists() and no_leftovers(dst)


EXPERT = "model.layers.1.mlp.experts.7.down_proj.weight"


def test_bad_missing_config(capsys, src, tmp_path):
    (src / "config.json").unlink()
    expect_error(capsys, src, tmp_path / "dst", match=r"config\.json")


def test_bad_unknown_architecture(capsys, src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    expect_error(capsys, src, tmp_path / "dst", match=r"config\.json.*unknown architecture.*llama")


def test_bad_missing_tensor(capsys, src, tmp_path):
    rewrite(src, lambda sd: sd.pop(EXPERT))
    expect_error(capsys, src, tmp_path / "dst", match=rf"missing tensor {re.escape(EXPERT)}")


def test_bad_wrong_shape(capsys, src, tmp_path):
    rewrite(src, lambda sd: sd.update({EXPERT: torch.zeros(64, 16, dtype=torch.bfloat16)}))
    expect_error(capsys, src, tmp_path / "dst", match=rf"model\.safetensors: tensor {re.escape(EXPERT)} "
                 r"has shape \[64, 16\], expected \[64, 32\]")


def test_bad_wrong_dtype(capsys, src, tmp_path):
    rewrite(src, lambda sd: sd.update({EXPERT: torch.zeros(64, 32, dtype=torch.int32)}))
    expect_error(capsys, src, tmp_path / "dst", match=rf"{re.escape(EXPERT)} has dtype I32, expected")


def test_bad_truncated_safetensors(capsys, src, tmp_path):
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    expect_error(capsys, src, tmp_path / "dst", match=r"model\.safetensors: corrupt or truncated")


def test_bad_corrupt_safetensors(capsys, src, tmp_path):
    (src / "model.safetensors").write_bytes(b"\xff" * 64)
    expect_error(capsys, src, tmp_path / "dst", match=r"model\.safetensors: corrupt or truncated")


def test_bad_missing_shard(capsys, tmp_path):
    src = write_random_model(tmp_path / "src", "qwen3_moe", shards=2)
    (src / "model-00002-of-00002.safetensors").unlink()
    expect_error(capsys, src, tmp_path / "dst", match=r"model-00002-of-00002\.safetensors: shard listed")


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_bad_nan_weights_found_mid_write_leave_nothing(capsys, src, tmp_path, bad):
    """The NaN sits in the last layer: shards were already written when it is found."""
    def poison(sd):
        sd[EXPERT] = sd[EXPERT].clone()
        sd[EXPERT][3, 5] = bad
    rewrite(src, poison)
    expect_error(capsys, src, tmp_path / "dst", "--shard-size", "0.02",
                 match=rf"model\.safetensors: tensor {re.escape(EXPERT)} contains NaN")


def test_bad_source_already_quantized(capsys, sources, outputs, tmp_path):
    expect_error(capsys, outputs["qwen3_moe", "nvfp4"], tmp_path / "dst", match=r"already quantized")
    src = write_random_model(tmp_path / "s2", "qwen3_moe")
    rewrite(src, lambda sd: sd.update({"model.layers.0.self_attn.q_proj.weight_scale": torch.tensor(1.0)}))
    expect_error(capsys, src, tmp_path / "dst", match=r"q_proj\.weight_scale is a quantization scale")


def test_bad_dst_not_empty_is_untouched(capsys, sources, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    rc = main([str(sources["qwen3_moe"]), str(dst)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "not empty" in err[0]
    assert [p.name for p in dst.iterdir()] == ["keep.txt"] and no_leftovers(dst)


def test_bad_missing_source_and_bad_flags(capsys, sources, tmp_path):
    expect_error(capsys, tmp_path / "nope", tmp_path / "dst", match=r"nope.*not found")
    expect_error(capsys, sources["qwen3_moe"], tmp_path / "dst", "--recipe", "mixed", "--format",
                 "compressed-tensors", match=r"--format compressed-tensors supports --recipe nvfp4 only")
    expect_error(capsys, sources["qwen3_moe"], tmp_path / "dst", "--shard-size", "0", match=r"--shard-size")
    with pytest.raises(SystemExit) as exc:           # argparse: unknown recipe
        main([str(sources["qwen3_moe"]), str(tmp_path / "dst"), "--recipe", "int4"])
    assert exc.value.code == 2 and not (tmp_path / "dst").exists()


def test_debug_shows_the_exception(src, tmp_path):
    (src / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        main([str(src), str(tmp_path / "dst"), "--debug"])
    assert not (tmp_path / "dst").exists()


def test_row_chunked_nvfp4_equals_whole_tensor():
    from hybrid.checkpoint.formats import quantize_nvfp4
    from hybrid.checkpoint.writer import quantize_nvfp4_rows

    w = (torch.randn(1000, 64, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    whole, chunked = quantize_nvfp4(w.float()), quantize_nvfp4_rows(w, rows=96)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[2], chunked[2])
    assert torch.equal(whole[1].view(torch.uint8), chunked[1].view(torch.uint8))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_module_importance_names(model_type, tmp_path):
    """imatrix.module_importance: the GGUF-named rows under each architecture's Linear names (mixtral's w1/w3/w2),
    expert e's row of the stacked tensor to expert e; a statistic with another expert count a ValueError."""
    import numpy as np

    from hybrid.baselines.imatrix import module_importance
    from hybrid.checkpoint.names import Names
    from hybrid.model.config import ModelConfig

    cfg = ModelConfig.from_folder(write_random_model(tmp_path / "m", model_type))
    names, e, k = Names(model_type), cfg.num_experts, cfg.moe_intermediate_size
    down = np.arange(e * k, dtype=np.float32)
    mat = {"blk.1.attn_output.weight": np.full(cfg.num_attention_heads * cfg.head_dim, 2.0, dtype=np.float32),
           "blk.0.ffn_down_exps.weight": down}
    out = module_importance(mat, cfg)
    assert set(out) == {names.attn(1, "o_proj")} | {names.expert(0, i, "down") for i in range(e)}
    assert np.array_equal(out[names.expert(0, 2, "down")], down[2 * k:3 * k])
    with pytest.raises(ValueError):
        module_importance({"blk.0.ffn_down_exps.weight": np.ones(e * k + 1, dtype=np.float32)}, cfg)
