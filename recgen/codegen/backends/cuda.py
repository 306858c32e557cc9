"""CUDA spellings (through mx.fast.cuda_kernel; NVRTC, C++17)."""
from .dialect import PTX_FRAGMENTS, PTX_FRAGMENTS16, Dialect

PRELUDE = """\
__device__ __forceinline__ float rg_sigmoid(float x) { return 0.5f * (1.0f + tanhf(0.5f * x)); }
__device__ __forceinline__ float rg_softplus(float x) { return x > 0.0f ? x + log1pf(expf(-x)) : log1pf(expf(x)); }
__device__ __forceinline__ float rg_logsigmoid(float x) { return -rg_softplus(-x); }
__device__ __forceinline__ float rg_sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }
__device__ __forceinline__ float rg_heaviside(float x, float at0) { return x > 0.0f ? 1.0f : (x < 0.0f ? 0.0f : at0); }
"""

# The warp's tensor cores: one mma.sync m16n8k8 on TF32 operands (rounded to nearest), FP32 accumulators.
# TF32 is what MLX's own float32 GEMMs use on this backend (cuBLAS sm90 tf32 kernels).
MMA_PRELUDE = """\
__device__ __forceinline__ unsigned rg_tf32(float x) {
  unsigned u;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(x));
  return u;
}
__device__ __forceinline__ float rg_tf32f(float x) { return __uint_as_float(rg_tf32(x)); }
__device__ __forceinline__ void rg_mma_r(float* d, const float* a, const float* b, int) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])),
                 "r"(__float_as_uint(a[3])), "r"(__float_as_uint(b[0])), "r"(__float_as_uint(b[1])));
}
__device__ __forceinline__ void rg_store2(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
__device__ __forceinline__ void rg_store2(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void rg_store2(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}
// m16n8k16 on bf16 or f16 pairs (one 32-bit register each, the first element in the low half)
template <typename T> __device__ __forceinline__ void rg_mma16(float* d, const unsigned* a, const unsigned* b, int);
#define RG_MMA16(T, S) \
  template <> __device__ __forceinline__ void rg_mma16<T>(float* d, const unsigned* a, const unsigned* b, int) { \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." S "." S ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
                 "{%0,%1,%2,%3};" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1])); \
  }
RG_MMA16(__nv_bfloat16, "bf16")
RG_MMA16(__half, "f16")
#undef RG_MMA16
template <typename T> __device__ __forceinline__ unsigned rg_ld2(const T* p) {
  return *reinterpret_cast<const unsigned*>(p);
}
template <typename T> __device__ __forceinline__ uint4 rg_ld8(const T* p) {
  return *reinterpret_cast<const uint4*>(p);
}
template <typename T> __device__ __forceinline__ uint2 rg_ld4(const T* p) {
  return *reinterpret_cast<const uint2*>(p);
}
// ldmatrix: lanes 8 m .. 8 m + 7 each name a 16-byte row of the 8 x 8 matrix m (m < 4), and lane l receives row
// l / 4, elements 2 (l % 4) and the next, of each (.trans: of each one's transpose)
__device__ __forceinline__ unsigned rg_smem_addr(const void* p) {
  unsigned s;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(p));
  return s;
}
#define RG_LDSM(NAME, TRANS) \
  __device__ __forceinline__ void NAME(unsigned* r, const void* p) { \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4" TRANS ".shared.b16 {%0,%1,%2,%3}, [%4];" \
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(rg_smem_addr(p))); \
  }
RG_LDSM(rg_ldsm4, "")
RG_LDSM(rg_ldsm4t, ".trans")
#undef RG_LDSM
// A's 16 x 16 at p as matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (0-7, 8-15), (8-15, 8-15): its pairs 0 .. 3
template <typename T> __device__ __forceinline__ void rg_ldsm_a(unsigned* r, const T* p, int ld, int lane) {
  rg_ldsm4(r, p + (lane & 15) * ld + (lane >> 4) * 8);
}
// B stored transposed (a row an n): matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
template <typename T> __device__ __forceinline__ void rg_ldsm_b(unsigned* r, const T* p, int ld, int lane) {
  rg_ldsm4(r, p + ((lane & 7) + ((lane >> 4) << 3)) * ld + ((lane >> 3) & 1) * 8);
}
// B row-major (a row a k), transposed as it loads: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), ..
template <typename T> __device__ __forceinline__ void rg_ldsm_bt(unsigned* r, const T* p, int ld, int lane) {
  rg_ldsm4t(r, p + (lane & 15) * ld + (lane >> 4) * 8);
}
__device__ __forceinline__ float2 rg_ld2f(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 rg_ld2f(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ float2 rg_ld2f(const __half* p) {
  return __half22float2(*reinterpret_cast<const __half2*>(p));
}
__device__ __forceinline__ unsigned rg_pack2(__nv_bfloat16 a, __nv_bfloat16 b) {
  return (unsigned)__bfloat16_as_ushort(a) | ((unsigned)__bfloat16_as_ushort(b) << 16);
}
__device__ __forceinline__ unsigned rg_pack2(__half a, __half b) {
  return (unsigned)__half_as_ushort(a) | ((unsigned)__half_as_ushort(b) << 16);
}
template <typename T> __device__ __forceinline__ unsigned rg_pack2f(float a, float b);
template <> __device__ __forceinline__ unsigned rg_pack2f<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned rg_pack2f<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}
__device__ __forceinline__ void rg_st8f(float* p, const float* v) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
template <typename T> __device__ __forceinline__ void rg_st8f(T* p, const float* v) {  // bf16, f16
  *reinterpret_cast<uint4*>(p) = make_uint4(rg_pack2f<T>(v[0], v[1]), rg_pack2f<T>(v[2], v[3]),
                                            rg_pack2f<T>(v[4], v[5]), rg_pack2f<T>(v[6], v[7]));
}
__device__ __forceinline__ void rg_ld8f(const float* p, float* v) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
template <typename T> __device__ __forceinline__ void rg_ld8f(const T* p, float* v) {  // bf16, f16
  const uint4 w = *reinterpret_cast<const uint4*>(p);
  const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = rg_ld2f(reinterpret_cast<const T*>(&u[i]));
    v[2 * i] = f.x; v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void rg_mma(float* d, const float* a, const float* b, int lane) {
  const float ar[4] = {rg_tf32f(a[0]), rg_tf32f(a[1]), rg_tf32f(a[2]), rg_tf32f(a[3])};
  const float br[2] = {rg_tf32f(b[0]), rg_tf32f(b[1])};
  rg_mma_r(d, ar, br, lane);
}
"""

