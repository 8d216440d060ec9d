// The JIT layer's own check: y[i] = a * x[i] + b, one thread per element.
// Used by the foundation tests (main thread and autograd's backward thread) and by `flashcuda info`.
#include "common/types.cuh"

extern "C" __global__ void smoke_axpb(const float* __restrict__ x,  // [n]
                                      float* __restrict__ y,        // [n]
                                      float a, float b, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + b;
}
