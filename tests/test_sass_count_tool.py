"""tools/sass_count.py: instruction counts per function from cuobjdump -sass text."""
import importlib.util
from pathlib import Path

PATH = Path(__file__).resolve().parents[1] / "tools" / "sass_count.py"


def test_counts_per_function():
    spec = importlib.util.spec_from_file_location("sass_count", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sass = """
	code for sm_90
		Function : kern_a
	.headerflags	@"EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
                                                                          /* 0x000fe20000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
                                                                          /* 0x000e220000002100 */
		Function : kern_b
        /*0000*/                   EXIT ;                                 /* 0x000000000000794d */
        /*10000*/                  BRA 0x10000;                           /* 0xfffffffc00fc7947 */
"""
    assert mod.counts(sass) == {"kern_a": 2, "kern_b": 2}
