// Elementwise maps over n contiguous elements: out[i] = f(x[i]) or f(x[i], y[i]), computed in fp32.
//
// Grid-stride loops (any n with any grid); 16-byte vectors when every pointer has the same offset
// within 16 bytes (always the case for fresh torch tensors, which start 512-byte aligned), with a
// scalar head and tail; plain scalar loops otherwise (e.g. x[1:] added to a fresh tensor).
// `out` may be the same tensor as an input (each element is read, then written, by one thread).
#pragma once
#include "common/types.cuh"
#include "ladder/vec.cuh"

struct GridStride {
  int64_t first;
  int64_t step;
  __device__ __forceinline__ GridStride()
      : first(static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x),
        step(static_cast<int64_t>(gridDim.x) * blockDim.x) {}
};

template <typename T, typename F>
__device__ __forceinline__ void map1(const T* x, T* out, int64_t n, F f) {
  constexpr int N = Vec16<T>::N;
  const GridStride g;
  int64_t begin = 0;
  if (offset16(x) == offset16(out)) {
    const Split16 s = split16(x, n);
    for (int64_t i = g.first; i < s.head; i += g.step) out[i] = from_float<T>(f(to_float(x[i])));
    const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + s.head);
    Vec16<T>* ov = reinterpret_cast<Vec16<T>*>(out + s.head);
    for_strided<4>(
        g.first, g.step, s.nvec, [&](int64_t i) { return xv[i]; },
        [&](int64_t i, const Vec16<T>& a) {
          Vec16<T> r;
#pragma unroll
          for (int k = 0; k < N; ++k) r.v[k] = from_float<T>(f(to_float(a.v[k])));
          ov[i] = r;
        });
    begin = s.head + s.nvec * N;
  }
  for (int64_t i = begin + g.first; i < n; i += g.step) out[i] = from_float<T>(f(to_float(x[i])));
}

template <typename T, typename F>
__device__ __forceinline__ void map2(const T* x, const T* y, T* out, int64_t n, F f) {
  constexpr int N = Vec16<T>::N;
  const GridStride g;
  int64_t begin = 0;
  if (offset16(x) == offset16(out) && offset16(y) == offset16(out)) {
    const Split16 s = split16(x, n);
    for (int64_t i = g.first; i < s.head; i += g.step) {
      out[i] = from_float<T>(f(to_float(x[i]), to_float(y[i])));
    }
    const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + s.head);
    const Vec16<T>* yv = reinterpret_cast<const Vec16<T>*>(y + s.head);
    Vec16<T>* ov = reinterpret_cast<Vec16<T>*>(out + s.head);
    struct Pair {
      Vec16<T> a, b;
    };
    for_strided<4>(
        g.first, g.step, s.nvec, [&](int64_t i) { return Pair{xv[i], yv[i]}; },
        [&](int64_t i, const Pair& p) {
          Vec16<T> r;
#pragma unroll
          for (int k = 0; k < N; ++k) r.v[k] = from_float<T>(f(to_float(p.a.v[k]), to_float(p.b.v[k])));
          ov[i] = r;
        });
    begin = s.head + s.nvec * N;
  }
  for (int64_t i = begin + g.first; i < n; i += g.step) {
    out[i] = from_float<T>(f(to_float(x[i]), to_float(y[i])));
  }
}
