// Rung 8 (matrix): out[c, r] = x[r, c], through shared-memory tiles.
//
// A 32 x 32 tile is read row by row (coalesced along x's rows) into shared memory and written
// column by column (coalesced along out's rows). Reading a tile column from shared memory would
// hit one bank 32 times with a 32-element row; padding each row by 4 bytes (1 fp32 or 2 fp16/bf16
// elements) makes the row pitch an odd number of 4-byte words (33 or 17), so the 32 reads of a
// column fall in 32 different banks. blockDim (32, 8): each thread moves 4 elements per tile; the
// grid strides over tiles, so any shape works with any grid.
#include "common/types.cuh"

using T = dtype_of<FC_DTYPE>::type;

constexpr int kTile = 32;
constexpr int kRowsPerPass = 8;
constexpr int kPad = 4 / static_cast<int>(sizeof(T));
static_assert(((kTile + kPad) * sizeof(T) / 4) % 2 == 1, "the row pitch must be an odd number of words");

extern "C" __global__ void __launch_bounds__(kTile * kRowsPerPass) FC_KERNEL_NAME(
    const T* __restrict__ x,  // [rows, cols]
    T* __restrict__ out,      // [cols, rows]
    int64_t rows, int64_t cols) {
  __shared__ T tile[kTile][kTile + kPad];
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int64_t tiles_c = (cols + kTile - 1) / kTile;
  const int64_t ntiles = tiles_c * ((rows + kTile - 1) / kTile);
  for (int64_t t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_c) * kTile;
    const int64_t c0 = (t % tiles_c) * kTile;
#pragma unroll
    for (int p = 0; p < kTile / kRowsPerPass; ++p) {
      const int j = ty + p * kRowsPerPass;
      const int64_t r = r0 + j;
      const int64_t c = c0 + tx;
      if (r < rows && c < cols) tile[j][tx] = x[r * cols + c];
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < kTile / kRowsPerPass; ++p) {
      const int j = ty + p * kRowsPerPass;
      const int64_t orow = c0 + j;  // = x's column
      const int64_t ocol = r0 + tx;  // = x's row
      if (orow < cols && ocol < rows) out[orow * rows + ocol] = tile[tx][j];
    }
    __syncthreads();  // the next tile overwrites `tile`
  }
}
