// Ampere (sm80+) building blocks: the only place sm80 kernels meet PTX.
//
//   cp_async_16 / cp_async_commit / cp_async_wait<N>   global -> shared, 16 bytes, zero-fill option
//   ldmatrix_x4 / ldmatrix_x4_trans                      shared -> mma fragments
//   mma_16816<T>                                         D += A B, m16n8k16, fp16/bf16 in, fp32 acc
//   SwizzledTile<ROWS, COLS>                             XOR-swizzled row-major tile layout
//   TileLoader<ROWS, COLS, THREADS>                      global -> swizzled tile with cp.async
//   quad_max / quad_sum                                  reductions over the 4 lanes owning a row
//
// Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with
// g = lane / 4 and t = lane % 4:
//   A (16x16, row-major), 4 regs of 2 x 16 bit:  a0 (g, 2t..2t+1)   a1 (g+8, 2t..2t+1)
//                                                a2 (g, 2t+8..+9)   a3 (g+8, 2t+8..+9)
//   B (16x8, k x n), 2 regs:                     b0 (k = 2t..2t+1, n = g)   b1 (k = 2t+8..+9, n = g)
//   C/D (16x8, fp32), 4 floats:                  c0, c1 (g, 2t..2t+1)   c2, c3 (g+8, 2t..2t+1)
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; register i receives matrix i
// with lane holding row lane/4, columns 2(lane%4)..+1 (.trans: the transposed matrix, i.e. column
// lane/4, rows 2(lane%4)..+1 of the stored one).
#pragma once
#include "common/types.cuh"
#include "common/smem.cuh"

// ---- addresses ---------------------------------------------------------------------------------

// 32-bit shared-window address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- cp.async ----------------------------------------------------------------------------------

// Copy 16 bytes global -> shared asynchronously, bypassing L1 (.cg). When `valid` is false nothing
// is read (src-size 0) and the 16 destination bytes are zero-filled; `src` must still be a legal
// address, so callers pass a known in-bounds one.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N committed groups of this thread are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- shared memory loads / stores --------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void store_global_16(void* p, const Bytes16& v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// ---- tensor cores ------------------------------------------------------------------------------

// d += a * b for one m16n8k16 tile, fp32 accumulators (layouts in the header comment).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<half_t>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<bf16_t>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

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
