"""RoutingCounter / Tee / save (hybrid.runtime.routing_counts): counts of fresh random routings against a
direct count, the file's invariants, and a failed write leaving no file."""
import os

import numpy as np
import pytest

from hybrid.errors import HybridError
from hybrid.experts.popularity import load_profile
from hybrid.runtime.routing_counts import RoutingCounter, Tee, save


def test_counts_match_a_direct_count(tmp_path):
    rng = np.random.default_rng()
    L, E, k = 3, 10, 4
    c = RoutingCounter(L, E, k)
    want, tokens = np.zeros((L, E), np.int64), 0
    for t in (5, 1, 1, 3):                                       # a prefill, decode steps, a chunk
        ids = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(t)]) for _ in range(L)])
        for layer in range(L):
            np.add.at(want[layer], ids[layer].ravel(), 1)
        seen = []
        Tee(c, type("Sink", (), {"step": lambda self, i, **f: seen.append(f), "close": lambda self: None})()).step(
            ids, phase="x")
        assert seen == [{"phase": "x"}]
        tokens += t
    assert np.array_equal(c.counts, want) and c.tokens == tokens
    p = save(c, tmp_path / "m.experts.json", "m", "qwen3_moe", "test")
    prof = load_profile(p)
    assert prof.tokens == tokens and np.array_equal(prof.counts, want) and prof.top_k == k
    assert [f.name for f in tmp_path.iterdir()] == ["m.experts.json"]               # no temp file left
    with pytest.raises(ValueError, match="outside"):
        c.step(np.full((L, 1, k), E))
    assert save(RoutingCounter(L, E, k), tmp_path / "empty.json", "m", "qwen3_moe", "test") is None


def test_unwritable_target_is_one_line(tmp_path):
    c = RoutingCounter(1, 4, 2)
    c.step(np.array([[[0, 1]]]))
    (tmp_path / f".p.json.{os.getpid()}.tmp").mkdir()     # the temp file cannot be written (root or not)
    with pytest.raises(HybridError, match="--save-expert-profile .*cannot write"):
        save(c, tmp_path / "p.json", "m", "qwen3_moe", "test")
    assert not (tmp_path / "p.json").exists()
    with pytest.raises(HybridError, match="expected a file in an existing folder"):
        save(c, tmp_path, "m", "qwen3_moe", "test")
