// msl_cpu_runtime.h -- run (MLX-wrapped) MSL kernels on the CPU, one fiber (sanitizers: std::thread) per GPU thread.
//
// Why: the only GPU-free check of MSL *behaviour* (indexing, barriers, SIMD-lane logic, atomics).
// Built with -fsanitize=thread it reports missing barriers as data races; with
// -fsanitize=address,undefined it reports out-of-bounds reads of exact-size buffers and
// threadgroup arrays.  The barrier below additionally reports non-uniform (divergent) barriers
// and deadlocks itself.  Threadgroups run one after another, so kernel-scope `static threadgroup`
// arrays (see msl_source.rewrite_for_clang) are threadgroup memory.  SIMD width is 32 (Apple).
// half = _Float16 (IEEE binary16); bfloat = 16-bit storage with round-to-nearest-even from float,
// arithmetic in float (what MLX's own bf16.h emulation does).
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <ucontext.h>
#include <vector>

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
#if defined(__FLT16_MAX__)
typedef _Float16 half;
#else
#error "msl_cpu_runtime.h needs _Float16 (clang >= 15 on x86-64)"
#endif

struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { bits = uint16_t((u >> 16) | 0x40u); return; }  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    bits = uint16_t(u >> 16);
  }
  operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
  bfloat& operator+=(float o) { return *this = bfloat(float(*this) + o); }
  bfloat& operator-=(float o) { return *this = bfloat(float(*this) - o); }
  bfloat& operator*=(float o) { return *this = bfloat(float(*this) * o); }
  bfloat& operator/=(float o) { return *this = bfloat(float(*this) / o); }
};

#define MSL_VEC(T) \
  typedef T T##2 __attribute__((ext_vector_type(2))); \
  typedef T T##3 __attribute__((ext_vector_type(3))); \
  typedef T T##4 __attribute__((ext_vector_type(4)));
MSL_VEC(float) MSL_VEC(half) MSL_VEC(int) MSL_VEC(uint) MSL_VEC(short) MSL_VEC(ushort)
MSL_VEC(char) MSL_VEC(uchar) MSL_VEC(bool)
#undef MSL_VEC

#include "msl_cpu_emu.h"

