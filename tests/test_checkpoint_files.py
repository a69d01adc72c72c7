"""hybrid.checkpoint.files: the one safetensors file layer under the reader, the quantizer's source,
GGUF export's source and the planner's byte count."""
import json
import shutil

import pytest
import torch

from hybrid.baselines.source import SourceModel as ExportSource
from hybrid.checkpoint.files import INDEX, SafetensorsFiles, read_header, shard_files
from hybrid.checkpoint.reader import Checkpoint
from hybrid.checkpoint.writer import SourceModel as QuantizeSource
from hybrid.errors import CheckpointError
from hybrid.planner.model_bytes import ModelBytes
from hybrid.testing import write_random_model

READERS = (SafetensorsFiles, Checkpoint, QuantizeSource, ExportSource, ModelBytes.from_folder)


def test_every_reader_sees_the_same_tensors(qwen3_dir, tmp_path):
    single = write_random_model(tmp_path / "one", "qwen3_moe")           # same seed, one file
    files, one = SafetensorsFiles(qwen3_dir), SafetensorsFiles(single)
    assert len(set(files.where.values())) == 2 and files.names() == one.names()
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    for r in (Checkpoint(qwen3_dir), QuantizeSource(qwen3_dir), ExportSource(qwen3_dir), one):
        assert r.names() == files.names() and torch.equal(r.tensor(name), files.tensor(name))
    assert files.meta(name) == ("BF16", (64, 32)) and files.nbytes(name) == 64 * 32 * 2
    headers = {n: b for f in shard_files(qwen3_dir) for n, b in read_header(f).items()}
    assert headers == {n: files.nbytes(n) for n in files.names()}
    assert ModelBytes.from_folder(qwen3_dir).total == sum(headers.values())


@pytest.mark.parametrize("reader", READERS)
def test_bad_index_and_missing_shard_name_the_file(qwen3_dir, tmp_path, reader):
    d = tmp_path / "m"
    shutil.copytree(qwen3_dir, d)
    index = json.loads((d / INDEX).read_text())
    (d / INDEX).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match=rf"{INDEX}: not a valid safetensors index"):
        reader(d)
    (d / INDEX).write_text(json.dumps(index))
    shard = sorted(set(index["weight_map"].values()))[1]
    (d / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"{shard}: shard listed in {INDEX} is missing"):
        reader(d)


def test_missing_tensor_and_empty_folder(qwen3_dir, tmp_path):
    with pytest.raises(CheckpointError, match="missing tensor 'nope'"):
        ExportSource(qwen3_dir).tensor("nope")
    (tmp_path / "config.json").write_text((qwen3_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files \(expected model\.safetensors"):
        QuantizeSource(tmp_path)
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files$"):
        ExportSource(tmp_path)
