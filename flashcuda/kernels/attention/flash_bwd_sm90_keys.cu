// Flash attention backward for head dim 192 on sm90a, fp16 / bf16, S / dP split by keys between
// two consumer warpgroups and dV / dK split by role (dV in warpgroup 0, dK in warpgroup 1): the
// main kernel (MAIN) between bwd_sm80's PRE and CONVERT, as flash_bwd_sm90_wide.cu, whose d192
// shape it replaces.
//
// Status: proven on the H200 (tests/gpu/test_bwd_sm90_wide.py, float64 oracle; 850 run / 0 failed
// at ca2a337 with the key split below as the d192 default, 853 passed at 1a27a88 and 510 (d192)
// at afddf15 with the role split; memcheck / synccheck 0 errors, racecheck only the analysed
// lse2 / delta report at afddf15, docs/GUARANTEES.md §1); the d192 default of family
// bwd_sm90_wide (FLASHCUDA_SM90_BWD_WIDE_SPLIT=keys | dims): the key split +5 to +14% over the
// head-dim split (session 30), the role split a further +4 to +10% (session 31,
// docs/perf-notes.md).
//
// Why: flash_bwd_sm90_wide.cu's d192 shape (three warpgroups, dK^T / dV^T split by head-dim rows)
// makes every warpgroup's key gradients read the P / dS of all three, so one barrier of all
// three stands before every step's dV^T / dK^T (36% of the stall samples at its d256 sibling).
// Here S / dP are split by keys (48 each; FlashAttention 4's d192 Hopper shape) and one
// warpgroup keeps each key gradient, over all 96 keys:
//     dV^T += dO^T P  (warpgroup 0),  dK^T += Q^T dS  (warpgroup 1)   (M = 192: three m64 tiles)
// so dV^T waits only for P (warpgroup 1 arrives, never waits), dK^T stands behind the dS barrier
// that dQ needs anyway, and each step reads dO^T / Q^T once as an A operand: the step is bound
// by the shared-memory pipe (session 30's ncu), and this cuts its operand reads by ~12%
// against session 30's key split, FlashAttention 4's (each warpgroup keeping dV^T_w / dK^T_w
// over all head-dim rows and only its own 48 keys, dO^T and Q^T then read by both; +4 to +10%,
// session 31). dQ is split by head-dim columns:
//     dQ_w = dS K[:, 96 w .. 96 w + 95]           (M = 64 queries, N = 96, K = 96 keys)
// and there are two warpgroups of 240 registers.
//
// Slices that start inside a 128-byte swizzle atom: warpgroup 1's 48 keys of P / dS start at key
// 48 of a 64-key atom, and its 96 dQ columns at column 96 of K (mid-atom of a 64-column chunk).
// An MN-major wgmma operand cannot start there, so those two tiles take narrower swizzles whose
// atoms divide the slices (FlashAttention 4 chooses swizzles the same way):
//     K       [key][d] in 6 chunks of 32 columns, 64-byte swizzle (TMA box 32 x 96)
//     P, dS   [query][key] in 6 chunks of 16 keys, 32-byte swizzle (stored by the consumers)
// Q, dO and V keep 128-byte swizzled 64-column chunks (their slices start on chunk boundaries).
//
// Feature matrix
//   dtypes        fp16, bf16 in and out; fp32 accumulation; fp32 dQ accumulator (bulk
//                 reduce-adds: not deterministic)
//   head dims     192 only (64 queries x 96 keys per step, two consumers)
//   masking       mask.cuh's band (causal, sliding window, none); ragged seqlen_q / seqlen_k
//   heads         MHA, GQA, MQA: the CTA loops over the query heads of its KV head
//   arch          sm_90a only (wgmma, setmaxnreg)
//   removed       (session 39; each measured on the H200 as a loss or noise, docs/perf-notes.md
//                 sessions 31 and 33) session 30's key split of dV^T / dK^T, 48 keys per
//                 warpgroup (FC_KV_ROLES=0), and P / dS by 32-bit shared stores
//                 (FC_PDS_STMATRIX=0)
//
// One CTA per (key block of 96 keys, KV head, batch); it loops over the (query head, query block
// of 64 rows) pairs that see the key block (mask.cuh's KeyBlockSteps). Warpgroups:
//   0     producer (setmaxnreg.dec): one elected thread issues the TMA loads: K and V once
//         (kv_full); per step Q with its lse2 / delta rows into a two-deep ring (q_full[s],
//         q_empty[s]) and dO into a single buffer (do_full, do_empty): shared memory has no room
//         for a second dO beside the dQ staging (FlashAttention 4 keeps one dO stage too).
//   1, 2  consumers w = 0, 1 (setmaxnreg.inc).
// Per step (query block m0, Q stage s), consumer w (consume_roles):
//     wait q_full[s] | issue S_w = Q K_w^T | wait do_full | issue dP_w = dO V_w^T |
//     wait S: P = exp2(S scale_log2 - lse2) (0 where masked) -> 16-bit -> its keys of the P tile
//     (w = 1: after warpgroup 0's previous dV^T) |
//       w = 0: barrier of both's P | issue dV^T | wait dP
//       w = 1: arrive on the P barrier | wait dP: release dO |
//     dS = P o (dP - delta) (0 where masked) (w = 0: release Q stage s) | (the other warpgroup's
//     previous readers of dS are done) -> its keys of the dS tile | barrier of both | issue dQ_w |
//       w = 0: wait dV^T: release dO, tell warpgroup 1 | wait dQ: tell warpgroup 1, stage dQ,
//              one bulk reduce-add into dq_accum
//       w = 1: issue dK^T | wait dQ: stage dQ, one bulk reduce-add | wait dK^T: tell warpgroup
//              0, release Q stage s.
// Epilogue: a barrier of both, then each stores its key gradient (dK^T * softmax_scale, dV^T)
// transposed into padded [key][d] staging rows over the (idle) Q / dO / P / dS region, a barrier,
// and all consumer threads copy the rows inside seqlen_k to dk / dv in 16-byte pieces.
//
// Shared memory (each region 1024-byte aligned):
//     K       [96][192]      6 chunks x 96 rows x 64 B (64B swizzle)         36 KB
//     V       [96][192]      3 chunks x 96 rows x 128 B (128B swizzle)       36 KB
//     Q       2 x [64][192]  3 chunks x 64 rows x 128 B each                 48 KB
//     dO      [64][192]      3 chunks x 64 rows x 128 B                      24 KB
//     P, dS   [64][96]       6 chunks x 64 rows x 32 B each (32B swizzle)    24 KB
//     dQ      2 x 64 x 96 fp32 staging, one per consumer (register order)    48 KB
//     lse2, delta  2 x 2 x [64] fp32; mbarriers                              1 KB
// 217 KB + 1 KB alignment slack.
//
// Out-of-range rows as flash_bwd_sm90_wide.cu: TMA zero-fills rows past seqlen_q / seqlen_k; a
// query row past seqlen_q (inside Sq_pad) has lse2 = +inf (P = 0); keys past seqlen_k are masked;
// a masked P and its dS are 0 whatever dP holds.
#include "common/types.cuh"
#include "common/sm90.cuh"
#include "common/smem.cuh"
#include "attention/mask.cuh"
#include "attention/online_softmax.cuh"
#include "attention/sm90_bwd_wide.cuh"