namespace metal {
#define MSL_MATH1(F, E) template <class T> inline T F(T x) { return T(E); }
#define MSL_ALL_MATH \
  MSL_MATH1(exp, std::exp(float(x))) MSL_MATH1(exp2, std::exp2(float(x))) MSL_MATH1(exp10, std::pow(10.f, float(x))) \
  MSL_MATH1(log, std::log(float(x))) MSL_MATH1(log2, std::log2(float(x))) MSL_MATH1(log10, std::log10(float(x))) \
  MSL_MATH1(sqrt, std::sqrt(float(x))) MSL_MATH1(rsqrt, 1.0f / std::sqrt(float(x))) \
  MSL_MATH1(sin, std::sin(float(x))) MSL_MATH1(cos, std::cos(float(x))) MSL_MATH1(tan, std::tan(float(x))) \
  MSL_MATH1(tanh, std::tanh(float(x))) MSL_MATH1(sinh, std::sinh(float(x))) MSL_MATH1(cosh, std::cosh(float(x))) \
  MSL_MATH1(asin, std::asin(float(x))) MSL_MATH1(acos, std::acos(float(x))) MSL_MATH1(atan, std::atan(float(x))) \
  MSL_MATH1(fabs, std::fabs(float(x))) MSL_MATH1(floor, std::floor(float(x))) MSL_MATH1(ceil, std::ceil(float(x))) \
  MSL_MATH1(round, std::round(float(x))) MSL_MATH1(trunc, std::trunc(float(x))) \
  MSL_MATH1(fract, float(x) - std::floor(float(x))) \
  MSL_MATH1(sign, float(x) > 0 ? 1.0f : (float(x) < 0 ? -1.0f : 0.0f)) \
  MSL_MATH1(saturate, std::fmin(std::fmax(float(x), 0.0f), 1.0f)) \
  template <class T> inline T pow(T a, T b) { return T(std::pow(float(a), float(b))); } \
  template <class T> inline T powr(T a, T b) { return T(std::pow(float(a), float(b))); } \
  template <class T> inline T fmax(T a, T b) { return T(std::fmax(float(a), float(b))); } \
  template <class T> inline T fmin(T a, T b) { return T(std::fmin(float(a), float(b))); } \
  template <class T> inline T fmod(T a, T b) { return T(std::fmod(float(a), float(b))); } \
  template <class T> inline T atan2(T a, T b) { return T(std::atan2(float(a), float(b))); } \
  template <class T> inline T copysign(T a, T b) { return T(std::copysign(float(a), float(b))); } \
  template <class T> inline T divide(T a, T b) { return T(float(a) / float(b)); } \
  template <class T> inline T fma(T a, T b, T c) { return T(std::fma(float(a), float(b), float(c))); } \
  template <class T> inline T mix(T a, T b, T t) { return T(float(a) + (float(b) - float(a)) * float(t)); }
MSL_ALL_MATH
namespace precise { MSL_ALL_MATH }
namespace fast { MSL_ALL_MATH }
#undef MSL_MATH1
#undef MSL_ALL_MATH

template <class T> inline T max(T a, T b) { return a > b ? a : b; }
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
template <class T> inline T abs(T a) { return a < T(0) ? T(-a) : a; }
template <class T> inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T> inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T> inline bool isnan(T x) { return std::isnan(float(x)); }
template <class T> inline bool isinf(T x) { return std::isinf(float(x)); }
template <class T> inline bool isfinite(T x) { return std::isfinite(float(x)); }

#define MSL_L int line = __builtin_LINE()
#define MSL_REDUCE(NAME, INIT, OP)                                                            \
  template <class T> inline T NAME(T x, MSL_L) {                                              \
    return msl_emu::simd_exchange(x, line, [](uint, uint64_t act, auto get) {                 \
      T acc = INIT; bool first = true;                                                        \
      for (uint l = 0; l < 32; ++l) if (act >> l & 1) { T v = get(l); acc = first ? v : T(OP); first = false; } \
      return acc; });                                                                         \
  }
MSL_REDUCE(simd_sum, T(0), acc + v)
MSL_REDUCE(simd_product, T(1), acc * v)
MSL_REDUCE(simd_max, T(0), acc > v ? acc : v)
MSL_REDUCE(simd_min, T(0), acc < v ? acc : v)
MSL_REDUCE(simd_and, T(0), acc & v)
MSL_REDUCE(simd_or, T(0), acc | v)
MSL_REDUCE(simd_xor, T(0), acc ^ v)
#undef MSL_REDUCE
template <class T> inline T simd_prefix_inclusive_sum(T x, MSL_L) {
  return msl_emu::simd_exchange(x, line, [](uint me, uint64_t act, auto get) {
    T acc = T(0); for (uint l = 0; l <= me; ++l) if (act >> l & 1) acc = T(acc + get(l)); return acc; });
}
template <class T> inline T simd_prefix_exclusive_sum(T x, MSL_L) {
  return msl_emu::simd_exchange(x, line, [](uint me, uint64_t act, auto get) {
    T acc = T(0); for (uint l = 0; l < me; ++l) if (act >> l & 1) acc = T(acc + get(l)); return acc; });
}
// Reading an inactive lane is undefined on the GPU: fail loudly instead of returning garbage.
#define MSL_SHUF(NAME, SRC, KEEP)                                                                 \
  template <class T> inline T NAME(T x, ushort d, MSL_L) {                                        \
    return msl_emu::simd_exchange(x, line, [x, d](uint me, uint64_t act, auto get) {              \
      uint src = (SRC); if (KEEP) return x;                                                       \
      if (src >= 32 || !(act >> src & 1)) msl_emu::fail(#NAME " reads an inactive SIMD lane");    \
      return get(src); });                                                                        \
  }
MSL_SHUF(simd_shuffle, d, false)
MSL_SHUF(simd_broadcast, d, false)
MSL_SHUF(simd_shuffle_xor, me ^ d, false)
MSL_SHUF(simd_shuffle_down, me + d, me + d >= 32)
MSL_SHUF(simd_shuffle_up, me - d, me < d)
#undef MSL_SHUF
template <class T> inline T simd_broadcast_first(T x, MSL_L) {
  return msl_emu::simd_exchange(x, line, [](uint, uint64_t act, auto get) { return get(__builtin_ctzll(act)); });
}
inline bool simd_all(bool b, MSL_L) { return msl_emu::simd_exchange(b, line, [](uint, uint64_t a, auto get) {
  for (uint l = 0; l < 32; ++l) if ((a >> l & 1) && !get(l)) return false; return true; }); }
inline bool simd_any(bool b, MSL_L) { return msl_emu::simd_exchange(b, line, [](uint, uint64_t a, auto get) {
  for (uint l = 0; l < 32; ++l) if ((a >> l & 1) && get(l)) return true; return false; }); }

// simdgroup_matrix 8x8 (float): lane l holds thread_elements() = row fm, columns fn, fn + 1, the layout MLX's steel
// kernels rely on (BaseMMAFrag::get_coord). simdgroup_multiply_accumulate gathers A and B from every lane (a SIMD-group
// rendezvous that all 32 lanes must join, as on the GPU), and each lane keeps its own elements of A B + C.
template <class T, int R, int C> struct simdgroup_matrix;  // only what the emulator models is defined
template <> struct simdgroup_matrix<float, 8, 8> {
  float2 e = float2(0.0f);
  float2& thread_elements() { return e; }
  const float2& thread_elements() const { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
inline void sg_coord(uint lane, int& fm, int& fn) {
  const int qid = int(lane) / 4;
  fm = (qid & 4) + (int(lane) / 2) % 4;
  fn = (qid & 2) * 2 + (int(lane) % 2) * 2;
}
inline void simdgroup_multiply_accumulate(simdgroup_float8x8& d, const simdgroup_float8x8& a, const simdgroup_float8x8& b,
                                          const simdgroup_float8x8& c, MSL_L) {
  float A[8][8], B[8][8];
  auto gather = [&](float2 mine, float (&M)[8][8]) {
    msl_emu::simd_exchange(mine, line, [&](uint, uint64_t act, auto get) {
      if (act != 0xffffffffull) msl_emu::fail("simdgroup_multiply_accumulate needs all 32 lanes of the SIMD group");
      for (uint l = 0; l < 32; ++l) {
        int fm, fn; sg_coord(l, fm, fn);
        const float2 v = get(l);
        M[fm][fn] = v[0]; M[fm][fn + 1] = v[1];
      }
      return mine; });
  };
  gather(a.e, A);
  gather(b.e, B);
  int fm, fn; sg_coord(msl_emu::tls->thread_index_in_simdgroup, fm, fn);
  float2 r = c.e;
  for (int j = 0; j < 2; ++j)
    for (int k = 0; k < 8; ++k) r[j] += A[fm][k] * B[k][fn + j];
  d.e = r;
}

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
inline void threadgroup_barrier(mem_flags, MSL_L) {
  msl_emu::Ctx* c = msl_emu::tls;
  c->group->barrier_count[c->thread_index_in_threadgroup]++;
  c->group->bar.arrive_and_wait(0, line);
}
inline void simdgroup_barrier(mem_flags, MSL_L) {
  msl_emu::simd_exchange(0, line, [](uint, uint64_t, auto) { return 0; });
}
#undef MSL_L

enum memory_order { memory_order_relaxed };
template <class T> struct atomic { T __v; };
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
template <class T> inline std::atomic_ref<T> __aref(const volatile atomic<T>* p) {
  return std::atomic_ref<T>(const_cast<atomic<T>*>(p)->__v);
}
template <class T, class U> inline void atomic_store_explicit(volatile atomic<T>* p, U v, memory_order) {
  __aref(p).store(T(v), std::memory_order_relaxed);
}
template <class T> inline T atomic_load_explicit(const volatile atomic<T>* p, memory_order) {
  return __aref(p).load(std::memory_order_relaxed);
}
template <class T, class U> inline T atomic_fetch_add_explicit(volatile atomic<T>* p, U v, memory_order) {
  return __aref(p).fetch_add(T(v), std::memory_order_relaxed);
}
template <class T, class U> inline T atomic_fetch_sub_explicit(volatile atomic<T>* p, U v, memory_order) {
  return __aref(p).fetch_sub(T(v), std::memory_order_relaxed);
}
template <class T, class U> inline T atomic_exchange_explicit(volatile atomic<T>* p, U v, memory_order) {
  return __aref(p).exchange(T(v), std::memory_order_relaxed);
}
template <class T, class U> inline T atomic_fetch_max_explicit(volatile atomic<T>* p, U v, memory_order) {
  auto r = __aref(p); T cur = r.load();
  while (cur < T(v) && !r.compare_exchange_weak(cur, T(v))) {}
  return cur;
}
template <class T, class U> inline T atomic_fetch_min_explicit(volatile atomic<T>* p, U v, memory_order) {
  auto r = __aref(p); T cur = r.load();
  while (cur > T(v) && !r.compare_exchange_weak(cur, T(v))) {}
  return cur;
}
template <class T> inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* p, T* expected, T desired,
                                                                     memory_order, memory_order) {
  return __aref(p).compare_exchange_weak(*expected, desired, std::memory_order_relaxed);
}
}  // namespace metal
using namespace metal;

// Pieces of MLX's kernels/utils.h prelude.
typedef half float16_t;
typedef bfloat bfloat16_t;
template <class T, class U> inline T ceildiv(T n, U d) { return (n + d - 1) / d; }
template <class IdxT = int64_t>
inline IdxT elem_to_loc(IdxT elem, const int* shape, const int64_t* strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) { loc += (elem % shape[i]) * IdxT(strides[i]); elem /= shape[i]; }
  return loc;
}

// Address spaces vanish on the CPU.  Defined last: `thread` would break std::thread above.
#define device
#define constant
#define threadgroup
#define thread
#define kernel
