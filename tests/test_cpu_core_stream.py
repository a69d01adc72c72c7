"""tools/cpu_core_stream.py runs on small weights and records one row per measurement."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_core_stream_records_each_measurement(tmp_path):
    from cpu.i16 import PREFETCH

    out = tmp_path / "rows.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "cpu_core_stream.py"), "--rows", "64,128", "--pf",
                        "0,8194", "--ms", "1,2", "--reps", "1", "--record", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    kernel = [x for x in rows if x["what"] == "kernel"]
    assert [(x["rows"], x["m"], x["pf"]) for x in kernel] == [(64, 1, PREFETCH), (64, 2, PREFETCH), (128, 1, 0),
                                                              (128, 1, 8194), (128, 2, 0), (128, 2, 8194)]
    assert [x["rows"] for x in rows if x["what"] == "read"] == [128]
    assert all(x["gbs"] > 0 and x["git_sha"] and x["machine"] and x["threads"] == 1 for x in rows)


def test_dram_rows_exceed_the_cache():
    import importlib.util

    spec = importlib.util.spec_from_file_location("cpu_core_stream", ROOT / "tools" / "cpu_core_stream.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from cpu.layout import nvfp4_nbytes

    assert mod.dram_rows(16 << 20) == 65536                                   # a small L3: the old default
    n = mod.dram_rows(300 << 20)
    assert n % 64 == 0 and nvfp4_nbytes(n, 2048) >= 4 * (300 << 20) > nvfp4_nbytes(n - 64, 2048)
