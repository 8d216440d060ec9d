// Rung 6 (matrix): out = sum_i x[i] * y[i], fp32 accumulation, deterministic, no atomics.
//
//   FC_DOT_STAGE 1: block b sums its grid-stride share of the products into partials[b] (fp32),
//                   16-byte loads when x and y share their offset within 16 bytes.
//   FC_DOT_STAGE 2: one block sums partials[0, count) in a fixed order and writes out[0] in the
//                   input dtype.
// The host derives the stage-1 grid from n alone (never from the GPU's SM count), so a given
// (n, dtype) adds in the same order on every GPU and every run.
#include "common/reduce.cuh"
#include "common/types.cuh"
#include "ladder/elementwise.cuh"
#include "ladder/vec.cuh"

using T = dtype_of<FC_DTYPE>::type;

#if FC_DOT_STAGE == 1

extern "C" __global__ void __launch_bounds__(256) FC_KERNEL_NAME(const T* __restrict__ x,  // [n]
                                                                 const T* __restrict__ y,  // [n]
                                                                 float* __restrict__ partials,  // [gridDim.x]
                                                                 int64_t n) {
  constexpr int N = Vec16<T>::N;
  __shared__ float scratch[32];
  const GridStride g;
  float acc = 0.f;
  int64_t begin = 0;
  if (offset16(x) == offset16(y)) {
    const Split16 s = split16(x, n);
    for (int64_t i = g.first; i < s.head; i += g.step) acc += to_float(x[i]) * to_float(y[i]);
    const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + s.head);
    const Vec16<T>* yv = reinterpret_cast<const Vec16<T>*>(y + s.head);
    struct Pair {
      Vec16<T> a, b;
    };
    for_strided<4>(
        g.first, g.step, s.nvec, [&](int64_t i) { return Pair{xv[i], yv[i]}; },
        [&](int64_t, const Pair& p) {
#pragma unroll
          for (int k = 0; k < N; ++k) acc += to_float(p.a.v[k]) * to_float(p.b.v[k]);
        });
    begin = s.head + s.nvec * N;
  }
  for (int64_t i = begin + g.first; i < n; i += g.step) acc += to_float(x[i]) * to_float(y[i]);
  acc = block_reduce_sum(acc, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

#else

extern "C" __global__ void __launch_bounds__(256) FC_KERNEL_NAME(const float* __restrict__ partials,  // [count]
                                                                 T* __restrict__ out,                 // [1]
                                                                 int64_t count) {
  __shared__ float scratch[32];
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = block_reduce_sum(acc, scratch);
  if (threadIdx.x == 0) out[0] = from_float<T>(acc);
}

#endif
