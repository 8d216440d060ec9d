// Flash attention backward on sm80 tensor cores (the FA2 algorithm), fp16 and bf16.
//
// | feature                         | support                                                      |
// |---------------------------------|--------------------------------------------------------------|
// | dtypes                          | fp16, bf16 (fp32 accumulation, fp32 dQ accumulator)          |
// | head dims                       | compile-time FC_HEAD_DIM; a smaller runtime head_dim (a      |
// |                                 | multiple of 8) is zero-padded on load and never stored       |
// | masks                           | mask.cuh: bottom-right causal, sliding window, ragged Sq/Sk  |
// | GQA / MQA                       | a CTA loops over the query heads of its KV head (no expanded |
// |                                 | dK/dV buffers, no reduction kernel)                          |
// | deterministic                   | FC_WITH_DQ=0 main kernel + the dQ kernel (part 2): no atomics|
// | layouts                         | any (batch, row, head) strides, unit last stride, 16-B align |
//
// One backward is three launches (four parts of this file, picked by FC_PART):
//   part 0  preprocess  per (query block, head, batch): delta = rowsum(dO * O), lse2 = lse * log2(e)
//                       (+inf for rows with no visible key and for padding rows: P = 0 there, never
//                       NaN), and zeroes the fp32 dQ accumulator.
//   part 1  main        per (key block, KV head, batch): K_j, V_j stay in shared memory; the loop runs
//                       over the (query head, query block) pairs that see the block:
//                           S^T  = K_j Q_i^T            P^T = exp2(S^T * scale_log2 - lse2)
//                           dV  += P^T dO_i             dP^T = V_j dO_i^T
//                           dS^T = P^T o (dP^T - delta) dK  += dS^T Q_i
//                           dQ_i += dS K_j   (fp32 reductions into the accumulator; FC_WITH_DQ)
//   part 2  dQ          deterministic mode only, per (query block, head, batch): loops over the key
//                       blocks, recomputes P and dS and writes dQ = scale * dS K directly.
//   part 3  convert     dq = dq_accum * softmax_scale in the input dtype.
//
// Why the scores are computed transposed (S^T = K Q^T, each warp owning 16 keys): the accumulator
// of S^T is, register for register, the A operand of dV += P^T dO and dK += dS^T Q (FA2's forward
// trick for P V), so P and dS never go through shared memory for those two GEMMs; only dS^T is
// stored once, for dQ = dS K, whose reduction runs over the keys of all warps.
//
// Shared-memory tiles are row-major with rows padded by 16 bytes (row stride D + 8 elements): the
// stride in 16-byte units is then odd, so the 8 row addresses of every ldmatrix phase and of every
// 16-byte cp.async hit 8 distinct bank groups, for every supported D (32/64/96/128), without a
// swizzle. Cost: 6% more shared memory at D = 128.
#include "common/types.cuh"
#include "attention/mask.cuh"
#include "attention/online_softmax.cuh"
#include "attention/sm80_bwd_ops.cuh"

using namespace bwd80;
using T = dtype_of<FC_DTYPE>::type;

constexpr int kD = FC_HEAD_DIM;         // compile-time head dim
constexpr int kChunks = kD / 8;         // 16-byte chunks per row
constexpr int kRowStride = kD + 8;      // shared row stride of Q, K, V, dO tiles (elements)
static_assert(kD % 16 == 0, "head dim must be a multiple of 16");

// ---------------------------------------------------------------------------------------------
// Tile verbs shared by the main and dQ kernels.

// Lane address patterns of ldmatrix.x4 (byte offsets from a 16x16 block's top-left corner):
//  - rows_then_cols: matrix j = (rows +8 if j&1, cols +8 if j&2). Used for an A operand stored
//    [m][k] (plain) and a B operand stored [k][n] (.trans: two n-tiles of 8).
//  - cols_then_rows: matrix j = (cols +8 if j&1, rows +8 if j&2). Used for a B operand stored
//    [n][k] (plain: two n-tiles) and an A operand stored [k][m] (.trans).
template <int kStride> __device__ __forceinline__ uint32_t lane_rows_then_cols(int lane) {
  return static_cast<uint32_t>((((lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8) * 2);
}
template <int kStride> __device__ __forceinline__ uint32_t lane_cols_then_rows(int lane) {
  return static_cast<uint32_t>((((lane & 7) + (lane >> 4) * 8) * kStride + ((lane >> 3) & 1) * 8) * 2);
}

// Async copy of a kRows x kD tile (global row stride `ld` elements) to shared memory; rows
// >= rows_valid and columns >= head_dim are zero-filled. A thread copies one column chunk of rows
// r, r + kRowsPerPass, ...: its addresses advance by a constant, so the compiler keeps one pointer
// per tile alive instead of one per chunk.
template <int kRows, int kThreads>
__device__ __forceinline__ void load_tile(uint32_t dst, const T* __restrict__ src, int64_t ld,
                                          int rows_valid, int head_dim, int tid) {
  constexpr int kRowsPerPass = kThreads / kChunks;  // threads past whole rows (D = 96) idle
  static_assert(kRowsPerPass > 0, "fewer threads than chunks in a row");
  if (kThreads % kChunks != 0 && tid >= kRowsPerPass * kChunks) return;
  const int row = tid / kChunks;
  const int col = (tid % kChunks) * 8;
  const T* g = src + row * ld + col;
  const uint32_t s = dst + (row * kRowStride + col) * 2;
  const bool col_ok = col < head_dim;
#pragma unroll
  for (int i = 0; i < (kRows + kRowsPerPass - 1) / kRowsPerPass; ++i) {
    if (kRows % kRowsPerPass == 0 || row + i * kRowsPerPass < kRows) {
      const bool valid = col_ok && row + i * kRowsPerPass < rows_valid;
      cp_async_16(s + i * kRowsPerPass * kRowStride * 2, valid ? g + i * kRowsPerPass * ld : src,
                  valid);
    }
  }
}

// acc[16 x 8*kNTiles] += A[16 x kD] * B^T, A = 16 rows of a [m][k] tile at `a`, B stored [n][k]
// (kNTiles * 8 rows) at `b`: the S = X Y^T GEMM of two row-major tiles, reduced over the head dim.
template <int kNTiles>
__device__ __forceinline__ void gemm_tile_tile(float (&acc)[kNTiles][4], uint32_t a, uint32_t b,
                                               int lane) {
  static_assert(kNTiles % 2 == 0, "n-tiles come in pairs");
  const uint32_t a_lane = a + lane_rows_then_cols<kRowStride>(lane);
  const uint32_t b_lane = b + lane_cols_then_rows<kRowStride>(lane);
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    uint32_t fa[4];
    ldmatrix_x4(fa, a_lane + kk * 32);
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t fb[4];
      ldmatrix_x4(fb, b_lane + np * 16 * kRowStride * 2 + kk * 32);
      mma16816<T>(acc[2 * np], fa, fb[0], fb[1]);
      mma16816<T>(acc[2 * np + 1], fa, fb[2], fb[3]);
    }
  }
}

