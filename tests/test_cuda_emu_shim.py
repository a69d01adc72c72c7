"""tests/cuda_emu.poison_shared: every __shared__ declaration becomes a static object filled with 0xff bytes by
thread 0 at each block's start, then a barrier (the emulations' stand-in for a GPU's stale shared memory)."""
from tests.cuda_emu import poison_shared


def test_poison_shared_rewrites_each_declaration():
    src = ("  __shared__ __align__(16) unsigned char smem[Smem<MT, NT, ST>::BYTES];\n"
           "  __shared__ int cnt[1024], scan[1024];\n"
           "  __shared__ float pss[8][4];  // comment\n"
           "#define __shared__ static\n")
    out = poison_shared(src).split("\n")
    assert out[0] == ("  static __align__(16) unsigned char smem[Smem<MT, NT, ST>::BYTES]; if (threadIdx.x == 0) "
                      "{ std::memset(&smem, 0xff, sizeof smem); } __syncthreads();")
    assert out[1] == ("  static int cnt[1024], scan[1024]; if (threadIdx.x == 0) { std::memset(&cnt, 0xff, sizeof cnt); "
                      "std::memset(&scan, 0xff, sizeof scan); } __syncthreads();")
    assert out[2].startswith("  static float pss[8][4]; if (threadIdx.x == 0) { std::memset(&pss, 0xff, sizeof pss); }")
    assert out[2].endswith("// comment") and out[3] == "#define __shared__ static"