using T = typename dtype_of<FC_DTYPE>::type;
constexpr int kHeadDim = 192;
constexpr int kBlockM = 64;   // query rows per step
constexpr int kBlockN = 96;   // keys per CTA
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kConsumerWarps = 4 * kConsumers;
constexpr int kProducerRegs = FC_PRODUCER_REGS;
constexpr int kConsumerRegs = FC_CONSUMER_REGS;

constexpr int kKeys = kBlockN / kConsumers;    // 48: keys of S / dP per warpgroup
constexpr int kDCols = kHeadDim / kConsumers;  // 96: dQ columns per warpgroup
constexpr int kDTiles = kHeadDim / 64;         // 3: m64 tiles of dK^T / dV^T's head-dim rows

constexpr int kQChunkBytes = kBlockM * 128;          // Q, dO: 64 columns x 64 rows
constexpr int kQBytes = kDTiles * kQChunkBytes;      // 24 KB
constexpr int kVChunkBytes = kBlockN * 128;          // V: 64 columns x 96 rows
constexpr int kKChunkBytes = kBlockN * 64;           // K: 32 columns x 96 rows
constexpr int kKVBytes = kBlockN * kHeadDim * 2;     // 36 KB each
constexpr int kPChunkBytes = kBlockM * 32;           // P, dS: 16 keys x 64 rows
constexpr int kPBytes = kBlockN / 16 * kPChunkBytes;  // 12 KB
constexpr int kDqBytes = kBlockM * kDCols * 4;       // 24 KB per consumer
constexpr int kStatBytes = kBlockM * 4;

constexpr int kSmemK = 0;
constexpr int kSmemV = kSmemK + kKVBytes;
constexpr int kSmemQ = kSmemV + kKVBytes;
constexpr int kSmemDO = kSmemQ + 2 * kQBytes;
constexpr int kSmemP = kSmemDO + kQBytes;
constexpr int kSmemDS = kSmemP + kPBytes;
constexpr int kSmemDQ = kSmemDS + kPBytes;
constexpr int kSmemStats = kSmemDQ + kConsumers * kDqBytes;
constexpr int kSmemBar = kSmemStats + 2 * 2 * kStatBytes;
constexpr int kBarriers = 7;  // kv_full, q_full[2], q_empty[2], do_full, do_empty
constexpr int kSmemBytes = 1024 + kSmemBar + 8 * kBarriers;

// Epilogue staging of dK (then dV) as [key][kHeadDim + 8] 16-bit rows over Q .. dS: the
// transposed 16-bit stores of a warp then hit distinct banks (row stride = 4 banks mod 32).
constexpr int kStageStride = kHeadDim + 8;
constexpr int kStageBytes = kBlockN * kStageStride * 2;

