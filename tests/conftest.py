import pytest
import torch

from hybrid.testing import write_random_model

# Tests run many tiny ops: intra-op threads only add wake-up latency (and thrash on a busy CI box).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """A small random BF16 qwen3_moe folder, sharded in two."""
    return write_random_model(tmp_path_factory.mktemp("qwen3"), "qwen3_moe", shards=2)
