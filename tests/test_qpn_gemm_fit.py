"""tools/gemm_fit.py on a synthetic probe: rows whose times are the model's own give a zero error,
the picker's plan is found among them, and --fit leaves a model that still reproduces them."""
import copy
import json

import pytest

from hybrid.kernels import qpn


def _rows(sms=132):
    rows = []
    for fmt, name in ((2, "nvfp4"), (8, "fp8")):
        for shape, n, k in (("lm_head", 151936, 2048), ("expert_gate_up", 768, 2048), ("dense_down", 5120, 25600)):
            for m in (64, 512):
                plan = qpn.prefill_plan(fmt, m, n, k, sms, 90)
                cands = [("", plan)] + [(c, qpn.prefill_plan(fmt, m, n, k, sms, 90, c))
                                        for c in ("wmma", "f128x128", "f64x256", "f64x128")]
                for tag, p in cands:
                    tile = tuple(int(v) for v in p.kernel.rsplit("_", 1)[1].split("x"))
                    cost = qpn.gemmf_cost if "gemmf" in p.kernel else qpn.gemm_us
                    us = cost(m, n, tile, sms, p.grid[2], p.ks, fmt)
                    rows.append({"shape": shape + (f"[{tag}]" if tag else ""), "format": name, "m": m, "n": n,
                                 "k": k, "kernel": p.label, "t_us": us})
    return rows


@pytest.fixture
def saved_constants():
    from tools import gemm_fit

    names = {p[0] for p in gemm_fit.PARAMS}
    saved = {nm: copy.deepcopy(getattr(qpn, nm)) for nm in names}
    yield
    for nm, v in saved.items():
        setattr(qpn, nm, v)
    qpn.prefill_plan.cache_clear()


@pytest.mark.parametrize("refit", [False, True])
def test_gemm_fit_on_model_rows(tmp_path, capsys, saved_constants, refit):
    from tools import gemm_fit

    if refit:
        pytest.importorskip("scipy")
    path = tmp_path / "gemm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    assert gemm_fit.main([str(path)] + (["--fit"] if refit else [])) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("model vs measured"))
    rms = float(head.split("rms ")[1].split("%")[0])
    assert rms < (0.5 if refit else 0.05), head           # --fit rounds the constants to 3 digits
    table = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(table) == 12 and all(line.rstrip(" |").endswith("1.000") for line in table), out