// Named barriers (0 is __syncthreads): 1 both consumers' dS stored; 2 the epilogue's; 3 + w
// consumer w's own threads; 5 + w "the other consumer's readers of this step's dS are done" (an
// arrive by the other, a sync by w before it stores the next step's dS); 7 (P), 8 (P read), 9
// (with 1: both dS halves stored) and 10, 11 (the epilogue's meeting), see consume_roles.
constexpr int kBarBoth = 1, kBarEpilogue = 2, kBarOwn = 3, kBarDsRead = 5;

static_assert(FC_DTYPE == 1 || FC_DTYPE == 2, "sm90 kernel: fp16 or bf16");
static_assert(kKeys % 16 == 0 && kDCols % 32 == 0, "slices on the narrow swizzles' atoms");
static_assert(2 * kStageBytes <= kSmemDQ - kSmemQ, "dK / dV staging inside Q .. dS");
static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= register_pool(kThreads),
              "register split over the CTA's pool at launch (register_pool, sm90.cuh)");
static_assert(kSmemBytes == FC_SMEM_BYTES, "smem layout disagrees with the host's smem_bytes");

struct Smem {
  uint32_t base;  // 1024-byte aligned
  uint8_t* ptr;   // the same, as a generic pointer

  __device__ __forceinline__ uint32_t k() const { return base + kSmemK; }
  __device__ __forceinline__ uint32_t v() const { return base + kSmemV; }
  __device__ __forceinline__ uint32_t q(int s) const { return base + kSmemQ + s * kQBytes; }
  __device__ __forceinline__ uint32_t dout() const { return base + kSmemDO; }
  __device__ __forceinline__ uint32_t p() const { return base + kSmemP; }
  __device__ __forceinline__ uint32_t ds() const { return base + kSmemDS; }
  __device__ __forceinline__ uint32_t dq(int w) const { return base + kSmemDQ + w * kDqBytes; }
  __device__ __forceinline__ uint32_t lse2(int s) const {
    return base + kSmemStats + s * 2 * kStatBytes;
  }
  __device__ __forceinline__ uint32_t delta(int s) const { return lse2(s) + kStatBytes; }
  __device__ __forceinline__ const float* lse2_ptr(int s) const {
    return reinterpret_cast<const float*>(ptr + kSmemStats + s * 2 * kStatBytes);
  }
  __device__ __forceinline__ const float* delta_ptr(int s) const { return lse2_ptr(s) + kBlockM; }
  __device__ __forceinline__ uint32_t bar(int i) const { return base + kSmemBar + 8 * i; }
  __device__ __forceinline__ uint32_t kv_full() const { return bar(0); }
  __device__ __forceinline__ uint32_t q_full(int s) const { return bar(1 + s); }
  __device__ __forceinline__ uint32_t q_empty(int s) const { return bar(3 + s); }
  __device__ __forceinline__ uint32_t do_full() const { return bar(5); }
  __device__ __forceinline__ uint32_t do_empty() const { return bar(6); }

  __device__ __forceinline__ void init_barriers() const {
    mbar_init(kv_full(), 1);
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      mbar_init(q_full(s), 1);
      mbar_init(q_empty(s), kConsumerWarps);
    }
    mbar_init(do_full(), 1);
    mbar_init(do_empty(), kConsumerWarps);
    fence_barrier_init();
  }
};

using Steps = KeyBlockSteps<kBlockM, kBlockN>;  // (mask.cuh)

// Step it's Q stage and the parities of its waits (the Q ring is two deep, dO one).
__device__ __forceinline__ int q_stage(int it) { return it & 1; }
__device__ __forceinline__ uint32_t q_parity(int it) { return (it >> 1) & 1; }
__device__ __forceinline__ uint32_t do_parity(int it) { return it & 1; }

// The (query head, query block) pairs of a CTA's steps in order: the group's heads outer, the
// query blocks from m_first inner. take() gives the current step's head and first query row and
// moves to the next.
struct StepCursor {
  int g = 0, mi = 0;  // the step's query head in the group, its query block - m_first
  __device__ __forceinline__ void take(const Steps& steps, int head_kv, int& h, int& m0) {
    h = head_kv * steps.group + g;
    m0 = (steps.m_first + mi) * kBlockM;
    if (++mi == steps.n_m) {
      mi = 0;
      ++g;
    }
  }
};

