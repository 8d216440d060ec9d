// Rung 5 (primitives): out[r] = sum_j x[r, j], accumulated in fp32, written in the input dtype.
//
// One block per row (grid-stride over rows), blockDim a multiple of 32 chosen by the host from
// the row length (32 threads for short rows, 256 for long ones). Each thread sums its strided
// share of the row with 16-byte loads (rowwise.cuh), then the block combines the partial sums:
// warp shuffles, one shared-memory slot per warp, shuffles again (common/reduce.cuh). The order of
// additions is fixed by (cols, blockDim), so results are deterministic. cols == 0 writes zeros.
#include "common/reduce.cuh"
#include "common/types.cuh"
#include "ladder/rowwise.cuh"

using T = dtype_of<FC_DTYPE>::type;

extern "C" __global__ void __launch_bounds__(256) FC_KERNEL_NAME(const T* __restrict__ x,  // [rows, cols]
                                                                 T* __restrict__ out,      // [rows]
                                                                 int64_t rows, int64_t cols) {
  __shared__ float scratch[32];
  const RowTeam team = RowTeam::of_launch(scratch);  // the block (blockDim.y == 1)
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float acc = 0.f;
    row_for_each(x + r * cols, cols, team, [&](float v) { acc += v; });
    acc = block_reduce_sum(acc, scratch);
    if (threadIdx.x == 0) out[r] = from_float<T>(acc);
  }
}
