import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid.checkpoint.formats import QType
from hybrid.checkpoint.reader import Checkpoint
from hybrid.errors import CheckpointError
from tests.quant_layouts import to_nvfp4

Q = "model.layers.0.self_attn.q_proj"
EXPERT = "model.layers.1.mlp.experts.3.down_proj"


@pytest.fixture(scope="module")
def nvfp4_dirs(qwen3_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("layouts")
    return (to_nvfp4(qwen3_dir, base / "modelopt", "modelopt"),
            to_nvfp4(qwen3_dir, base / "ct", "compressed-tensors"))


def test_dense_checkpoint_reads_lazily_with_shapes(qwen3_dir):
    ck = Checkpoint(qwen3_dir)
    assert ck.quant.method is None
    qw = ck.linear(Q, (64, 64))
    assert qw.qtype is QType.BF16 and qw.shape == (64, 64)
    assert len(list(qwen3_dir.glob("*.safetensors"))) == 2 and len(ck.names()) > 50


def test_modelopt_and_compressed_tensors_decode_equal(nvfp4_dirs):
    mo, ct = (Checkpoint(d) for d in nvfp4_dirs)
    assert mo.quant.method == "modelopt" and ct.quant.method == "compressed-tensors"
    for name, shape in ((Q, (64, 64)), (EXPERT, (64, 32))):
        a, b = mo.linear(name, shape), ct.linear(name, shape)
        assert a.qtype is b.qtype is QType.NVFP4
        assert torch.equal(a.dequantize(), b.dequantize())
    assert mo.linear("lm_head", (512, 64)).qtype is QType.BF16  # excluded


def test_nvfp4_close_to_source(qwen3_dir, nvfp4_dirs):
    src = Checkpoint(qwen3_dir).linear(EXPERT, (64, 32)).dequantize()
    q = Checkpoint(nvfp4_dirs[0]).linear(EXPERT, (64, 32)).dequantize()
    assert ((q - src).norm() / src.norm()).item() < 0.15


def test_wrong_shape_names_tensor(qwen3_dir):
    with pytest.raises(CheckpointError, match="q_proj"):
        Checkpoint(qwen3_dir).linear(Q, (64, 32))


def test_missing_tensor(qwen3_dir):
    with pytest.raises(CheckpointError, match="missing tensor 'nope.weight'"):
        Checkpoint(qwen3_dir).linear("nope", (1, 1))


def test_truncated_file(qwen3_dir, tmp_path):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(qwen3_dir, d)
    f = sorted(d.glob("*.safetensors"))[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f.name):
        ck = Checkpoint(d)
        for n in ck.names():
            ck.tensor(n)


def test_negative_or_nan_scales_rejected(nvfp4_dirs, tmp_path):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(nvfp4_dirs[0], d)
    for f in d.glob("*.safetensors"):
        sd = load_file(str(f))
        key = f"{Q}.weight_scale_2"
        if key in sd:
            sd[key] = torch.tensor(float("nan"))
            save_file(sd, str(f))
    with pytest.raises(CheckpointError, match="weight_scale_2 has NaN"):
        Checkpoint(d).linear(Q, (64, 64))


def test_unsupported_quant_algo(qwen3_dir, tmp_path):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(qwen3_dir, d)
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "W4A8_AWQ"}}))
    with pytest.raises(CheckpointError, match="unsupported quant_algo 'W4A8_AWQ'"):
        Checkpoint(d)


def test_config_says_nvfp4_but_tensor_dense(qwen3_dir, tmp_path):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(qwen3_dir, d)
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4",
                                                                         "exclude_modules": ["lm_head"]}}))
    with pytest.raises(CheckpointError, match="stored as bf16 but"):
        Checkpoint(d).linear(Q, (64, 64))
