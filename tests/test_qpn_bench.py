"""hybrid-bench cuda-kernels without a GPU: the report renders from stored records, and the
target checks compute met / not met from the numbers."""
import json

from hybrid.bench.cuda_kernels import markdown, promote, targets
from hybrid.cli.bench import main


def rec(shape, fmt, m, t, eff, ceff, **kw):
    return dict(gpu="G", sm=90, torch="t", nvrtc="n", git_sha="abc", command="c", read_gbs=1.0,
                copy_gbs=1.0, shape=shape, n=16, k=64, format=fmt, m=m, bytes=1, t_us=t,
                eff_read=eff, cublas_t_us=2 * t, cublas_eff_read=ceff, speedup_vs_cublas=2.0, **kw)


def test_targets_met_and_not_met():
    recs = [rec("lm_head", "nvfp4", 1, 10.0, 0.9, 0.8, speedup_vs_dequant=5.0),
            rec("lm_head", "nvfp4", 8, 12.0, 0.75, 0.8)]
    text = "\n".join(targets(recs))
    assert "NVFP4 M=1 lm_head >= 85%: met (90.0%)" in text
    assert "M=8 within 10% of M=1: NOT met" in text
    assert "every shape and M: NOT met (1 of 2" in text
    assert "dequantize-then-FP16-matmul at M=1 on large shapes: met" in text


def test_prefill_target():
    recs = [rec("q_proj", "nvfp4", 128, 12.0, 0.1, 0.3), rec("lm_head", "fp8", 512, 10.0, 0.1, 0.3)]
    recs[0]["cublas_t_us"] = 10.0  # x1.2: met
    assert "prefill (M >= 64) within 1.5x of cuBLAS FP16 time: met (2 of 2" in "\n".join(targets(recs))
    recs[1]["cublas_t_us"] = 5.0   # x2.0: not met
    assert "NOT met (1 of 2 rows; lm_head fp8 M=512 x2.00)" in "\n".join(targets(recs))


def test_promote_marks_kernels():
    recs = [rec("lm_head", "fp8", 1, 10.0, 0.5, 0.9), rec("lm_head[u2]", "fp8", 1, 8.0, 0.6, 0.9),
            rec("lm_head", "fp8", 16, 20.0, 0.3, 0.9)]
    out = {(r["shape"], r["m"]): r for r in promote(recs, "u2", "u4")}
    assert out[("lm_head", 1)]["t_us"] == 8.0 and out[("lm_head", 1)]["kernel"] == "default"
    assert out[("lm_head[u4]", 1)]["t_us"] == 10.0
    assert out[("lm_head", 16)]["kernel"] == "default"


def test_render_from_jsonl(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(rec("dense_up", "nvfp4", m, 5.0 + m, 0.5, 0.8)) for m in (1, 8)))
    assert main(["cuda-kernels", "--from-jsonl", str(path), "--out", str(tmp_path / "o")]) == 0
    text = (tmp_path / "o.md").read_text()
    assert "| dense_up | 16 | 64 | nvfp4 | 8 |" in text and "## Targets" in text
    assert markdown({"gpu": "G", "command": "c", "git_sha": "s", "torch": "t", "nvrtc": "n", "sm": 90,
                     "read_gbs": 1.0, "copy_gbs": 1.0}, []).startswith("# QPN CUDA kernels on G")
    assert "driver not recorded" in text                    # records from before the driver was recorded


def test_markdown_names_driver_and_clock():
    """The run's driver and the SM clock right after its timings head the table (the same code times differently
    on another driver or clock: results/cuda_kernels.md, twenty-eighth session)."""
    env = {"gpu": "G", "command": "c", "git_sha": "s", "torch": "t", "nvrtc": "n", "sm": 90, "read_gbs": 1.0,
           "copy_gbs": 1.0, "driver": "580.159.04",
           "clocks": {"sm_clock_mhz": 1980, "sm_clock_max_mhz": 1980, "clock_event_reasons": "0x0"}}
    md = markdown(env, [])
    assert ("driver 580.159.04, native sm_90; SM clock after the timings 1980 of 1980 MHz (clock event reasons 0x0)"
            in md)


def test_render_skips_records_that_are_not_kernel_rows(tmp_path):
    """results/cuda_kernels.jsonl also holds other records (MoE decode notes, no 'm' or 'shape'): the render takes the
    last run of kernel rows and lists the earlier ones, skipping the rest."""
    path = tmp_path / "r.jsonl"
    old = [{**rec("lm_head", "nvfp4", 1, 50.0, 0.7, 0.9), "git_sha": "aaaa"}]
    other = [{"git_sha": "bbbb", "command": "x", "active_experts": 8}]
    new = [{**rec("lm_head", "nvfp4", 1, 46.0, 0.8, 0.9), "git_sha": "cccc"}]
    path.write_text("\n".join(json.dumps(r) for r in old + new + other))
    assert main(["cuda-kernels", "--from-jsonl", str(path), "--out", str(tmp_path / "o")]) == 0
    text = (tmp_path / "o.md").read_text()
    assert "git sha: `cccc`" in text and "| `aaaa` | lm_head | nvfp4 | 50.0 |" in text


def test_render_missing_file_is_a_user_error(tmp_path, capsys):
    assert main(["cuda-kernels", "--from-jsonl", str(tmp_path / "none.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"git_sha": "bbbb", "command": "x", "active_experts": 8}))
    assert main(["cuda-kernels", "--from-jsonl", str(other)]) == 2
    assert "no kernel timing rows" in capsys.readouterr().err


def test_plain_read_reference():
    """M = 1 rows carry a plain read of the same bytes: the table's 'of read' column and the lm_head line."""
    recs = [rec("lm_head", "nvfp4", 1, 10.0, 0.8, 0.9, read_t_us=9.0, cublas_read_t_us=19.0)]
    text = "\n".join(targets(recs))
    assert "NVFP4 M=1 lm_head >= 85%: NOT met (80.0%; a plain read of its 0 MB in one launch: 88.9%)" in text
    assert "lm_head nvfp4 ours 0.90 vs cuBLAS 0.95" in text
    md = markdown({"gpu": "G", "command": "c", "git_sha": "s", "torch": "t", "nvrtc": "n", "sm": 90,
                   "read_gbs": 1.0, "copy_gbs": 1.0}, recs)
    assert "| 9.0 | 0.90 |" in md


def test_read_bytes_checks_its_buffer():
    """qpn.read_bytes (the plain-read reference) refuses a CPU tensor with a one-line reason."""
    import pytest
    import torch

    from hybrid.kernels import qpn

    with pytest.raises(ValueError, match="buf: expected a contiguous CUDA tensor"):
        qpn.read_bytes(torch.zeros(16, dtype=torch.uint8))
