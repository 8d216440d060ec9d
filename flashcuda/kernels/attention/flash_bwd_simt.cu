// Flash attention backward, SIMT generation (the FA2 algorithm in fp32 FMAs), any sm >= 70.
//
// | feature                        | here                                                        |
// |--------------------------------|-------------------------------------------------------------|
// | dtypes                         | fp32, fp16, bf16 storage (FC_DTYPE); fp32 compute           |
// | head dim                       | any 1..FC_HEAD_DIM at run time                              |
// | causal / sliding window        | mask.cuh; tiles outside the band are never visited          |
// | GQA / MQA                      | dK, dV summed over a KV head's query heads in one CTA, in a |
// |                                | fixed order: deterministic without an expanded buffer       |
// | dQ                             | fp32 atomics from the dK/dV kernel (default), or its own    |
// |                                | kernel with no atomics (deterministic)                      |
//
// With S = Q K^T (per head), P = softmax(S * scale) recomputed from the forward's natural-log lse
// as P = exp2(S * scale_log2 - lse * log2(e)), and D = rowsum(dO o O):
//     dV = P^T dO,   dP = dO V^T,   dS = P o (dP - D),   dK = scale dS^T Q,   dQ = scale dS K.
// A row with lse = -inf (it saw no key) gets P = 0, so it contributes nothing and dQ = 0.
//
// The source holds three kernels; FC_BWD_KERNEL picks the one a specialisation compiles (each is
// its own KernelSpec, flashcuda/ops/bwd_simt.py, so NVRTC builds only what is launched):
//   FC_BWD_DOT_DO_O  grid (ceil(Sq / 4), H, B), 128 threads: D = rowsum(dO o O), one warp a row.
//   FC_BWD_DKDV      grid (ceil(Sk / BLOCK), Hkv, B): a key tile's dK, dV over every query tile of
//                    every query head of its KV head; optionally atomically adds dQ (fp32).
//   FC_BWD_DQ        grid (ceil(Sq / BLOCK), H, B): a query tile's dQ over its key tiles.
#include "attention/mask.cuh"
#include "attention/online_softmax.cuh"
#include "attention/tile_simt.cuh"
#include "common/types.cuh"

#define FC_BWD_DOT_DO_O 0
#define FC_BWD_DKDV 1
#define FC_BWD_DQ 2

using T = dtype_of<FC_DTYPE>::type;

#if FC_BWD_KERNEL == FC_BWD_DOT_DO_O

constexpr int kRowsPerCta = 4;  // one warp per row

extern "C" __global__ void __launch_bounds__(32 * kRowsPerCta) FC_KERNEL_NAME(
    const T* __restrict__ out,   // [B, Sq, H, D]
    const T* __restrict__ dout,  // [B, Sq, H, D]
    float* __restrict__ delta,   // [B, H, Sq] contiguous
    int64_t o_batch_stride, int64_t o_row_stride, int64_t o_head_stride,
    int64_t do_batch_stride, int64_t do_row_stride, int64_t do_head_stride,
    int batch, int seqlen_q, int nheads, int head_dim) {
  const int row = blockIdx.x * kRowsPerCta + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int head = blockIdx.y;
  const int b = blockIdx.z;
  if (row >= seqlen_q) return;  // whole warps leave together
  const T* o = out + b * o_batch_stride + row * o_row_stride + head * o_head_stride;
  const T* dO = dout + b * do_batch_stride + row * do_row_stride + head * do_head_stride;
  float sum = 0.f;
  for (int d = lane; d < head_dim; d += 32) sum = fmaf(to_float(o[d]), to_float(dO[d]), sum);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) delta[(static_cast<int64_t>(b) * nheads + head) * seqlen_q + row] = sum;
}

#else  // the tile kernels

constexpr int kHeadDim = FC_HEAD_DIM;  // maximum head dim of this specialisation
constexpr int kBlock = FC_BLOCK;       // query rows per query tile = keys per key tile
constexpr int kLanes = FC_LANES;       // threads per tile row
constexpr int kThreads = FC_THREADS;
static_assert(kThreads == kBlock * kLanes, "one row group per tile row");
static_assert(kBlock % kLanes == 0 && kHeadDim % kLanes == 0, "rows split evenly over lanes");