// ---- producer: one thread issues every TMA load --------------------------------------------------
__device__ __forceinline__ void produce(const Smem& sm, const Steps& steps, int n0, int head_kv,
                                        int batch, const TmaMap& map_q, const TmaMap& map_k,
                                        const TmaMap& map_v, const TmaMap& map_do,
                                        const float* lse2, const float* delta, int nheads,
                                        int seqlen_q_pad) {
  mbar_arrive_expect_tx(sm.kv_full(), 2 * kKVBytes);
#pragma unroll
  for (int c = 0; c < kHeadDim / 32; ++c)  // K: 32-column boxes, 64-byte swizzle
    tma_load_4d(sm.k() + c * kKChunkBytes, map_k, sm.kv_full(), 32 * c, n0, head_kv, batch);
#pragma unroll
  for (int c = 0; c < kDTiles; ++c)
    tma_load_4d(sm.v() + c * kVChunkBytes, map_v, sm.kv_full(), 64 * c, n0, head_kv, batch);
  StepCursor cursor;
  for (int it = 0; it < steps.count(); ++it) {
    const int s = q_stage(it);
    int h, m0;
    cursor.take(steps, head_kv, h, m0);
    mbar_wait_producer(sm.q_empty(s), q_parity(it) ^ 1);  // first pass: stages start empty
    mbar_arrive_expect_tx(sm.q_full(s), kQBytes + 2 * kStatBytes);
    const int64_t row = (static_cast<int64_t>(batch) * nheads + h) * seqlen_q_pad + m0;
    bulk_load(sm.lse2(s), lse2 + row, kStatBytes, sm.q_full(s));
    bulk_load(sm.delta(s), delta + row, kStatBytes, sm.q_full(s));
#pragma unroll
    for (int c = 0; c < kDTiles; ++c)
      tma_load_4d(sm.q(s) + c * kQChunkBytes, map_q, sm.q_full(s), 64 * c, m0, h, batch);
    mbar_wait_producer(sm.do_empty(), do_parity(it) ^ 1);
    mbar_arrive_expect_tx(sm.do_full(), kQBytes);
#pragma unroll
    for (int c = 0; c < kDTiles; ++c)
      tma_load_4d(sm.dout() + c * kQChunkBytes, map_do, sm.do_full(), 64 * c, m0, h, batch);
  }
}

// 32B-swizzled [row][16 16-bit] chunk (Swizzle<1,4,3>: the 16-byte half XOR row bit 2): byte
// offset of the 4-byte word holding columns col, col + 1 (col even, < 16) of `row`.
__device__ __forceinline__ uint32_t swizzled32_word(int row, int col) {
  return row * 32 + ((((col >> 3) ^ ((row >> 2) & 1)) << 4) | ((col & 7) << 1));
}

// A consumer warpgroup's per-step tiles and the GEMMs that make them.
struct StepTiles {
  float s[kKeys / 2];    // S, then P (fp32): 64 queries x 48 keys
  float dp[kKeys / 2];   // dP, then dS
  float dq[kDCols / 2];  // dQ: 64 queries x 96 columns

