// Flash attention backward for the wide head dims on sm90a (kHeadDim 192 and 256), fp16 / bf16:
// the main kernel (MAIN) between bwd_sm80's PRE and CONVERT, as flash_bwd_sm90.cu.
//
// Status: proven on the H200 (tests/gpu/test_bwd_sm90_wide.py, float64 oracle, 505 passed at
// d03bdf6; compute-sanitizer memcheck / synccheck / racecheck clean on the boundary case);
// dispatched by default at d256 (family bwd_sm90_wide), 1.02-1.12x the best peer; d192 runs
// flash_bwd_sm90_keys.cu by default since session 30 (this kernel's d192 shape read 0.83-0.89x
// FlashAttention 4, the key split 0.90-0.96x; FLASHCUDA_SM90_BWD_WIDE_SPLIT=dims selects this one).
//
// Why a second sm90 backward: flash_bwd_sm90.cu keeps a consumer warpgroup's 64 keys x kHeadDim of
// dK and of dV in its registers (kHeadDim / 2 floats per thread each): at kHeadDim = 256 that is
// 256 registers for the two alone. Here the accumulators are split by head-dim columns instead
// (FlashAttention 3's dKV_swapAB for its d256 backward): dK and dV are computed transposed,
//     dV^T += dO^T P,   dK^T += Q^T dS        (M = head dim, N = the CTA's kBlockN keys),
// and consumer warpgroup w owns head-dim rows [kDRows w, kDRows (w + 1)) of both: kDTiles m64
// tiles x kBlockN keys, kDTiles * kBlockN / 2 floats each (d256: two warpgroups, 2 tiles x 64
// keys: 64 + 64; d192: three warpgroups, 1 tile x 96 keys: 48 + 48).
// The scores are computed the forward way round (M = the step's kBlockM queries) and split by
// keys: consumer w computes S = Q K^T and dP = dO V^T for keys [kSKeys w, kSKeys (w + 1)) of the
// block (m64 n{kSKeys}, K = kHeadDim), P and dS for them, and stores both (16-bit) into shared
// tiles [query][key] (128B-swizzled chunks of 64 keys); a named barrier of the consumers later
// every warpgroup reads all kBlockN keys of P and dS from there:
//     dV^T, dK^T: A = dO^T / Q^T (the stage's tile stored [query][d], read MN-major: imm-trans-a),
//                 B = P / dS stored [query][key] (read MN-major: imm-trans-b)
//     dQ_w = dS K[:, kDRows w ..]: A = dS read K-major, B = K stored [key][d] read MN-major;
//                 M = kBlockM queries, N = kDRows head-dim columns, reduced into dq_accum (PRE
//                 zeroed it, CONVERT scales it) by bulk reduce-adds from shared memory (the
//                 stage's own Q / dO chunks, see "dQ" below).
//
// Feature matrix
//   dtypes        fp16, bf16 in and out; fp32 accumulation; fp32 dQ accumulator (atomics: not
//                 deterministic, as flash_bwd_sm90.cu)
//   head dims     kHeadDim = 256 (64 x 64 tiles, 2 consumers) or 192 (64 x 96, 3 consumers);
//                 the runtime head dim equals the kernel's
//   masking       mask.cuh's band (causal, sliding window, none); ragged seqlen_q / seqlen_k
//   heads         MHA, GQA, MQA: the CTA loops over the query heads of its KV head
//   arch          sm_90a only (wgmma, setmaxnreg)
//   removed       (session 39; the dQ forms each measured on the H200 as a loss, docs/perf-notes.md
//                 sessions 27-28) dQ by red.global.add.v2 per thread into a row-major dq_accum
//                 (FC_DQ_STAGE=0, the host's FLASHCUDA_SM90_BWD_WIDE_DQ=red) and by red.v4
//                 (FC_DQ_V4); both halves of the dQ tile staged after dK^T (FC_DQ_STAGE_SPLIT=0);
//                 and the timing probe without the dQ reductions (FC_PROBE_NO_DQ, a wrong dQ,
//                 never dispatched)
//
// One CTA per (key block of kBlockN keys, KV head, batch); it loops over the (query head, query
// block of kBlockM rows) pairs that see the key block (mask.cuh's KeyBlockSteps). Warpgroups:
//   0     producer (setmaxnreg.dec): one elected thread issues the TMA loads: K and V of the key
//         block once (kv_full), then per step Q and dO of the query block and its lse2 and delta
//         rows into a kStages-deep ring (full[s]: 1 arrival + bytes; empty[s]: one arrival per
//         consumer warp).
//   1 ..  consumers w = 0 .. kConsumers - 1 (setmaxnreg.inc).
// Per step (query block m0, stage s), consumer w:
//     wait full[s] | issue S_w = Q K_w^T, then dP_w = dO V_w^T (two commit groups) | wait S:
//     P = exp2(S scale_log2 - lse2) (0 where masked) -> 16-bit -> P tile | wait dP: dS = P o (dP -
//     delta) (0 where masked) -> 16-bit -> dS tile | fence.proxy.async, named barrier of the
//     consumers | issue dQ_w and dV^T_w (a group), then dK^T_w (a group) | wait dQ / dV^T: the
//     dQ tile's second half into the stage's own dO chunks, its bulk reduce-add while the tensor
//     cores run dK^T | wait dK^T: the first half into its own Q chunks, the second bulk
//     reduce-add (the stage is released at the next step, once both have read it).
// d256: P and dS are double-buffered (tile it & 1), so one barrier per step suffices: at step
// it + 1 a consumer writes tile (it + 1) & 1, whose last readers (step it - 1's GEMMs of every
// consumer) finished before their consumer arrived at step it's barrier. d192 (kPBuffers = 1:
// two 96-key tiles of each would not fit): a second barrier before a step's stores, once every
// consumer has drained the previous step's GEMMs.
// Epilogue: the consumers' barrier, then each stores dK^T * softmax_scale and dV^T transposed
// into a padded [key][d] staging tile over the (now idle) Q / dO ring, another barrier, and all
// consumer threads copy the rows inside seqlen_k to dk / dv in 16-byte pieces.
//
// Shared memory (128B-swizzled [rows][64 16-bit] chunks, each region 1024-byte aligned):
//     K, V      [kBlockN][kHeadDim]             kHeadDim / 64 chunks of kBlockN x 128 B each
//     Q, dO     kStages x [kBlockM][kHeadDim]   kHeadDim / 64 chunks of kBlockM x 128 B each
//     P, dS     kPBuffers x [kBlockM][kBlockN]  ceil(kBlockN / 64) chunks of kBlockM x 128 B each
//     lse2, delta  kStages x 2 x [kBlockM] fp32;  mbarriers kv_full, full[], empty[]
// d256 (kBlockM = kBlockN = 64, 2 stages, 2 P / dS tiles): 64 + 128 + 32 + 1 KB (+ 1 KB
// alignment slack); d192 (96 keys, 1 tile of 2 chunks): 72 + 96 + 32 + 1 KB.
//
// Out-of-range rows as flash_bwd_sm90.cu: TMA zero-fills rows past seqlen_q / seqlen_k; a query
// row past seqlen_q (inside Sq_pad) has lse2 = +inf (P = 0); keys past seqlen_k are masked; a
// masked P and its dS are 0 whatever dP holds (a V row outside the band may hold anything).
#include "common/types.cuh"
#include "common/sm90.cuh"
#include "common/smem.cuh"
#include "attention/mask.cuh"
#include "attention/online_softmax.cuh"
#include "attention/sm90_bwd_wide.cuh"

