// Rung 8 (matrix): out[c, r] = x[r, c], through shared-memory tiles.
//
// A kTile x kTile tile is read row by row (coalesced along x's rows) into shared memory and
// written column by column (coalesced along out's rows). Reading a tile column from shared memory
// would hit one bank 32 times with a 32-word row pitch; padding each row by 4 bytes (1 fp32 or 2
// fp16/bf16 elements) makes the pitch an odd number of 4-byte words (65 or 33 for kTile = 64), so
// the 32 reads of a column fall in 32 different banks.
//
// Why 64 x 64 tiles with 16 elements per thread (blockDim (32, 8)): a transpose is a copy, so it
// is judged against the copy bandwidth, and a copy needs enough bytes in flight per SM to cover
// the DRAM latency (Little's law: 4.3 TB/s / 132 SMs x ~1 us = ~32 KB per SM). With 32 x 32 tiles
// (4 elements per thread) a 256-thread block had 4 KB (fp32) or 2 KB (bf16) of loads in flight,
// 8 blocks per SM: 32 KB / 16 KB, at or below that bound. A 64 x 64
// tile issues all 16 loads of a thread before the first shared-memory store: 16 KB (fp32) or 8 KB
// (bf16) per block. Registers then decide the residency: 16 values plus their addresses need ~56
// registers (4 blocks per SM); __launch_bounds__(256, 5) caps them at 48 without spills (at 40,
// i.e. 6 blocks, sm_90a spills), so 5 blocks per SM: 80 KB (fp32) or 40 KB (bf16) in flight.
//
// The tile and block shape come from the host (_kernels.py: FC_TILE, FC_ROWS_PER_PASS), the one
// place the grid is sized from. The grid strides over tiles, so any shape works with any grid.
#include "common/types.cuh"

using T = dtype_of<FC_DTYPE>::type;

constexpr int kTile = FC_TILE;                // tile side; blockDim.x = 32 columns per pass
constexpr int kRowsPerPass = FC_ROWS_PER_PASS;  // blockDim.y
constexpr int kColPasses = kTile / 32;        // columns of the tile each thread covers
constexpr int kRowPasses = kTile / kRowsPerPass;  // rows of the tile each thread covers
constexpr int kPerThread = kColPasses * kRowPasses;  // 16 for 64 x 64 with (32, 8)
constexpr int kPad = 4 / static_cast<int>(sizeof(T));
static_assert(kTile % 32 == 0 && kTile % kRowsPerPass == 0, "the block must tile the tile");
static_assert(((kTile + kPad) * sizeof(T) / 4) % 2 == 1, "the row pitch must be an odd number of words");

extern "C" __global__ void __launch_bounds__(32 * kRowsPerPass, 5) FC_KERNEL_NAME(
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
    // This thread's rows and columns left inside the matrix (<= 0: none). Element (j, i) of the
    // tile, row j = ty + p * kRowsPerPass and column i = tx + q * 32, exists iff
    // p * kRowsPerPass < rows_left and q * 32 < cols_left.
    const int64_t rows_left = rows - r0 - ty;
    const int64_t cols_left = cols - c0 - tx;
    // All kPerThread global loads first (independent, so all in flight at once), then the
    // shared-memory stores. A warp reads 32 consecutive elements of one row of x.
    const T* src = x + (r0 + ty) * cols + (c0 + tx);
    T v[kPerThread];
#pragma unroll
    for (int p = 0; p < kRowPasses; ++p) {
#pragma unroll
      for (int q = 0; q < kColPasses; ++q) {
        if (p * kRowsPerPass < rows_left && q * 32 < cols_left) {
          v[p * kColPasses + q] = src[p * kRowsPerPass * cols + q * 32];
        }
      }
    }
#pragma unroll
    for (int p = 0; p < kRowPasses; ++p) {
#pragma unroll
      for (int q = 0; q < kColPasses; ++q) {
        if (p * kRowsPerPass < rows_left && q * 32 < cols_left) {
          tile[ty + p * kRowsPerPass][tx + q * 32] = v[p * kColPasses + q];
        }
      }
    }
    __syncthreads();
    // Out's row c0 + j holds x's column c0 + j: a warp writes 32 consecutive elements of it
    // (out[(c0 + j) * rows + r0 + i]), reading the tile down a column (conflict-free thanks to
    // the odd pitch). Here j = ty + p * kRowsPerPass runs along x's columns, i = tx + q * 32
    // along x's rows.
    T* dst = out + (c0 + ty) * rows + (r0 + tx);
#pragma unroll
    for (int p = 0; p < kRowPasses; ++p) {
#pragma unroll
      for (int q = 0; q < kColPasses; ++q) {
        if (p * kRowsPerPass < cols - c0 - ty && q * 32 < rows - r0 - tx) {
          dst[p * kRowsPerPass * rows + q * 32] = tile[tx + q * 32][ty + p * kRowsPerPass];
        }
      }
    }
    __syncthreads();  // the next tile overwrites `tile`
  }
}