  // S_w = Q K_w^T (one commit group): A = the Q stage (128B chunks of 64 columns; step kk: 32
  // bytes at column (kk % 4) 16 of chunk kk / 4), B = this warpgroup's 48 K rows (64B chunks of
  // 32 columns, 8 rows = 512 bytes; step kk: 32 bytes at column (kk % 2) 16 of chunk kk / 2).
  __device__ __forceinline__ void issue_scores(uint32_t q, uint32_t k_rows) {
    const uint64_t a0 = smem_desc_k_major_sw128(q);
    const uint64_t b0 = smem_desc(k_rows, 16, 512, kSwizzle64B);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint64_t a = desc_advance(a0, (kk / 4) * kQChunkBytes + (kk % 4) * 32);
      const uint64_t b = desc_advance(b0, (kk / 2) * kKChunkBytes + (kk % 2) * 32);
      wgmma_ss<kKeys, T>(s, a, b, kk > 0);
    }
    wgmma_commit();
  }

  // A step's first GEMMs: S_w once Q stage q_stage(it) has arrived, then dP_w once dO has (two
  // commit groups).
  __device__ __forceinline__ void issue_scores_dp(const Smem& sm, int it, uint32_t k_rows,
                                                  uint32_t v_rows, uint32_t dout) {
    mbar_wait(sm.q_full(q_stage(it)), q_parity(it));
    wgmma_fresh(s);
    wgmma_fresh(dp);
    wgmma_fence();
    issue_scores(sm.q(q_stage(it)), k_rows);
    mbar_wait(sm.do_full(), do_parity(it));
    issue_dp(dout, v_rows);
  }

  // dP_w = dO V_w^T (one commit group): both 128B chunks of 64 columns, as issue_scores' A.
  __device__ __forceinline__ void issue_dp(uint32_t dout, uint32_t v_rows) {
    const uint64_t a0 = smem_desc_k_major_sw128(dout), b0 = smem_desc_k_major_sw128(v_rows);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t within = (kk % 4) * 32;
      const uint64_t a = desc_advance(a0, (kk / 4) * kQChunkBytes + within);
      const uint64_t b = desc_advance(b0, (kk / 4) * kVChunkBytes + within);
      wgmma_ss<kKeys, T>(dp, a, b, kk > 0);
    }
    wgmma_commit();
  }

  // dq = dS K[:, 96 w ..] (one commit group): A = dS [query][key] read K-major (32B chunks of 16
  // keys: step kk is chunk kk; 8 rows at SBO = 256), B = K [key][d] read MN-major from chunk 3w
  // (64B chunks of 32 columns: the next 32 at LBO = a chunk; 8 keys at SBO = 512; step kk: key
  // rows 16 kk .., 1024 bytes further).
  __device__ __forceinline__ void issue_dq(uint32_t ds, uint32_t k_cols) {
    const uint64_t a0 = smem_desc(ds, 16, 256, kSwizzle32B);
    const uint64_t b0 = smem_desc(k_cols, kKChunkBytes, 512, kSwizzle64B);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      wgmma_ss_tb<kDCols, T>(dq, desc_advance(a0, kk * kPChunkBytes), desc_advance(b0, kk * 1024),
                             kk > 0);
    }
    wgmma_commit();
  }

  // acc[i] += X^T Z for the three head-dim tiles i (no commit): X = the Q stage or dO
  // ([query][d]; tile i = chunk i, read MN-major, step kk: queries 16 kk .. at 2048 bytes
  // further), Z = N keys of the P or dS tile from `z_keys` on ([query][key], 32B chunks of 16
  // keys read MN-major: the next 16 keys at LBO = a chunk, 8 queries at SBO = 256 bytes; step kk:
  // 512 bytes further).
  template <int N>
  __device__ __forceinline__ static void issue_key_grad(float (&acc)[kDTiles][N / 2], uint32_t x,
                                                        uint32_t z_keys) {
    const uint64_t b0 = smem_desc(z_keys, kPChunkBytes, 256, kSwizzle32B);
#pragma unroll
    for (int i = 0; i < kDTiles; ++i) {
      const uint64_t a0 = smem_desc_mn_major_sw128(x + i * kQChunkBytes, kQChunkBytes);
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        wgmma_ss_tt<N, T>(acc[i], desc_advance(a0, kk * 2048), desc_advance(b0, kk * 512), 1);
      }
    }
  }

  // P (wide_bwd::probs), then stored (16-bit) into the P tile at this warpgroup's keys; `row` =
  // this lane's first query row in the block (16 warp + g), `key0` = its first key column in the
  // block (48 w + 2t), `at` its store_tile offset.
  template <bool kMasked>
  __device__ __forceinline__ void probs(const float* lse2, float scale_log2, const Mask& mask,
                                        int m0, int n0, int row, int key0, uint32_t p_tile,
                                        uint32_t at) {
    wide_bwd::probs<kMasked, kKeys>(s, lse2, scale_log2, mask, m0, n0, row, key0);
    store_tile(p_tile, s, at);
  }

  // A m64n48 accumulator (16-bit) into this warpgroup's keys of a [query][key] tile of 32B
  // chunks (lane (g, t) holds rows row, row + 8 and keys 48 w + 8 j + 2t, + 1) by stmatrix.x4,
  // FA4's way: store k takes key groups 2k, 2k + 1 (8 keys each) of the warp's 16 rows as four
  // 8 x 8 matrices — (2k, rows 0-7), (2k, 8-15), (2k + 1, 0-7), (2k + 1, 8-15) — whose registers
  // are exactly the accumulator's pairs c[8k ..]; lane l gives the row address of matrix l / 8,
  // row l % 8: `at` (lane_offset) + k chunks. Three per tile and warp, where 32-bit stores took 24
  // (session 32: ncu counted our shared stores at twice FA4's): +0.7 / +1.6% at 2k / 4k without
  // a mask, causal +-0.3% (session 33's same-process A/B).
  __device__ __forceinline__ static void store_tile(uint32_t tile, const float (&c)[kKeys / 2],
                                                    uint32_t at) {
#pragma unroll
    for (int k = 0; k < kKeys / 16; ++k) {
      stmatrix_x4(tile + at + k * kPChunkBytes, pack2<T>(c[8 * k], c[8 * k + 1]),
                  pack2<T>(c[8 * k + 2], c[8 * k + 3]), pack2<T>(c[8 * k + 4], c[8 * k + 5]),
                  pack2<T>(c[8 * k + 6], c[8 * k + 7]));
    }
  }
  // store_tile's offset `at` for lane l = 4 (row % 8) + t of consumer w: row l % 8 (+ 8 for odd
  // matrices l / 8) of the warp's 16 and the 16-byte half (l / 8) / 2 of chunk 3w (+ k chunks per
  // store). (An out-parameter: returned by value, NVRTC 13.0 scheduled the kernel without
  // FC_LPT_TAIL differently, same instruction count; session 39 kept the SASS.)
  __device__ __forceinline__ static void lane_offset(uint32_t& at, int w, int row, int t) {
    const int lane = 4 * (row & 7) + t, f = lane >> 3;
    at = (kKeys / 16) * w * kPChunkBytes +
         swizzled32_word((row & ~15) + (lane & 7) + 8 * (f & 1), 8 * (f >> 1));
  }

  // This warpgroup's 64 x 96 dQ tile in its registers' order into its staging buffer: dq[4 j ..
  // + 3] of thread tw at float 512 j + 4 tw (a warp's 32 float4 are 512 contiguous bytes: no bank
  // conflicts). In dq_accum's 64-row block of the step this is floats [6144 w, 6144 (w + 1)):
  // CONVERT's FC_DQ_FRAG_M order puts column c's 8-column group at 512 (c / 8), and this
  // warpgroup's group j is column 96 w + 8 j.
  __device__ __forceinline__ void stage_dq(uint32_t buf, int tw) const {
#pragma unroll
    for (int j = 0; j < kDCols / 8; ++j) {
      const float* x = &dq[4 * j];
      store_shared_16(buf + 4 * (512 * j + 4 * tw),
                      {__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]),
                       __float_as_uint(x[3])});
    }
  }

  // The step's dQ (waited for) into warpgroup w's staging buffer, then one bulk reduce-add into
  // floats [6144 w, + 6144) of dq_accum's 64-row block of the step (query block m0 of head bh).
  __device__ __forceinline__ void reduce_dq(const Smem& sm, int w, int tw, float* dq_accum,
                                            int64_t bh, int seqlen_q_pad, int m0) const {
    stage_dq(sm.dq(w), tw);
    fence_proxy_async();  // the generic stores before the bulk reduction's read
    named_barrier_sync(kBarOwn + w, 128);
    if (tw == 0) {
      float* dst = dq_accum + (bh * seqlen_q_pad + m0) * kHeadDim + (kBlockM * kDCols) * w;
      bulk_reduce_add_f32(dst, sm.dq(w), kDqBytes);
      bulk_commit_group();
    }
  }
};

