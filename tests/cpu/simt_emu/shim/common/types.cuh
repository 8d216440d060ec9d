// Host stand-in of flashcuda/kernels/common/types.cuh for the emulator (tests/cpu/simt_emu):
// the same types and names, conversions by the host's _Float16 / bit arithmetic (round to
// nearest even, as the PTX cvt.rn the real header uses) instead of inline PTX.
#pragma once
#include <cstdint>
#include <cstring>

struct __align__(2) half_t { uint16_t bits; };
struct __align__(2) bf16_t { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(half_t x) {
  _Float16 h;
  std::memcpy(&h, &x.bits, 2);
  return static_cast<float>(h);
}
inline float to_float(bf16_t x) { return __uint_as_float(static_cast<uint32_t>(x.bits) << 16); }

template <typename T> T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline half_t from_float<half_t>(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  half_t r;
  std::memcpy(&r.bits, &h, 2);
  return r;
}
template <> inline bf16_t from_float<bf16_t>(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16_t{static_cast<uint16_t>(u >> 16)};
}

template <typename T> inline uint32_t pack2(float lo, float hi) {
  return static_cast<uint32_t>(from_float<T>(lo).bits) |
         (static_cast<uint32_t>(from_float<T>(hi).bits) << 16);
}

struct Float2 {
  float lo, hi;
};
template <typename T> inline Float2 unpack2(uint32_t w) {
  return {to_float(T{static_cast<uint16_t>(w & 0xffffu)}), to_float(T{static_cast<uint16_t>(w >> 16)})};
}

inline float neg_inf() { return __int_as_float(static_cast<int>(0xff800000u)); }
inline float pos_inf() { return __int_as_float(0x7f800000); }

template <int Code> struct dtype_of;
template <> struct dtype_of<0> { using type = float; };
template <> struct dtype_of<1> { using type = half_t; };
template <> struct dtype_of<2> { using type = bf16_t; };
