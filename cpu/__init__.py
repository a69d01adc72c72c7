"""Numba CPU kernels for cold experts (AVX2 target), over numpy arrays only.

    decode.py  register decoders (E2M1 / E4M3 byte -> f32 via fp16 bits, in 16-bit lanes)
    layout.py  the prepacked tile layouts (NVFP4 [NT, G, 9, R], FP8 [NT, K, R]) and packers
    tiles.py   one tile x a block of activation rows (M = 1, 2, 4 fused; M >= 12 decode-once)
    tiles_unrolled.py  the fused M = 1, 2, 4 loops, written out by gen_tiles.py
    gemm.py    weight-only GEMV / small-M GEMM over a range of tiles
    expert.py  fused SwiGLU experts in two phases (gate|up + SiLU, then down + weighted scatter)
    bench.py   hook for hybrid-bench calibrate
Threads and hand-off live in hybrid/experts/cpu_runner.py.
"""