// ---- the consumers: dV^T in warpgroup 0, dK^T in warpgroup 1 ------------------------------------
// Session 30's layout (dV^T_w / dK^T_w split by keys) made each warpgroup's key gradients read all
// of dO^T / Q^T as their A operands (3 x 8 KB each per step, twice over the two warpgroups) for
// an N of 48 keys. Here warpgroup 0 keeps dV^T and warpgroup 1 dK^T, each over all 96 keys
// (m64n96, the same 144 accumulator registers): A is read once per step, and the
// per-step operand reads of the key gradients fall from 2 x 84 KB to 2 x 60 KB (the step is
// bound by the shared-memory pipe: docs/perf-notes.md, session 30's ncu; +4 to +10%, session 31).
// S / dP stay split by keys and dQ by columns; the hand-offs become
//   P:  dV^T (warpgroup 0) reads both halves: warpgroup 1 arrives on kBarP once its P_1 is
//       stored, and waits on kBarPRead (warpgroup 0's previous dV^T is done) before storing it;
//   dS: dK^T (warpgroup 1) and both dQs read both halves: kBarBoth (the meeting below); before
//       storing dS_0, warpgroup 0 waits for warpgroup 1's previous dQ_1 and dK^T (kBarDsRead),
//       before dS_1 warpgroup 1 for warpgroup 0's previous dQ_0.
// dO is released by warpgroup 0 after dV^T and by warpgroup 1 after dP; the Q stage by warpgroup
// 0 after its dS, by warpgroup 1 after dK^T.
constexpr int kBarP = 7, kBarPRead = 8;
// Where both warpgroups must wait for each other (the dS tile stored; the epilogue), each waits
// at its own instantiation's instruction. bar.sync is barrier.sync.aligned, which PTX defines only
// when every thread meeting at the barrier executes the same instruction (compute-sanitizer's
// synccheck reports "divergent thread(s)" otherwise), so the meeting is two bar.arrive / bar.sync
// pairs: warpgroup 0 arrives on id0 and waits on id1, warpgroup 1 the other way round (ids
// kBarBoth / kBarMeet, then kBarMeet + 1 / + 2 below: not kBarEpilogue, which the kernel's
// epilogue syncs on right after, and a warpgroup through the meeting could otherwise count
// towards the meeting's instance). Each warpgroup's own writes before it are ordered too: its
// warps all wait on the same barrier.
constexpr int kBarMeet = 9;  // 9: dS stored (with kBarBoth); 10, 11: the epilogue's

template <int kW>
__device__ __forceinline__ void meet(int id0, int id1) {
  named_barrier_arrive(kW == 0 ? id0 : id1, 256);
  named_barrier_sync(kW == 0 ? id1 : id0, 256);
}

struct Consumer : StepTiles {
  float kv[kDTiles][kBlockN / 2];  // dV^T (w = 0) or dK^T (w = 1): rows [64 i, + 64) x 96 keys

  // the key gradient belongs to the tensor cores between a wgmma's issue and its wait: keep the
  // compiler's reads and writes of it on their side of both
  __device__ __forceinline__ void hold_key_grads() {
#pragma unroll
    for (int i = 0; i < kDTiles; ++i) wgmma_fence_operands(kv[i]);
  }
};