// acc[16 x kD] += A[16 x 16*kKTiles] * B, A in registers as packed C fragments (a16[n-tile][half]:
// [0] = row g, [1] = row g+8, cols 2t..2t+1 of that n-tile), B stored [k][n] (row-major tile).
template <int kKTiles>
__device__ __forceinline__ void gemm_regs_tile(float (&acc)[kD / 8][4],
                                               const uint32_t (&a16)[2 * kKTiles][2], uint32_t b,
                                               int lane) {
  const uint32_t b_lane = b + lane_rows_then_cols<kRowStride>(lane);
#pragma unroll
  for (int kk = 0; kk < kKTiles; ++kk) {
    const uint32_t fa[4] = {a16[2 * kk][0], a16[2 * kk][1], a16[2 * kk + 1][0], a16[2 * kk + 1][1]};
#pragma unroll
    for (int np = 0; np < kD / 16; ++np) {
      uint32_t fb[4];
      ldmatrix_x4_trans(fb, b_lane + kk * 16 * kRowStride * 2 + np * 32);
      mma16816<T>(acc[2 * np], fa, fb[0], fb[1]);
      mma16816<T>(acc[2 * np + 1], fa, fb[2], fb[3]);
    }
  }
}

template <int kN>
__device__ __forceinline__ void zero(float (&acc)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// Write a warp's 16 x kD accumulator (rows `row0`.. of the tile) as dtype T into a shared tile
// (row stride kRowStride), each value times `scale`.
__device__ __forceinline__ void stage_rows(unsigned char* tile, int row0, const float (&acc)[kD / 8][4],
                                           float scale, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < kD / 8; ++nt) {
    const int col = nt * 8 + 2 * t;
    *reinterpret_cast<uint32_t*>(tile + ((row0 + g) * kRowStride + col) * 2) =
        pack2<T>(acc[nt][0] * scale, acc[nt][1] * scale);
    *reinterpret_cast<uint32_t*>(tile + ((row0 + g + 8) * kRowStride + col) * 2) =
        pack2<T>(acc[nt][2] * scale, acc[nt][3] * scale);
  }
}

// Copy 16 staged rows (tile rows row0.., global rows grow0..) to global memory, 16 bytes a lane.
__device__ __forceinline__ void store_rows(T* __restrict__ dst, int64_t ld, const unsigned char* tile,
                                           int row0, int grow0, int rows_valid, int head_dim, int lane) {
#pragma unroll
  for (int c = lane; c < 16 * kChunks; c += 32) {
    const int r = c / kChunks;
    const int col = (c % kChunks) * 8;
    if (grow0 + r < rows_valid && col < head_dim) {
      *reinterpret_cast<Vec16*>(dst + (grow0 + r) * ld + col) =
          *reinterpret_cast<const Vec16*>(tile + ((row0 + r) * kRowStride + col) * 2);
    }
  }
}

#if FC_PART == 0
// ---------------------------------------------------------------------------------------------
// Preprocess. grid (ceil(seqlen_q_pad / FC_BLOCK_M), nheads, batch), 256 threads (the last block
// stops at seqlen_q_pad when that is no multiple of FC_BLOCK_M: bwd_sm90's 80-row steps).
// Each row of O and dO is read as 16-byte chunks by a group of kLanesPerRow lanes (kChunks rounded
// up to a power of two; lanes past head_dim read nothing) and reduced by shuffles inside the
// group. Every load of the CTA is issued before the first use (registers ov / dv), and the dQ
// accumulator is zeroed while they are in flight: a row per warp at a time (the first version)
// left the kernel latency-bound at ~1/3 of the memory bandwidth.
constexpr int kRows = FC_BLOCK_M;
constexpr int kThreads = 256;
constexpr int kLanesPerRow = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
constexpr int kRowsPerPass = kThreads / kLanesPerRow;
constexpr int kPasses = (kRows + kRowsPerPass - 1) / kRowsPerPass;
static_assert(kRows % 8 == 0, "rows per CTA");
static_assert(kChunks <= 32, "one 16-byte chunk per lane covers at most 256 columns");

