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
// One block per row (grid-stride over rows), two ways through a row:
//   in registers  each thread loads its (at most kRowVectors) 16-byte vectors of the row once, all
//                 at the same time, and keeps them for the max, the sum and the write: one read of
//                 the row from DRAM and one memory latency per row. The host sizes the block so
//                 that rows up to 256 x kRowVectors vectors take this way (4096 fp32 or 8192
//                 bf16 elements with kRowVectors = 4).
//   three passes  longer rows, or x and out at different offsets within 16 bytes: max, sum and
//                 write each re-read the row; for attention-sized rows (<= 64 KiB) the second and
//                 third reads hit L1/L2.
// Why the first way: the three-pass kernel waits for a memory latency in every pass, with a block
// reduction between passes, and bf16 rows of 4096 elements had 256 threads x 2 vectors = 4 KB in
// flight per block: measured 18% of the copy bandwidth (fp32: 42%; both with some host time in
// them, see docs/perf-notes.md), and bf16 took longer than fp32 for half the bytes. Cost:
// registers (ptxas, sm_90a): fp32 58, bf16 80; capping bf16 at 64 spills. A 4096-element row then has 64 KB (fp32, 4 blocks of 256 threads per SM) or 48 KB
// (bf16, 6 blocks of 128) in flight per SM, above the ~32 KB the copy bandwidth needs.
// `out` may be `x` (in place): every element is read and written by the same thread, and the
// reductions' barriers separate the last read of the row from the first write.
#include "common/reduce.cuh"
#include "common/types.cuh"
#include "ladder/rowwise.cuh"
#include "ladder/vec.cuh"

using T = dtype_of<FC_DTYPE>::type;

constexpr int kRowVectors = FC_ROW_VECTORS;  // _kernels.py: ROW_VECTORS_PER_THREAD

__device__ __forceinline__ void write_zeros(T* orow, int64_t from, int64_t cols) {
  for (int64_t j = from + threadIdx.x; j < cols; j += blockDim.x) orow[j] = from_float<T>(0.f);
}

// f(j) for this thread's j of the scalar head [0, head) and tail [tail, limit) of a row.
template <typename F>
__device__ __forceinline__ void for_scalars(int64_t head, int64_t tail, int64_t limit, F f) {
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) f(j);
  for (int64_t j = tail + threadIdx.x; j < limit; j += blockDim.x) f(j);
}

// The row held in registers: v[k] is vector threadIdx.x + k * blockDim.x of the 16-byte-aligned
// part (s.nvec <= blockDim.x * kRowVectors), the head and tail scalars are read from memory (at
// most 2 x 7 of them per row, by the first threads).
__device__ __forceinline__ void softmax_row_registers(const T* xr, T* orow, int64_t limit,
                                                      int64_t cols, Split16 s, float* scratch) {
  constexpr int N = Vec16<T>::N;
  const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(xr + s.head);
  Vec16<T>* ov = reinterpret_cast<Vec16<T>*>(orow + s.head);
  const int64_t tail = s.head + s.nvec * N;

  Vec16<T> v[kRowVectors];
#pragma unroll
  for (int k = 0; k < kRowVectors; ++k) {  // independent loads: all in flight together
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (i < s.nvec) v[k] = xv[i];
  }

  float m = neg_inf();
#pragma unroll
  for (int k = 0; k < kRowVectors; ++k) {
    if (threadIdx.x + static_cast<int64_t>(k) * blockDim.x < s.nvec) {
#pragma unroll
      for (int e = 0; e < N; ++e) m = fmaxf(m, to_float(v[k].v[e]));
    }
  }
  for_scalars(s.head, tail, limit, [&](int64_t j) { m = fmaxf(m, to_float(xr[j])); });
  m = block_reduce_max(m, scratch);
  if (m == neg_inf()) {  // block-uniform: every thread holds the same reduced max
    write_zeros(orow, 0, cols);
    return;
  }

  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < kRowVectors; ++k) {
    if (threadIdx.x + static_cast<int64_t>(k) * blockDim.x < s.nvec) {
#pragma unroll
      for (int e = 0; e < N; ++e) sum += expf(to_float(v[k].v[e]) - m);
    }
  }
  for_scalars(s.head, tail, limit, [&](int64_t j) { sum += expf(to_float(xr[j]) - m); });
  sum = block_reduce_sum(sum, scratch);

  // exp is recomputed rather than kept: fp32 copies of a bf16 row would double the registers,
  // and the SFU has time to spare in a memory-bound kernel.
  const float inv = 1.f / sum;
#pragma unroll
  for (int k = 0; k < kRowVectors; ++k) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (i < s.nvec) {
      Vec16<T> o;
#pragma unroll
      for (int e = 0; e < N; ++e) o.v[e] = from_float<T>(expf(to_float(v[k].v[e]) - m) * inv);
      ov[i] = o;
    }
  }
  for_scalars(s.head, tail, limit, [&](int64_t j) { orow[j] = from_float<T>(expf(to_float(xr[j]) - m) * inv); });
  write_zeros(orow, limit, cols);
}

// Any row: three passes over memory (rowwise.cuh vectorises each).
__device__ __forceinline__ void softmax_row_passes(const T* xr, T* orow, int64_t limit,
                                                   int64_t cols, float* scratch) {
  float m = neg_inf();
  row_for_each(xr, limit, [&](float v) { m = fmaxf(m, v); });
  m = block_reduce_max(m, scratch);
  if (m == neg_inf()) {  // block-uniform
    write_zeros(orow, 0, cols);
    return;
  }

  float s = 0.f;
  row_for_each(xr, limit, [&](float v) { s += expf(v - m); });
  s = block_reduce_sum(s, scratch);

  const float inv = 1.f / s;
  row_map(xr, orow, limit, [&](float v) { return expf(v - m) * inv; });
  write_zeros(orow, limit, cols);
}

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
    const Split16 s = split16(xr, limit);
    // Block-uniform choice (it depends on the row only), so the reductions' barriers are safe.
    if (offset16(xr) == offset16(orow) && s.nvec <= static_cast<int64_t>(blockDim.x) * kRowVectors) {
      softmax_row_registers(xr, orow, limit, cols, s, scratch);
    } else {
      softmax_row_passes(xr, orow, limit, cols, scratch);
    }
  }
}
