"""Numba CPU kernels for cold experts (AVX2 target), over numpy arrays only.

    isa.py     AVX2 or not (asked of LLVM for Numba's target): picks the NVFP4 kernel family at import
    i16.py     NVFP4 x int16 activations in explicit vector IR (vpshufb decode, vpmaddwd), AVX2
    decode.py  register decoders (E2M1 / E4M3 byte -> f32 via fp16 bits, in 16-bit lanes)
    layout.py  the prepacked tile layouts (NVFP4 [NT, G, 9, R] or int16 [NT, R/8, G*72], FP8 [NT, K, R])
    tiles.py   one tile x a block of activation rows (M = 1, 2, 4 fused; M >= 12 decode-once)
    tiles_unrolled.py  the fused M = 1, 2, 4 loops, written out by gen_tiles.py
    gemm.py    weight-only GEMV / small-M GEMM over a range of tiles
    expert.py  fused SwiGLU experts in two phases (gate|up + SiLU, then down + weighted scatter)
    atomic.py  atomic fetch-and-add for Numba code (the shared unit counter of expert.py's pool call)
    dataflow.py  the fused experts as one parallel region: units claimed in order, no phase barrier
    stream.py  read-only bandwidth probe (hybrid-bench cpu-kernels' `read`)
    bench.py   hook for hybrid-bench calibrate
    cache.py   drops Numba's cached code of cpu/ when any cpu/*.py changed (cross-file inlining)
Threads and hand-off live in hybrid/experts/cpu_runner.py.
"""
from cpu import isa  # noqa: F401  first: HYBRID_CPU_VNNI's tuning must precede any Numba dispatcher (isa.vnni_tuning)
from cpu.cache import drop_stale

drop_stale()
