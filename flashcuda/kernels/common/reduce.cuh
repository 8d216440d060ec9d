// Warp and block reductions: the one place where shuffles and the cross-warp scratch live.
//
//   warp_allreduce<Width>(v, op)     every lane of each aligned group of Width lanes gets the group's
//                                    result (Width a power of two <= 32; the sm80 flash kernels
//                                    reduce a score row over the 4 lanes of an mma quad: Width = 4)
//   block_allreduce(v, scratch, op)  every thread of the block gets the block's result
//   red_add_f32x2 / red_add_f32x4    fp32 global reductions of 2 / 4 consecutive floats (the
//                                    backward kernels' dQ accumulation)
//
// `op` is a functor with `static T identity()` and `T operator()(T, T)`: SumOp, MaxOp, MinOp.
// Both are deterministic: the combination order is fixed by the butterfly, and every lane ends with
// bit-identical values (each pairwise step combines the same two operands on both partners).
#pragma once
#include "common/types.cuh"

template <typename T> struct SumOp {
  static __device__ __forceinline__ T identity() { return T(0); }
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

// fmaxf/fminf return the other operand for a NaN: a NaN never wins a max. Callers that must see
// NaNs (softmax) get them back through the sum of exp(x - max).
template <typename T> struct MaxOp;
template <> struct MaxOp<float> {
  static __device__ __forceinline__ float identity() { return neg_inf(); }
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename T> struct MinOp;
template <> struct MinOp<float> {
  static __device__ __forceinline__ float identity() { return pos_inf(); }
  __device__ __forceinline__ float operator()(float a, float b) const { return fminf(a, b); }
};

// Butterfly over the lanes of each aligned Width-lane group. All 32 lanes of the warp must call it
// (the full-warp mask), with Width the same everywhere.
template <int Width = 32, typename T, typename Op>
__device__ __forceinline__ T warp_allreduce(T v, Op op) {
  static_assert(Width >= 1 && Width <= 32 && (Width & (Width - 1)) == 0,
                "Width must be a power of two <= 32");
#pragma unroll
  for (int offset = Width / 2; offset > 0; offset /= 2) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Every thread of the block must call it, with a block size that is a multiple of 32 (at most
// 1024). `scratch` is 32 elements of shared memory; it may be reused as soon as the call returns
// (the trailing barrier orders the reads of this call before any later write).
template <typename T, typename Op>
__device__ __forceinline__ T block_allreduce(T v, T* scratch, Op op) {
  const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int nthreads = blockDim.x * blockDim.y * blockDim.z;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int nwarps = nthreads >> 5;
  v = warp_allreduce(v, op);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  // Every warp reduces the per-warp partials itself: no second barrier for a broadcast.
  T r = lane < nwarps ? scratch[lane] : Op::identity();
  r = warp_allreduce(r, op);
  __syncthreads();
  return r;
}

__device__ __forceinline__ float warp_reduce_sum(float v) { return warp_allreduce(v, SumOp<float>()); }
__device__ __forceinline__ float warp_reduce_max(float v) { return warp_allreduce(v, MaxOp<float>()); }

__device__ __forceinline__ float block_reduce_sum(float v, float* scratch) {
  return block_allreduce(v, scratch, SumOp<float>());
}
__device__ __forceinline__ float block_reduce_max(float v, float* scratch) {
  return block_allreduce(v, scratch, MaxOp<float>());
}

// ---- fp32 global reductions ----------------------------------------------------------------------

// *p += (x, y) for two consecutive floats (8-byte aligned), result unused: one vector reduction on
// sm_90 (PTX 8.1 red .v2.f32), two scalar ones before.
__device__ __forceinline__ void red_add_f32x2(float* p, float x, float y) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
  atomicAdd(p, x);
  atomicAdd(p + 1, y);
#endif
}

// *p += (x, y, z, w) for four consecutive floats (16-byte aligned), result unused: one vector
// reduction on sm_90 (PTX 8.1 red .v4.f32), four scalar ones before.
__device__ __forceinline__ void red_add_f32x4(float* p, float x, float y, float z, float w) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(x), "f"(y), "f"(z),
               "f"(w)
               : "memory");
#else
  atomicAdd(p, x);
  atomicAdd(p + 1, y);
  atomicAdd(p + 2, z);
  atomicAdd(p + 3, w);
#endif
}