using T = typename dtype_of<FC_DTYPE>::type;
constexpr int kHeadDim = FC_HEAD_DIM;
constexpr int kBlockM = FC_BLOCK_M;  // query rows per step
constexpr int kBlockN = FC_BLOCK_N;  // keys per CTA
constexpr int kStages = FC_STAGES;   // Q / dO ring depth
constexpr int kConsumers = FC_CONSUMERS;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kConsumerWarps = 4 * kConsumers;
constexpr int kProducerRegs = FC_PRODUCER_REGS;
constexpr int kConsumerRegs = FC_CONSUMER_REGS;

constexpr int kDRows = kHeadDim / kConsumers;  // head-dim rows of dK^T / dV^T (cols of dQ) per wg
constexpr int kDTiles = kDRows / 64;           // m64 tiles of them
constexpr int kSKeys = kBlockN / kConsumers;   // keys of S / dP per warpgroup

constexpr int kChunks = kHeadDim / 64;  // swizzled 64-column chunks per row of Q, dO, K, V
constexpr int kQChunkBytes = kBlockM * 128;
constexpr int kKVChunkBytes = kBlockN * 128;
constexpr int kQBytes = kChunks * kQChunkBytes;
constexpr int kKVBytes = kChunks * kKVChunkBytes;
constexpr int kPChunkBytes = kBlockM * 128;  // 64 keys of every query row
constexpr int kPBytes = (kBlockN + 63) / 64 * kPChunkBytes;  // (96 keys: the 2nd chunk half used)
constexpr int kPBuffers = FC_P_BUFFERS;  // P / dS tiles of each kind: 2, or 1 and a barrier
constexpr int kStatBytes = kBlockM * 4;