// Consumer warpgroup kW's steps, then its key gradient (dK^T * softmax_scale for w = 1, dV^T for
// w = 0) transposed into its half of the epilogue's staging (kernel's epilogue copies it out).
template <int kW>
__device__ __forceinline__ void consume_roles(const Smem& sm, const Steps& steps, const Mask& mask,
                                              int n0, int head_kv, int batch, int nheads,
                                              int seqlen_q_pad, float scale_log2,
                                              float softmax_scale, float* __restrict__ dq_accum) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int warp = static_cast<int>((threadIdx.x / 32) % 4);  // within the warpgroup
  const int g = lane >> 2, t = lane & 3;
  const int row = 16 * warp + g;
  const int key0 = kKeys * kW + 2 * t;  // this lane's first S / dP key column in the block
  const int tw = static_cast<int>(threadIdx.x & 127);
  const uint32_t k_rows0 = sm.k() + kKeys * kW * 64;
  const uint32_t v_rows0 = sm.v() + kKeys * kW * 128;
  const uint32_t k_cols0 = sm.k() + (kDCols / 32) * kW * kKChunkBytes;
  uint32_t at;
  StepTiles::lane_offset(at, kW, row, t);
  Consumer cs;
#pragma unroll
  for (int i = 0; i < kDTiles; ++i)
#pragma unroll
    for (int j = 0; j < kBlockN / 2; ++j) cs.kv[i][j] = 0.f;
  mbar_wait(sm.kv_full(), 0);  // also when there are no steps: no TMA may outlive the CTA

  const int count = steps.count();
  StepCursor cursor;
  for (int it = 0; it < count; ++it) {
    // The slices' addresses made opaque each step: their descriptors are then summed where the
    // wgmmas are issued (uniform adds) instead of hoisted out of the loop into registers, which
    // spilled (the accumulators take most of the 240; session 30).
    uint32_t k_rows = k_rows0, v_rows = v_rows0, k_cols = k_cols0, p_all = sm.p();
    uint32_t ds_all = sm.ds(), dout = sm.dout();
    asm volatile("" : "+r"(k_rows), "+r"(v_rows), "+r"(k_cols), "+r"(p_all), "+r"(ds_all),
                 "+r"(dout));
    const int st = q_stage(it);
    int h, m0;
    cursor.take(steps, head_kv, h, m0);
    const int64_t bh = static_cast<int64_t>(batch) * nheads + h;

    cs.issue_scores_dp(sm, it, k_rows, v_rows, dout);

    const bool masked = mask.tile_needs_mask(m0, kBlockM, n0 + kKeys * kW, kKeys);
    wgmma_wait<1>();  // S
    wgmma_fence_operands(cs.s);
    if (kW == 1 && it > 0) named_barrier_sync(kBarPRead, 256);  // the previous dV^T read P_1
    if (masked) {
      cs.probs<true>(sm.lse2_ptr(st), scale_log2, mask, m0, n0, row, key0, sm.p(), at);
    } else {
      cs.probs<false>(sm.lse2_ptr(st), scale_log2, mask, m0, n0, row, key0, sm.p(), at);
    }
    fence_proxy_async();  // the generic stores before the async-proxy reads of the wgmmas
    if constexpr (kW == 0) {
      named_barrier_sync(kBarP, 256);  // both halves of P stored
      cs.hold_key_grads();
      wgmma_fence();
      StepTiles::issue_key_grad<kBlockN>(cs.kv, dout, p_all);  // dV^T += dO^T P
      wgmma_commit();
      wgmma_wait<1>();  // dP (dV^T may still run)
    } else {
      named_barrier_arrive(kBarP, 256);
      wgmma_wait<0>();  // dP
      wide_bwd::release(sm.do_empty());  // this warpgroup's only read of dO
    }
    wgmma_fence_operands(cs.dp);
    if (masked) {
      wide_bwd::dsoftmax<true, kKeys>(cs.s, cs.dp, sm.delta_ptr(st), row);
    } else {
      wide_bwd::dsoftmax<false, kKeys>(cs.s, cs.dp, sm.delta_ptr(st), row);
    }
    if constexpr (kW == 0) wide_bwd::release(sm.q_empty(st));  // S, lse2, delta: all read
    if (it > 0) named_barrier_sync(kBarDsRead + kW, 256);  // the other's readers of dS are done
    StepTiles::store_tile(sm.ds(), cs.dp, at);
    if (tw == 0) bulk_wait_group_read<0>();  // the previous dQ reduction has read the staging
    fence_proxy_async();
    meet<kW>(kBarBoth, kBarMeet);  // both halves of dS stored

    wgmma_fresh(cs.dq);
    wgmma_fence();
    cs.issue_dq(ds_all, k_cols);
    cs.hold_key_grads();
    if constexpr (kW == 0) {
      wgmma_wait<1>();  // dV^T: dO is free, and P_1 for warpgroup 1's next step
      cs.hold_key_grads();
      wide_bwd::release(sm.do_empty());
      if (it + 1 < count) named_barrier_arrive(kBarPRead, 256);
      wgmma_wait<0>();  // dQ
      wgmma_fence_operands(cs.dq);
      if (it + 1 < count) named_barrier_arrive(kBarDsRead + 1, 256);
      cs.reduce_dq(sm, kW, tw, dq_accum, bh, seqlen_q_pad, m0);
    } else {
      StepTiles::issue_key_grad<kBlockN>(cs.kv, sm.q(st), ds_all);  // dK^T += Q^T dS
      wgmma_commit();
      wgmma_wait<1>();  // dQ
      wgmma_fence_operands(cs.dq);
      cs.reduce_dq(sm, kW, tw, dq_accum, bh, seqlen_q_pad, m0);
      wgmma_wait<0>();  // dK^T: dS_0 is read, and the Q stage is free
      cs.hold_key_grads();
      if (it + 1 < count) named_barrier_arrive(kBarDsRead + 0, 256);
      wide_bwd::release(sm.q_empty(st));
    }
  }
  if (tw == 0) bulk_wait_group<0>();  // complete, not only read: no reduction outlives the CTA

  meet<kW>(kBarMeet + 1, kBarMeet + 2);  // every wgmma of both is done: Q .. dS are free
  wide_bwd::stage_transposed<T, kDTiles, kBlockN, kStageStride>(
      sm.q(0) + (1 - kW) * kStageBytes, cs.kv, kW == 1 ? softmax_scale : 1.f, 0, row, 2 * t);
}