extern "C" __global__ void __launch_bounds__(kThreads) FC_KERNEL_NAME(
    const T* __restrict__ out,          // [B, Sq, H, D]
    const T* __restrict__ dout,         // [B, Sq, H, D]
    const float* __restrict__ lse,      // [B, H, Sq] natural log
    float* __restrict__ lse2,           // [B, H, Sq_pad]
    float* __restrict__ delta,          // [B, H, Sq_pad]
    float* __restrict__ dq_accum,       // [B, H, Sq_pad, kD] or null
    int64_t o_sb, int64_t o_ss, int64_t o_sh, int64_t do_sb, int64_t do_ss, int64_t do_sh,
    int64_t lse_sb, int64_t lse_sh, int seqlen_q, int nheads, int head_dim, int seqlen_q_pad) {
  const int tid = threadIdx.x;
  const int sub = tid % kLanesPerRow;  // this lane's chunk of the row
  const int col = sub * 8;
  const int m0 = blockIdx.x * kRows, h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = static_cast<int64_t>(b) * nheads + h;
  uint4 ov[kPasses], dv[kPasses];
  float l[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = p * kRowsPerPass + tid / kLanesPerRow, row = m0 + r;
    ov[p] = dv[p] = make_uint4(0u, 0u, 0u, 0u);
    l[p] = neg_inf();
    if (r < kRows && row < seqlen_q) {
      if (col < head_dim) {
        ov[p] = *reinterpret_cast<const uint4*>(out + b * o_sb + row * o_ss + h * o_sh + col);
        dv[p] = *reinterpret_cast<const uint4*>(dout + b * do_sb + row * do_ss + h * do_sh + col);
      }
      if (sub == 0) l[p] = lse[b * lse_sb + h * lse_sh + row];
    }
  }
  if (dq_accum != nullptr) {
    float4* dst = reinterpret_cast<float4*>(dq_accum + (bh * seqlen_q_pad + m0) * kD);
    const int rows = min(kRows, seqlen_q_pad - m0);
    for (int i = tid; i < rows * kD / 4; i += kThreads) dst[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const uint32_t o4[4] = {ov[p].x, ov[p].y, ov[p].z, ov[p].w};
    const uint32_t d4[4] = {dv[p].x, dv[p].y, dv[p].z, dv[p].w};
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const Float2 o = unpack2<T>(o4[i]), d = unpack2<T>(d4[i]);
      acc += o.lo * d.lo + o.hi * d.hi;
    }
#pragma unroll
    for (int s = kLanesPerRow / 2; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    const int r = p * kRowsPerPass + tid / kLanesPerRow, row = m0 + r;
    if (sub == 0 && r < kRows && row < seqlen_q_pad) {
      // +inf for padding rows and rows with no visible key (lse -inf): P = 0 there, never NaN
      const float l2 = (row < seqlen_q && l[p] != neg_inf()) ? l[p] * kLog2e : pos_inf();
      const int64_t at = bh * seqlen_q_pad + row;
      delta[at] = row < seqlen_q ? acc : 0.f;
      lse2[at] = l2;
    }
  }
}

#elif FC_PART == 1
// ---------------------------------------------------------------------------------------------
// Main kernel. grid (ceil(Sk / kBN), nheads_kv, batch), kThreads threads, FC_SMEM_BYTES dynamic smem.
constexpr int kBM = FC_BLOCK_M;              // query rows per step
constexpr int kBN = FC_BLOCK_N;              // keys per CTA, 16 per warp
constexpr int kWarps = FC_WARPS;
constexpr int kThreads = kWarps * 32;
constexpr bool kWithDQ = FC_WITH_DQ;
constexpr int kDqWarpsM = FC_DQ_WARPS_M;     // warp grid of the dQ GEMM (kBM x kD)
constexpr int kDqWarpsN = kWarps / kDqWarpsM;
constexpr int kDqWM = kBM / kDqWarpsM;
constexpr int kDqWN = kD / kDqWarpsN;
constexpr int kDqPasses = FC_DQ_PASSES;
constexpr int kDqPassN = kDqWN / kDqPasses;
constexpr int kSStride = kBM + 8;            // dS^T tile row stride (elements), same padding rule
constexpr int kDpGroup = FC_DP_GROUP;        // query n-tiles of dP^T computed at a time
constexpr int kMinBlocks = FC_MIN_BLOCKS;    // CTAs per SM the launch bounds ask for
// dQ reductions as 16-byte red.v4 (PTX 8.1, sm_90 only; sm_80 keeps 8-byte red.v2 / atomics).
constexpr bool kRedV4 = FC_DQ_RED_V4 && __CUDA_ARCH__ >= 900;
static_assert(kBN == 16 * kWarps, "each warp owns 16 keys");
static_assert(kBM % 16 == 0 && kBM / 2 <= kThreads, "query block");
static_assert(kDpGroup % 2 == 0 && (kBM / 8) % kDpGroup == 0, "dP^T groups");
static_assert(kDqWarpsM * kDqWarpsN == kWarps && kDqWM % 16 == 0 && kDqPassN % 16 == 0 &&
              kDqPassN * kDqPasses == kDqWN, "dQ warp grid");

constexpr int kTileKV = kBN * kRowStride * 2;  // bytes
constexpr int kTileQ = kBM * kRowStride * 2;
constexpr int kOffK = 0;
constexpr int kOffV = kOffK + kTileKV;
constexpr int kOffQ = kOffV + kTileKV;          // 2 stages
constexpr int kOffDO = kOffQ + 2 * kTileQ;      // 2 stages
constexpr int kOffDS = kOffDO + 2 * kTileQ;
constexpr int kOffLse = kOffDS + (kWithDQ ? kBN * kSStride * 2 : 0);  // 2 stages of kBM floats
constexpr int kOffDelta = kOffLse + 2 * kBM * 4;
constexpr int kSmemBytes = kOffDelta + 2 * kBM * 4;
static_assert(kSmemBytes == FC_SMEM_BYTES, "shared-memory layout disagrees with the Python config");

// P^T from S^T in place: exp2(s * scale_log2 - lse2[query]); with kMasked, 0 where the key is not
// visible to the query. Element (nt, e): key = key0 + g + 8 * (e >> 1), query = m0 + 8 nt + 2t + (e & 1).
template <bool kMasked>
__device__ __forceinline__ void probs_t(float (&s)[kBM / 8][4], const float* lse2, const Mask& mask,
                                        int m0, int key0, float scale_log2, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < kBM / 8; ++nt) {
    const float2 l = *reinterpret_cast<const float2*>(lse2 + nt * 8 + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = fast_exp2(fmaf(s[nt][e], scale_log2, -((e & 1) ? l.y : l.x)));
      if (kMasked && !mask.visible(m0 + nt * 8 + 2 * t + (e & 1), key0 + g + 8 * (e >> 1))) p = 0.f;
      s[nt][e] = p;
    }
  }
}

// dS^T = P^T o (dP^T - delta[query]) for the kDpGroup n-tiles g0.. (dp holds just those), packed
// as the A operand of dK += dS^T Q. With kMasked, a zero P gives a zero dS even where dP is not
// finite (a masked-out V row may hold anything; in an unmasked tile every key is visible, so a
// non-finite value there is the caller's).
template <bool kMasked>
__device__ __forceinline__ void dsoftmax_t(uint32_t (&ds16)[kBM / 8][2], const float (&p)[kBM / 8][4],
                                           const float (&dp)[kDpGroup][4], const float* delta, int g0,
                                           int lane) {
  const int t = lane & 3;
#pragma unroll
  for (int i = 0; i < kDpGroup; ++i) {
    const int nt = g0 + i;
    const float2 d = *reinterpret_cast<const float2*>(delta + nt * 8 + 2 * t);
    float ds[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      ds[e] = p[nt][e] * (dp[i][e] - ((e & 1) ? d.y : d.x));
      if (kMasked && p[nt][e] == 0.f) ds[e] = 0.f;
    }
    ds16[nt][0] = pack2<T>(ds[0], ds[1]);
    ds16[nt][1] = pack2<T>(ds[2], ds[3]);
  }
}

extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocks) FC_KERNEL_NAME(
    const T* __restrict__ q,            // [B, Sq, H, D]
    const T* __restrict__ k,            // [B, Sk, Hkv, D]
    const T* __restrict__ v,            // [B, Sk, Hkv, D]
    const T* __restrict__ dout,         // [B, Sq, H, D]
    const float* __restrict__ lse2,     // [B, H, Sq_pad]
    const float* __restrict__ delta,    // [B, H, Sq_pad]
    float* __restrict__ dq_accum,       // [B, H, Sq_pad, kD] (FC_WITH_DQ) or null
    T* __restrict__ dk,                 // [B, Sk, Hkv, D]
    T* __restrict__ dv,                 // [B, Sk, Hkv, D]
    int64_t q_sb, int64_t q_ss, int64_t q_sh, int64_t k_sb, int64_t k_ss, int64_t k_sh,
    int64_t v_sb, int64_t v_ss, int64_t v_sh, int64_t do_sb, int64_t do_ss, int64_t do_sh,
    int64_t dk_sb, int64_t dk_ss, int64_t dk_sh, int64_t dv_sb, int64_t dv_ss, int64_t dv_sh,
    int seqlen_q, int seqlen_k, int nheads, int nheads_kv, int head_dim, int seqlen_q_pad,
    float scale_log2, float softmax_scale, int window_left, int window_right) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int n0 = blockIdx.x * kBN, h_kv = blockIdx.y, b = blockIdx.z;
  const int group = nheads / nheads_kv;
  const Mask mask{seqlen_q, seqlen_k, window_left, window_right};

  // Query rows that see at least one key of [n0, n_end): key j is seen by rows
  // j - shift - window_right .. j - shift + window_left.
  const int n_end = min(n0 + kBN, seqlen_k);
  const int q_begin = max(0, n0 - mask.shift() - window_right);
  const int q_end = min(seqlen_q, n_end - 1 - mask.shift() + window_left + 1);
  const int m_first = q_begin / kBM;
  const int n_m = q_end > q_begin ? (q_end - 1) / kBM - m_first + 1 : 0;
  const int n_iter = n_m * group;  // (query head of the group, query block) pairs

  const uint32_t s = smem_addr(smem);
  load_tile<kBN, kThreads>(s + kOffK, k + b * k_sb + n0 * k_ss + h_kv * k_sh, k_ss, seqlen_k - n0,
                           head_dim, tid);
  load_tile<kBN, kThreads>(s + kOffV, v + b * v_sb + n0 * v_ss + h_kv * v_sh, v_ss, seqlen_k - n0,
                           head_dim, tid);

  auto load_query_block = [&](int it, int stage) {
    const int h = h_kv * group + it / n_m;
    const int m0 = (m_first + it % n_m) * kBM;
    load_tile<kBM, kThreads>(s + kOffQ + stage * kTileQ, q + b * q_sb + m0 * q_ss + h * q_sh, q_ss,
                             seqlen_q - m0, head_dim, tid);
    load_tile<kBM, kThreads>(s + kOffDO + stage * kTileQ, dout + b * do_sb + m0 * do_ss + h * do_sh,
                             do_ss, seqlen_q - m0, head_dim, tid);
    const int64_t row = (static_cast<int64_t>(b) * nheads + h) * seqlen_q_pad + m0;
    if (tid < kBM / 4) {
      cp_async_16(s + kOffLse + stage * kBM * 4 + tid * 16, lse2 + row + tid * 4, true);
    } else if (tid < kBM / 2) {
      const int c = tid - kBM / 4;
      cp_async_16(s + kOffDelta + stage * kBM * 4 + c * 16, delta + row + c * 4, true);
    }
  };
  if (n_iter > 0) load_query_block(0, 0);
  cp_async_commit();

  float acc_dk[kD / 8][4], acc_dv[kD / 8][4];
  zero(acc_dk);
  zero(acc_dv);
  const int g = lane >> 2, t = lane & 3;
  const int key0 = n0 + 16 * warp;                                   // this warp's first key
  const uint32_t s_k_warp = s + kOffK + 16 * warp * kRowStride * 2;  // this warp's K rows
  const uint32_t s_v_warp = s + kOffV + 16 * warp * kRowStride * 2;

  for (int it = 0; it < n_iter; ++it) {
    const int stage = it & 1;
    cp_async_wait<0>();
    __syncthreads();  // stage `it` landed; every warp is done with step it-1 (its buffers, dS^T)
    if (it + 1 < n_iter) load_query_block(it + 1, stage ^ 1);
    cp_async_commit();

    const int h = h_kv * group + it / n_m;
    const int m0 = (m_first + it % n_m) * kBM;
    const uint32_t s_q = s + kOffQ + stage * kTileQ;
    const uint32_t s_do = s + kOffDO + stage * kTileQ;
    const float* s_lse = reinterpret_cast<const float*>(smem + kOffLse + stage * kBM * 4);
    const float* s_delta = reinterpret_cast<const float*>(smem + kOffDelta + stage * kBM * 4);

    // P^T = exp2(K Q^T * scale_log2 - lse2), masked only on diagonal / ragged tiles.
    const bool masked = mask.tile_needs_mask(m0, kBM, n0, kBN);
    float p[kBM / 8][4];
    zero(p);
    gemm_tile_tile<kBM / 8>(p, s_k_warp, s_q, lane);
    if (masked) {
      probs_t<true>(p, s_lse, mask, m0, key0, scale_log2, lane);
    } else {
      probs_t<false>(p, s_lse, mask, m0, key0, scale_log2, lane);
    }

    // dV += P^T dO
    uint32_t a16[kBM / 8][2];
#pragma unroll
    for (int nt = 0; nt < kBM / 8; ++nt) {
      a16[nt][0] = pack2<T>(p[nt][0], p[nt][1]);
      a16[nt][1] = pack2<T>(p[nt][2], p[nt][3]);
    }
    gemm_regs_tile<kBM / 16>(acc_dv, a16, s_do, lane);

    // dP^T = V dO^T;  dS^T = P^T o (dP^T - delta), in groups of kDpGroup query n-tiles so only
    // one group of dP^T is alive next to P^T, dK and dV (each extra group reloads V's rows).
#pragma unroll
    for (int g0 = 0; g0 < kBM / 8; g0 += kDpGroup) {
      float dp[kDpGroup][4];
      zero(dp);
      gemm_tile_tile<kDpGroup>(dp, s_v_warp, s_do + g0 * 8 * kRowStride * 2, lane);
      if (masked) {
        dsoftmax_t<true>(a16, p, dp, s_delta, g0, lane);
      } else {
        dsoftmax_t<false>(a16, p, dp, s_delta, g0, lane);
      }
    }

    // dK += dS^T Q
    gemm_regs_tile<kBM / 16>(acc_dk, a16, s_q, lane);

    if constexpr (kWithDQ) {
      // dS^T -> shared (row = key, col = query), then dQ_i += dS K_j over all keys of the block.
      unsigned char* s_ds = smem + kOffDS;
#pragma unroll
      for (int nt = 0; nt < kBM / 8; ++nt) {
        const int col = nt * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(s_ds + ((16 * warp + g) * kSStride + col) * 2) = a16[nt][0];
        *reinterpret_cast<uint32_t*>(s_ds + ((16 * warp + g + 8) * kSStride + col) * 2) = a16[nt][1];
      }
      __syncthreads();

      // Each warp: a kDqWM x kDqWN tile of dQ, in kDqPasses column passes (fewer live
      // accumulators next to dK and dV; each extra pass reloads the warp's dS rows).
      const int wm = warp / kDqWarpsN, wn = warp % kDqWarpsN;
      const uint32_t a_lane = s + kOffDS + lane_cols_then_rows<kSStride>(lane) + wm * kDqWM * 2;
      float* dq_rows = dq_accum + ((static_cast<int64_t>(b) * nheads + h) * seqlen_q_pad + m0) * kD;
#pragma unroll
      for (int pass = 0; pass < kDqPasses; ++pass) {
        const int n_first = wn * kDqWN + pass * kDqPassN;  // first dQ column of this pass
        const uint32_t b_lane = s + kOffK + lane_rows_then_cols<kRowStride>(lane) + n_first * 2;
        float acc_dq[kDqWM / 16][kDqPassN / 8][4];
#pragma unroll
        for (int mi = 0; mi < kDqWM / 16; ++mi) zero(acc_dq[mi]);
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) {
          uint32_t fa[kDqWM / 16][4];
#pragma unroll
          for (int mi = 0; mi < kDqWM / 16; ++mi) {
            ldmatrix_x4_trans(fa[mi], a_lane + kk * 16 * kSStride * 2 + mi * 32);
          }
#pragma unroll
          for (int np = 0; np < kDqPassN / 16; ++np) {
            uint32_t fb[4];
            ldmatrix_x4_trans(fb, b_lane + kk * 16 * kRowStride * 2 + np * 32);
#pragma unroll
            for (int mi = 0; mi < kDqWM / 16; ++mi) {
              mma16816<T>(acc_dq[mi][2 * np], fa[mi], fb[0], fb[1]);
              mma16816<T>(acc_dq[mi][2 * np + 1], fa[mi], fb[2], fb[3]);
            }
          }
        }
#pragma unroll
        for (int mi = 0; mi < kDqWM / 16; ++mi) {
          const int row = wm * kDqWM + mi * 16 + g;
#pragma unroll
          for (int ni = 0; ni < kDqPassN / 8; ++ni) {
            const int col = n_first + ni * 8 + 2 * t;
            if constexpr (kRedV4) {
              // Lanes t and t^1 swap halves so each holds 4 consecutive columns of one row: even t
              // row g, columns 2t..2t+3; odd t row g+8, columns 2t-2..2t+1. One 16-byte reduction
              // per lane instead of two 8-byte ones.
              const bool odd = t & 1;
              const float* c = acc_dq[mi][ni];
              const float x = __shfl_xor_sync(0xffffffffu, odd ? c[0] : c[2], 1);
              const float y = __shfl_xor_sync(0xffffffffu, odd ? c[1] : c[3], 1);
              // Selects, not a branch: one warp-wide red.v4 (a branch would issue two half-empty).
              const int r = row + (odd ? 8 : 0);
              if (m0 + r < seqlen_q) {
                red_add_f32x4(dq_rows + r * kD + col - (odd ? 2 : 0), odd ? x : c[0], odd ? y : c[1],
                              odd ? c[2] : x, odd ? c[3] : y);
              }
            } else {
              if (m0 + row < seqlen_q) {
                red_add_f32x2(dq_rows + row * kD + col, acc_dq[mi][ni][0], acc_dq[mi][ni][1]);
              }
              if (m0 + row + 8 < seqlen_q) {
                red_add_f32x2(dq_rows + (row + 8) * kD + col, acc_dq[mi][ni][2], acc_dq[mi][ni][3]);
              }
            }
          }
        }
      }
    }
  }

  // Epilogue: stage dK * softmax_scale and dV through the (now free) K and V tiles, then 16-byte
  // stores. Each warp writes and reads back only its own 16 rows. (The wait matters when the loop
  // ran zero times: the K/V copies may still be in flight.)
  cp_async_wait<0>();
  __syncthreads();
  stage_rows(smem + kOffK, 16 * warp, acc_dk, softmax_scale, lane);
  stage_rows(smem + kOffV, 16 * warp, acc_dv, 1.f, lane);
  __syncwarp();
  store_rows(dk + b * dk_sb + h_kv * dk_sh, dk_ss, smem + kOffK, 16 * warp, key0, seqlen_k, head_dim, lane);
  store_rows(dv + b * dv_sb + h_kv * dv_sh, dv_ss, smem + kOffV, 16 * warp, key0, seqlen_k, head_dim, lane);
}

