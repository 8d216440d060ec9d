// NaN / +-Inf in 16-bit floats, tested on their bits: what the tensor-core forwards' masked-V
// paths (FC_MASKED_V in flash_fwd_sm80.cu and flash_fwd_sm90.cu) look for in a V tile, zero for
// the GEMM and put back on the rows that see them. A value is not finite when its exponent bits
// are all ones; then its mantissa says NaN (non-zero) or Inf (zero), its sign bit which Inf.
#pragma once

#include "common/types.cuh"

template <typename T> struct Bits16;
template <> struct Bits16<half_t> {
  static constexpr uint32_t kExp = 0x7c00u, kMant = 0x03ffu;
};
template <> struct Bits16<bf16_t> {
  static constexpr uint32_t kExp = 0x7f80u, kMant = 0x007fu;
};

// Whether the 16-bit value `h` (low bits) is NaN or +-Inf.
template <typename T> __device__ __forceinline__ bool half_nonfinite(uint32_t h) {
  return (h & Bits16<T>::kExp) == Bits16<T>::kExp;
}

// Whether either 16-bit value of `w` is NaN or +-Inf.
template <typename T> __device__ __forceinline__ bool word_nonfinite(uint32_t w) {
  return half_nonfinite<T>(w & 0xffffu) || half_nonfinite<T>(w >> 16);
}

// `w` with each NaN / +-Inf of its two 16-bit values replaced by +0.
template <typename T> __device__ __forceinline__ uint32_t word_zero_nonfinite(uint32_t w) {
  const uint32_t lo = half_nonfinite<T>(w & 0xffffu) ? 0u : (w & 0xffffu);
  const uint32_t hi = half_nonfinite<T>(w >> 16) ? 0u : (w >> 16);
  return lo | (hi << 16);
}

// The kind of a non-finite `h`: 0 NaN, 1 +Inf, 2 -Inf.
template <typename T> __device__ __forceinline__ int nonfinite_kind(uint32_t h) {
  return (h & Bits16<T>::kMant) ? 0 : (h & 0x8000u) ? 2 : 1;
}

// A non-finite `h` as fp32 (NaN, +Inf or -Inf).
template <typename T> __device__ __forceinline__ float nonfinite_value(uint32_t h) {
  // (selects, not a table: an indexed local array would live in local memory)
  const uint32_t bits = (h & Bits16<T>::kMant) ? 0x7fc00000u
                        : (h & 0x8000u)          ? 0xff800000u
                                                 : 0x7f800000u;
  return __int_as_float(static_cast<int>(bits));
}

// Whether the fp32 value `x` is NaN or +-Inf (on its bits: no compiler flag can fold it away).
__device__ __forceinline__ bool float_nonfinite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

// `p` folded with every value of `v` so that the result is NaN or +-Inf whenever some value is
// (or `p` was): fma(a, b, q) propagates a NaN, turns an Inf into +-Inf or, times 0, into NaN,
// and +Inf + -Inf is NaN. Finite values can make it non-finite only by overflow (|a b| past
// ~3.4e38): a false report, never a missed one. Half an FFMA per value, four independent chains.
template <int N> __device__ __forceinline__ float fold_nonfinite(const float (&v)[N], float p) {
  static_assert(N % 8 == 0, "pairs of values over four chains");
  float q[4] = {p, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < N / 2; ++i) q[i % 4] = fmaf(v[2 * i], v[2 * i + 1], q[i % 4]);
  return (q[0] + q[1]) + (q[2] + q[3]);
}
