"""Metal Shading Language spellings (through mx.fast.metal_kernel)."""
from .dialect import Dialect

# NOTE: MSL has no log1p; softplus uses log(1 + e) on the non-positive branch, where e <= 1.
PRELUDE = """\
inline float rg_sigmoid(float x) { return 0.5f * (1.0f + metal::precise::tanh(0.5f * x)); }
inline float rg_softplus(float x) { return x > 0.0f ? x + metal::log(1.0f + metal::exp(-x)) : metal::log(1.0f + metal::exp(x)); }
inline float rg_logsigmoid(float x) { return -rg_softplus(-x); }
inline float rg_heaviside(float x, float at0) { return x > 0.0f ? 1.0f : (x < 0.0f ? 0.0f : at0); }
"""

# A reference spelling of the 16x8x8 fragment multiply-add in the PTX m16n8k8 layout, by SIMD
# shuffles in FP32: correct on any Apple GPU but slow, so the tuning keeps the FMA scan there; it lets the
# CPU emulator verify the layout-dependent indexing of chunk_scan_mma.j2 that CUDA runs on tensor
# cores. (simdgroup_matrix keeps its 8x8 layout opaque, so it cannot stand in for these fragments.)
MMA_PRELUDE = """\
inline void rg_mma(thread float* d, thread const float* a, thread const float* b, uint lane) {
  const uint gq = lane >> 2, tq = lane & 3;
  for (uint k = 0; k < 8; ++k) {
    const uint src = k & 3;  // A[row][k] sits in lane 4 row + k % 4, B[k][col] in lane 4 col + k % 4
    const float lo = metal::simd_shuffle(k < 4 ? a[0] : a[2], ushort(4 * gq + src));
    const float hi = metal::simd_shuffle(k < 4 ? a[1] : a[3], ushort(4 * gq + src));
    const float b0 = metal::simd_shuffle(k < 4 ? b[0] : b[1], ushort(8 * tq + src));
    const float b1 = metal::simd_shuffle(k < 4 ? b[0] : b[1], ushort(8 * tq + 4 + src));
    d[0] += lo * b0; d[1] += lo * b1; d[2] += hi * b0; d[3] += hi * b1;
  }
}
"""

METAL = Dialect(
    name="metal", ext="metal", mlx_factory="metal_kernel",
    lane="thread_index_in_simdgroup", thread_in_tg="thread_position_in_threadgroup.x",
    tg_x="threadgroup_position_in_grid.x", tg_y="threadgroup_position_in_grid.y",
    shfl_xor="simd_shuffle_xor({x}, {m})",
    barrier="threadgroup_barrier(metal::mem_flags::mem_threadgroup)",
    smem="threadgroup", int64="int64_t", global_space="device ", shared_space="threadgroup ",
    smem_bytes=32 * 1024,  # maxTotalThreadgroupMemoryLength of Apple GPUs
    fns={"exp": "metal::exp", "log": "metal::log", "sqrt": "metal::sqrt", "tanh": "metal::precise::tanh",
         "sigmoid": "rg_sigmoid", "softplus": "rg_softplus", "logsigmoid": "rg_logsigmoid", "Abs": "metal::abs",
         "Max": "metal::max", "Min": "metal::min", "sign": "metal::sign", "Heaviside": "rg_heaviside",
         "sin": "metal::sin", "cos": "metal::cos"},
    dtypes={"float32": "float", "float16": "half", "bfloat16": "bfloat16_t"},
    prelude=PRELUDE,
    mma="rg_mma({acc}, {a}, {b}, {lane})", mma_prelude=MMA_PRELUDE,
    standalone_dtypes={"float32": "float", "float16": "half", "bfloat16": "bfloat"}, constant_space="constant ",
)
