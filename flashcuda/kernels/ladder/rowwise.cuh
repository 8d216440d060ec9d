// A team of threads walks one row: the building block of row sum and row softmax.
//
//   RowTeam                          the threads that share a row: the whole block, or one warp
//   row_for_each(p, n, team, f)      f(v) for each of this thread's elements of p[0, n), as fp32
//   row_map(x, out, n, team, f)      out[j] = f(x[j]) for this thread's j in [0, n)
//
// Members take elements team.size apart, so a warp's accesses are contiguous (coalesced). Rows
// that start off a 16-byte boundary (any cols that is not a multiple of 16 bytes) are split into
// a scalar head, 16-byte vectors and a scalar tail (vec.cuh), so every row is vectorised.
#pragma once
#include "common/reduce.cuh"
#include "common/types.cuh"
#include "ladder/vec.cuh"

// Two shapes of team, chosen by the launch: a block of (threads, 1) gives the block to each row
// (block reductions through `scratch`, two barriers each); a block of (32, rows) gives a warp to
// each row (shuffles only, no barrier, so warps of one block run their rows independently).
struct RowTeam {
  uint32_t rank;   // this thread's index in the team
  uint32_t size;   // threads in the team: 32 for a warp, blockDim.x for a block
  float* scratch;  // 32 floats of shared memory, used by block teams only

  static __device__ __forceinline__ RowTeam of_launch(float* scratch) {
    return {threadIdx.x, blockDim.x, scratch};
  }
  // Every member gets the team's result. A 32-thread team is one warp whatever blockDim.y is;
  // a larger one is the whole block (the host launches those with blockDim.y == 1).
  template <typename Op> __device__ __forceinline__ float all(float v, Op op) const {
    return size == 32 ? warp_allreduce(v, op) : block_allreduce(v, scratch, op);
  }
  __device__ __forceinline__ float max(float v) const { return all(v, MaxOp<float>()); }
  __device__ __forceinline__ float sum(float v) const { return all(v, SumOp<float>()); }
};

template <typename T, typename F>
__device__ __forceinline__ void row_for_each(const T* p, int64_t n, const RowTeam& team, F f) {
  constexpr int N = Vec16<T>::N;
  const Split16 s = split16(p, n);
  for (int64_t j = team.rank; j < s.head; j += team.size) f(to_float(p[j]));
  const Vec16<T>* pv = reinterpret_cast<const Vec16<T>*>(p + s.head);
  for_strided<4>(
      team.rank, team.size, s.nvec, [&](int64_t i) { return pv[i]; },
      [&](int64_t, const Vec16<T>& a) {
#pragma unroll
        for (int k = 0; k < N; ++k) f(to_float(a.v[k]));
      });
  for (int64_t j = s.head + s.nvec * N + team.rank; j < n; j += team.size) f(to_float(p[j]));
}

template <typename T, typename F>
__device__ __forceinline__ void row_map(const T* x, T* out, int64_t n, const RowTeam& team, F f) {
  constexpr int N = Vec16<T>::N;
  int64_t begin = 0;
  if (offset16(x) == offset16(out)) {
    const Split16 s = split16(x, n);
    for (int64_t j = team.rank; j < s.head; j += team.size) out[j] = from_float<T>(f(to_float(x[j])));
    const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + s.head);
    Vec16<T>* ov = reinterpret_cast<Vec16<T>*>(out + s.head);
    for_strided<4>(
        team.rank, team.size, s.nvec, [&](int64_t i) { return xv[i]; },
        [&](int64_t i, const Vec16<T>& a) {
          Vec16<T> r;
#pragma unroll
          for (int k = 0; k < N; ++k) r.v[k] = from_float<T>(f(to_float(a.v[k])));
          ov[i] = r;
        });
    begin = s.head + s.nvec * N;
  }
  for (int64_t j = begin + team.rank; j < n; j += team.size) out[j] = from_float<T>(f(to_float(x[j])));
}
