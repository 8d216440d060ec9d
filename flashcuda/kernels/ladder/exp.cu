// Rung 3 (primitives): out = exp(x), elementwise. fp32 / fp16 / bf16 (FC_DTYPE), computed in fp32
// with expf (max 2 ulp), not the ex2.approx path of the flash kernels: this rung is checked
// against the fp64 exponential. Memory-bound: 2 x n x sizeof(T) bytes.
#include "common/types.cuh"
#include "ladder/elementwise.cuh"

using T = dtype_of<FC_DTYPE>::type;

struct Exp {
  __device__ __forceinline__ float operator()(float v) const { return expf(v); }
};

extern "C" __global__ void __launch_bounds__(256) FC_KERNEL_NAME(const T* x,  // [n]
                                                                 T* out,      // [n], may be x
                                                                 int64_t n) {
  map1(x, out, n, Exp{});
}
