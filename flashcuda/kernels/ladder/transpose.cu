// Rung 8 (matrix): out[c, r] = x[r, c], through shared-memory tiles. Two specialisations
// (FC_VECTOR), chosen by the host (_kernels.transpose_plan):
//
// | path   | when                                         | per thread and tile                 |
// |--------|----------------------------------------------|-------------------------------------|
// | vector | x, out 16-byte aligned, rows and cols        | 4 x 16-byte loads, 16 / 8 shared    |
// |        | multiples of 16 bytes / sizeof(T) (4 fp32,   | word stores, 4 x 16-byte shared     |
// |        | 8 fp16/bf16): every row of x and of out      | loads, 4 x 16-byte stores           |
// |        | starts on a 16-byte boundary                 |                                     |
// | scalar | anything else (odd sizes, views at an        | 16 element loads, shared stores,    |
// |        | element offset)                              | shared loads, element stores        |
//
// Vector path. The shared tile is 64 rows of 64 32-bit words (16 KB) for every dtype: row j holds
// x's column c0 + j, word w holds x's rows r0 + P w .. r0 + P w + P - 1 of that column, P = 4 /
// sizeof(T) elements per word (1 fp32, 2 fp16/bf16). So a tile covers 64 P rows x 64 columns of x
// (64 x 64 fp32, 128 x 64 fp16/bf16), and each output row segment is 64 words = 256 bytes in both.
//   load    a unit = P rows x V columns of x (V = 16 / sizeof(T)): P 16-byte loads, all of a
//           thread's units issued before the first shared store (64 bytes per thread in flight).
//           For 16-bit, the two rows are interleaved into pair words, (x[r][c], x[r+1][c]) =
//           __byte_perm(a, b, 0x5410 / 0x7632): a 2 x 2 transpose in registers, so every shared
//           and global access is 4 or 16 bytes, never 2.
//   store   V word stores per unit: word w of rows V g .. V g + V - 1 (g = the unit's column
//           group). A warp's units are 8 column groups x 4 consecutive words (lane = g % 8 +
//           8 (w % 4)), so without care all 8 column groups would hit the same 4 banks.
//           Swizzle: 16-byte chunk q of row j is stored at chunk q ^ ((j / V) % 8), which spreads
//           the 8 groups over 8 chunks = 32 banks: conflict-free.
//   write   a thread reads 16-byte chunks of tile rows (8 lanes = 128 bytes of one row: one
//           conflict-free wavefront, since the XOR permutes chunks within each aligned group of 8)
//           and stores them to out's row c0 + j: 16 lanes cover a 256-byte row segment.
// Why (docs/perf-notes.md, "16-bit softmax and transpose"): the scalar kernel moves a 16-bit
// element per instruction: 64 bytes per warp access and 8 KB per block in flight against 16 KB for
// fp32, and 4 memory instructions (global and shared) per 2 bytes; it reached 57% of copy in bf16
// against 81% in fp32. The vector path does the same number of instructions per byte for every
// dtype (fewer than the fp32 scalar kernel), with 256-byte output row segments in all of them.
//
// Scalar path: a kTile x kTile tile read row by row (coalesced along x's rows) into shared memory
// and written column by column (coalesced along out's rows). Reading a tile column from shared
// memory would hit one bank 32 times with a 32-word row pitch; padding each row by 4 bytes (1 fp32
// or 2 fp16/bf16 elements) makes the pitch an odd number of 4-byte words (65 or 33 for kTile = 64),
// so the 32 reads of a column fall in 32 different banks. 64 x 64 tiles with 16 elements per
// thread (blockDim (32, 8)), all 16 loads in flight before the first shared store;
// __launch_bounds__(256, 5) holds it at 48 registers without spills (5 blocks per SM).
//
// The tile and block shape come from the host (_kernels.py: FC_TILE_ROWS, FC_TILE_COLS,
// FC_ROWS_PER_PASS), the one place the grid is sized from; the kernel checks them against its
// own layout. The grid strides over tiles, so any shape works with any grid.
#include "common/types.cuh"