extern "C" __global__ void __launch_bounds__(kThreads, 1)
FC_KERNEL_NAME(const __grid_constant__ TmaMap map_q,   // q [B, Sq, H, D]: box 64 x 64, 128B
               const __grid_constant__ TmaMap map_k,   // k [B, Sk, Hkv, D]: box 32 x 96, 64B
               const __grid_constant__ TmaMap map_v,   // v [B, Sk, Hkv, D]: box 64 x 96, 128B
               const __grid_constant__ TmaMap map_do,  // dout [B, Sq, H, D]: box 64 x 64, 128B
               const float* __restrict__ lse2,         // [B, H, Sq_pad] (PRE)
               const float* __restrict__ delta,        // [B, H, Sq_pad] (PRE)
               float* __restrict__ dq_accum,           // [B, H, Sq_pad, D] (PRE zeroed it)
               T* __restrict__ dk,                     // [B, Sk, Hkv, D]
               T* __restrict__ dv,                     // [B, Sk, Hkv, D]
               int64_t dk_sb, int64_t dk_ss, int64_t dk_sh, int64_t dv_sb, int64_t dv_ss,
               int64_t dv_sh, int seqlen_q, int seqlen_k, int nheads, int nheads_kv,
               int seqlen_q_pad, float scale_log2, float softmax_scale, int window_left,
               int window_right) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = ((raw + 1023u) & ~1023u) - raw;
  const Smem sm{raw + pad, smem_raw + pad};
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  const Mask mask{seqlen_q, seqlen_k, window_left, window_right};
  const BlockCoord blk = block_coord<FC_LPT_TAIL>(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x,
                                                 gridDim.y, gridDim.z);
  const int n0 = blk.key_block * kBlockN, head_kv = blk.head_kv, batch = blk.batch;
  const Steps steps(mask, n0, nheads, nheads_kv);

  if (threadIdx.x == 0) {
    sm.init_barriers();
    tma_prefetch(map_q);
    tma_prefetch(map_k);
    tma_prefetch(map_v);
    tma_prefetch(map_do);
  }
  __syncthreads();

  if (wg == 0) {  // ---- producer warpgroup
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x < 32 && elect_one()) {
      produce(sm, steps, n0, head_kv, batch, map_q, map_k, map_v, map_do, lse2, delta, nheads,
              seqlen_q_pad);
    }
    return;
  }

  // ---- consumer warpgroups
  setmaxnreg_inc<kConsumerRegs>();
  if (wg == 1) {
    consume_roles<0>(sm, steps, mask, n0, head_kv, batch, nheads, seqlen_q_pad, scale_log2,
                     softmax_scale, dq_accum);
  } else {
    consume_roles<1>(sm, steps, mask, n0, head_kv, batch, nheads, seqlen_q_pad, scale_log2,
                     softmax_scale, dq_accum);
  }

  // ---- epilogue: both key gradients are staged (consume_roles' last meeting): copy them out
  const int tid = static_cast<int>(threadIdx.x) - 128;
  const int keys = min(kBlockN, seqlen_k - n0);
  const uint8_t* stage_ptr = sm.ptr + kSmemQ;
  using wide_bwd::copy_rows;
  named_barrier_sync(kBarEpilogue, 256);
  copy_rows<T, kBlockN, kHeadDim, kStageStride, 256>(
      stage_ptr, dk + batch * dk_sb + static_cast<int64_t>(n0) * dk_ss + head_kv * dk_sh, dk_ss,
      keys, tid);
  copy_rows<T, kBlockN, kHeadDim, kStageStride, 256>(
      stage_ptr + kStageBytes,
      dv + batch * dv_sb + static_cast<int64_t>(n0) * dv_ss + head_kv * dv_sh, dv_ss, keys, tid);
}
