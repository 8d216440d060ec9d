// One thread block walks one row: the building block of row sum and row softmax.
//
//   row_for_each(p, n, f)       f(v) for each of this thread's elements of p[0, n), as fp32
//   row_map(x, out, n, f)       out[j] = f(x[j]) for this thread's j in [0, n)
//
// Threads take elements blockDim.x apart, so a warp's accesses are contiguous (coalesced). Rows
// that start off a 16-byte boundary (any cols that is not a multiple of 16 bytes) are split into
// a scalar head, 16-byte vectors and a scalar tail (vec.cuh), so every row is vectorised.
#pragma once
#include "common/types.cuh"
#include "ladder/vec.cuh"

template <typename T, typename F>
__device__ __forceinline__ void row_for_each(const T* p, int64_t n, F f) {
  constexpr int N = Vec16<T>::N;
  const Split16 s = split16(p, n);
  for (int64_t j = threadIdx.x; j < s.head; j += blockDim.x) f(to_float(p[j]));
  const Vec16<T>* pv = reinterpret_cast<const Vec16<T>*>(p + s.head);
  for_strided<4>(
      threadIdx.x, blockDim.x, s.nvec, [&](int64_t i) { return pv[i]; },
      [&](int64_t, const Vec16<T>& a) {
#pragma unroll
        for (int k = 0; k < N; ++k) f(to_float(a.v[k]));
      });
  for (int64_t j = s.head + s.nvec * N + threadIdx.x; j < n; j += blockDim.x) f(to_float(p[j]));
}

template <typename T, typename F>
__device__ __forceinline__ void row_map(const T* x, T* out, int64_t n, F f) {
  constexpr int N = Vec16<T>::N;
  int64_t begin = 0;
  if (offset16(x) == offset16(out)) {
    const Split16 s = split16(x, n);
    for (int64_t j = threadIdx.x; j < s.head; j += blockDim.x) out[j] = from_float<T>(f(to_float(x[j])));
    const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + s.head);
    Vec16<T>* ov = reinterpret_cast<Vec16<T>*>(out + s.head);
    for_strided<4>(
        threadIdx.x, blockDim.x, s.nvec, [&](int64_t i) { return xv[i]; },
        [&](int64_t i, const Vec16<T>& a) {
          Vec16<T> r;
#pragma unroll
          for (int k = 0; k < N; ++k) r.v[k] = from_float<T>(f(to_float(a.v[k])));
          ov[i] = r;
        });
    begin = s.head + s.nvec * N;
  }
  for (int64_t j = begin + threadIdx.x; j < n; j += blockDim.x) out[j] = from_float<T>(f(to_float(x[j])));
}