using T = dtype_of<FC_DTYPE>::type;

constexpr bool kVector = FC_VECTOR;
constexpr int kTileRows = FC_TILE_ROWS;  // rows of x per tile
constexpr int kTileCols = FC_TILE_COLS;  // columns of x per tile
constexpr int kThreads = 32 * FC_ROWS_PER_PASS;

// ---- vector path ------------------------------------------------------------------------------

namespace vec {
constexpr int P = 4 / static_cast<int>(sizeof(T));   // elements per 32-bit word
constexpr int V = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector
constexpr int kWords = 64;                           // words per tile row (256 bytes)
constexpr int kRowsT = 64;                           // tile rows = x columns per tile
constexpr int kGroups = kRowsT / V;                  // column groups of V per tile
constexpr int kUnits = kWords * kGroups;             // P x V units per tile
constexpr int kChunks = kRowsT * kWords / 4;         // 16-byte chunks per tile
constexpr int kUnitsPerThread = kUnits / kThreads;
constexpr int kChunksPerThread = kChunks / kThreads;
static_assert(!kVector || (kTileRows == P * kWords && kTileCols == kRowsT), "host tile != vector tile");
static_assert(kUnits % kThreads == 0 && kChunks % kThreads == 0 && kGroups % 8 == 0,
              "the block must tile the tile, in warps of 8 column groups");

struct __align__(16) Words {
  uint32_t w[4];
};

// Word index within the tile of (row j, word w): 16-byte chunk w / 4 XOR-swizzled by (j / V) % 8.
__device__ __forceinline__ int swizzled(int j, int w) {
  return j * kWords + (((w >> 2) ^ ((j / V) & 7)) << 2) + (w & 3);
}

// This thread's units: column group g (x columns c0 + V g ..) and word rows w0 + k kWordStep
// (x rows r0 + P w ..), k < kUnitsPerThread. A warp's 32 units are 8 column groups x 4
// consecutive words, as the swizzle needs.
struct Units {
  static constexpr int kGroupBlocks = kGroups / 8;      // warps side by side across a tile row
  static constexpr int kWordStep = kThreads / kGroups;  // word rows the block covers per unit
  int g, w0;
  __device__ __forceinline__ explicit Units(int tid) {
    const int lane = tid & 31;
    const int warp = tid >> 5;
    g = (lane & 7) + 8 * (warp % kGroupBlocks);
    w0 = 4 * (warp / kGroupBlocks) + (lane >> 3);
  }
  __device__ __forceinline__ int w(int k) const { return w0 + k * kWordStep; }
  // Shared word of element e < V of unit k: tile row V g + e, whose swizzle is g % 8 for every e.
  __device__ __forceinline__ int smem(int k, int e) const {
    return (V * g + e) * kWords + (((w(k) >> 2) ^ (g & 7)) << 2) + (w(k) & 3);
  }
};
static_assert(kWords % Units::kWordStep == 0 && Units::kWordStep % 4 == 0, "units tile the words");

__device__ __forceinline__ void transpose_tiles(const T* __restrict__ x, T* __restrict__ out,
                                                int64_t rows, int64_t cols) {
  __shared__ uint32_t tile[kRowsT * kWords];
  const int tid = threadIdx.x + 32 * threadIdx.y;
  const Units units(tid);
  const int64_t tiles_c = (cols + kTileCols - 1) / kTileCols;
  const int64_t ntiles = tiles_c * ((rows + kTileRows - 1) / kTileRows);
  for (int64_t t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_c) * kTileRows;
    const int64_t c0 = (t % tiles_c) * kTileCols;
    // Loads: a unit exists iff its first row and first column do (rows % V == 0 and cols % V == 0,
    // so units are never cut by the matrix edge).
    const bool col_in = c0 + V * units.g < cols;
    const T* src = x + (r0 + P * units.w0) * cols + c0 + V * units.g;  // unit 0, its first row
    constexpr int64_t kUnitRows = P * Units::kWordStep;                 // rows from unit k to k + 1
    Words a[kUnitsPerThread][P];
#pragma unroll
    for (int k = 0; k < kUnitsPerThread; ++k) {
      if (col_in && r0 + P * units.w(k) < rows) {
#pragma unroll
        for (int p = 0; p < P; ++p) a[k][p] = *reinterpret_cast<const Words*>(src + (k * kUnitRows + p) * cols);
      }
    }
    // Shared stores: word w of tile rows V g + e, e < V.
#pragma unroll
    for (int k = 0; k < kUnitsPerThread; ++k) {
      if (col_in && r0 + P * units.w(k) < rows) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          uint32_t word;
          if constexpr (P == 1) {
            word = a[k][0].w[e];
          } else {  // element e of rows r and r + 1: halves e % 2 of words e / 2
            word = __byte_perm(a[k][0].w[e / 2], a[k][1].w[e / 2], (e % 2) ? 0x7632 : 0x5410);
          }
          tile[units.smem(k, e)] = word;
        }
      }
    }
    __syncthreads();
    // Out's row c0 + j, elements r0 + V q .. r0 + V q + V - 1 = chunk q of tile row j. A chunk
    // exists iff its first element does (again never cut by the edge).
    constexpr int kChunksPerRow = kWords / 4;
    const int q = tid % kChunksPerRow;  // the same chunk of kThreads / kChunksPerRow rows per k
