"""Repeat the eager and the graphed CUDA decode of tests/test_decode_graphs.py's fixture model (4 layers, 16
experts, top-4, NVFP4) in one process, one new session per run, and print each run's greedy ids and its largest
logit difference from the first run (6 decode steps): whether a session's CUDA graphs give the eager path's
numbers bit for bit, and under which switches (results/runtime.md §42). Where a run differs, also the prompt's
logits' difference and the first KV-cache row (position, layer) whose K differs from the first run's: the KV
rows a layer writes at a position depend on everything before that layer at that position, so the first
differing (position, layer) localizes where the difference entered.

    HYBRID_CACHE_DIR=.qpncache python3 -m pytest -q -s -p no:cacheprovider tools/gpu_graph_repeat.py

GRAPH_REPEAT_ENVS: the settings to run, ';'-separated, each one NAME=VALUE (an empty entry: the defaults),
default ";HYBRID_FUSED=0;HYBRID_FUSED_NEW=0".
GRAPH_REPEAT_MODES: the HYBRID_CUDA_GRAPHS value of each run in order, default "0,0,1,1,1,1,1,1,1,1".
GRAPH_REPEAT_PLACE: all_resident (default) or mixed (PLACES of the test). Skipped without a CUDA GPU.
"""
import os

import pytest
import torch

from hybrid.generate import prefill
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.testing import tokenizer_for
from tests.test_decode_graphs import PLACES, PROMPT, model_dir, models, warm  # noqa: F401 (fixtures)

ENVS = os.environ.get("GRAPH_REPEAT_ENVS", ";HYBRID_FUSED=0;HYBRID_FUSED_NEW=0").split(";")
MODES = os.environ.get("GRAPH_REPEAT_MODES", "0,0,1,1,1,1,1,1,1,1").split(",")
PLACE = os.environ.get("GRAPH_REPEAT_PLACE", "all_resident")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("env", ENVS)
def test_graph_repeat(model_dir, warm, env, monkeypatch):   # noqa: F811 (the imported fixtures)
    torch.set_num_threads(1)                                  # as tests/conftest.py
    if env:
        name, value = env.split("=", 1)
        monkeypatch.setenv(name, value)
    slots, extra, _ = PLACES[PLACE]
    slots = slots if len(slots) == 2 else (slots[0] // 2,)
    ids = tokenizer_for(model_dir).encode(PROMPT)
    runs = []
    for graphs in MODES:
        monkeypatch.setenv("HYBRID_CUDA_GRAPHS", graphs)
        s = open_session(model_dir, RuntimeOptions(device="cuda", gpus=(0, 0), layer_split=(2,), cache_slots=slots,
                                                   expert_profile=warm, pcie_frac=0.0, cache_warm="profile"),
                         context=len(ids) + 8)
        try:
            runs.append((graphs, *decode(s.model, ids, STEPS)))
        finally:
            s.close()
    diffs = [float((lg - runs[0][3]).abs().max()) for _, _, _, lg, _ in runs]
    print(f"\ngraph_repeat place={PLACE} env={env or 'default'} modes={','.join(MODES)} "
          f"ids_equal={all(r[1] == runs[0][1] for r in runs)} max_diff_vs_run0={[f'{d:.2e}' for d in diffs]}")
    for j, (graphs, _, first, _, keys) in enumerate(runs):
        if diffs[j]:
            print(f"  run {j} (graphs={graphs}): prompt logits {float((first - runs[0][2]).abs().max()):.2e}, "
                  f"first K row differing (position, layer): {first_kv_diff(keys, runs[0][4])}")
    assert all(r[1] == runs[0][1] for r in runs)


STEPS = 6


def decode(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Prefill, then n greedy steps -> (ids, the prompt's last logits, [n, V] step logits, per layer the K rows
    written [len(ids) + n, Hkv, D] on the CPU)."""
    model.new_cache(len(ids) + n + 1)
    logits = prefill(model, ids, 0)
    first, out, rows = logits[-1].float().cpu(), [], []
    for step in range(n):
        out.append(int((rows[-1] if rows else first).argmax()))
        rows.append(model.forward(torch.tensor([out[-1]]), len(ids) + step, last_only=True)[-1].float().cpu())
    cache = model.model.cache
    return out, first, torch.stack(rows), [k[: len(ids) + n].float().cpu() for k in cache.k_store]


def first_kv_diff(keys: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[int, int] | None:
    """The first (position, layer), positions first, where a layer's K rows differ from ref's; None if none."""
    for pos in range(ref[0].shape[0]):
        for layer, (k, r) in enumerate(zip(keys, ref)):
            if not torch.equal(k[pos], r[pos]):
                return pos, layer
    return None
