"""Metal Shading Language spellings (through mx.fast.metal_kernel)."""
from dataclasses import replace

from .dialect import PTX_FRAGMENTS, PTX_FRAGMENTS16, SIMDGROUP_FRAGMENTS, Dialect

# NOTE: MSL has no log1p; softplus uses log(1 + e) on the non-positive branch, where e <= 1.
PRELUDE = """\
inline float rg_sigmoid(float x) { return 0.5f * (1.0f + metal::precise::tanh(0.5f * x)); }
inline float rg_softplus(float x) { return x > 0.0f ? x + metal::log(1.0f + metal::exp(-x)) : metal::log(1.0f + metal::exp(x)); }
inline float rg_logsigmoid(float x) { return -rg_softplus(-x); }
inline float rg_heaviside(float x, float at0) { return x > 0.0f ? 1.0f : (x < 0.0f ? 0.0f : at0); }
"""

# The 16x8x8 fragment multiply-add on the SIMD group's matrix unit: A as its top and bottom 8x8 simdgroup_matrix
# halves, one B, two multiply-accumulates (SIMDGROUP_FRAGMENTS: the lane layout of each 8x8's thread_elements()).
MMA_PRELUDE = """\
inline void rg_mma(thread float* d, thread const float* a, thread const float* b, uint lane) {
  metal::simdgroup_float8x8 a0, a1, bm, d0, d1;
  a0.thread_elements()[0] = a[0]; a0.thread_elements()[1] = a[1];
  a1.thread_elements()[0] = a[2]; a1.thread_elements()[1] = a[3];
  bm.thread_elements()[0] = b[0]; bm.thread_elements()[1] = b[1];
  d0.thread_elements()[0] = d[0]; d0.thread_elements()[1] = d[1];
  d1.thread_elements()[0] = d[2]; d1.thread_elements()[1] = d[3];
  metal::simdgroup_multiply_accumulate(d0, a0, bm, d0);
  metal::simdgroup_multiply_accumulate(d1, a1, bm, d1);
  d[0] = d0.thread_elements()[0]; d[1] = d0.thread_elements()[1];
  d[2] = d1.thread_elements()[0]; d[3] = d1.thread_elements()[1];
}
"""