#pragma unroll
    for (int k = 0; k < kChunksPerThread; ++k) {
      const int j = tid / kChunksPerRow + k * (kThreads / kChunksPerRow);
      if (c0 + j < cols && r0 + V * q < rows) {
        const Words v = *reinterpret_cast<const Words*>(&tile[swizzled(j, 4 * q)]);
        *reinterpret_cast<Words*>(out + (c0 + j) * rows + r0 + V * q) = v;
      }
    }
    __syncthreads();  // the next tile overwrites `tile`
  }
}
}  // namespace vec

// ---- scalar path ------------------------------------------------------------------------------

namespace scalar {
constexpr int kTile = kTileRows;                   // tile side; blockDim.x = 32 columns per pass
constexpr int kRowsPerPass = FC_ROWS_PER_PASS;      // blockDim.y
constexpr int kColPasses = kTile / 32;             // columns of the tile each thread covers
constexpr int kRowPasses = kTile / kRowsPerPass;   // rows of the tile each thread covers
constexpr int kPerThread = kColPasses * kRowPasses;  // 16 for 64 x 64 with (32, 8)
constexpr int kPad = 4 / static_cast<int>(sizeof(T));
static_assert(kVector || kTileRows == kTileCols, "square scalar tiles");
static_assert(kTile % 32 == 0 && kTile % kRowsPerPass == 0, "the block must tile the tile");
static_assert(((kTile + kPad) * sizeof(T) / 4) % 2 == 1, "the row pitch must be an odd number of words");

__device__ __forceinline__ void transpose_tiles(const T* __restrict__ x, T* __restrict__ out,
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
}  // namespace scalar

// Blocks per SM the registers must allow: 5 for the scalar kernels (48 registers; at 40, i.e. 6,
// sm_90a spills) and for fp32 vector tiles (46 naturally; 16 bytes of spills at 40); 6 for 16-bit
// vector tiles (47 naturally, 40 without spills): 96 KB of loads in flight per SM.
constexpr int kMinBlocks = (kVector && sizeof(T) == 2) ? 6 : 5;

extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocks) FC_KERNEL_NAME(
    const T* __restrict__ x,  // [rows, cols]
    T* __restrict__ out,      // [cols, rows]
    int64_t rows, int64_t cols) {
  if constexpr (kVector) {
    vec::transpose_tiles(x, out, rows, cols);
  } else {
    scalar::transpose_tiles(x, out, rows, cols);
  }
}