constexpr int kSmemK = 0;
constexpr int kSmemV = kSmemK + kKVBytes;
constexpr int kSmemQ = kSmemV + kKVBytes;
constexpr int kSmemDO = kSmemQ + kStages * kQBytes;
constexpr int kSmemP = kSmemDO + kStages * kQBytes;  // P[kPBuffers], then dS[kPBuffers]
constexpr int kSmemDS = kSmemP + kPBuffers * kPBytes;
constexpr int kSmemStats = kSmemDS + kPBuffers * kPBytes;
constexpr int kSmemBar = kSmemStats + kStages * 2 * kStatBytes;
constexpr int kBarriers = 1 + 2 * kStages;  // kv_full, full[], empty[]
constexpr int kSmemBytes = 1024 + kSmemBar + 8 * kBarriers;

// Epilogue staging of dK (then dV) as [key][kHeadDim + 8] 16-bit rows over the Q / dO ring: the
// transposed 16-bit stores of a warp then hit distinct banks (row stride = 4 banks mod 32).
constexpr int kStageStride = kHeadDim + 8;
constexpr int kStageBytes = kBlockN * kStageStride * 2;

// dQ: bulk reduce-adds from shared memory, +13 to +20% over red.global.add.v2 per thread at d256
// on the H200 (session 27, docs/perf-notes.md: with red.v2 the reductions were 44% of the
// warp-stall samples and a probe without them ran 1.6-1.9x faster: the L2's reduction rate, not
// the tensor cores, set the pace). Shared memory has no room for a staging tile, but once a
// step's GEMMs are done, warpgroup w's own Q and dO chunks of the stage (its head-dim columns,
// read since the barrier by its dV^T / dK^T only: 2 x kDTiles x 8 KB) are free: it stores its
// 64 x kDRows dQ tile there in its registers' order (kDTiles 64 x 64 blocks, flash_bwd_sm90.cu's
// frag order), and one thread issues two cp.reduce.async.bulk .add.f32 into dq_accum laid out in
// that order (CONVERT's FC_DQ_FRAG_M reader). The staging is split around dK^T: dQ and dV^T are
// one commit group and dK^T the next, so once dV^T is done the dO chunks take the second half of
// the dQ tile and its bulk reduce-add is issued while the tensor cores still run dK^T; then the
// Q chunks take the first half. Measured +10.3 to +14.9% at d256 and +6.1 / +6.4% at d192 over
// staging both halves after dK^T (session 28, same-process A/B, 15 rounds): the L2's reduction
// rate is the wall, and half of each step's dQ bytes now reach it a dK^T earlier, so the
// reductions overlap the tensor work instead of queueing behind it. That thread waits for the
// reductions to have read the stage before its warp releases the stage, at the next step (so the
// wait is off the critical path).
// (Tried in session 27: a step's dV^T / dK^T issued behind the next step's S / dP, -1.3 to 0%,
// removed; the next step's S / dP issued before this step's dQ reductions: spills and serialised
// wgmmas at compile time, not run.)

