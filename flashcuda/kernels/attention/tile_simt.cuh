// Tile building blocks of the SIMT flash kernels (DESIGN.md §4, rung "tile blocks"): load a tile
// into shared memory, tile scores, row max, row sum, exp2, accumulate P·V. Plain fp32 FMAs, any
// storage dtype, any sm >= 70; the SIMT forward and backward are written with these verbs only.
//
// Thread layout. A CTA of kThreads threads owns its tile's rows in *row groups*: kLanes consecutive
// threads (lanes of one warp) per row. A row's scores are spread over its lanes by interleaved
// columns, lane `l` holding columns l, l + kLanes, l + 2 kLanes, ...; a row's output accumulator is
// spread the same way over the head dimension. So row max / row sum are a local reduction plus
// log2(kLanes) shuffles, and a row's P values only travel through shared memory inside one warp
// (__syncwarp, not __syncthreads).
//
// Shared-memory tiles are fp32, row-major, with a row stride of cols + 1: the +1 pad puts the
// rows a warp touches in one column walk into different banks (for cols a multiple of 32 the
// bank of (r, c) is (r + c) % 32). Every access pattern below is one wavefront per instruction:
// a row group reads one address per row (a broadcast) and its lanes read consecutive columns.
#pragma once
#include "attention/mask.cuh"
#include "common/types.cuh"

// A Rows x Cols fp32 tile in shared memory (row stride Cols + 1).
template <int Rows, int Cols>
struct SmemTile {
  static constexpr int kRows = Rows;
  static constexpr int kCols = Cols;
  static constexpr int kStride = Cols + 1;
  static constexpr int kFloats = Rows * kStride;
  float* data;

  __device__ __forceinline__ float& operator()(int r, int c) const { return data[r * kStride + c]; }
};

// Hand out the next `Tile` from the dynamic shared-memory cursor.
template <class Tile>
__device__ __forceinline__ Tile carve(float*& cursor) {
  Tile t{cursor};
  cursor += Tile::kFloats;
  return t;
}

// Bytes of dynamic shared memory the launch provided. Kernels compare it with what they carve and
// trap on a mismatch, so a host-side budget that disagrees with the kernel fails loudly.
__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
#if defined(FC_HOST_EMULATION)  // (tests/cpu/simt_emu)
  return emu::dynamic_smem_size();
#else
  uint32_t n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
#endif
}

// This thread's row group: the tile row it works on and its lane within the row.
template <int kLanes>
struct RowGroup {
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0,
                "a row group is a power-of-two slice of one warp");
  int row;
  int lane;
  __device__ __forceinline__ RowGroup()
      : row(static_cast<int>(threadIdx.x) / kLanes), lane(static_cast<int>(threadIdx.x) % kLanes) {}
};

// ---------------------------------------------------------------------------------------------
// Global <-> shared

// dst(r, c) = float(src[r * row_stride + c]) for r < rows and c < cols, 0 elsewhere. The whole tile
// is written, so nothing of a previous tile or beyond the sequence (possibly NaN) is ever read
// into a dot product. All kThreads threads of the CTA call it; consecutive threads take
// consecutive columns (coalesced).
template <int kThreads, class Tile, typename T>
__device__ __forceinline__ void load_tile(Tile dst, const T* __restrict__ src, int64_t row_stride,
                                          int rows, int cols) {
  constexpr int kElems = Tile::kRows * Tile::kCols;
  static_assert(kElems % kThreads == 0, "the tile must split evenly over the CTA");
#pragma unroll 4
  for (int i = threadIdx.x; i < kElems; i += kThreads) {
    const int r = i / Tile::kCols;
    const int c = i % Tile::kCols;
    float x = 0.f;
    if (r < rows && c < cols) x = to_float(src[r * row_stride + c]);
    dst(r, c) = x;
  }
}

// dst[r * row_stride + c] = T(src(r, c)) for r < rows, c < cols.
template <int kThreads, class Tile, typename T>
__device__ __forceinline__ void store_tile(T* __restrict__ dst, int64_t row_stride, Tile src,
                                           int rows, int cols) {
  constexpr int kElems = Tile::kRows * Tile::kCols;
  static_assert(kElems % kThreads == 0, "the tile must split evenly over the CTA");
#pragma unroll 4
  for (int i = threadIdx.x; i < kElems; i += kThreads) {
    const int r = i / Tile::kCols;
    const int c = i % Tile::kCols;
    if (r < rows && c < cols) dst[r * row_stride + c] = from_float<T>(src(r, c));
  }
}

// ---------------------------------------------------------------------------------------------
// Row-group register pieces: x[k] belongs to column lane + k * kLanes of the group's row.

