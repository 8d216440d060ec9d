// Flash attention forward, SIMT generation: fp32 FMAs in shared memory, any sm >= 70, any storage
// dtype. The readable GPU reference for the tile loop the tensor-core kernels share.
//
// | feature                        | here                                                        |
// |--------------------------------|-------------------------------------------------------------|
// | dtypes                         | fp32, fp16, bf16 storage (FC_DTYPE); fp32 compute           |
// | head dim                       | any 1..FC_HEAD_DIM at run time (tiles zero-padded)          |
// | causal / sliding window        | mask.cuh; tiles outside the band are never visited          |
// | GQA / MQA                      | kv_head = head / (nheads / nheads_kv)                       |
// | strides                        | any (batch, row, head) strides, unit last stride, 64-bit    |
// | outputs                        | out (input dtype), lse (B, H, Sq) fp32, natural log         |
//
// One CTA per (query tile, head, batch): grid (ceil(Sq / BLOCK_M), H, B), BLOCK_M * LANES threads.
// Per key tile of [key_begin, key_end): S = Q K^T * scale_log2, mask if the tile needs it, online
// softmax (OnlineSoftmax), acc = acc * corr + P V. At the end out = acc / l, lse = m ln2 + ln l.
// Tile sizes come from the host config (flashcuda/ops/fwd_simt.py), never chosen here.
#include "attention/mask.cuh"
#include "attention/online_softmax.cuh"
#include "attention/tile_simt.cuh"
#include "common/types.cuh"

using T = dtype_of<FC_DTYPE>::type;
constexpr int kHeadDim = FC_HEAD_DIM;  // maximum head dim of this specialisation
constexpr int kBlockM = FC_BLOCK_M;    // query rows per CTA
constexpr int kBlockN = FC_BLOCK_N;    // keys per tile
constexpr int kLanes = FC_LANES;       // threads per query row
constexpr int kThreads = FC_THREADS;
static_assert(kThreads == kBlockM * kLanes, "one row group per query row");
static_assert(kBlockN % kLanes == 0 && kHeadDim % kLanes == 0, "rows split evenly over lanes");

using QTile = SmemTile<kBlockM, kHeadDim>;  // Q, then the output staging tile
using KVTile = SmemTile<kBlockN, kHeadDim>;
using PTile = SmemTile<kBlockM, kBlockN>;
constexpr int kSmemBytes = 4 * (QTile::kFloats + 2 * KVTile::kFloats + PTile::kFloats);

struct Tiles {
  QTile q;
  KVTile k, v;
  PTile p;
};

// One key tile [key0, key0 + BLOCK_N) for this thread's query row: the loop body, written once.
// kMasked is true only for tiles that cross the band's edges or seqlen_k (Mask::tile_needs_mask).
template <bool kMasked>
__device__ __forceinline__ void attend_tile(float (&acc)[kHeadDim / kLanes], OnlineSoftmax& state,
                                            const Tiles& t, const RowGroup<kLanes>& g,
                                            const Mask& mask, int row0, int key0, int head_dim,
                                            float scale_log2) {
  float s[kBlockN / kLanes];
  tile_scores<kLanes>(s, t.q, g.row, t.k, g.lane, head_dim, scale_log2);
  if (kMasked) mask_keys<kLanes>(s, mask, row0 + g.row, key0, g.lane);
  const float corr = state.update(row_max<kLanes>(s));
  exp2_rows(s, state.ref());
  state.add(row_sum<kLanes>(s));
  scale_rows(acc, corr);
  store_row<kLanes>(t.p, g.row, g.lane, s);
  __syncwarp();
  accumulate_pv<kLanes, kMasked>(acc, t.p, g.row, t.v, g.lane);
}

extern "C" __global__ void __launch_bounds__(kThreads) FC_KERNEL_NAME(
    const T* __restrict__ q,    // [B, Sq, H, D]
    const T* __restrict__ k,    // [B, Sk, Hkv, D]
    const T* __restrict__ v,    // [B, Sk, Hkv, D]
    T* __restrict__ out,        // [B, Sq, H, D]
    float* __restrict__ lse,    // [B, H, Sq] contiguous
    int64_t q_batch_stride, int64_t q_row_stride, int64_t q_head_stride,
    int64_t k_batch_stride, int64_t k_row_stride, int64_t k_head_stride,
    int64_t v_batch_stride, int64_t v_row_stride, int64_t v_head_stride,
    int64_t o_batch_stride, int64_t o_row_stride, int64_t o_head_stride,
    int batch, int seqlen_q, int seqlen_k, int nheads, int nheads_kv, int head_dim,
    float scale_log2, int window_left, int window_right) {
  if (dynamic_smem_bytes() < kSmemBytes) __trap();  // host budget disagrees with this layout
  extern __shared__ float smem[];
  float* cursor = smem;
  Tiles t;
  t.q = carve<QTile>(cursor);
  t.k = carve<KVTile>(cursor);
  t.v = carve<KVTile>(cursor);
  t.p = carve<PTile>(cursor);

  const int row0 = blockIdx.x * kBlockM;
  const int head = blockIdx.y;
  const int b = blockIdx.z;
  const int kv_head = head / (nheads / nheads_kv);
  const int rows = min(kBlockM, seqlen_q - row0);
  const Mask mask{seqlen_q, seqlen_k, window_left, window_right};
  const RowGroup<kLanes> g;

  const T* q_tile = q + b * q_batch_stride + row0 * q_row_stride + head * q_head_stride;
  const T* k_head = k + b * k_batch_stride + kv_head * k_head_stride;
  const T* v_head = v + b * v_batch_stride + kv_head * v_head_stride;

  load_tile<kThreads>(t.q, q_tile, q_row_stride, rows, head_dim);

  float acc[kHeadDim / kLanes];
#pragma unroll
  for (int i = 0; i < kHeadDim / kLanes; ++i) acc[i] = 0.f;
  OnlineSoftmax state;
  state.init();

  // Only keys some row of this tile can see; a row that sees none keeps l = 0 (out 0, lse -inf).
  const int key_begin = mask.key_begin(row0);
  const int key_end = mask.key_end(row0 + rows);
  for (int key0 = key_begin; key0 < key_end; key0 += kBlockN) {
    const int keys = min(kBlockN, key_end - key0);  // keys past key_end are zero-filled, masked
    load_tile<kThreads>(t.k, k_head + key0 * k_row_stride, k_row_stride, keys, head_dim);
    load_tile<kThreads>(t.v, v_head + key0 * v_row_stride, v_row_stride, keys, head_dim);
    __syncthreads();
    if (mask.tile_needs_mask(row0, kBlockM, key0, kBlockN))
      attend_tile<true>(acc, state, t, g, mask, row0, key0, head_dim, scale_log2);
    else
      attend_tile<false>(acc, state, t, g, mask, row0, key0, head_dim, scale_log2);
    __syncthreads();  // the next tile overwrites K, V and P
  }

  // Epilogue: normalise, stage the rows in the Q tile (no longer needed) and store coalesced.
  // (The barrier orders the staging after the Q load when no key tile was visited.)
  scale_rows(acc, state.inv_sum());
  __syncthreads();
  store_row<kLanes>(t.q, g.row, g.lane, acc);
  if (g.lane == 0 && g.row < rows)
    lse[(static_cast<int64_t>(b) * nheads + head) * seqlen_q + row0 + g.row] = state.lse();
  __syncthreads();
  T* o_tile = out + b * o_batch_stride + row0 * o_row_stride + head * o_head_stride;
  store_tile<kThreads>(o_tile, o_row_stride, t.q, rows, head_dim);
}