static_assert(FC_DTYPE == 1 || FC_DTYPE == 2, "sm90 kernel: fp16 or bf16");
static_assert(kBlockM == 64 && ((kHeadDim == 256 && kConsumers == 2 && kBlockN == 64) ||
                                 (kHeadDim == 192 && kConsumers == 3 && kBlockN == 96)),
              "instantiated for d256 (64 x 64, two consumers) and d192 (64 x 96, three): S m64n32, "
              "dV^T / dK^T m64n{kBlockN}, dQ m64n{kDRows}");
static_assert(kSKeys % 8 == 0 && kDRows % 64 == 0, "consumer split of keys / head dim");
static_assert(kPBuffers == 1 || kPBuffers == 2, "one or two P / dS tiles");
static_assert(2 * kStageBytes <= 2 * kStages * kQBytes, "dK / dV staging inside the Q / dO ring");
static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= register_pool(kThreads),
              "register split over the CTA's pool at launch (register_pool, sm90.cuh)");
static_assert(kDRows * 64 * 4 == 2 * kDTiles * kQChunkBytes && kBlockM == 64,
              "dQ staging: a warpgroup's 64 x kDRows fp32 dQ tile fills its Q and dO chunks");
static_assert(kSmemBytes == FC_SMEM_BYTES, "smem layout disagrees with the host's smem_bytes");

struct Smem {
  uint32_t base;  // 1024-byte aligned
  uint8_t* ptr;   // the same, as a generic pointer

  __device__ __forceinline__ uint32_t k() const { return base + kSmemK; }
  __device__ __forceinline__ uint32_t v() const { return base + kSmemV; }
  __device__ __forceinline__ uint32_t q(int s) const { return base + kSmemQ + s * kQBytes; }
  __device__ __forceinline__ uint32_t dout(int s) const { return base + kSmemDO + s * kQBytes; }
  __device__ __forceinline__ uint32_t p(int b) const {
    return base + kSmemP + (kPBuffers == 2 ? b : 0) * kPBytes;
  }
  __device__ __forceinline__ uint32_t ds(int b) const {
    return base + kSmemDS + (kPBuffers == 2 ? b : 0) * kPBytes;
  }
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
  __device__ __forceinline__ uint32_t full(int s) const { return bar(1 + s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return bar(1 + kStages + s); }

  __device__ __forceinline__ void init_barriers() const {
    mbar_init(kv_full(), 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), kConsumerWarps);
    }
    fence_barrier_init();
  }
};

using Steps = KeyBlockSteps<kBlockM, kBlockN>;  // (mask.cuh)

__device__ __forceinline__ int stage_of(int it) { return it % kStages; }
__device__ __forceinline__ uint32_t parity_of(int it) { return (it / kStages) & 1; }