#elif FC_PART == 2
// ---------------------------------------------------------------------------------------------
// Deterministic dQ. grid (ceil(Sq / kBM), nheads, batch), kThreads threads, FC_SMEM_BYTES smem.
// Each warp owns 16 query rows; S, P, dP and dS stay in registers (row-major C fragments), and
// dS is the register A operand of dQ += dS K.
constexpr int kBM = FC_BLOCK_M;
constexpr int kBN = FC_BLOCK_N;
constexpr int kWarps = FC_WARPS;
constexpr int kThreads = kWarps * 32;
static_assert(kBM == 16 * kWarps, "each warp owns 16 query rows");
static_assert(kBN % 16 == 0, "key block");

constexpr int kTileQ = kBM * kRowStride * 2;
constexpr int kTileKV = kBN * kRowStride * 2;
constexpr int kOffQ = 0;
constexpr int kOffDO = kOffQ + kTileQ;
constexpr int kOffK = kOffDO + kTileQ;   // 2 stages
constexpr int kOffV = kOffK + 2 * kTileKV;  // 2 stages
constexpr int kSmemBytes = kOffV + 2 * kTileKV;
static_assert(kSmemBytes == FC_SMEM_BYTES, "shared-memory layout disagrees with the Python config");

// P from S in place. Element (nt, e): row = row0 + g + 8 * (e >> 1), key = n0 + 8 nt + 2t + (e & 1).
template <bool kMasked>
__device__ __forceinline__ void probs(float (&s)[kBN / 8][4], const float (&l2)[2], const Mask& mask,
                                      int row0, int n0, float scale_log2, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = fast_exp2(fmaf(s[nt][e], scale_log2, -l2[e >> 1]));
      if (kMasked && !mask.visible(row0 + g + 8 * (e >> 1), n0 + nt * 8 + 2 * t + (e & 1))) p = 0.f;
      s[nt][e] = p;
    }
  }
}

