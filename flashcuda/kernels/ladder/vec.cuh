// 16-byte vector access for the memory-bound rungs.
//
// One 16-byte load (LDG.128) moves 4 fp32 or 8 fp16/bf16 values: a quarter of the load
// instructions of scalar code, which is what lets a grid-stride loop keep enough bytes in flight
// to approach the copy bandwidth. A pointer qualifies when it sits on a 16-byte boundary; a run of
// elements that starts elsewhere is split into a scalar head (up to the first boundary), vectors,
// and a scalar tail (`split16`). Pointers that disagree on their offset within 16 bytes cannot be
// vectorised together and take the scalar path.
#pragma once
#include "common/types.cuh"

template <typename T> struct __align__(16) Vec16 {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

__device__ __forceinline__ uint32_t offset16(const void* p) {
  return static_cast<uint32_t>(reinterpret_cast<uint64_t>(p) & 15u);
}

// A run of n elements at p: `head` scalars up to the first 16-byte boundary, then `nvec` vectors,
// then the n - head - nvec * N scalars of the tail.
struct Split16 {
  int64_t head;
  int64_t nvec;
};

template <typename T> __device__ __forceinline__ Split16 split16(const T* p, int64_t n) {
  constexpr int N = Vec16<T>::N;
  const uint32_t off = offset16(p);  // a multiple of sizeof(T): torch aligns elements
  int64_t head = off ? static_cast<int64_t>((16u - off) / sizeof(T)) : 0;
  if (head > n) head = n;
  return {head, (n - head) / N};
}

// for (i = first; i < n; i += step) store(i, load(i)), with the loads of U consecutive trips issued
// before their stores. The compiler may not hoist a load above a store through pointers that can
// alias (out= may be an input), so without this each trip waits a full memory latency; with U = 4
// a thread keeps 4 x 16 bytes per input in flight.
template <int U, typename Load, typename Store>
__device__ __forceinline__ void for_strided(int64_t first, int64_t step, int64_t n, Load load,
                                            Store store) {
  using V = decltype(load(first));
  int64_t i = first;
  for (; i + (U - 1) * step < n; i += U * step) {
    V v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = load(i + u * step);
#pragma unroll
    for (int u = 0; u < U; ++u) store(i + u * step, v[u]);
  }
  for (; i < n; i += step) store(i, load(i));
}