// ---- producer: one thread issues every TMA load --------------------------------------------------
__device__ __forceinline__ void produce(const Smem& sm, const Steps& steps, int n0, int head_kv,
                                        int batch, const TmaMap& map_q, const TmaMap& map_k,
                                        const TmaMap& map_v, const TmaMap& map_do,
                                        const float* lse2, const float* delta, int nheads,
                                        int seqlen_q_pad) {
  mbar_arrive_expect_tx(sm.kv_full(), 2 * kKVBytes);
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    tma_load_4d(sm.k() + c * kKVChunkBytes, map_k, sm.kv_full(), 64 * c, n0, head_kv, batch);
    tma_load_4d(sm.v() + c * kKVChunkBytes, map_v, sm.kv_full(), 64 * c, n0, head_kv, batch);
  }
  int g = 0, mi = 0;  // the step's query head in the group, its query block - m_first
  for (int it = 0; it < steps.count(); ++it) {
    const int s = stage_of(it);
    const int h = head_kv * steps.group + g, m0 = (steps.m_first + mi) * kBlockM;
    if (++mi == steps.n_m) {
      mi = 0;
      ++g;
    }
    mbar_wait_producer(sm.empty(s), parity_of(it) ^ 1);  // first pass: stages start empty
    mbar_arrive_expect_tx(sm.full(s), 2 * kQBytes + 2 * kStatBytes);
    const int64_t row = (static_cast<int64_t>(batch) * nheads + h) * seqlen_q_pad + m0;
    bulk_load(sm.lse2(s), lse2 + row, kStatBytes, sm.full(s));
    bulk_load(sm.delta(s), delta + row, kStatBytes, sm.full(s));
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      tma_load_4d(sm.q(s) + c * kQChunkBytes, map_q, sm.full(s), 64 * c, m0, h, batch);
      tma_load_4d(sm.dout(s) + c * kQChunkBytes, map_do, sm.full(s), 64 * c, m0, h, batch);
    }
  }
}

// 128B-swizzled [row][64 16-bit] chunk: byte offset of the 4-byte word holding columns col, col + 1
// (col even) of `row`.
__device__ __forceinline__ uint32_t swizzled_word(int row, int col) {
  return row * 128 + ((((col >> 3) ^ (row & 7)) << 4) | ((col & 7) << 1));
}

struct Consumer {
  float dk[kDTiles][kBlockN / 2];  // dK^T rows [kDRows w + 64 i, + 64) x kBlockN keys (m64n64)
  float dv[kDTiles][kBlockN / 2];
  float s[kSKeys / 2];             // S, then P (fp32): kBlockM queries x kSKeys keys
  float dp[kSKeys / 2];            // dP, then dS
  float dq[kDRows / 2];            // dQ: kBlockM queries x kDRows columns

