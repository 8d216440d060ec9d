// Ampere (sm80+) building blocks of the tensor-core kernels:
//
//   SwizzledTile<ROWS, COLS>                             XOR-swizzled row-major tile layout
//   TileLoader<ROWS, COLS, THREADS>                      global -> swizzled tile with cp.async
//   quad_max / quad_sum                                  reductions over the 4 lanes owning a row
//
// and (common/sm80_ptx.cuh, the only place sm80 kernels meet PTX) cp.async, ldmatrix, mma.sync
// m16n8k16 and their fragment layouts.
#pragma once
#include "common/types.cuh"
#include "common/smem.cuh"
#include "common/sm80_ptx.cuh"

// ---- row reductions over a quad ----------------------------------------------------------------

// The 4 lanes 4g..4g+3 hold the same two rows of every C fragment.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---- swizzled tile layout ----------------------------------------------------------------------

// A ROWS x COLS tile of 16-bit elements in shared memory, addressed in 16-byte chunks (8 elements).
// The columns are split into atoms of 64 columns (128-byte rows) when COLS % 64 == 0, else of 32
// columns (64-byte rows); atoms are stored one after the other, each row-major. Inside an atom the
// chunk index is XORed with a function of the row so that
//   * the 8 rows an ldmatrix phase reads at one logical chunk land in 8 different 16-byte bank
//     groups (128-byte atoms: chunk ^ (row & 7); 64-byte atoms: two rows share a 128-byte line,
//     so chunk ^ ((row >> 1) & 3) -- the row parity already picks the half line), and
//   * 8 consecutive chunks in copy order (`coords`) also land in 8 different bank groups,
// so cp.async stores, ldmatrix loads and the epilogue's 16-byte reads are conflict-free.
template <int ROWS, int COLS> struct SwizzledTile {
  static_assert(COLS % 32 == 0, "tile width must be a multiple of 32 elements");
  static_assert(ROWS % 8 == 0, "tile height must be a multiple of 8 rows");
  static constexpr int kAtomCols = (COLS % 64 == 0) ? 64 : 32;
  static constexpr int kAtomChunks = kAtomCols / 8;  // 16-byte chunks per atom row
  static constexpr int kAtomBytes = ROWS * kAtomCols * 2;
  static constexpr int kChunksPerRow = COLS / 8;
  static constexpr int kChunks = ROWS * kChunksPerRow;
  static constexpr int kBytes = ROWS * COLS * 2;

  // Byte offset of chunk `chunk` (columns 8*chunk .. 8*chunk+7) of row `row`.
  __device__ static __forceinline__ uint32_t offset(int row, int chunk) {
    const int atom = chunk / kAtomChunks;
    const int c = chunk % kAtomChunks;
    const int swz = kAtomChunks == 8 ? (row & 7) : ((row >> 1) & 3);
    return static_cast<uint32_t>(atom * kAtomBytes + row * (kAtomCols * 2) + ((c ^ swz) << 4));
  }

  // ldmatrix addressing without per-load index math. A lane reads row R + r, chunk C + c of the
  // tile, where R % 8 == 0 and C even are compile-time, and r >= 0, c in {0, 1} are the lane's
  // (r may include a runtime multiple of 8, e.g. a warp's first row). The swizzle depends on r only, and (C + c) % kAtomChunks == (C % kAtomChunks) ^ c, so
  //     offset(R + r, C + c) == (lane_address(r, c) ^ ((C % kAtomChunks) << 4)) + R * rowbytes
  //                             + (C / kAtomChunks) * kAtomBytes
  // i.e. one XOR with a constant and an immediate offset -- provided the tile base is aligned to
  // a whole atom row (128 bytes covers both atom widths), which the kernels guarantee.
  __device__ static __forceinline__ uint32_t lane_address(uint32_t tile_base, int r, int c) {
    return tile_base + offset(r, c);
  }
  __device__ static __forceinline__ uint32_t at(uint32_t lane_addr, int R, int C) {
    return (lane_addr ^ static_cast<uint32_t>((C % kAtomChunks) << 4)) +
           static_cast<uint32_t>(R * (kAtomCols * 2) + (C / kAtomChunks) * kAtomBytes);
  }

  // Copy order: the e-th chunk (0 <= e < kChunks) is (row, chunk), atom-major, then row, then
  // chunk. A warp's 32 consecutive chunks read whole 64- or 128-byte pieces of global rows.
  __device__ static __forceinline__ void coords(int e, int& row, int& chunk) {
    const int atom = e / (ROWS * kAtomChunks);
    const int rem = e % (ROWS * kAtomChunks);
    row = rem / kAtomChunks;
    chunk = atom * kAtomChunks + rem % kAtomChunks;
  }
};

