"""Which instruction set Numba compiles for here: decides the NVFP4 kernel family at import.

AVX2 is asked of LLVM itself: a `<8 x i32>` add is compiled for Numba's own target (host CPU, or
NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when set) and the assembly is checked for a ymm `vpaddd`.
Generic IR, so the probe cannot fail to compile on any target.

    HYBRID_NVFP4_KERNEL=int16|fp32   overrides the choice (int16 on a machine without AVX2 still
                                     runs, through generic IR, only slowly)
    HYBRID_CPU_VNNI=1                on a host with VNNI: the M >= 2 int16 kernels add each product
                                     with vpdpwssd (vnni_tuning, target_has_vnni); default off
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


VNNI_ENV = "HYBRID_CPU_VNNI"


def _host_has_vnni(feats: str) -> bool:
    f = set(feats.split(","))
    return "+avxvnni" in f or {"+avx512vnni", "+avx512vl"} <= f


def vnni_tuning() -> bool:
    """HYBRID_CPU_VNNI=1 on a host with AVX-VNNI or AVX512-VNNI (+VL), before Numba's code generator
    starts, with no NUMBA_CPU_NAME / NUMBA_CPU_FEATURES given: Numba compiles for the host's
    features plus LLVM's `fast-dpwssd` tuning.  Without it LLVM's machine combiner splits every
    chain of vpdpwssd back into vpmaddwd + vpaddd on Intel server CPUs (Ice Lake-SP .. Emerald
    Rapids: a shorter dependency chain, one more uop per product); the int16 kernels are
    throughput-bound, so at M = 8 that costs 56 vpaddd per 64 products.  Returns whether it applied.
    The features are part of Numba's cache key, so such a process keeps its own cached code.
    Runs when `cpu` is imported (cpu/__init__.py imports this module first): creating any Numba
    dispatcher (@njit) starts the code generator with its features, after which this cannot apply."""
    from numba.core import config
    from numba.core.registry import cpu_target
    import llvmlite.binding as ll

    if os.environ.get(VNNI_ENV, "").strip() != "1" or config.CPU_NAME or config.CPU_FEATURES is not None:
        return False
    if "_toplevel_target_context" in vars(cpu_target):   # (a cached property: looking would start it)
        return False                                    # the code generator already runs with its features
    feats = ll.get_host_cpu_features().flatten()
    if not _host_has_vnni(feats):
        return False
    config.CPU_FEATURES = feats + ",+fast-dpwssd"
    return True


def target_has_vnni() -> bool:
    """True when the features Numba compiles with include AVX-VNNI, or AVX512-VNNI with AVX512VL
    (vpdpwssd on ymm), and HYBRID_CPU_VNNI=1 (a NUMBA_CPU_NAME without features counts as none)."""
    from numba.core.registry import cpu_target

    if os.environ.get(VNNI_ENV, "").strip() != "1":
        return False
    cg = cpu_target.target_context.codegen()
    return _host_has_vnni(getattr(cg, "_tm_features", None) or cg._get_host_cpu_features())


VNNI_TUNED = vnni_tuning()
HAS_AVX2 = target_has_avx2()
HAS_VNNI = HAS_AVX2 and target_has_vnni()
NVFP4_INT16 = nvfp4_int16_default()