  // acc = X Y^T over kHeadDim / 16 k16 steps (one commit group): X = the query tile (Q or dO),
  // Y = this warpgroup's kSKeys K or V rows (`y` = their first row in chunk 0), both K-major;
  // step kk reads 32 bytes at column (kk % 4) * 16 of chunk kk / 4.
  __device__ __forceinline__ static void issue_scores(float (&acc)[kSKeys / 2], uint32_t x,
                                                      uint32_t y) {
    const uint64_t a0 = smem_desc_k_major_sw128(x), b0 = smem_desc_k_major_sw128(y);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t within = (kk % 4) * 32;
      const uint64_t a = k_major_at(a0, x, (kk / 4) * kQChunkBytes + within);
      const uint64_t b = k_major_at(b0, y, (kk / 4) * kKVChunkBytes + within);
      wgmma_ss<kSKeys, T>(acc, a, b, kk > 0);
    }
    wgmma_commit();
  }

  // acc[i] += X^T Z for this warpgroup's head-dim tiles i (no commit): X = the stage's Q or dO
  // ([query][d]; tile i is chunk kDTiles w + i, read MN-major), Z = the P or dS tile
  // ([query][key], read MN-major); step kk covers queries 16 kk .. + 15 (2048 bytes further).
  __device__ __forceinline__ static void issue_key_grad(float (&acc)[kDTiles][kBlockN / 2],
                                                        uint32_t x, uint32_t z, int w) {
    const uint64_t b0 = smem_desc_mn_major_sw128(z, kPChunkBytes);
#pragma unroll
    for (int i = 0; i < kDTiles; ++i) {
      const uint32_t xi = x + (kDTiles * w + i) * kQChunkBytes;
      const uint64_t a0 = smem_desc_mn_major_sw128(xi, kQChunkBytes);
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        const uint64_t a = mn_major_at(a0, xi, kk * 16 * 128, kQChunkBytes);
        const uint64_t b = mn_major_at(b0, z, kk * 16 * 128, kPChunkBytes);
        wgmma_ss_tt<kBlockN, T>(acc[i], a, b, 1);
      }
    }
  }

  // dK^T / dV^T belong to the tensor cores between a wgmma's issue and its wait: keep the
  // compiler's reads and writes of them on their side of both.
  __device__ __forceinline__ void hold_key_grads() {
#pragma unroll
    for (int i = 0; i < kDTiles; ++i) {
      wgmma_fence_operands(dv[i]);
      wgmma_fence_operands(dk[i]);
    }
  }

  // dq = dS K[:, kDRows w ..] (one commit group): A = dS [query][key] read K-major (step kk: 32
  // bytes at column (kk % 4) * 16 of key chunk kk / 4), B = K [key][d] read MN-major from chunk
  // kDTiles w on (the next 64 columns kKVChunkBytes further; step kk: key rows 16 kk ..).
  __device__ __forceinline__ void issue_dq(uint32_t ds, uint32_t k, int w) {
    const uint32_t k_base = k + kDTiles * w * kKVChunkBytes;
    const uint64_t a0 = smem_desc_k_major_sw128(ds);
    const uint64_t b0 = smem_desc_mn_major_sw128(k_base, kKVChunkBytes);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t a = k_major_at(a0, ds, (kk / 4) * kPChunkBytes + (kk % 4) * 32);
      const uint64_t b = mn_major_at(b0, k_base, kk * 16 * 128, kKVChunkBytes);
      wgmma_ss_tb<kDRows, T>(dq, a, b, kk > 0);
    }
    wgmma_commit();
  }

  // P (wide_bwd::probs), then stored (16-bit) into the P tile at this warpgroup's keys; `row` =
  // this lane's first query row in the block (16 warp + g), `key0` = its first key column in the
  // block (kSKeys w + 2t).
  template <bool kMasked>
  __device__ __forceinline__ void probs(const float* lse2, float scale_log2, const Mask& mask,
                                        int m0, int n0, int row, int key0, uint32_t p_tile) {
    wide_bwd::probs<kMasked, kSKeys>(s, lse2, scale_log2, mask, m0, n0, row, key0);
    store_tile(p_tile, s, row, key0);
  }

  // dS (wide_bwd::dsoftmax) in dp's registers, then stored (16-bit) into the dS tile.
  template <bool kMasked>
  __device__ __forceinline__ void dsoftmax(const float* delta, int row, int key0,
                                           uint32_t ds_tile) {
    wide_bwd::dsoftmax<kMasked, kSKeys>(s, dp, delta, row);
    store_tile(ds_tile, dp, row, key0);
  }

  // A m64n{kSKeys} accumulator (16-bit) into a [query][key] tile: lane (g, t) holds rows row,
  // row + 8 and columns key0 + 8 j, + 1. A warp's stores of one j cover 8 rows x 16 bytes, one
  // 16-byte unit per row and, swizzled, a different bank group per row: no conflicts.
  __device__ __forceinline__ static void store_tile(uint32_t tile, const float (&c)[kSKeys / 2],
                                                    int row, int key0) {
#pragma unroll
    for (int j = 0; j < kSKeys / 8; ++j) {
      const int col = key0 + 8 * j;
      const uint32_t chunk = tile + (col / 64) * kPChunkBytes;
      store_shared_32(chunk + swizzled_word(row, col % 64), pack2<T>(c[4 * j], c[4 * j + 1]));
      store_shared_32(chunk + swizzled_word(row + 8, col % 64),
                      pack2<T>(c[4 * j + 2], c[4 * j + 3]));
    }
  }

  // This warpgroup's kDTiles 64 x 64 blocks of dQ in the registers' order: thread tw's dq[32 b +
  // 4 k .. + 3] (block b, k < 8) at float 4096 b + 512 k + 4 tw of a kDTiles x 16 KB range (a
  // warp's 32 float4 are 512 contiguous bytes: no bank conflicts). Stores the float4 of half
  // kHalfIndex of the range (0: floats [0, kDTiles 2048); 1: the rest) from `base` on.
  template <int kHalfIndex>
  __device__ __forceinline__ void stage_dq_half(uint32_t base, int tw) const {
    constexpr int kHalf = kDTiles * 2048;  // floats
#pragma unroll
    for (int q = 0; q < kDRows / 8; ++q) {  // float4 q of the registers
      const int at = 4096 * (q / 8) + 512 * (q % 8);  // + 4 tw < 512: the half is q's
      if ((at < kHalf) != (kHalfIndex == 0)) continue;
      const uint32_t addr = base + 4 * (at - kHalfIndex * kHalf + 4 * tw);
      const float* x = &dq[4 * q];
      store_shared_16(addr, {__float_as_uint(x[0]), __float_as_uint(x[1]),
                             __float_as_uint(x[2]), __float_as_uint(x[3])});
    }
  }
};

