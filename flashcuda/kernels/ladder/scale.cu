// Rung 2 (primitives): out = alpha * x, elementwise. fp32 / fp16 / bf16 (FC_DTYPE), computed in
// fp32. Memory-bound: 2 x n x sizeof(T) bytes.
#include "common/types.cuh"
#include "ladder/elementwise.cuh"

using T = dtype_of<FC_DTYPE>::type;

struct Scale {
  float alpha;
  __device__ __forceinline__ float operator()(float v) const { return alpha * v; }
};

extern "C" __global__ void __launch_bounds__(256) FC_KERNEL_NAME(const T* x,  // [n]
                                                                 T* out,      // [n], may be x
                                                                 float alpha, int64_t n) {
  map1(x, out, n, Scale{alpha});
}
