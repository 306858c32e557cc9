// msl_shim.h -- declarations that let `clang++ -fsyntax-only -std=c++17` type-check MSL.
//
// Why: no open-source tool parses MSL.  Mapping Metal's address spaces onto distinct clang
// address spaces makes the commonest MSL bugs (threadgroup -> device pointer, writing through
// a constant pointer, MLX turning inputs with < 8 elements into `constant`) hard errors.
// Only declarations: nothing here is executed.  Fidelity is exactly this file's coverage;
// an undeclared builtin is reported as an error (extend the shim, do not silence it).
#pragma once
#include <stdint.h>
#include <stddef.h>

#define device      __attribute__((address_space(1)))
#define constant    __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread      /* private: the default address space */
#define kernel      /* `kernel void f` and `[[kernel]]` (-> empty attribute list) */

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
#if defined(__FLT16_MAX__)
typedef _Float16 half;
#else
#error "msl_shim.h needs _Float16 (clang >= 15 on x86-64)"
#endif
#if __clang_major__ >= 17
typedef __bf16 bfloat;
#else
struct bfloat { unsigned short bits; bfloat(); bfloat(float); operator float() const; };
#endif

#define MSL_VEC(T) \
  typedef T T##2 __attribute__((ext_vector_type(2))); \
  typedef T T##3 __attribute__((ext_vector_type(3))); \
  typedef T T##4 __attribute__((ext_vector_type(4)));
MSL_VEC(float) MSL_VEC(half) MSL_VEC(int) MSL_VEC(uint) MSL_VEC(short) MSL_VEC(ushort)
MSL_VEC(char) MSL_VEC(uchar) MSL_VEC(bool)
#undef MSL_VEC

namespace metal {
#define MSL_MATH1(F) float F(float); half F(half); bfloat F(bfloat); \
  float2 F(float2); float3 F(float3); float4 F(float4);
#define MSL_MATH2(F) float F(float, float); half F(half, half); bfloat F(bfloat, bfloat);
#define MSL_ALL_MATH \
  MSL_MATH1(exp) MSL_MATH1(exp2) MSL_MATH1(exp10) MSL_MATH1(log) MSL_MATH1(log2) MSL_MATH1(log10) \
  MSL_MATH1(sqrt) MSL_MATH1(rsqrt) MSL_MATH1(sin) MSL_MATH1(cos) MSL_MATH1(tan) MSL_MATH1(tanh) \
  MSL_MATH1(sinh) MSL_MATH1(cosh) MSL_MATH1(asin) MSL_MATH1(acos) MSL_MATH1(atan) MSL_MATH1(fabs) \
  MSL_MATH1(floor) MSL_MATH1(ceil) MSL_MATH1(round) MSL_MATH1(trunc) MSL_MATH1(fract) MSL_MATH1(sign) \
  MSL_MATH1(saturate) \
  MSL_MATH2(pow) MSL_MATH2(powr) MSL_MATH2(fmax) MSL_MATH2(fmin) MSL_MATH2(fmod) MSL_MATH2(atan2) \
  MSL_MATH2(copysign) MSL_MATH2(divide) MSL_MATH2(step) \
  float fma(float, float, float); half fma(half, half, half); \
  float mix(float, float, float); half mix(half, half, half);
MSL_ALL_MATH
namespace precise { MSL_ALL_MATH }
namespace fast { MSL_ALL_MATH }
#undef MSL_MATH1
#undef MSL_MATH2
#undef MSL_ALL_MATH

template <class T> T max(T, T);
template <class T> T min(T, T);
template <class T> T abs(T);
template <class T> T clamp(T, T, T);
template <class T> T select(T, T, bool);
bool isnan(float); bool isnan(half); bool isinf(float); bool isinf(half);
bool isfinite(float); bool isfinite(half);
float dot(float2, float2); float dot(float3, float3); float dot(float4, float4);

// SIMD-group functions: 32-bit and 16-bit scalar types only (64-bit is ambiguous, as in Metal).
#define MSL_SIMD(T) \
  T simd_sum(T); T simd_max(T); T simd_min(T); T simd_product(T); \
  T simd_prefix_inclusive_sum(T); T simd_prefix_exclusive_sum(T); \
  T simd_shuffle(T, ushort); T simd_shuffle_xor(T, ushort); T simd_shuffle_down(T, ushort); \
  T simd_shuffle_up(T, ushort); T simd_broadcast(T, ushort); T simd_broadcast_first(T);
MSL_SIMD(float) MSL_SIMD(half) MSL_SIMD(bfloat) MSL_SIMD(int) MSL_SIMD(uint) MSL_SIMD(short)
MSL_SIMD(ushort) MSL_SIMD(float2) MSL_SIMD(float4)
#undef MSL_SIMD
int simd_and(int); uint simd_and(uint); int simd_or(int); uint simd_or(uint);
int simd_xor(int); uint simd_xor(uint);
bool simd_all(bool); bool simd_any(bool); bool simd_is_first();

// simdgroup_matrix: 8x8 of float, half or bfloat; each lane's thread_elements() are two of them.
template <class T, int R, int C> struct simdgroup_matrix {
  typedef T elements __attribute__((ext_vector_type(2)));
  simdgroup_matrix();
  thread elements& thread_elements();
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <class T, class U, class V, class W>
void simdgroup_multiply_accumulate(thread simdgroup_matrix<T, 8, 8>&, thread const simdgroup_matrix<U, 8, 8>&,
                                   thread const simdgroup_matrix<V, 8, 8>&, thread const simdgroup_matrix<W, 8, 8>&);

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b);
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);

enum memory_order { memory_order_relaxed };
template <class T> struct atomic { T __v; atomic() = delete; };
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
template <class T> void atomic_store_explicit(volatile device atomic<T>*, T, memory_order);
template <class T> void atomic_store_explicit(volatile threadgroup atomic<T>*, T, memory_order);
template <class T> T atomic_load_explicit(const volatile device atomic<T>*, memory_order);
template <class T> T atomic_load_explicit(const volatile threadgroup atomic<T>*, memory_order);
#define MSL_ATOMIC_RMW(F) \
  template <class T> T F(volatile device atomic<T>*, T, memory_order); \
  template <class T> T F(volatile threadgroup atomic<T>*, T, memory_order);
MSL_ATOMIC_RMW(atomic_fetch_add_explicit) MSL_ATOMIC_RMW(atomic_fetch_sub_explicit)
MSL_ATOMIC_RMW(atomic_fetch_max_explicit) MSL_ATOMIC_RMW(atomic_fetch_min_explicit)
MSL_ATOMIC_RMW(atomic_exchange_explicit)
#undef MSL_ATOMIC_RMW
template <class T> bool atomic_compare_exchange_weak_explicit(volatile device atomic<T>*, thread T*, T,
                                                              memory_order, memory_order);
}  // namespace metal
using namespace metal;

// Pieces of MLX's kernels/utils.h prelude (always compiled in front of custom kernels).
typedef half float16_t;
typedef bfloat bfloat16_t;
template <class T, class U> T ceildiv(T, U);
template <class IdxT = int64_t>
IdxT elem_to_loc(IdxT elem, const constant int* shape, const constant int64_t* strides, int ndim);

// Metal has no double: make any use a loud, named error.  Must stay last.
#define double __msl_error_double_is_not_supported_in_Metal