extern "C" __global__ void __launch_bounds__(kThreads, 1)
FC_KERNEL_NAME(const __grid_constant__ TmaMap map_q,   // q [B, Sq, H, D]: dims (D, Sq, H, B)
               const __grid_constant__ TmaMap map_k,   // k [B, Sk, Hkv, D]
               const __grid_constant__ TmaMap map_v,   // v [B, Sk, Hkv, D]
               const __grid_constant__ TmaMap map_do,  // dout [B, Sq, H, D]
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
  const int w = wg - 1;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int warp = static_cast<int>((threadIdx.x / 32) % 4);  // within the warpgroup
  const int g = lane >> 2, t = lane & 3;
  const int row = 16 * warp + g;       // this lane's first accumulator row (query / d in a tile)
  const int key0 = kSKeys * w + 2 * t;  // this lane's first S / dP key column in the block
  const uint32_t k_rows = sm.k() + kSKeys * w * 128;  // this warpgroup's K / V rows (chunk 0)
  const uint32_t v_rows = sm.v() + kSKeys * w * 128;
  Consumer cs;
#pragma unroll
  for (int i = 0; i < kDTiles; ++i)
#pragma unroll
    for (int j = 0; j < kBlockN / 2; ++j) cs.dk[i][j] = cs.dv[i][j] = 0.f;
  mbar_wait(sm.kv_full(), 0);  // also when there are no steps: no TMA may outlive the CTA

  const int tw = static_cast<int>(threadIdx.x & 127);  // thread within the warpgroup
  int step_g = 0, step_mi = 0;
  for (int it = 0; it < steps.count(); ++it) {
    const int st = stage_of(it);
    const int h = head_kv * steps.group + step_g, m0 = (steps.m_first + step_mi) * kBlockM;
    if (++step_mi == steps.n_m) {
      step_mi = 0;
      ++step_g;
    }
    const int64_t bh = static_cast<int64_t>(batch) * nheads + h;
    const uint32_t p_tile = sm.p(it & 1), ds_tile = sm.ds(it & 1);

    mbar_wait(sm.full(st), parity_of(it));
    wgmma_fresh(cs.s);
    wgmma_fresh(cs.dp);
    wgmma_fence();
    Consumer::issue_scores(cs.s, sm.q(st), k_rows);
    Consumer::issue_scores(cs.dp, sm.dout(st), v_rows);
    if (it > 0) {  // the previous step's dQ reductions have read its stage: release it
      if (tw == 0) bulk_wait_group_read<0>();
      wide_bwd::release(sm.empty(stage_of(it - 1)));
    }

    const bool masked = mask.tile_needs_mask(m0, kBlockM, n0 + kSKeys * w, kSKeys);
    wgmma_wait<1>();  // S
    wgmma_fence_operands(cs.s);
    if constexpr (kPBuffers == 1) {
      // one P / dS tile: every consumer has drained the previous step's GEMMs, which read it
      if (it > 0) named_barrier_sync(7, 128 * kConsumers);  // (ids 3 .. 5: the warpgroups' own)
    }
    if (masked) {
      cs.probs<true>(sm.lse2_ptr(st), scale_log2, mask, m0, n0, row, key0, p_tile);
    } else {
      cs.probs<false>(sm.lse2_ptr(st), scale_log2, mask, m0, n0, row, key0, p_tile);
    }
    wgmma_wait<0>();  // dP
    wgmma_fence_operands(cs.dp);
    if (masked) {
      cs.dsoftmax<true>(sm.delta_ptr(st), row, key0, ds_tile);
    } else {
      cs.dsoftmax<false>(sm.delta_ptr(st), row, key0, ds_tile);
    }
    fence_proxy_async();  // the generic stores before the async-proxy reads of the wgmmas
    named_barrier_sync(1, 128 * kConsumers);

    wgmma_fresh(cs.dq);
    wgmma_fence();
    cs.issue_dq(ds_tile, sm.k(), w);
    cs.hold_key_grads();
    Consumer::issue_key_grad(cs.dv, sm.dout(st), p_tile, w);
    wgmma_commit();  // dQ and dV^T: one group, dK^T the next
    Consumer::issue_key_grad(cs.dk, sm.q(st), ds_tile, w);
    wgmma_commit();
    // dQ and dV^T done: the dO chunks take the second half of the dQ tile while dK^T runs (since
    // the barrier only this warpgroup's dV^T / dK^T read its Q / dO chunks of the stage; the S /
    // dP of every warpgroup finished before it)
    wgmma_wait<1>();
    wgmma_fence_operands(cs.dq);
    const uint32_t q_part = sm.q(st) + kDTiles * w * kQChunkBytes;
    const uint32_t do_part = sm.dout(st) + kDTiles * w * kQChunkBytes;
    float* dst = dq_accum + (bh * seqlen_q_pad + m0) * kHeadDim + kDTiles * w * 4096;
    cs.stage_dq_half<1>(do_part, tw);
    fence_proxy_async();
    named_barrier_sync(3 + w, 128);
    if (tw == 0) bulk_reduce_add_f32(dst + kDTiles * 2048, do_part, kDTiles * kQChunkBytes);
    wgmma_wait<0>();  // dK^T: the Q chunks take the first half
    cs.hold_key_grads();
    cs.stage_dq_half<0>(q_part, tw);
    fence_proxy_async();
    named_barrier_sync(3 + w, 128);
    if (tw == 0) {
      bulk_reduce_add_f32(dst, q_part, kDTiles * kQChunkBytes);
      bulk_commit_group();
    }
  }
  if (tw == 0) bulk_wait_group<0>();  // complete, not only read: no reduction outlives the CTA

  // ---- epilogue: every consumer's wgmmas are done (each waited for its own before the barrier),
  // so the Q / dO ring is free: dK^T * softmax_scale, then dV^T, transposed through it.
  const int tid = static_cast<int>(threadIdx.x) - 128;
  const int keys = min(kBlockN, seqlen_k - n0);
  const uint32_t stage = sm.q(0);
  const uint8_t* stage_ptr = sm.ptr + kSmemQ;
  named_barrier_sync(2, 128 * kConsumers);
  // (dK^T / dV^T: this warpgroup's head-dim rows kDRows w .., all kBlockN keys)
  using wide_bwd::copy_rows, wide_bwd::stage_transposed;
  stage_transposed<T, kDTiles, kBlockN, kStageStride>(stage, cs.dk, softmax_scale, kDRows * w,
                                                      row, 2 * t);
  stage_transposed<T, kDTiles, kBlockN, kStageStride>(stage + kStageBytes, cs.dv, 1.f,
                                                      kDRows * w, row, 2 * t);
  named_barrier_sync(2, 128 * kConsumers);
  constexpr int kCopiers = 128 * kConsumers;
  copy_rows<T, kBlockN, kHeadDim, kStageStride, kCopiers>(
      stage_ptr, dk + batch * dk_sb + static_cast<int64_t>(n0) * dk_ss + head_kv * dk_sh, dk_ss,
      keys, tid);
  copy_rows<T, kBlockN, kHeadDim, kStageStride, kCopiers>(
      stage_ptr + kStageBytes,
      dv + batch * dv_sb + static_cast<int64_t>(n0) * dv_ss + head_kv * dv_sh, dv_ss, keys, tid);
}
