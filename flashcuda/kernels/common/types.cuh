// Scalar types and conversions shared by every kernel, with no CUDA or host headers, so NVRTC
// compiles the kernels without the toolkit's include directory.
//
// fp16 and bf16 are stored as 16-bit patterns (`half_t`, `bf16_t`); conversions go through PTX cvt
// (round to nearest even), the same instructions cuda_fp16.h / cuda_bf16.h use.
#pragma once

using int8_t = signed char;
using uint8_t = unsigned char;
using int16_t = short;
using uint16_t = unsigned short;
using int32_t = int;
using uint32_t = unsigned int;
using int64_t = long long;
using uint64_t = unsigned long long;

struct __align__(2) half_t { uint16_t bits; };
struct __align__(2) bf16_t { uint16_t bits; };

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(half_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

__device__ __forceinline__ float to_float(bf16_t x) {
  return __uint_as_float(static_cast<uint32_t>(x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float x);

template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

template <> __device__ __forceinline__ half_t from_float<half_t>(float x) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
  return h;
}

template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
  bf16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
  return h;
}

// Two floats -> one 32-bit register of two 16-bit values, `lo` in the low half (the operand order
// mma.sync expects for consecutive columns).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <> __device__ __forceinline__ uint32_t pack2<half_t>(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

template <> __device__ __forceinline__ uint32_t pack2<bf16_t>(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// The inverse of pack2: one 32-bit register of two 16-bit values -> two floats (exact).
struct Float2 {
  float lo, hi;
};

template <typename T> __device__ __forceinline__ Float2 unpack2(uint32_t w);

template <> __device__ __forceinline__ Float2 unpack2<half_t>(uint32_t w) {
  return {to_float(half_t{static_cast<uint16_t>(w & 0xffffu)}),
          to_float(half_t{static_cast<uint16_t>(w >> 16)})};
}

template <> __device__ __forceinline__ Float2 unpack2<bf16_t>(uint32_t w) {
  return {__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u)};
}

// Elementwise max of two packed pairs (max.f16x2 / max.bf16x2, sm_80+): exact, and like fmaxf a
// NaN operand loses to a number.
template <typename T> __device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b);

template <> __device__ __forceinline__ uint32_t max2<half_t>(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

template <> __device__ __forceinline__ uint32_t max2<bf16_t>(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// -inf without <cmath>.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

// The `FC_DTYPE` compile-time constant (0 = fp32, 1 = fp16, 2 = bf16) -> storage type.
template <int Code> struct dtype_of;
template <> struct dtype_of<0> { using type = float; };
template <> struct dtype_of<1> { using type = half_t; };
template <> struct dtype_of<2> { using type = bf16_t; };
