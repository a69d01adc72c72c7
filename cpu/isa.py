"""Which instruction set Numba compiles for here: decides the NVFP4 kernel family at import.

AVX2 is asked of LLVM itself: a `<8 x i32>` add is compiled for Numba's own target (host CPU, or
NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when set) and the assembly is checked for a ymm `vpaddd`.
Generic IR, so the probe cannot fail to compile on any target.

    HYBRID_NVFP4_KERNEL=int16|fp32   overrides the choice (int16 on a machine without AVX2 still
                                     runs, through generic IR, only slowly)
"""
from __future__ import annotations

import os
import re

_PROBE = """
define <8 x i32> @probe(<8 x i32> %a, <8 x i32> %b) {
  %c = add <8 x i32> %a, %b
  ret <8 x i32> %c
}
"""


def target_has_avx2() -> bool:
    """True when the code Numba emits in this process may use 256-bit integer vectors (AVX2)."""
    import llvmlite.binding as ll
    from numba.core.registry import cpu_target

    cg = cpu_target.target_context.codegen()
    tm = ll.Target.from_default_triple().create_target_machine(
        cpu=cg._get_host_cpu_name(), features=cg._get_host_cpu_features())
    asm = tm.emit_assembly(ll.parse_assembly(_PROBE))
    return re.search(r"vpaddd\s+%ymm", asm) is not None


def nvfp4_int16_default() -> bool:
    """The NVFP4 family to use: int16 activations (AVX2) or the fp32 kernels."""
    choice = os.environ.get("HYBRID_NVFP4_KERNEL", "").strip().lower()
    if choice in ("int16", "fp32"):
        return choice == "int16"
    if choice:
        raise ValueError(f"HYBRID_NVFP4_KERNEL={choice!r}: expected int16 or fp32")
    return target_has_avx2()


HAS_AVX2 = target_has_avx2()
NVFP4_INT16 = nvfp4_int16_default()
