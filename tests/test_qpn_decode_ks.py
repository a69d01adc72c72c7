"""The M <= 8 linear kernels' K split (qpn._linear_ks) against measured H200 rows."""
from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import pytest

from hybrid.kernels import layout
from hybrid.kernels.qpn import WARPS, _linear_ks, tiles_per_warp
from hybrid.checkpoint.formats import QType

PROBES = Path(__file__).resolve().parents[1] / "results" / "cuda_kernels_probes.jsonl"


def _grid_probe_rows() -> list[dict]:
    for line in PROBES.read_text().splitlines():
        rec = json.loads(line)
        if rec["what"].startswith("qpn_grid_probe"):
            return rec["rows"]
    pytest.skip("no qpn_grid_probe record in results/cuda_kernels_probes.jsonl")


@pytest.mark.parametrize("units,chunks,per_sm", [(4748, 32, 4), (800, 80, 4), (20, 400, 6), (3, 2, 1),
                                                 (100000, 4, 3), (1, 1, 8)])
def test_ks_is_valid(units, chunks, per_sm):
    ks = _linear_ks(units, chunks, 132, per_sm)
    assert ks in (1, 2, 4, 8)
    assert ks == 1 or chunks // ks >= 2


def test_partial_wave_is_split_further():
    # 2.25 waves at KS = 2 (the last one a quarter full) vs 4.5 at KS = 4: the fuller launch wins
    assert _linear_ks(4748, 32, 132, 4) == 4
    # far from a wave, more warps per tile fill the GPU
    assert _linear_ks(64, 128, 132, 4) == 8


def test_picks_against_measured_rows():
    """Every (shape, format, M, kernel) of the stored probe: the model's KS within 6% of the best
    measured KS, and in sum within 1% of the per-group best."""
    groups = collections.defaultdict(list)
    for r in _grid_probe_rows():
        if r["kernel"] != "pick":
            groups[(r["shape"], r["format"], r["m"], r["kernel"])].append(r)
    assert len(groups) >= 40
    tot_pick = tot_best = 0.0
    for (shape, fmt, m, kernel), rows in groups.items():
        n, k = rows[0]["n"], rows[0]["k"]
        qt = QType.NVFP4 if fmt == "nvfp4" else QType.FP8
        tiles = -(-n // 16)
        units = -(-tiles // tiles_per_warp(kernel))
        ks = _linear_ks(units, k // layout.CHUNK[qt], 132, rows[0]["per_sm"])
        by_ks = {r["ks"]: r["t_us"] for r in rows}
        assert rows[0]["grid"] == -(-units // (WARPS // rows[0]["ks"]))
        best = min(by_ks.values())
        assert by_ks[ks] <= 1.06 * best, (shape, fmt, m, kernel, ks, by_ks)
        tot_pick += by_ks[ks]
        tot_best += best
    assert tot_pick <= 1.01 * tot_best
    assert math.isfinite(tot_pick)