// s[k] = scale * dot(a(a_row, :dim), b(lane + k * kLanes, :dim)). With a = Q, b = K and
// scale = softmax_scale * log2(e) these are the log2-domain scores OnlineSoftmax takes; the
// backward also uses it for S^T = K Q^T and dP = dO V^T.
template <int kLanes, class TileA, class TileB, int N>
__device__ __forceinline__ void tile_scores(float (&s)[N], TileA a, int a_row, TileB b, int lane,
                                            int dim, float scale) {
  static_assert(N * kLanes == TileB::kRows, "one score per (lane, k) covers the tile's columns");
#pragma unroll
  for (int k = 0; k < N; ++k) s[k] = 0.f;
#pragma unroll 4
  for (int d = 0; d < dim; ++d) {
    const float x = a(a_row, d);
#pragma unroll
    for (int k = 0; k < N; ++k) s[k] = fmaf(x, b(lane + k * kLanes, d), s[k]);
  }
#pragma unroll
  for (int k = 0; k < N; ++k) s[k] *= scale;
}

// Scores of query row `row` against keys key0 + lane + k * kLanes: -inf where not visible.
template <int kLanes, int N>
__device__ __forceinline__ void mask_keys(float (&s)[N], const Mask& mask, int row, int key0,
                                          int lane) {
#pragma unroll
  for (int k = 0; k < N; ++k)
    if (!mask.visible(row, key0 + lane + k * kLanes)) s[k] = neg_inf();
}

// Scores of key `key` against query rows row0 + lane + k * kLanes (the transposed tile of the
// backward): -inf where not visible.
template <int kLanes, int N>
__device__ __forceinline__ void mask_queries(float (&s)[N], const Mask& mask, int row0, int key,
                                             int lane) {
#pragma unroll
  for (int k = 0; k < N; ++k)
    if (!mask.visible(row0 + lane + k * kLanes, key)) s[k] = neg_inf();
}

// Max over the group's row (every lane of the group gets it). Every thread of the warp must call.
template <int kLanes, int N>
__device__ __forceinline__ float row_max(const float (&s)[N]) {
  float m = s[0];
#pragma unroll
  for (int k = 1; k < N; ++k) m = fmaxf(m, s[k]);
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  return m;
}

// Sum over the group's row (every lane of the group gets it). Every thread of the warp must call.
template <int kLanes, int N>
__device__ __forceinline__ float row_sum(const float (&s)[N]) {
  float t = 0.f;
#pragma unroll
  for (int k = 0; k < N; ++k) t += s[k];
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    t += __shfl_xor_sync(0xffffffffu, t, offset);
  return t;
}

// p[k] = exp2(s[k] - ref): -inf scores give exactly 0.
template <int N>
__device__ __forceinline__ void exp2_rows(float (&p)[N], float ref) {
#pragma unroll
  for (int k = 0; k < N; ++k) p[k] = fast_exp2(p[k] - ref);
}

template <int N>
__device__ __forceinline__ void scale_rows(float (&acc)[N], float factor) {
#pragma unroll
  for (int k = 0; k < N; ++k) acc[k] *= factor;
}

// dst(row, lane + k * kLanes) = x[k]: publish a row's pieces to the other lanes of its group.
template <int kLanes, class Tile, int N>
__device__ __forceinline__ void store_row(Tile dst, int row, int lane, const float (&x)[N]) {
  static_assert(N * kLanes == Tile::kCols, "the pieces cover the row");
#pragma unroll
  for (int k = 0; k < N; ++k) dst(row, lane + k * kLanes) = x[k];
}

// acc[k] += sum_c p(p_row, c) * v(c, lane + k * kLanes): the group's row of P times V. With
// kSkipZero (masked tiles), a zero weight contributes nothing even when v is NaN or inf, so a
// masked-out key can never reach the output (0 * NaN would be NaN).
template <int kLanes, bool kSkipZero, class TileP, class TileV, int N>
__device__ __forceinline__ void accumulate_pv(float (&acc)[N], TileP p, int p_row, TileV v,
                                              int lane) {
  static_assert(TileP::kCols == TileV::kRows, "P's columns index V's rows");
  static_assert(N * kLanes == TileV::kCols, "the accumulator pieces cover V's columns");
#pragma unroll 4
  for (int c = 0; c < TileP::kCols; ++c) {
    const float w = p(p_row, c);
    if (kSkipZero && w == 0.f) continue;
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = fmaf(w, v(c, lane + k * kLanes), acc[k]);
  }
}

// acc[k] += sum_r pt(r, p_col) * v(r, lane + k * kLanes): like accumulate_pv with P stored
// transposed (the backward's dS^T, read by query row to form dQ = dS K).
template <int kLanes, bool kSkipZero, class TileP, class TileV, int N>
__device__ __forceinline__ void accumulate_ptv(float (&acc)[N], TileP pt, int p_col, TileV v,
                                               int lane) {
  static_assert(TileP::kRows == TileV::kRows, "P^T's rows index V's rows");
  static_assert(N * kLanes == TileV::kCols, "the accumulator pieces cover V's columns");
#pragma unroll 4
  for (int r = 0; r < TileP::kRows; ++r) {
    const float w = pt(r, p_col);
    if (kSkipZero && w == 0.f) continue;
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = fmaf(w, v(r, lane + k * kLanes), acc[k]);
  }
}