extern "C" __global__ void __launch_bounds__(kThreads) FC_KERNEL_NAME(
    const T* __restrict__ q,            // [B, Sq, H, D]
    const T* __restrict__ k,            // [B, Sk, Hkv, D]
    const T* __restrict__ v,            // [B, Sk, Hkv, D]
    const T* __restrict__ dout,         // [B, Sq, H, D]
    const float* __restrict__ lse2,     // [B, H, Sq_pad]
    const float* __restrict__ delta,    // [B, H, Sq_pad]
    T* __restrict__ dq,                 // [B, Sq, H, D]
    int64_t q_sb, int64_t q_ss, int64_t q_sh, int64_t k_sb, int64_t k_ss, int64_t k_sh,
    int64_t v_sb, int64_t v_ss, int64_t v_sh, int64_t do_sb, int64_t do_ss, int64_t do_sh,
    int64_t dq_sb, int64_t dq_ss, int64_t dq_sh,
    int seqlen_q, int seqlen_k, int nheads, int nheads_kv, int head_dim, int seqlen_q_pad,
    float scale_log2, float softmax_scale, int window_left, int window_right) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int m0 = blockIdx.x * kBM, h = blockIdx.y, b = blockIdx.z;
  const int h_kv = h / (nheads / nheads_kv);
  const Mask mask{seqlen_q, seqlen_k, window_left, window_right};

  const int key_begin = mask.key_begin(m0);
  const int key_end = mask.key_end(min(m0 + kBM, seqlen_q));
  const int n_first = key_begin / kBN;
  const int n_iter = key_end > key_begin ? (key_end - 1) / kBN - n_first + 1 : 0;

  const uint32_t s = smem_addr(smem);
  load_tile<kBM, kThreads>(s + kOffQ, q + b * q_sb + m0 * q_ss + h * q_sh, q_ss, seqlen_q - m0,
                           head_dim, tid);
  load_tile<kBM, kThreads>(s + kOffDO, dout + b * do_sb + m0 * do_ss + h * do_sh, do_ss,
                           seqlen_q - m0, head_dim, tid);
  auto load_key_block = [&](int it, int stage) {
    const int n0 = (n_first + it) * kBN;
    load_tile<kBN, kThreads>(s + kOffK + stage * kTileKV, k + b * k_sb + n0 * k_ss + h_kv * k_sh,
                             k_ss, seqlen_k - n0, head_dim, tid);
    load_tile<kBN, kThreads>(s + kOffV + stage * kTileKV, v + b * v_sb + n0 * v_ss + h_kv * v_sh,
                             v_ss, seqlen_k - n0, head_dim, tid);
  };
  if (n_iter > 0) load_key_block(0, 0);
  cp_async_commit();

  const int g = lane >> 2, t = lane & 3;
  const int row0 = m0 + 16 * warp;  // this warp's first query row
  const int64_t stat = (static_cast<int64_t>(b) * nheads + h) * seqlen_q_pad + row0 + g;
  const float l2[2] = {lse2[stat], lse2[stat + 8]};
  const float dl[2] = {delta[stat], delta[stat + 8]};
  const uint32_t s_q_warp = s + kOffQ + 16 * warp * kRowStride * 2;
  const uint32_t s_do_warp = s + kOffDO + 16 * warp * kRowStride * 2;

  float acc_dq[kD / 8][4];
  zero(acc_dq);
  for (int it = 0; it < n_iter; ++it) {
    const int stage = it & 1;
    cp_async_wait<0>();
    __syncthreads();
    if (it + 1 < n_iter) load_key_block(it + 1, stage ^ 1);
    cp_async_commit();
    const int n0 = (n_first + it) * kBN;
    const uint32_t s_k = s + kOffK + stage * kTileKV;
    const uint32_t s_v = s + kOffV + stage * kTileKV;

    float p[kBN / 8][4];
    zero(p);
    gemm_tile_tile<kBN / 8>(p, s_q_warp, s_k, lane);
    const bool masked = mask.tile_needs_mask(m0, kBM, n0, kBN);
    if (masked) {
      probs<true>(p, l2, mask, row0, n0, scale_log2, lane);
    } else {
      probs<false>(p, l2, mask, row0, n0, scale_log2, lane);
    }
    float dp[kBN / 8][4];
    zero(dp);
    gemm_tile_tile<kBN / 8>(dp, s_do_warp, s_v, lane);
    uint32_t a16[kBN / 8][2];
#pragma unroll
    for (int nt = 0; nt < kBN / 8; ++nt) {
      float ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        ds[e] = p[nt][e] * (dp[nt][e] - dl[e >> 1]);
        if (masked && p[nt][e] == 0.f) ds[e] = 0.f;  // as dsoftmax_t: masked-out V may be non-finite
      }
      a16[nt][0] = pack2<T>(ds[0], ds[1]);
      a16[nt][1] = pack2<T>(ds[2], ds[3]);
    }
    gemm_regs_tile<kBN / 16>(acc_dq, a16, s_k, lane);
  }

  // Epilogue through this warp's own Q rows (no other warp reads them). Other threads loaded them:
  // wait for every copy (the loop may have run zero times) before overwriting.
  cp_async_wait<0>();
  __syncthreads();
  stage_rows(smem + kOffQ, 16 * warp, acc_dq, softmax_scale, lane);
  __syncwarp();
  store_rows(dq + b * dq_sb + h * dq_sh, dq_ss, smem + kOffQ, 16 * warp, row0, seqlen_q, head_dim, lane);
}