using RowTile = SmemTile<kBlock, kHeadDim>;  // Q, dO, K, V tiles
using SqTile = SmemTile<kBlock, kBlock>;     // P^T, dS^T or dS
constexpr int kPieces = kHeadDim / kLanes;   // accumulator floats per thread
constexpr int kScores = kBlock / kLanes;     // scores per thread
// __launch_bounds__' minBlocks: 2 keeps the 255-register cap of 128 threads but steers ptxas'
// heuristics. Without it NVRTC 13.5 spilled hdim 32 dK/dV on sm_80 (4 bytes at 72 registers) and
// fp16/bf16 hdim 256 dQ on sm_90a (20 bytes at 56 registers); with it none spills (<= 185 regs).
constexpr int kMinBlocks = 2;

// The recomputation's log2-domain row offset: lse * log2(e), or +inf for a row that saw no key
// or lies past seqlen_q, so that exp2(s - offset) = 0 for it whatever s is (s is finite or -inf).
__device__ __forceinline__ float lse_to_log2(const float* __restrict__ lse_row, int i,
                                             int seqlen_q) {
  if (i >= seqlen_q) return pos_inf();
  const float x = lse_row[i];
  return x == neg_inf() ? pos_inf() : x * kLog2e;
}

// dS = P o (dP - D), with 0 wherever P is 0 (in masked tiles dP may be NaN from a masked-out
// NaN value; 0 * NaN must not leak).
template <bool kMasked>
__device__ __forceinline__ float dsoftmax(float p, float dp, float d) {
  const float ds = p * (dp - d);
  return (kMasked && p == 0.f) ? 0.f : ds;
}

#if FC_BWD_KERNEL == FC_BWD_DKDV

// Query rows that can see some key of [key0, key1): the inverse of Mask::key_begin / key_end.
__device__ __forceinline__ int query_begin(const Mask& m, int key0) {
  const int i = key0 - m.shift() - m.window_right;
  return i > 0 ? i : 0;
}
__device__ __forceinline__ int query_end(const Mask& m, int key1) {
  const int i = key1 - 1 - m.shift() + m.window_left + 1;
  return i < 0 ? 0 : (i < m.seqlen_q ? i : m.seqlen_q);
}

struct DkdvTiles {
  RowTile k, v, q, dout;
  SqTile pt, dst;   // P^T and dS^T: row = key, column = query
  float* lse_log2;  // [kBlock] per query row of the current tile
  float* delta;     // [kBlock]
};
constexpr int kDkdvSmemBytes = 4 * (4 * RowTile::kFloats + 2 * SqTile::kFloats + 2 * kBlock);

// One query tile [row0, row0 + BLOCK) against this CTA's key tile: the loop body, written once.
// The thread's row group is key `g.row` (dK, dV) and, for the dQ atomics, query `g.row`.
template <bool kMasked>
__device__ __forceinline__ void dkdv_step(float (&dk)[kPieces], float (&dv)[kPieces],
                                          const DkdvTiles& t, const RowGroup<kLanes>& g,
                                          const Mask& mask, int row0, int key0, int head_dim,
                                          float scale, float scale_log2,
                                          float* __restrict__ dq_rows, int64_t dq_row_stride) {
  // P^T(key, query) and dP^T(key, query) for queries lane + k * LANES.
  float p[kScores];
  tile_scores<kLanes>(p, t.k, g.row, t.q, g.lane, head_dim, scale_log2);
  if (kMasked) mask_queries<kLanes>(p, mask, row0, key0 + g.row, g.lane);
#pragma unroll
  for (int k = 0; k < kScores; ++k) p[k] = fast_exp2(p[k] - t.lse_log2[g.lane + k * kLanes]);
  float ds[kScores];
  tile_scores<kLanes>(ds, t.v, g.row, t.dout, g.lane, head_dim, 1.f);
#pragma unroll
  for (int k = 0; k < kScores; ++k)
    ds[k] = dsoftmax<kMasked>(p[k], ds[k], t.delta[g.lane + k * kLanes]);
  store_row<kLanes>(t.pt, g.row, g.lane, p);
  store_row<kLanes>(t.dst, g.row, g.lane, ds);
  __syncwarp();
  accumulate_pv<kLanes, kMasked>(dv, t.pt, g.row, t.dout, g.lane);  // dV += P^T dO
  accumulate_pv<kLanes, kMasked>(dk, t.dst, g.row, t.q, g.lane);    // dK += dS^T Q
  if (dq_rows == nullptr) return;
  __syncthreads();  // dQ's row reads dS^T's column, written by every row group
  float dq[kPieces];
#pragma unroll
  for (int i = 0; i < kPieces; ++i) dq[i] = 0.f;
  accumulate_ptv<kLanes, kMasked>(dq, t.dst, g.row, t.k, g.lane);  // dQ += dS K
  if (row0 + g.row < mask.seqlen_q) {
    float* dst = dq_rows + g.row * dq_row_stride;
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int d = g.lane + i * kLanes;
      if (d < head_dim) atomicAdd(dst + d, dq[i] * scale);
    }
  }
}

extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocks) FC_KERNEL_NAME(
    const T* __restrict__ q,        // [B, Sq, H, D]
    const T* __restrict__ k,        // [B, Sk, Hkv, D]
    const T* __restrict__ v,        // [B, Sk, Hkv, D]
    const T* __restrict__ dout,     // [B, Sq, H, D]
    const float* __restrict__ lse,  // [B, H, Sq] contiguous, natural log
    const float* __restrict__ delta,  // [B, H, Sq] contiguous, rowsum(dO o O)
    T* __restrict__ dk,             // [B, Sk, Hkv, D]
    T* __restrict__ dv,             // [B, Sk, Hkv, D]
    float* __restrict__ dq_accum,   // [B, Sq, H, D] fp32, zeroed; null: no dQ (deterministic)
    int64_t q_batch_stride, int64_t q_row_stride, int64_t q_head_stride,
    int64_t k_batch_stride, int64_t k_row_stride, int64_t k_head_stride,
    int64_t v_batch_stride, int64_t v_row_stride, int64_t v_head_stride,
    int64_t do_batch_stride, int64_t do_row_stride, int64_t do_head_stride,
    int64_t dk_batch_stride, int64_t dk_row_stride, int64_t dk_head_stride,
    int64_t dv_batch_stride, int64_t dv_row_stride, int64_t dv_head_stride,
    int64_t dq_batch_stride, int64_t dq_row_stride, int64_t dq_head_stride,
    int batch, int seqlen_q, int seqlen_k, int nheads, int nheads_kv, int head_dim,
    float scale, float scale_log2, int window_left, int window_right) {
  if (dynamic_smem_bytes() < kDkdvSmemBytes) __trap();  // host budget disagrees with this layout
  extern __shared__ float smem[];
  float* cursor = smem;
  DkdvTiles t;
  t.k = carve<RowTile>(cursor);
  t.v = carve<RowTile>(cursor);
  t.q = carve<RowTile>(cursor);
  t.dout = carve<RowTile>(cursor);
  t.pt = carve<SqTile>(cursor);
  t.dst = carve<SqTile>(cursor);
  t.lse_log2 = cursor;
  t.delta = cursor + kBlock;

  const int key0 = blockIdx.x * kBlock;
  const int kv_head = blockIdx.y;
  const int b = blockIdx.z;
  const int keys = min(kBlock, seqlen_k - key0);
  const int group = nheads / nheads_kv;
  const Mask mask{seqlen_q, seqlen_k, window_left, window_right};
  const RowGroup<kLanes> g;

  const int64_t k_off = b * k_batch_stride + key0 * k_row_stride + kv_head * k_head_stride;
  const int64_t v_off = b * v_batch_stride + key0 * v_row_stride + kv_head * v_head_stride;
  load_tile<kThreads>(t.k, k + k_off, k_row_stride, keys, head_dim);
  load_tile<kThreads>(t.v, v + v_off, v_row_stride, keys, head_dim);

  float dk_acc[kPieces], dv_acc[kPieces];
#pragma unroll
  for (int i = 0; i < kPieces; ++i) dk_acc[i] = dv_acc[i] = 0.f;

  const int row_begin = query_begin(mask, key0);
  const int row_end = query_end(mask, key0 + keys);
  for (int head = kv_head * group; head < (kv_head + 1) * group; ++head) {
    const float* lse_head = lse + (static_cast<int64_t>(b) * nheads + head) * seqlen_q;
    const float* delta_head = delta + (static_cast<int64_t>(b) * nheads + head) * seqlen_q;
    for (int row0 = row_begin; row0 < row_end; row0 += kBlock) {
      const int rows = min(kBlock, seqlen_q - row0);
      load_tile<kThreads>(t.q, q + b * q_batch_stride + row0 * q_row_stride + head * q_head_stride,
                          q_row_stride, rows, head_dim);
      load_tile<kThreads>(t.dout,
                          dout + b * do_batch_stride + row0 * do_row_stride + head * do_head_stride,
                          do_row_stride, rows, head_dim);
      for (int r = threadIdx.x; r < kBlock; r += kThreads) {
        t.lse_log2[r] = lse_to_log2(lse_head, row0 + r, seqlen_q);
        t.delta[r] = row0 + r < seqlen_q ? delta_head[row0 + r] : 0.f;
      }
      __syncthreads();
      float* dq_rows = nullptr;
      if (dq_accum != nullptr)
        dq_rows = dq_accum + b * dq_batch_stride + row0 * dq_row_stride + head * dq_head_stride;
      if (mask.tile_needs_mask(row0, kBlock, key0, kBlock))
        dkdv_step<true>(dk_acc, dv_acc, t, g, mask, row0, key0, head_dim, scale, scale_log2,
                        dq_rows, dq_row_stride);
      else
        dkdv_step<false>(dk_acc, dv_acc, t, g, mask, row0, key0, head_dim, scale, scale_log2,
                         dq_rows, dq_row_stride);
      __syncthreads();  // the next query tile overwrites Q, dO, P^T, dS^T
    }
  }

  // Epilogue: stage dK (scaled) and dV in the Q and dO tiles, then store coalesced. Keys no query
  // sees get zeros.
  scale_rows(dk_acc, scale);
  __syncthreads();
  store_row<kLanes>(t.q, g.row, g.lane, dk_acc);
  store_row<kLanes>(t.dout, g.row, g.lane, dv_acc);
  __syncthreads();
  store_tile<kThreads>(dk + b * dk_batch_stride + key0 * dk_row_stride + kv_head * dk_head_stride,
                       dk_row_stride, t.q, keys, head_dim);
  store_tile<kThreads>(dv + b * dv_batch_stride + key0 * dv_row_stride + kv_head * dv_head_stride,
                       dv_row_stride, t.dout, keys, head_dim);
}