# A reference spelling of the same multiply-add in CUDA's PTX m16n8k8 layout, by SIMD shuffles in FP32: the
# ``metal_ptx`` dialect, which no op runs; the CPU emulator runs the fragment frames in it so that their indexing
# in CUDA's layout is checked too, without a GPU.
PTX_SHUFFLE_PRELUDE = """\
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
// The wide one (PTX m16n8k16), its 16-bit pairs held as float2: A[row][k] in lane 4 row + (k % 8) / 2, pair
// k / 8 (+ 1 for row + 8), element k % 2; B[k][col] in lane 4 col + (k % 8) / 2, pair k / 8.
inline void rg_mma16(thread float* d, thread const float2* a, thread const float2* b, uint lane) {
  const uint gq = lane >> 2, tq = lane & 3;
  for (uint k = 0; k < 16; ++k) {
    const uint src = (k & 7) >> 1;
    const float2 lo = metal::simd_shuffle(k < 8 ? a[0] : a[2], ushort(4 * gq + src));
    const float2 hi = metal::simd_shuffle(k < 8 ? a[1] : a[3], ushort(4 * gq + src));
    const float2 b0 = metal::simd_shuffle(k < 8 ? b[0] : b[1], ushort(8 * tq + src));
    const float2 b1 = metal::simd_shuffle(k < 8 ? b[0] : b[1], ushort(8 * tq + 4 + src));
    const float l = (k & 1) ? lo.y : lo.x, h = (k & 1) ? hi.y : hi.x;
    const float c0 = (k & 1) ? b0.y : b0.x, c1 = (k & 1) ? b1.y : b1.x;
    d[0] += l * c0; d[1] += l * c1; d[2] += h * c0; d[3] += h * c1;
  }
}
// ldmatrix's results (CUDA's lanes gather them from the group's row loads): each lane reads its own pairs
template <typename T> inline void rg_ldsm_a(thread float2* r, const threadgroup T* p, int ld, int lane) {
  for (int i = 0; i < 4; ++i) {  // A[gq + 8 (i % 2)][2 tq + 8 (i / 2)] and the next
    const threadgroup T* q = p + ((lane >> 2) + 8 * (i & 1)) * ld + 2 * (lane & 3) + 8 * (i >> 1);
    r[i] = float2{float(q[0]), float(q[1])};
  }
}
template <typename T> inline void rg_ldsm_b(thread float2* r, const threadgroup T* p, int ld, int lane) {
  for (int i = 0; i < 4; ++i) {  // tile i / 2's pair i % 2: B[2 tq + 8 (i % 2)][8 (i / 2) + gq] at p[n ld + k]
    const threadgroup T* q = p + (8 * (i >> 1) + (lane >> 2)) * ld + 2 * (lane & 3) + 8 * (i & 1);
    r[i] = float2{float(q[0]), float(q[1])};
  }
}
template <typename T> inline void rg_ldsm_bt(thread float2* r, const threadgroup T* p, int ld, int lane) {
  for (int i = 0; i < 4; ++i) {  // the same at p[k ld + n]
    const threadgroup T* q = p + (2 * (lane & 3) + 8 * (i & 1)) * ld + 8 * (i >> 1) + (lane >> 2);
    r[i] = float2{float(q[0]), float(q[ld])};
  }
}
struct rg_pairs2 { float2 x, y; };
template <typename T> inline rg_pairs2 rg_ld4(const device T* p) {
  rg_pairs2 v;
  v.x = float2{float(p[0]), float(p[1])}; v.y = float2{float(p[2]), float(p[3])};
  return v;
}
struct rg_pairs4 { float2 x, y, z, w; };
template <typename T> inline rg_pairs4 rg_ld8(const device T* p) {
  rg_pairs4 v;
  v.x = float2{float(p[0]), float(p[1])}; v.y = float2{float(p[2]), float(p[3])};
  v.z = float2{float(p[4]), float(p[5])}; v.w = float2{float(p[6]), float(p[7])};
  return v;
}
"""

# Metal has no asynchronous copy a kernel can spell portably: the staging copies are plain 16-byte moves, so the
# two-buffer frames run in step (their barriers order each block's copy before its use).
COPY_PRELUDE = """\
inline void rg_cp16(threadgroup void* dst, const device void* src) { *((threadgroup uint4*)dst) = *((const device uint4*)src); }
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
    mma="rg_mma({acc}, {a}, {b}, {lane})", mma_prelude=MMA_PRELUDE, frag=SIMDGROUP_FRAGMENTS,
    mma_rounded="rg_mma({acc}, {a}, {b}, {lane})", mma_round="{x}",  # float operands: nothing to round
    copy16="rg_cp16({dst}, {src})", copy_prelude=COPY_PRELUDE,
    standalone_dtypes={"float32": "float", "float16": "half", "bfloat16": "bfloat"}, constant_space="constant ",
)

# its wide multiply-add keeps the pairs as float2 (the values exact: the emulator checks where each element sits)
METAL_PTX = replace(METAL, name="metal_ptx", mma_prelude=PTX_SHUFFLE_PRELUDE, frag=PTX_FRAGMENTS,
                    mma16="rg_mma16({acc}, {a}, {b}, {lane})", frag16=PTX_FRAGMENTS16, pair="float2",
                    load2="float2{{float({p}), float((&{p})[1])}}", load8="rg_ld8(&{p})", load4="rg_ld4(&{p})",
                    ldsm_a="rg_ldsm_a({r}, &{p}, {ld}, {lane})", ldsm_b="rg_ldsm_b({r}, &{p}, {ld}, {lane})",
                    ldsm_bt="rg_ldsm_bt({r}, &{p}, {ld}, {lane})",
                    pack2="float2{{float({a}), float({b})}}",
                    pack2f="float2{{float({t}({a})), float({t}({b}))}}", pair_lo="float2{{{a}.x, {b}.x}}",
                    pair_hi="float2{{{a}.y, {b}.y}}")