#elif FC_PART == 3
// ---------------------------------------------------------------------------------------------
// Convert. grid (ceil(Sq / FC_BLOCK_M), nheads, batch), 256 threads: dq = dq_accum * scale.
constexpr int kRows = FC_BLOCK_M;
constexpr int kThreads = 256;
#ifndef FC_DQ_FRAG_M
#define FC_DQ_FRAG_M 0  // 0: dq_accum row-major; else flash_bwd_sm90's FC_DQ_FRAG tiles (below)
#endif
// FC_DQ_FRAG_M = M (flash_bwd_sm90's kBlockM, FLASHCUDA_SM90_BWD_DQ=frag): per (batch, head),
// Sq_pad / M tiles of M x kD floats, each kD M / 4096 blocks of 4096 floats, one per 64 x 64 tile
// c (query tile c % (M / 64), d tile c / (M / 64)), in the registers' order of the sm90 consumer
// that computed it: element (row rr, column cc) of the 64 x 64 tile is register i = 4 (cc / 8) +
// 2 ((rr % 16) / 8) + cc % 2 of thread w = 32 (rr / 16) + 4 (rr % 8) + (cc % 8) / 2, at float
// 512 (i / 4) + 4 w + i % 4 of the block. Returns the float offset of (row, col) in a (b, h) slice.
__device__ __forceinline__ int64_t frag_offset(int row, int col) {
  constexpr int kTilesM = FC_DQ_FRAG_M / 64;
  const int r = row % FC_DQ_FRAG_M, rr = r % 64, cc = col % 64;
  const int c = r / 64 + kTilesM * (col / 64);
  const int w = 32 * (rr / 16) + 4 * (rr % 8) + (cc % 8) / 2;
  const int i = 4 * (cc / 8) + 2 * ((rr % 16) / 8) + cc % 2;
  const int64_t block = static_cast<int64_t>(row / FC_DQ_FRAG_M) * (FC_DQ_FRAG_M * kD / 4096) + c;
  return block * 4096 + 512 * (i / 4) + 4 * w + i % 4;
}

#ifndef FC_DQ_SPANS
#define FC_DQ_SPANS 0
#endif
#ifndef FC_DQ_FRAG_T
#define FC_DQ_FRAG_T 0  // 1: flash_bwd_sm90's FC_DQ_SWAP tiles of kRows queries (below)
#endif
#if FC_DQ_FRAG_T
// FC_DQ_FRAG_T (flash_bwd_sm90's FC_DQ_SWAP: kRows = its kBlockM, 80): per (batch, head),
// Sq_pad / kRows tiles of kRows x kD floats; tile m holds kD / 64 blocks of 64 x kRows floats,
// block c the dQ^T of columns 64 c .. 64 c + 63 in its consumer's registers' order: element
// (d 64 c + 16 w + g + 8 h, query 8 j + 2 t + e) is register 4 j + 2 h + e of thread
// W = 32 w + 4 g + t, at float 512 j + 4 W + 2 h + e of the block. One CTA per tile: float4 i of
// the tile (a warp reads 512 contiguous bytes) is block i / (16 kRows), j = (i % (16 kRows)) / 128,
// W = i % 128: (query, d), (query + 1, d), (query, d + 8), (query + 1, d + 8) with query 8 j + 2 t,
// d 64 c + 16 w + g. Scaled, rounded to T and put into a [kRows][kD] 16-bit tile in shared memory
// whose 16-byte units are swizzled by query % 8 within each 64-column group (as the span reader's
// tile: a warp's 2-byte stores then fall in 16 banks, lanes g, g ^ 1 sharing a word), then rows
// below seqlen_q go out in 16-byte stores.
static_assert(kD % 64 == 0 && kRows % 8 == 0, "64-column blocks of dQ^T, 8-query fragments");
constexpr int kPerThread = kRows * kD / 4 / kThreads;  // float4 per thread (10 at 80 x 128)
static_assert(kRows * kD / 4 % kThreads == 0, "whole float4 per thread");

__device__ __forceinline__ void put_t(uint16_t (*tile)[kD], int q, int d, float x) {
  const int u = d / 8, su = (u & ~7) | ((u ^ q) & 7);
  tile[q][8 * su + d % 8] = static_cast<uint16_t>(pack2<T>(x, 0.f) & 0xffffu);
}

extern "C" __global__ void __launch_bounds__(kThreads) FC_KERNEL_NAME(
    const float* __restrict__ dq_accum,  // [B, H, Sq_pad, kD] in FC_DQ_FRAG_T tiles
    T* __restrict__ dq,                  // [B, Sq, H, D]
    int64_t dq_sb, int64_t dq_ss, int64_t dq_sh,
    int seqlen_q, int nheads, int head_dim, int seqlen_q_pad, float softmax_scale) {
  __shared__ __align__(16) uint16_t tile[kRows][kD];
  const int m0 = blockIdx.x * kRows, h = blockIdx.y, b = blockIdx.z;
  const float4* src = reinterpret_cast<const float4*>(
      dq_accum + ((static_cast<int64_t>(b) * nheads + h) * seqlen_q_pad + m0) * kD);
  // every load in flight before the first store (the loop's loads would otherwise wait on each
  // other's stores: measured 57 us against the span reader's 50 at 16k x 16 heads)
  float4 x[kPerThread];
#pragma unroll
  for (int p = 0; p < kPerThread; ++p)
    x[p] = src[threadIdx.x + p * kThreads];  // (rows past seqlen_q too: zeroed by PRE)
#pragma unroll
  for (int p = 0; p < kPerThread; ++p) {
    const int i = threadIdx.x + p * kThreads;
    const int c = i / (16 * kRows), j = (i % (16 * kRows)) / 128, w = (i % 128) / 32;
    const int g = (i % 32) / 4, t = i % 4;
    const int q = 8 * j + 2 * t, d = 64 * c + 16 * w + g;
    put_t(tile, q, d, x[p].x * softmax_scale);
    put_t(tile, q + 1, d, x[p].y * softmax_scale);
    put_t(tile, q, d + 8, x[p].z * softmax_scale);
    put_t(tile, q + 1, d + 8, x[p].w * softmax_scale);
  }
  __syncthreads();
  for (int c = threadIdx.x; c < kRows * kChunks; c += kThreads) {
    const int r = c / kChunks, k = c % kChunks;
    if (m0 + r < seqlen_q && 8 * k < head_dim) {
      *reinterpret_cast<Vec16*>(dq + b * dq_sb + (m0 + r) * dq_ss + h * dq_sh + 8 * k) =
          *reinterpret_cast<const Vec16*>(&tile[r][8 * ((k & ~7) | ((k ^ r) & 7))]);
    }
  }
}
#elif FC_DQ_FRAG_M && FC_DQ_SPANS
// FC_DQ_SPANS: read each 4096-float block whole, one 64-byte span per thread, and write dq
// through shared memory. Span s (thread s of 256) is the 16 floats at 16 s of the block:
// w = 4 (s % 32), i / 4 = s / 32, so (frag_offset) rows rr = 16 ((s % 32) / 8) + s % 8 and rr + 8,
// columns 8 (s / 32) .. + 7 of the 64 x 64 tile; float 4 u + e of the span is row rr + 8 (e / 2),
// column 8 (s / 32) + 2 u + e % 2. A warp reads 2 KB in a row, every 16-byte load used whole
// (the float2 path above uses 8 of every 16 bytes per load).
static_assert(kRows % 64 == 0 && kD % 64 == 0 && FC_DQ_FRAG_M % 64 == 0, "64 x 64 frag tiles");
static_assert(kThreads == 256, "one span of 16 floats per thread covers a 4096-float block");

