// Rung 10 (naive attention): row softmax, max-subtracted, fp32 arithmetic in any storage dtype:
//     out[r, j] = exp(x[r, j] - m_r) / sum_{j' < limit_r} exp(x[r, j'] - m_r)   for j < limit_r
//     out[r, j] = 0                                                                for j >= limit_r
// limit_r = clamp(r % period + offset, 0, cols). Plain softmax: period = 1, offset = cols. Causal
// (FlashAttention's bottom-right alignment, DESIGN.md §3): row r is query i = r % seqlen_q, which
// sees keys j <= i + cols - seqlen_q, so period = seqlen_q, offset = cols - seqlen_q + 1. Masked
// entries are never read, so NaN there cannot leak in.
//
// A row whose visible scores are all -inf (or that sees none) has max -inf: it is written as zeros,
// never exp(-inf - -inf) = NaN. A NaN among the visible scores makes the row NaN (the max ignores
// it; the sum does not), as in torch.
//
// One block per row, three passes (max, sum, write); for attention-sized rows (<= 64 KiB) the
// second and third reads hit L1/L2. `out` may be `x` (in place).
#include "common/reduce.cuh"
#include "common/types.cuh"
#include "ladder/rowwise.cuh"

using T = dtype_of<FC_DTYPE>::type;

extern "C" __global__ void __launch_bounds__(256) FC_KERNEL_NAME(const T* x,  // [rows, cols]
                                                                 T* out,      // [rows, cols], may be x
                                                                 int64_t rows, int64_t cols,
                                                                 int64_t period, int64_t offset) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    int64_t limit = r % period + offset;
    limit = limit < 0 ? 0 : (limit > cols ? cols : limit);
    const T* xr = x + r * cols;
    T* orow = out + r * cols;

    float m = neg_inf();
    row_for_each(xr, limit, [&](float v) { m = fmaxf(m, v); });
    m = block_reduce_max(m, scratch);

    if (m == neg_inf()) {  // block-uniform: every thread holds the same reduced max
      for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) orow[j] = from_float<T>(0.f);
      continue;
    }

    float s = 0.f;
    row_for_each(xr, limit, [&](float v) { s += expf(v - m); });
    s = block_reduce_sum(s, scratch);

    const float inv = 1.f / s;
    row_map(xr, orow, limit, [&](float v) { return expf(v - m) * inv; });
    for (int64_t j = limit + threadIdx.x; j < cols; j += blockDim.x) orow[j] = from_float<T>(0.f);
  }
}