#elif FC_BWD_KERNEL == FC_BWD_DQ

struct DqTiles {
  RowTile q, dout, k, v;
  SqTile ds;  // row = query, column = key
};
constexpr int kDqSmemBytes = 4 * (4 * RowTile::kFloats + SqTile::kFloats);

// One key tile [key0, key0 + BLOCK) for this thread's query row: the loop body, written once.
template <bool kMasked>
__device__ __forceinline__ void dq_step(float (&dq)[kPieces], const DqTiles& t,
                                        const RowGroup<kLanes>& g, const Mask& mask, int row0,
                                        int key0, int head_dim, float scale_log2,
                                        float row_lse_log2, float row_delta) {
  float p[kScores];
  tile_scores<kLanes>(p, t.q, g.row, t.k, g.lane, head_dim, scale_log2);
  if (kMasked) mask_keys<kLanes>(p, mask, row0 + g.row, key0, g.lane);
  exp2_rows(p, row_lse_log2);
  float ds[kScores];
  tile_scores<kLanes>(ds, t.dout, g.row, t.v, g.lane, head_dim, 1.f);
#pragma unroll
  for (int k = 0; k < kScores; ++k) ds[k] = dsoftmax<kMasked>(p[k], ds[k], row_delta);
  store_row<kLanes>(t.ds, g.row, g.lane, ds);
  __syncwarp();
  accumulate_pv<kLanes, kMasked>(dq, t.ds, g.row, t.k, g.lane);  // dQ += dS K
}

extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocks) FC_KERNEL_NAME(
    const T* __restrict__ q,          // [B, Sq, H, D]
    const T* __restrict__ k,          // [B, Sk, Hkv, D]
    const T* __restrict__ v,          // [B, Sk, Hkv, D]
    const T* __restrict__ dout,       // [B, Sq, H, D]
    const float* __restrict__ lse,    // [B, H, Sq] contiguous, natural log
    const float* __restrict__ delta,  // [B, H, Sq] contiguous, rowsum(dO o O)
    T* __restrict__ dq,               // [B, Sq, H, D]
    int64_t q_batch_stride, int64_t q_row_stride, int64_t q_head_stride,
    int64_t k_batch_stride, int64_t k_row_stride, int64_t k_head_stride,
    int64_t v_batch_stride, int64_t v_row_stride, int64_t v_head_stride,
    int64_t do_batch_stride, int64_t do_row_stride, int64_t do_head_stride,
    int64_t dq_batch_stride, int64_t dq_row_stride, int64_t dq_head_stride,
    int batch, int seqlen_q, int seqlen_k, int nheads, int nheads_kv, int head_dim,
    float scale, float scale_log2, int window_left, int window_right) {
  if (dynamic_smem_bytes() < kDqSmemBytes) __trap();  // host budget disagrees with this layout
  extern __shared__ float smem[];
  float* cursor = smem;
  DqTiles t;
  t.q = carve<RowTile>(cursor);
  t.dout = carve<RowTile>(cursor);
  t.k = carve<RowTile>(cursor);
  t.v = carve<RowTile>(cursor);
  t.ds = carve<SqTile>(cursor);

  const int row0 = blockIdx.x * kBlock;
  const int head = blockIdx.y;
  const int b = blockIdx.z;
  const int kv_head = head / (nheads / nheads_kv);
  const int rows = min(kBlock, seqlen_q - row0);
  const Mask mask{seqlen_q, seqlen_k, window_left, window_right};
  const RowGroup<kLanes> g;

  load_tile<kThreads>(t.q, q + b * q_batch_stride + row0 * q_row_stride + head * q_head_stride,
                      q_row_stride, rows, head_dim);
  load_tile<kThreads>(t.dout,
                      dout + b * do_batch_stride + row0 * do_row_stride + head * do_head_stride,
                      do_row_stride, rows, head_dim);
  const int64_t lse_off = (static_cast<int64_t>(b) * nheads + head) * seqlen_q;
  const float row_lse_log2 = lse_to_log2(lse + lse_off, row0 + g.row, seqlen_q);
  const float row_delta = row0 + g.row < seqlen_q ? delta[lse_off + row0 + g.row] : 0.f;
  const T* k_head = k + b * k_batch_stride + kv_head * k_head_stride;
  const T* v_head = v + b * v_batch_stride + kv_head * v_head_stride;

  float dq_acc[kPieces];
#pragma unroll
  for (int i = 0; i < kPieces; ++i) dq_acc[i] = 0.f;

  const int key_begin = mask.key_begin(row0);
  const int key_end = mask.key_end(row0 + rows);
  for (int key0 = key_begin; key0 < key_end; key0 += kBlock) {
    const int keys = min(kBlock, key_end - key0);  // keys past key_end are zero-filled, masked
    load_tile<kThreads>(t.k, k_head + key0 * k_row_stride, k_row_stride, keys, head_dim);
    load_tile<kThreads>(t.v, v_head + key0 * v_row_stride, v_row_stride, keys, head_dim);
    __syncthreads();
    if (mask.tile_needs_mask(row0, kBlock, key0, kBlock))
      dq_step<true>(dq_acc, t, g, mask, row0, key0, head_dim, scale_log2, row_lse_log2, row_delta);
    else
      dq_step<false>(dq_acc, t, g, mask, row0, key0, head_dim, scale_log2, row_lse_log2, row_delta);
    __syncthreads();  // the next tile overwrites K, V and dS
  }

  // Epilogue: stage the scaled rows in the Q tile and store coalesced. (The barrier orders the
  // staging after the Q load when no key tile was visited.)
  scale_rows(dq_acc, scale);
  __syncthreads();
  store_row<kLanes>(t.q, g.row, g.lane, dq_acc);
  __syncthreads();
  store_tile<kThreads>(dq + b * dq_batch_stride + row0 * dq_row_stride + head * dq_head_stride,
                       dq_row_stride, t.q, rows, head_dim);
}

#endif  // FC_BWD_KERNEL == FC_BWD_DKDV / FC_BWD_DQ
#endif  // FC_BWD_KERNEL == FC_BWD_DOT_DO_O