// ---- global -> shared tile copies --------------------------------------------------------------

// Copies a ROWS x COLS tile of a row-major global matrix into a SwizzledTile with cp.async, all
// THREADS threads taking part. Thread tid owns chunk tid % kThreadsPerRow of atom row
// tid / kThreadsPerRow, then the same chunk kRowsPerPass rows further down, and so on, in every
// atom. kThreadsPerRow threads read one whole 64- or 128-byte atom row (coalesced), 8 consecutive
// threads store to 8 different bank groups, and since kRowsPerPass % 8 == 0 the swizzle of a
// thread's rows never changes: every store address is the thread's one base plus a constant, and
// the thread keeps 3 registers of copy state however many chunks it moves.
template <int ROWS, int COLS, int THREADS> struct TileLoader {
  using Tile = SwizzledTile<ROWS, COLS>;
  static constexpr int kThreadsPerRow = Tile::kAtomChunks;
  static constexpr int kRowsPerPass = THREADS / kThreadsPerRow;
  static constexpr int kPasses = ROWS / kRowsPerPass;
  static constexpr int kAtoms = COLS / Tile::kAtomCols;
  static_assert(THREADS % kThreadsPerRow == 0 && kRowsPerPass % 8 == 0, "copy pass shape");
  static_assert(ROWS % kRowsPerPass == 0, "tile rows must be whole copy passes");

  uint32_t smem_offset;  // offset of this thread's first chunk in the tile
  int row, col;          // this thread's first row and column in the tile

  __device__ __forceinline__ explicit TileLoader(unsigned tid) {
    row = static_cast<int>(tid / kThreadsPerRow);
    col = static_cast<int>(tid % kThreadsPerRow) * 8;
    smem_offset = Tile::offset(row, static_cast<int>(tid % kThreadsPerRow));
  }

  // Copy rows [row0, row0 + ROWS) of the matrix whose element (0, 0) is `g` into the tile at
  // shared address `tile`. Rows outside [lo, hi) and columns >= ncols are zero-filled and never
  // read; their cp.async gets `safe` (any readable address, e.g. the tensor's base pointer, best a
  // kernel parameter so that it costs no register) as its source.
  template <typename E>
  __device__ __forceinline__ void load(uint32_t tile, const E* g, int64_t row_stride, int row0,
                                       int lo, int hi, int ncols, const E* safe) const {
    const E* p = g + static_cast<int64_t>(row0 + row) * row_stride + col;
    const int64_t pass_stride = kRowsPerPass * row_stride;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int r = row0 + row + pass * kRowsPerPass;
      const bool row_ok = r >= lo && r < hi;
#pragma unroll
      for (int atom = 0; atom < kAtoms; ++atom) {
        const bool ok = row_ok & (col < ncols - atom * Tile::kAtomCols);
        cp_async_16(tile + smem_offset + atom * Tile::kAtomBytes +
                        pass * kRowsPerPass * Tile::kAtomCols * 2,
                    ok ? p + atom * Tile::kAtomCols : safe, ok);
      }
      p += pass_stride;
    }
  }
};