extern "C" __global__ void __launch_bounds__(kThreads) FC_KERNEL_NAME(
    const float* __restrict__ dq_accum,  // [B, H, Sq_pad, kD] in FC_DQ_FRAG blocks
    T* __restrict__ dq,                  // [B, Sq, H, D]
    int64_t dq_sb, int64_t dq_ss, int64_t dq_sh,
    int seqlen_q, int nheads, int head_dim, int seqlen_q_pad, float softmax_scale) {
  // The CTA's kRows x kD of dq in 16-byte chunks, chunk k of a row stored at k ^ (row % 8) within
  // its 64-column group: the staging writes (32 rows, one chunk) and the row reads are both
  // free of bank conflicts.
  __shared__ __align__(16) Vec16 tile[kRows][kChunks];
  const int m0 = blockIdx.x * kRows, h = blockIdx.y, b = blockIdx.z;
  const float* slice = dq_accum + (static_cast<int64_t>(b) * nheads + h) * seqlen_q_pad * kD;
  const int s = threadIdx.x, rr = 16 * ((s % 32) / 8) + s % 8, chunk = s / 32;
#pragma unroll
  for (int tr = 0; tr < kRows / 64; ++tr) {
#pragma unroll
    for (int tc = 0; tc < kD / 64; ++tc) {
      // (rows past seqlen_q are read too: dq_accum is seqlen_q_pad long, zeroed by PRE)
      const float4* span = reinterpret_cast<const float4*>(
          slice + frag_offset(m0 + 64 * tr, 64 * tc) + 16 * s);
      float4 x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) x[u] = span[u];
      Vec16 lo, hi;  // rows rr and rr + 8: (x[u].x, x[u].y) and (x[u].z, x[u].w) are columns 2u, 2u+1
      lo.x = pack2<T>(x[0].x * softmax_scale, x[0].y * softmax_scale);
      lo.y = pack2<T>(x[1].x * softmax_scale, x[1].y * softmax_scale);
      lo.z = pack2<T>(x[2].x * softmax_scale, x[2].y * softmax_scale);
      lo.w = pack2<T>(x[3].x * softmax_scale, x[3].y * softmax_scale);
      hi.x = pack2<T>(x[0].z * softmax_scale, x[0].w * softmax_scale);
      hi.y = pack2<T>(x[1].z * softmax_scale, x[1].w * softmax_scale);
      hi.z = pack2<T>(x[2].z * softmax_scale, x[2].w * softmax_scale);
      hi.w = pack2<T>(x[3].z * softmax_scale, x[3].w * softmax_scale);
      const int r = 64 * tr + rr, k = 8 * tc + (chunk ^ (rr % 8));  // (r + 8) % 8 == rr % 8
      tile[r][k] = lo;
      tile[r + 8][k] = hi;
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < kRows * kChunks; c += kThreads) {
    const int r = c / kChunks, k = c % kChunks;
    if (m0 + r < seqlen_q && 8 * k < head_dim) {
      *reinterpret_cast<Vec16*>(dq + b * dq_sb + (m0 + r) * dq_ss + h * dq_sh + 8 * k) =
          tile[r][(k & ~7) | ((k ^ r) & 7)];
    }
  }
}
#else
extern "C" __global__ void __launch_bounds__(kThreads) FC_KERNEL_NAME(
    const float* __restrict__ dq_accum,  // [B, H, Sq_pad, kD]
    T* __restrict__ dq,                  // [B, Sq, H, D]
    int64_t dq_sb, int64_t dq_ss, int64_t dq_sh,
    int seqlen_q, int nheads, int head_dim, int seqlen_q_pad, float softmax_scale) {
  const int m0 = blockIdx.x * kRows, h = blockIdx.y, b = blockIdx.z;
#if FC_DQ_FRAG_M
  const float* slice = dq_accum + (static_cast<int64_t>(b) * nheads + h) * seqlen_q_pad * kD;
#else
  const float* src = dq_accum + ((static_cast<int64_t>(b) * nheads + h) * seqlen_q_pad + m0) * kD;
#endif
  for (int c = threadIdx.x; c < kRows * kChunks; c += kThreads) {
    const int r = c / kChunks;
    const int col = (c % kChunks) * 8;
    if (m0 + r < seqlen_q && col < head_dim) {
#if FC_DQ_FRAG_M
      // columns col + 2u, + 1 (u = 0..3) are one float2 of threads w .. w + 3: 4 floats apart
      const float* p = slice + frag_offset(m0 + r, col);
      const float2 x0 = *reinterpret_cast<const float2*>(p);
      const float2 x1 = *reinterpret_cast<const float2*>(p + 4);
      const float2 y0 = *reinterpret_cast<const float2*>(p + 8);
      const float2 y1 = *reinterpret_cast<const float2*>(p + 12);
      const float4 x = make_float4(x0.x, x0.y, x1.x, x1.y);
      const float4 y = make_float4(y0.x, y0.y, y1.x, y1.y);
#else
      const float4 x = *reinterpret_cast<const float4*>(src + r * kD + col);
      const float4 y = *reinterpret_cast<const float4*>(src + r * kD + col + 4);
#endif
      Vec16 o;
      o.x = pack2<T>(x.x * softmax_scale, x.y * softmax_scale);
      o.y = pack2<T>(x.z * softmax_scale, x.w * softmax_scale);
      o.z = pack2<T>(y.x * softmax_scale, y.y * softmax_scale);
      o.w = pack2<T>(y.z * softmax_scale, y.w * softmax_scale);
      *reinterpret_cast<Vec16*>(dq + b * dq_sb + (m0 + r) * dq_ss + h * dq_sh + col) = o;
    }
  }
}
#endif  // FC_DQ_SPANS
#endif