# cp.async (sm_80 and later) copies 16 bytes from global to shared memory without passing through registers; the
# shared address is the 32-bit window address (cvta.to.shared), the global one generic (as CUTLASS passes it).
COPY_PRELUDE = """\
__device__ __forceinline__ void rg_cp16(void* dst, const void* src) {
  unsigned s;
  asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(src) : "memory");
}
"""

CUDA = Dialect(
    name="cuda", ext="cu", mlx_factory="cuda_kernel",
    lane="(threadIdx.x & 31)", thread_in_tg="threadIdx.x",
    tg_x="blockIdx.x", tg_y="blockIdx.y",
    shfl_xor="__shfl_xor_sync(0xffffffffu, {x}, {m})",
    barrier="__syncthreads()",
    smem="__shared__", int64="long long", global_space="", shared_space="",
    smem_bytes=48 * 1024,  # static __shared__ per block without opting in
    fns={"exp": "expf", "log": "logf", "sqrt": "sqrtf", "tanh": "tanhf",
         "sigmoid": "rg_sigmoid", "softplus": "rg_softplus", "logsigmoid": "rg_logsigmoid", "Abs": "fabsf",
         "Max": "fmaxf", "Min": "fminf", "sign": "rg_sign", "Heaviside": "rg_heaviside", "sin": "sinf", "cos": "cosf"},
    dtypes={"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"},
    prelude=PRELUDE,
    mma="rg_mma({acc}, {a}, {b}, {lane})", mma_prelude=MMA_PRELUDE, frag=PTX_FRAGMENTS,
    mma_rounded="rg_mma_r({acc}, {a}, {b}, {lane})", mma_round="rg_tf32f({x})", store2="rg_store2(&{p}, {a}, {b})",
    store8f="rg_st8f(&{p}, {v})", load8f="rg_ld8f(&{p}, {v})",
    mma16="rg_mma16<{t}>({acc}, {a}, {b}, {lane})", frag16=PTX_FRAGMENTS16, pair="unsigned", load2="rg_ld2(&{p})",
    load8="rg_ld8(&{p})", load4="rg_ld4(&{p})", load2f="rg_ld2f(&{p})", ldsm_a="rg_ldsm_a({r}, &{p}, {ld}, {lane})",
    ldsm_b="rg_ldsm_b({r}, &{p}, {ld}, {lane})", ldsm_bt="rg_ldsm_bt({r}, &{p}, {ld}, {lane})",
    pack2="rg_pack2({a}, {b})", pack2f="rg_pack2f<{t}>({a}, {b})", pair_lo="__byte_perm({a}, {b}, 0x5410)",
    pair_hi="__byte_perm({a}, {b}, 0x7632)",
    prefetch='asm volatile("prefetch.global.L2 [%0];" :: "l"({p}))',
    copy16="rg_cp16({dst}, {src})", copy_prelude=COPY_PRELUDE,
    copy_commit='asm volatile("cp.async.commit_group;" ::: "memory")',
    copy_wait='asm volatile("cp.async.wait_group {n};" ::: "memory")',
    standalone_dtypes={"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"},
    binary_factory="precompiled_cuda_kernel",
)
