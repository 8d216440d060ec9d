// Flash attention backward, sm90a main kernel (the FlashAttention-3 design), fp16 / bf16.
//
// Status: proven on the H200 (tests/gpu/test_bwd_sm90.py, float64 oracle); dispatched by default
// on compute capability 9.0 (FLASHCUDA_ENABLE_SM90_BWD=0 turns it off). No spills, HGMMA in SASS.
//
// Feature matrix
//   dtypes        fp16, bf16 in and out; fp32 accumulation; fp32 dQ accumulator
//   head dims     kHeadDim in {64, 128}, exactly (the runtime head dim equals the kernel's)
//   masking       bottom-right aligned band of mask.cuh (causal, sliding window, none); ragged
//                 seqlen_q / seqlen_k
//   heads         MHA, GQA, MQA: a CTA loops over the query heads of its KV head, dK / dV summed
//                 over them in registers (as flash_bwd_sm80.cu)
//   steps         kBlockM = 64 (d128) or 128 (d64) query rows; FC_DQ_SWAP: 80 at d128 with dQ
//                 computed transposed (the host's default without a mask from 2048 query rows,
//                 +1.4-2.3% there; see "FC_DQ_SWAP" below)
//   dQ            non-deterministic only, fp32 into dq_accum: the consumers stage each step's dQ
//                 in shared memory and warp 1 of the producer warpgroup reduces it with bulk
//                 reduce-adds (write_dq; FA3's split), so no reduction is issued by a consumer.
//                 Two staging forms: FC_DQ_TMA (d64's default since session 10) — 128B-swizzled
//                 boxes reduced through a tensor map, kHeadDim / 32 per step, stored in the
//                 spread order (FC_DQ_SPREAD); FC_DQ_FRAG (d128's default since session 12,
//                 +0.2-6.5% over FC_DQ_TMA there) — each consumer's tile in its registers'
//                 order, one bulk reduction each
//   schedule      one CTA per work item in blockIdx order; FC_WAVE_SPLIT (below, ops/wave_split.py):
//                 the last wave's items as pieces of their steps in a dependent launch (d64
//                 without a mask from 2k), or a causal call's first pairs as their own grid after
//                 MAIN, longest-first (d64 causal 2k-8k)
//   layouts       q / k / v / dout: TMA (strides multiples of 8 elements, 16-byte aligned bases);
//                 dk / dv: the same (the epilogue's 16-byte stores)
//   not yet       ping-pong / overlap of the two GEMM halves, deterministic dQ (bwd_sm80 has
//                 it); a persistent schedule (FC_PERSISTENT, sessions 14-15: measured as noise,
//                 removed in session 18; perf-notes)
//   removed       (session 39; each measured on the H200 as noise or a loss, perf-notes)
//                 FlashAttention 4's epilogue (dK / dV through K's / V's tiles and tensor
//                 stores, FC_DKV_TMA 1 / 2), its load order (FC_SPLIT_LOADS), MAIN as PRE's
//                 programmatic dependent (FC_PDL), lse2 / delta in lane order (FC_STAT_LANES),
//                 the causal grid heads first (FC_HEADS_FIRST), the first loads before the
//                 CTA's barrier (FC_EARLY_LOADS), masked steps by visibility bits or one fused
//                 pass (FC_MASK_BITS, FC_MASKED_FUSED), the dQ writer's last wait for reads
//                 only (FC_DQ_END_READ); and the A/B baselines of the step counters and the
//                 16-byte epilogue (FC_STEP_COUNTERS=0, FC_DKV_QUAD=0); the dQ reductions
//                 issued by the consumers (red.global.add.v2 / .v4, a step late, row-wise bulk
//                 reduce-adds: FC_DQ_V4, FC_DQ_LATE, FC_DQ_BULK) and the writer's padded and
//                 flat staging (FC_DQ_WARP, FC_DQ_WARP_FLAT), all slower than the two forms
//                 above at their head dims; the previous GEMM order (dQ after dK, FC_DQ_EARLY=0),
//                 a third Q / dO stage (FC_STAGES=3) and the [query][key] dS layout outside
//                 FC_DQ_SWAP (FC_DS_K_MAJOR bring-up); in session 50 (H100, perf-notes), a masked
//                 step by k16 steps classed per warp (hidden ones zero without exp2s: no faster,
//                 FC_MASK_BLOCKS), the diagonal's hidden k16 steps left out of the dV / dK / dQ
//                 chains (FC_MASK_SKIP: a loss) and stage_dq from four bases (FC_DQ_BASES: noise);
//                 in session 51 the epilogue's transposes all before its stores
//                 (FC_EPI_SHUFFLE_FIRST: even) and a masked step as an unmasked one plus an
//                 AND of its packed P^T / dS^T words (FC_MASK_PACKED: a loss); in session
//                 52 a masked step's visible columns as bits computed before its GEMM wait
//                 (FC_MASK_PRE: even) and dV stored in the CTA's last step under its dK GEMM
//                 (FC_DV_LAST: a loss, 4-11%, growing with the steps per CTA); in session 56
//                 (H100) code behind a never-true test in the step loop, its length no cost
//                 (FC_LOOP_PAD), and masked and unmasked steps as two loops over one step
//                 (FC_SPLIT_STEPS: a loss, 2-10%)
//   arch          sm_90a only (wgmma, setmaxnreg)
//
// This is part MAIN of the backward; flashcuda/ops/bwd_sm90.py runs bwd_sm80's PRE (delta =
// rowsum(dO o O), lse2 = lse * log2 e, +inf for empty and padding rows, dq_accum = 0) before it
// and bwd_sm80's CONVERT (dq = dq_accum * softmax_scale) after it, unchanged.
//
// One CTA per (key block of kBlockN = 128 keys, KV head, batch); it loops over the (query head of
// the group, query block of kBlockM rows) pairs whose rows see the key block (mask.cuh), and keeps
// dK and dV of its 128 keys in registers throughout. 3 warpgroups:
//   warpgroup 0  producer (setmaxnreg.dec to 24; 32 at d64, for the dQ writer warp's loop): one
//                elected thread issues TMA: K and V of the key block once (kv_full), then per
//                step Q_m and dO_m of the query block (tensor maps) and its lse2 and delta rows
//                (cp.async.bulk, kBlockM floats each) into a 2-stage ring; warp 1 is the dQ
//                writer (write_dq):
//                    full[s]   TMA -> consumers (1 arrival + transaction bytes of all four)
//                    empty[s]  consumers -> TMA (one arrival per consumer warp)
//   warpgroups 1, 2  consumers (setmaxnreg.inc to 240; 232 at d64): consumer c owns keys 64c ..
//                64c + 63 of the block (the M of every key-side GEMM), and one of the two
//                64 x 64 tiles of the step's kBlockM x kHeadDim dQ block.
// Per step (query block m, stage s), each consumer warpgroup (FA3's order):
//     wait full[s] | issue S^T = K_c Q^T and dP^T = V_c dO^T: 2 x kHeadDim / 16 wgmma
//     m64n{kBlockM}k16, both operands K-major from shared memory (two commit groups) | wait S^T:
//     P^T = exp2(S^T * scale_log2 - lse2) (lse2, delta: the stage's rows in shared memory),
//     masked if the tile needs it | wait dP^T: dS^T = P^T o (dP^T - delta) | P^T, dS^T -> 16-bit
//     A fragments (the accumulator -> A register reuse of the forward's P V) | issue dV += P^T dO
//     (a group): kBlockM / 16 wgmma m64n{kHeadDim}k16, A from registers, B (dO stored
//     [query][d]) read MN-major (imm-trans-b = 1) | dS^T -> shared ds[m & 1] (16-bit,
//     [key][query], 128B swizzle) | fence, named barrier of both consumers | issue dQ_c = dS K
//     (a group): 8 wgmma m64n64k16, A = dS read MN-major from ds (imm-trans-a = 1), B = K read
//     MN-major (imm-trans-b = 1) | issue dK += dS^T Q (a group) | wait until dV and dQ are done
//     | stage dQ for the writer warp, while the tensor cores run dK | wait all; release stage s.
// ds is double-buffered so that one named barrier per step suffices: at step m + 1 a consumer
// writes ds[(m + 1) & 1] while the other may still be reading ds[m & 1] (its step-m dQ), never
// ds[(m + 1) & 1], whose last reader (its step m - 1 dQ) it finished before arriving at the
// step-m barrier.
// Epilogue: dK * softmax_scale and dV straight from the accumulator registers (16-byte stores).
//
// Shared memory (128B-swizzled [rows][64] chunks, as in flash_fwd_sm90.cu / sm90.cuh), each
// region 1024-byte aligned:
//     K, V     [kBlockN][kHeadDim]            kHeadDim / 64 chunks of kBlockN x 128 B
//     Q, dO    2 stages x [kBlockM][kHeadDim] kHeadDim / 64 chunks of kBlockM x 128 B
//     dS       2 x [kBlockN keys][kBlockM queries]  kBlockM / 64 chunks of kBlockN x 128 B
//     lse2, delta  2 stages x 2 x [kBlockM] fp32
//     dQ staging   one [kBlockM][kHeadDim] fp32 tile (FC_DQ_TMA: swizzled boxes; FC_DQ_FRAG:
//                  one register-order tile per consumer)
//     mbarriers kv_full, full[2], empty[2], dq_full / dq_empty (one pair per consumer with
//                  FC_DQ_FRAG)
// d128 (kBlockM 64): K + V 64 KB, Q + dO 64 KB, dS 32 KB, stats 1 KB; d64 (kBlockM 128): K + V
// 32 KB, Q + dO 64 KB, dS 64 KB, stats 2 KB; both: dQ staging 32 KB + 1 KB alignment slack (194 /
// 195 KB in all). dS layout: FC_DS_K_MAJOR below ([query][key] with FC_DQ_SWAP).
//
// Out-of-range rows: TMA zero-fills rows past seqlen_q / seqlen_k. A query row past seqlen_q
// (inside Sq_pad) has lse2 = +inf from PRE, so its P, dS are 0; a key past seqlen_k is masked
// (tile_needs_mask); dK / dV rows past seqlen_k are never stored. A masked P is 0 and its dS is
// forced to 0 even where dP^T is not finite (a V row outside the band may hold anything).
//
// Timeline (FC_TIMELINE = 1, Sm90BwdConfig.timeline; a profiling variant, never dispatched;
// scripts/sm90_bwd_timeline.py): one more kernel argument, a buffer of kTimelineWords uint64 per
// CTA, receives %globaltimer at fixed points of the CTA's life (see "timeline" below), its
// %smid, its step count and its block index: where the fixed cost per CTA goes (K / V load,
// pipeline fill, dK / dV epilogue) against the time per step.
#include "common/types.cuh"
#include "common/sm90.cuh"
#include "common/reduce.cuh"
#include "attention/block_order.cuh"
#include "attention/mask.cuh"
#include "attention/online_softmax.cuh"

using T = typename dtype_of<FC_DTYPE>::type;
constexpr int kHeadDim = FC_HEAD_DIM;
constexpr int kBlockM = FC_BLOCK_M;  // query rows per step
constexpr int kBlockN = FC_BLOCK_N;  // keys per CTA
constexpr int kStages = FC_STAGES;   // Q / dO ring depth
constexpr int kConsumers = kBlockN / 64;          // consumer warpgroups, 64 keys each
constexpr int kThreads = 128 * (1 + kConsumers);  // + the producer warpgroup
constexpr int kConsumerWarps = 4 * kConsumers;
constexpr int kProducerRegs = FC_PRODUCER_REGS;
constexpr int kConsumerRegs = FC_CONSUMER_REGS;

constexpr int kChunkCols = 64;                  // 16-bit elements per 128-byte swizzled row
constexpr int kChunks = kHeadDim / kChunkCols;  // swizzled chunks per row of Q, dO, K, V
constexpr int kQChunkBytes = kBlockM * 128;
constexpr int kKVChunkBytes = kBlockN * 128;
constexpr int kQBytes = kChunks * kQChunkBytes;
constexpr int kKVBytes = kChunks * kKVChunkBytes;
// dS layout in shared memory (FC_DS_K_MAJOR): 0 = [key][query] (query contiguous, as the
// accumulator holds dS^T; dQ reads A MN-major, imm-trans-a = 1), chunks of 64 queries x kBlockN
// keys; 1 = [query][key] (key contiguous; FC_DQ_SWAP's, whose dQ^T GEMM reads it as B, K-major),
// chunks of 64 keys x kBlockM queries. Both are kBlockN x kBlockM x 2 bytes.
constexpr bool kDsKMajor = FC_DS_K_MAJOR;
constexpr int kDsChunkBytes = kDsKMajor ? kBlockM * 128 : kBlockN * 128;
constexpr int kDsBytes = kBlockM * kBlockN * 2;

// dQ of a step is kBlockM x kHeadDim = kConsumers tiles of 64 x 64: consumer c takes query tile
// c % kDqTilesM and d tile c / kDqTilesM.
constexpr int kDqTilesM = kBlockM / 64;

constexpr int kSmemK = 0;
constexpr int kSmemV = kSmemK + kKVBytes;
constexpr int kSmemQ = kSmemV + kKVBytes;
constexpr int kSmemDO = kSmemQ + kStages * kQBytes;
constexpr int kSmemDS = kSmemDO + kStages * kQBytes;
constexpr int kStatBytes = kBlockM * 4;  // lse2 or delta of one query block
#ifndef FC_DQ_SWAP
#define FC_DQ_SWAP 0  // dQ^T = K^T dS^T at 80-query steps (d128 without a mask; see below)
#endif
// FC_DQ_SWAP (FlashAttention 3 / 4's d128 backward without a mask: 80 queries per step, dQ_swapAB):
// with kBlockM = 80 a step's dQ (80 x kHeadDim) is no whole number of m64 tiles, so each consumer
// computes its 64 columns of dQ transposed, dQ^T (64 d x 80 queries) = K^T dS^T: A = K^T, its
// chunk c of K read MN-major; B = dS stored [query][key] (FC_DS_K_MAJOR, written by
// stmatrix.trans: Consumer::store_ds_trans), read K-major. Its staging is FC_DQ_FRAG's: each
// consumer's 64 x 80 dQ^T in its registers' order (20 KB, 10 st.shared.v4 per thread), one bulk
// reduce-add each into dq_accum in that order (flash_bwd_sm80.cu's CONVERT, FC_DQ_FRAG_T, reads
// it back).
constexpr bool kDqSwap = FC_DQ_SWAP;
constexpr int kSmemStats = kSmemDS + 2 * kDsBytes;  // stages x (lse2, delta)
// The step's dQ staging (the consumers store, the writer warp reduces into dq_accum), one of:
#ifndef FC_DQ_TMA
#define FC_DQ_TMA 0  // through a tensor map from a 128B-swizzled staging tile (below)
#endif
// FC_DQ_TMA (FLASHCUDA_SM90_BWD_DQ=tma; the host's default at d64 since session 10): the staging
// tile is kHeadDim / 32 boxes of kBlockM rows x 32 fp32 (128 bytes, 128B-swizzled as TMA lays
// them: the 16-byte chunk k of row r sits at chunk k ^ (r % 8)), and the writer issues one
// tensor-map reduction per box (map_dq: dq_accum as a 2-D (kHeadDim, B H Sq_pad) fp32 tensor): 4
// operations per step at d128, 2 at d64, with 2-way bank conflicts in the consumers' float2
// stores. See dq_swizzled.
#ifndef FC_DQ_FRAG
#define FC_DQ_FRAG 0  // from per-consumer tiles in register order (below)
#endif
// FC_DQ_FRAG (FLASHCUDA_SM90_BWD_DQ=frag; the host's default at d128 since session 12;
// FlashAttention 4's way): each consumer stages its 64 x 64 dQ tile as 16 KB in its registers'
// order — thread w (of the warpgroup's 128) puts dq[4k .. 4k + 3] at float 512 k + 4 w, 8
// st.shared.v4 per thread, each warp writing 512 contiguous bytes (no bank conflicts, no
// swizzle arithmetic) — and hands it to the writer warp through its own dq_full[c] / dq_empty[c]
// pair; the writer issues one 16 KB bulk reduce-add per consumer into dq_accum, which then holds,
// per (batch, head), Sq_pad / kBlockM tiles of kConsumers such 4096-float blocks (frag_offset in
// flash_bwd_sm80.cu's CONVERT, compiled with FC_DQ_FRAG_M = kBlockM, reads it back).
constexpr int kDqHandshakes = FC_DQ_FRAG ? kConsumers : 1;  // dq_full / dq_empty pairs
// FC_DQ_FRAG: one consumer's tile (64 x 64, or with FC_DQ_SWAP 64 x kBlockM of dQ^T)
constexpr int kDqFragBytes = 64 * (kDqSwap ? kBlockM : 64) * 4;
constexpr int kDqBoxBytes = kBlockM * 128;  // FC_DQ_TMA: one box of 32 fp32 columns
constexpr int kDqStageBytes = kBlockM * kHeadDim * 4;  // the step's dQ staging
constexpr int kSmemDqStage = kSmemStats + kStages * 2 * kStatBytes;
constexpr int kSmemBar = kSmemDqStage + kDqStageBytes;
// kv_full, full[], empty[], dq_full, dq_empty (one pair per consumer with FC_DQ_FRAG)
constexpr int kBarriers = 1 + 2 * kStages + 2 * kDqHandshakes;
constexpr int kSmemBytes = 1024 + kSmemBar + 8 * kBarriers;  // + slack to align the base

static_assert(FC_DTYPE == 1 || FC_DTYPE == 2, "sm90 kernel: fp16 or bf16");
static_assert(kHeadDim == 64 || kHeadDim == 128, "sm90 kernel: head dim 64 or 128");
static_assert(kBlockN == 128, "two consumer warpgroups of 64 keys");
static_assert(kBlockM == 64 || kBlockM == 128 || (kDqSwap && kBlockM == 80),
              "wgmma_ss is instantiated for n = 64, 128 (80 with FC_DQ_SWAP)");
static_assert(kDqSwap ? kHeadDim == 64 * kConsumers : kBlockM * kHeadDim == 64 * 64 * kConsumers,
              "one 64 x 64 dQ tile per consumer (FC_DQ_SWAP: 64 columns of dQ^T per consumer)");
static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= register_pool(kThreads),
              "register split over the CTA's pool at launch (register_pool, sm90.cuh)");
static_assert(kSmemBytes == FC_SMEM_BYTES, "smem layout disagrees with Sm90BwdConfig.smem_bytes");
static_assert(kSmemDqStage % 16 == 0, "bulk reduction sources are 16-byte aligned");

struct Smem {
  uint32_t base;  // 1024-byte aligned
  uint8_t* ptr;   // the same, as a generic pointer (for ordinary loads)

  __device__ __forceinline__ uint32_t k() const { return base + kSmemK; }
  __device__ __forceinline__ uint32_t v() const { return base + kSmemV; }
  __device__ __forceinline__ uint32_t q(int s) const { return base + kSmemQ + s * kQBytes; }
  __device__ __forceinline__ uint32_t dout(int s) const { return base + kSmemDO + s * kQBytes; }
  __device__ __forceinline__ uint32_t ds(int b) const { return base + kSmemDS + b * kDsBytes; }
  __device__ __forceinline__ uint32_t lse2(int s) const {
    return base + kSmemStats + s * 2 * kStatBytes;
  }
  __device__ __forceinline__ uint32_t delta(int s) const { return lse2(s) + kStatBytes; }
  __device__ __forceinline__ const float* lse2_ptr(int s) const {
    return reinterpret_cast<const float*>(ptr + kSmemStats + s * 2 * kStatBytes);
  }
  __device__ __forceinline__ const float* delta_ptr(int s) const {
    return lse2_ptr(s) + kBlockM;
  }
  __device__ __forceinline__ uint32_t dq_stage() const { return base + kSmemDqStage; }
  __device__ __forceinline__ uint32_t bar(int i) const { return base + kSmemBar + 8 * i; }
  __device__ __forceinline__ uint32_t kv_full() const { return bar(0); }
  __device__ __forceinline__ uint32_t full(int s) const { return bar(1 + s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return bar(1 + kStages + s); }
  // The dQ staging tile is full (every consumer warp stored its part) / empty (the writer
  // warp's reductions have read it)
  __device__ __forceinline__ uint32_t dq_full(int c = 0) const {
    return bar(1 + 2 * kStages + c);
  }
  __device__ __forceinline__ uint32_t dq_empty(int c = 0) const {
    return bar(1 + 2 * kStages + kDqHandshakes + c);
  }
  // FC_DQ_FRAG: consumer c's 16 KB staging tile
  __device__ __forceinline__ uint32_t dq_frag(int c) const {
    return base + kSmemDqStage + c * kDqFragBytes;
  }

  __device__ __forceinline__ void init_barriers() const {
    mbar_init(kv_full(), 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), kConsumerWarps);
    }
#pragma unroll
    for (int c = 0; c < kDqHandshakes; ++c) {
      mbar_init(dq_full(c), FC_DQ_FRAG ? 4 : kConsumerWarps);  // one arrival per (its) warp
      mbar_init(dq_empty(c), 1);
    }
    fence_barrier_init();
  }
};

using Steps = KeyBlockSteps<kBlockM, kBlockN>;  // (mask.cuh)

// Bring-up watchdog (FC_WATCHDOG = 1, FLASHCUDA_SM90_BWD_WATCHDOG=1): a wait that has not
// completed after 2 s of %globaltimer gives up and marks its thread `stuck` (its later waits
// return at once), so a wrong phase lets the kernel finish, with NaN in every dK / dV row a stuck
// consumer thread stores, instead of hanging the GPU. Not a trap: __trap() in the loop makes
// ptxas give up the setmaxnreg budget (C7512, 1 KB of spills); not printf: a call serializes
// every wgmma (C7510).
constexpr bool kWatchdog = FC_WATCHDOG;
#ifndef FC_RELEASE_FENCE
#define FC_RELEASE_FENCE 1  // the host sets it per head dim (bwd_sm90.FENCE_DIMS: off at both
                            // since session 21); FLASHCUDA_SM90_BWD_FENCE=0 / 1 (A/B); release()
#endif
static_assert(FC_DQ_TMA + FC_DQ_FRAG == 1, "one dQ staging form: FC_DQ_TMA or FC_DQ_FRAG");
static_assert(!FC_DQ_TMA || kSmemDqStage % 1024 == 0,
              "128B-swizzled TMA boxes start 1024-byte aligned");
static_assert(!FC_DQ_FRAG || kConsumers * kDqFragBytes == kDqStageBytes,
              "the consumers' tiles fill the step's staging region");
static_assert(kDsKMajor == kDqSwap && (!kDqSwap || FC_DQ_FRAG),
              "FC_DQ_SWAP: FC_DQ_FRAG's staging, dS [query][key] (and only there)");
#ifndef FC_DS_STMATRIX
#define FC_DS_STMATRIX 0  // dS^T stored by stmatrix.x4 (the host's default at d64 since session
                          // 12, Sm90BwdConfig.ds_stmatrix; see Consumer::store_ds_stmatrix)
#endif
// (the [key][query] layout only; no effect with FC_DQ_SWAP)
[[maybe_unused]] constexpr bool kDsStmatrix = FC_DS_STMATRIX && !kDsKMajor;
// FC_PROBS_EARLY = k (session 23; k = 4 the host's default for the default kernels of d64 and,
// since session 24, d128 with its 80-query form, bwd_sm90.PROBS_EARLY; an A/B elsewhere): only
// P^T's first k column blocks of 8 queries before the dP^T wait, the rest after it, in the block
// that computes dS^T. The d64 backward's ncu source counters against FlashAttention 4's (16 x 1024
// x 32, runs/lane-20261202-76195cb): the same 16.8 M MUFU.EX2, but 5468 "wait" stall samples on
// them against 869 — ours issue back to back (each P^T element is one FFMA and one MUFU, nothing
// else to put between them), FA4's between its mask FSELs and lse shuffles. After the wait, the
// FADD / FMUL of dS^T's first blocks can fill the MUFU spacing of P^T's last ones. The default,
// kBlockM / 8, is the kernel before.
#ifndef FC_PROBS_EARLY
#define FC_PROBS_EARLY (kBlockM / 8)
#endif
constexpr int kProbsEarly = FC_PROBS_EARLY;
static_assert(kProbsEarly >= 0 && kProbsEarly <= kBlockM / 8, "FC_PROBS_EARLY: 0 .. kBlockM / 8");
// FC_PROBS_EMU = k (session 25; k = 2 the host's default at d64, bwd_sm90.PROBS_EMU; an A/B
// elsewhere): the exp2s of k of P^T's column blocks after the dP^T wait (evenly spaced among
// them) run on the FMA pipe (exp2_fma) instead of MUFU. Both
// consumer warpgroups reach that part of the step together (the dS^T barrier keeps them in step),
// so a sub-partition's two consumer warps issue their MUFUs into one XU pipe at once: 16 results
// per SM cycle, 8 cycles per warp instruction — at d64 (48 such exp2s per thread) 768 XU cycles
// against ~480 issue cycles for everything else the block does with those elements. Moving a
// fifth of them to ~8 FMA-pipe instructions each balances the two. (The forward's version of this,
// session 14, lost 4-14%: there the warpgroups take turns and the XU pipe is not the bound.)
// Measured (session 25, perf-notes): k = 2 +0.0 to +1.6% at d64, k = 3 -4.5 to -9.6%, d128
// noise — smaller than this balance predicts: the phase is not purely XU-bound.
#ifndef FC_PROBS_EMU
#define FC_PROBS_EMU 0
#endif
static_assert(FC_PROBS_EMU >= 0 && FC_PROBS_EMU <= kBlockM / 8 - kProbsEarly,
              "FC_PROBS_EMU: 0 .. the column blocks after the dP^T wait");

// Whether P^T's column block j takes its exp2s on the FMA pipe (FC_PROBS_EMU of the blocks
// [kProbsEarly, kBlockM / 8), spread out; j is a constant once probs' loop is unrolled).
__device__ __forceinline__ constexpr bool probs_on_fma(int j) {
  constexpr int n = kBlockM / 8 - kProbsEarly;
  return FC_PROBS_EMU > 0 && j >= kProbsEarly &&
         ((j - kProbsEarly) * FC_PROBS_EMU) / n != ((j - kProbsEarly + 1) * FC_PROBS_EMU) / n;
}

// 2^x on the FMA pipe, for x <= 0.5 (a score less its row's log-sum-exp, up to rounding) or -inf
// / NaN: x clamped at -125 keeping NaN; t = x + 1.5 * 2^23 puts n = round(x) in t's low mantissa
// bits; 2^(x - n) by a cubic fitted for relative error on [-0.5, 0.5] (7.7e-5 in fp32 Horner:
// 4% of bf16's half-ulp, 16% of fp16's; tests/cpu/test_bwd_sm90_probs_emu.py repeats this
// arithmetic in numpy); 2^n added into the exponent field: t's bits shifted by 23 are n << 23
// (the 1.5 * 2^23 part shifts out). -inf gives 2^-125 (not 0; P^T's masked elements are zeroed
// after this), NaN stays NaN; x >= 127.5 (impossible with the forward's lse) would not be 2^x.
__device__ __forceinline__ float exp2_fma(float x) {
  asm("max.NaN.f32 %0, %0, 0fC2FA0000;" : "+f"(x));  // max(x, -125), NaN kept
  const float t = __fadd_rn(x, 12582912.f);          // 1.5 * 2^23 + round(x)
  const float f = __fadd_rn(x, -__fadd_rn(t, -12582912.f));
  float p = fmaf(0.05516774207353592f, f, 0.24260137975215912f);
  p = fmaf(p, f, 0.6932608485221863f);
  p = fmaf(p, f, 0.9999287724494934f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// (kProducer: the TMA producer's wait for a free stage, mbar_wait_producer)
template <bool kProducer = false>
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity, bool& stuck) {
  if constexpr (kWatchdog) {
    if (stuck) return;
    const uint64_t t0 = global_ns();
    while (!mbar_try_wait(bar, parity)) {
      if (global_ns() - t0 > 2000000000ull) {
        stuck = true;
        return;
      }
    }
  } else if constexpr (kProducer) {
    mbar_wait_producer(bar, parity);
  } else {
    mbar_wait(bar, parity);
  }
}

#ifndef FC_WAVE_SPLIT
// The last-wave split (Sm90BwdConfig.wave_split, bwd_sm90.wave_plan / lpt_launch_for; 0: off;
// the host's defaults: WAVE_SPLIT_DIMS, LPT_LAUNCH_DIMS). A grid of T work
// items on S SMs (one CTA each) runs T / S full waves and a last one of r = T mod S CTAs, during
// which S - r SMs idle (timelines, session 37: 1.5-3.3% of the d64 calls). With the split the
// host launches two kernels built from this file:
//   1  MAIN: the grid as always, but CTAs before `first_main` in blockIdx order exit at once (the
//      GPU dispatches them first: see wave_split.py), and every CTA triggers its programmatic
//      dependents at its start;
//   2  PIECES: launched as MAIN's programmatic dependent (it starts once every MAIN CTA has
//      started, on the SMs MAIN's last wave frees), one CTA per piece of the host's table:
//      item `item` (a work item < first_main, in blockIdx order) over its steps [step0, step_end)
//      only. A piece reduces its dK (unscaled) and dV in fp32 into its item's slot of `part`
//      (red.global.add.v4, each thread's registers in their own order: 16-byte reductions, a
//      warp's 512 contiguous bytes), then adds its step count to the slot's counter; the piece
//      that brings the counter to the item's step count read the sums back into its
//      accumulators and runs the epilogue. `part` and the counters are zeroed per call.
//   3  TAIL (bwd_sm90.LPT_LAUNCH_DIMS, causal calls): MAIN's skipped items are its first K
//      whole (KV head, batch) pairs, run by a second grid of (K, key blocks): CTA (x, y) runs key
//      block y of pair x, so the GPU starts key block 0 of every such pair first — under a causal
//      mask the longest-first order FC_LPT_TAIL computes, here with the key block a blockIdx
//      component (FC_LPT_TAIL's remap cost d64 its uniform wgmma descriptors); MAIN's
//      programmatic dependent like PIECES, whole items, no sums.
// dQ: every piece reduces its steps' dQ into dq_accum as MAIN does. A piece's (TAIL CTA's)
// thread 64 (an idle producer warp) waits for MAIN's completion (griddepcontrol.wait) before the
// CTA exits, so the next kernel in the stream (CONVERT) starts after both.
#define FC_WAVE_SPLIT 0
#endif
static_assert(FC_WAVE_SPLIT >= 0 && FC_WAVE_SPLIT <= 3, "FC_WAVE_SPLIT: 0, 1 (MAIN), 2 or 3");
// FC_LPT_TAIL (attention/block_order.cuh, default 0) = K > 0: the CTAs of the last K (KV head,
// batch) pairs of the grid run longest-first across those pairs — key block 0 of all K pairs,
// then key block 1, ... — instead of pair after pair; the rest of the grid keeps blockIdx order
// (the CTAs that run together read the same heads' Q / dO: session 12's FC_LPT_ORDER, which
// reordered the whole grid, lost up to 6% at d64). The GPU starts CTAs in blockIdx order (the
// backward timeline, session 13), and under a causal mask key block 0 has the most steps, so the
// last pair's heaviest CTAs would start near the end: at 4 x 4096 x 16 d128 causal the SMs idled
// 83 us (median) of a 1299 us makespan. The host sets K = 8 for causal calls at d128
// (bwd_sm90.LPT_TAIL; session 14 on the H200: +1-2.7% at causal 1k / 4k / 8k, 0 at 2k); d64
// lost 3-4% (session 14) and 5.5-9.4% with K = 4 / 8 (session 33), so 0 there and without a mask.
// Why (session 37): the remapped key block is no blockIdx component, and holding it through the
// consumers' loop moves d64's wgmma descriptors into vector registers (R2UR 22 -> 111); the
// remap's arithmetic with blockIdx order kept loses as much (-4.5 to -9.5%), the order itself
// gains +1 to +3%: d64's causal calls take FC_WAVE_SPLIT = 3's tail grid instead.
#ifndef FC_TIMELINE
#define FC_TIMELINE 0  // 1: per-CTA times into a buffer (a profiling variant, see "timeline")
#endif
static_assert(!FC_WAVE_SPLIT || !FC_LPT_TAIL, "FC_WAVE_SPLIT: the grid in blockIdx order");
#if FC_TIMELINE
// ---- timeline: where a CTA's time goes (profiling variant) -------------------------------------
// Record of CTA (x, y, z) at (x + gridDim.x (y + gridDim.y z)) * kTimelineWords of the buffer,
// each word written once by the thread named (t128: consumer 0's first thread, t256: consumer
// 1's; the host zeroes the buffer, so a word nobody wrote reads 0):
//   kTlId        smid << 32 | steps                               t128, at exit
//   kTlBlock     blockIdx.z << 48 | blockIdx.y << 32 | blockIdx.x  t128, at exit
//   kTlEntry     the kernel's first instruction                    t128
//   kTlFirstTma  just before the producer issues K and V           the producer thread
//   kTlProduced  the producer's last TMA issued (it has waited for the last empty stage)
//   kTlKv        K and V in shared memory (after the kv_full wait) t128
//   kTlFirst     step 0's Q, dO, lse2, delta in shared memory (after its full wait; the step
//                loop's own wait then returns at once)             t128
//   kTlLast      the last step done: its GEMMs complete and its dQ handed on (after the loop)
//                                                                  t128
//   kTlExit      dK / dV stores issued (the end of the epilogue)   t128; + 1: t256
//   kTlDqEnd     the dQ writer warp's last reduction complete (its lane 0)
//   kTlMerged    FC_WAVE_SPLIT = 2: the piece's dK / dV sums and step count done   t128
//   kTlS0        step 0's S^T landed (after its wait; dP^T may still run)          t128
//   kTlBar0      step 0's dS^T barrier passed (both consumers' dS^T in shared)     t128
//   kTlEnd0      step 0 done (dK's wait passed, its stage released)               t128
//   kTlEnd1      step 1 done, as kTlEnd0 (CTAs of 2 or more steps)                t128
// (the step marks: a causal CTA's step 0 is its masked one; against an unmasked CTA's step 0
// and the steps after it, they say what the masked step costs and where inside the step)
// (a piece that is not its item's last exits after kTlMerged: its kTlExit is that time)
// Single-thread stores straight to the buffer (no value held across the step loop, so the
// consumers' registers are the default build's); globaltimer_ns (sm90.cuh) keeps program order.
constexpr int kTlId = 0, kTlBlock = 1, kTlEntry = 2, kTlFirstTma = 3, kTlProduced = 4,
              kTlKv = 5, kTlFirst = 6, kTlLast = 7, kTlExit = 8, kTlDqEnd = 10;
[[maybe_unused]] constexpr int kTlMerged = 11;
constexpr int kTlS0 = 12, kTlBar0 = 13, kTlEnd0 = 14, kTlEnd1 = 15;
constexpr int kTimelineWords = 16;

// One record per CTA, at its place in blockIdx order.
__device__ __forceinline__ uint64_t* timeline_record(uint64_t* timeline) {
  const int64_t cta =
      blockIdx.x + static_cast<int64_t>(gridDim.x) * (blockIdx.y + gridDim.y * blockIdx.z);
  return timeline + cta * kTimelineWords;
}

// word := now (the calling thread decides whether it is the one that records)
__device__ __forceinline__ void timeline_mark(uint64_t* timeline, int word) {
  timeline_record(timeline)[word] = globaltimer_ns();
}

// A consumer's exit time, and consumer 0's SM, step count and block index (its first thread).
__device__ __forceinline__ void timeline_close(uint64_t* timeline, int c, int steps) {
  if ((threadIdx.x & 127) == 0) {
    timeline_mark(timeline, kTlExit + c);
    if (c == 0) {
      uint64_t* rec = timeline_record(timeline);
      rec[kTlId] = (static_cast<uint64_t>(sm_id()) << 32) | static_cast<uint32_t>(steps);
      rec[kTlBlock] = (static_cast<uint64_t>(blockIdx.z) << 48) |
                      (static_cast<uint64_t>(blockIdx.y) << 32) | blockIdx.x;
    }
  }
}
#endif

__device__ __forceinline__ int stage_of(int it) { return it % kStages; }
// The CTA's steps: its piece's `count` (FC_WAVE_SPLIT = 2), else all of its item's. (MAIN asks
// steps.count() where it needs it rather than keeping it from the start, as before the split: a
// value held from the kernel's start moved ptxas's uniform registers around.)
__device__ __forceinline__ int own_steps(const Steps& steps, int count) {
  return FC_WAVE_SPLIT == 2 ? count : steps.count();
}
__device__ __forceinline__ uint32_t parity_of(int it) { return (it / kStages) & 1; }

// ---- producer: one thread issues every TMA load -------------------------------------------------
__device__ __forceinline__ void produce(const Smem& sm, const Steps& steps, int n0, int head_kv,
                                        int batch, const TmaMap& map_q, const TmaMap& map_k,
                                        const TmaMap& map_v, const TmaMap& map_do,
                                        const float* lse2, const float* delta, int nheads,
                                        int seqlen_q_pad, int step0, int count) {
  bool stuck = false;  // the watchdog's verdict (FC_WATCHDOG)
  mbar_arrive_expect_tx(sm.kv_full(), 2 * kKVBytes);
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    tma_load_4d(sm.k() + c * kKVChunkBytes, map_k, sm.kv_full(), c * kChunkCols, n0, head_kv,
                batch);
    tma_load_4d(sm.v() + c * kKVChunkBytes, map_v, sm.kv_full(), c * kChunkCols, n0, head_kv,
                batch);
  }
  const int n = own_steps(steps, count);
  for (int it = 0; it < n; ++it) {  // (it: the CTA's own step)
    const int s = stage_of(it);
    const int h = steps.head(step0 + it, head_kv), m0 = steps.m0(step0 + it);
    wait<true>(sm.empty(s), parity_of(it) ^ 1, stuck);  // first pass: stages start empty
    mbar_arrive_expect_tx(sm.full(s), 2 * kQBytes + 2 * kStatBytes);
    const int64_t row = (static_cast<int64_t>(batch) * nheads + h) * seqlen_q_pad + m0;
    bulk_load(sm.lse2(s), lse2 + row, kStatBytes, sm.full(s));
    bulk_load(sm.delta(s), delta + row, kStatBytes, sm.full(s));
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      tma_load_4d(sm.q(s) + c * kQChunkBytes, map_q, sm.full(s), c * kChunkCols, m0, h, batch);
      tma_load_4d(sm.dout(s) + c * kQChunkBytes, map_do, sm.full(s), c * kChunkCols, m0, h,
                  batch);
    }
  }
}

// One arrival per consumer warp on an "empty" barrier (every lane's wgmma reading the stage has
// completed: a wgmma_wait in each lane before the __syncwarp). The consumers also read lse2 /
// delta with ordinary loads, which the producer's next cp.async.bulk (async proxy) overwrites:
// the proxy fence orders those generic reads before it, as the PTX memory model asks of a
// generic-then-async access pair. Without it (d128's default since session 19: +2-6% in a
// same-process A/B; d64 keeps it, 3-11% faster with it in session 2's A/B) the order still holds
// in this kernel: every lse2 / delta value a lane loads feeds the exp2 / dS arithmetic that the
// stage's dV / dK wgmmas consume, and those wgmmas complete (wgmma_wait) before the arrive below,
// so each load has returned its data (register scoreboard) before the producer can observe the
// release; CUTLASS's TMA pipelines release consumer stages the same way, without a proxy fence.
// compute-sanitizer racecheck reports this write-after-read with or without the fence
// (scripts/racecheck_probe.py bulk shows the same report on a minimal correct ring;
// docs/GUARANTEES.md).
__device__ __forceinline__ void release(uint32_t bar) {
#if FC_RELEASE_FENCE
  fence_proxy_async();  // this lane's generic reads of the stage (lse2, delta) before TMA rewrites
#endif
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(bar);
}

// ---- dQ writer: warp 1 of the producer warpgroup -----------------------------------------------
// Per step: wait until the consumers have stored the step's dQ tile (dq_full), reduce it into
// dq_accum (FC_DQ_TMA: one tensor-map reduce-add per 32-column box; FC_DQ_FRAG: one bulk
// reduce-add per consumer's tile), wait until the reductions have read the staging tile, hand it
// back (dq_empty). The reductions run beside the consumers' next step; only their issue and the
// read wait are this warp's. Before returning, every reduction is complete (not only read): no
// bulk operation outlives the CTA's shared memory.
__device__ __forceinline__ void write_dq(const Smem& sm, const Steps& steps, int step0, int count,
                                         int head_kv, int batch, float* dq_accum,
                                         const TmaMap* map_dq, int nheads, int seqlen_q_pad,
                                         int lane) {
  bool stuck = false;  // the watchdog's verdict (FC_WATCHDOG)
  if constexpr (FC_DQ_FRAG) {
    // Per step and consumer c, as soon as c has staged: one 16 KB (FC_DQ_SWAP: 20 KB) reduce-add
    // of its tile, then its buffer back once the reduction has read it; the other consumer is not
    // waited for.
    const int tiles_m = seqlen_q_pad / kBlockM;  // the host pads Sq to whole query blocks
    for (int it = 0; it < own_steps(steps, count); ++it) {
      const int h = steps.head(step0 + it, head_kv), m0 = steps.m0(step0 + it);
      const int64_t tile =
          ((static_cast<int64_t>(batch) * nheads + h) * tiles_m + m0 / kBlockM) * kConsumers;
#pragma unroll
      for (int c = 0; c < kConsumers; ++c) {
        wait(sm.dq_full(c), it & 1, stuck);
        if (lane == 0) {
          bulk_reduce_add_f32(dq_accum + (tile + c) * (kDqFragBytes / 4), sm.dq_frag(c),
                              kDqFragBytes);
          bulk_commit_group();
          bulk_wait_group_read<0>();
          mbar_arrive(sm.dq_empty(c));
        }
        __syncwarp();
      }
    }
    if (lane == 0) bulk_wait_group<0>();
  } else {
    for (int it = 0; it < own_steps(steps, count); ++it) {
      const int h = steps.head(step0 + it, head_kv), m0 = steps.m0(step0 + it);
      wait(sm.dq_full(), it & 1, stuck);
      const int64_t row0 = (static_cast<int64_t>(batch) * nheads + h) * seqlen_q_pad + m0;
      // row0 < 2^31: the host checks B H Sq_pad against the tensor map's int32 coordinates
      if (lane == 0) {
#pragma unroll
        for (int b = 0; b < kHeadDim / 32; ++b)
          tma_reduce_add_2d(*map_dq, sm.dq_stage() + b * kDqBoxBytes, 32 * b,
                            static_cast<int>(row0));
      }
      bulk_commit_group();
      bulk_wait_group_read<0>();
      __syncwarp();
      if (lane == 0) mbar_arrive(sm.dq_empty());
    }
    bulk_wait_group<0>();
  }
}

// FC_DQ_TMA: Consumer::stage_dq's fragments go into the 128B-swizzled boxes of the staging tile:
// (row, col) -> box col / 32, row `row`, 16-byte chunk ((col % 32) / 4) ^ (row % 8), word
// col % 4. Banks: a half-warp's 16 float2 stores (g % 4 = 0..3, t = 0..3) fall in chunks
// (2 (j % 4) + t / 2) ^ g (row % 8 = g: the other row terms are multiples of 8): 4 distinct
// chunks of 16 bytes for 128 bytes of data, 2-way conflicts (ncu, session 11: exactly 2 extra
// wavefronts per store, 30% of the backward's shared-store wavefronts).
// FC_DQ_SPREAD = 1 (A/B): at store i the lanes of odd g store fragment j = i ^ 2 instead of i
// (every lane still stores each of its fragments once, picked with a select, no dynamic register
// index): the half-warp's chunks become (2 (j % 4) + t / 2) ^ g with j % 4 = (i % 4) ^ 2 (g & 1),
// i.e. pair (j ^ (g >> 1)) & 3 = (i ^ 2 (g & 1) ^ (g >> 1)) & 3, four distinct pairs of chunks
// for g = 0..3: 8 chunks, 128 bytes, one wavefront per half-warp (tests/cpu/test_bwd_sm90_
// compile.py checks the arithmetic for every instruction).
#ifndef FC_DQ_SPREAD
#define FC_DQ_SPREAD 0
#endif
// (no effect on the other dQ modes; the host's default at d64 since session 11, SPREAD_DIMS)
[[maybe_unused]] constexpr bool kDqSpread = FC_DQ_SPREAD && FC_DQ_TMA;
__device__ __forceinline__ uint32_t dq_swizzled(uint32_t stage, int row, int col) {
  const int cc = col & 31;
  return stage + (col >> 5) * kDqBoxBytes + row * 128 + (((cc >> 2) ^ (row & 7)) << 4) +
         ((cc & 3) << 2);
}

// ---- consumer -----------------------------------------------------------------------------------
// Accumulator element (j, e) of an m64 x n tile (sm90.cuh header): row (here: key) 16 warp + g +
// 8 (e >> 1), column (here: query or d) 8 j + 2 t + (e & 1).
struct Consumer {
  float dk[kHeadDim / 2];          // dK of this warpgroup's 64 keys (m64n{kHeadDim} layout)
  float dv[kHeadDim / 2];
  float s[kBlockM / 2];            // S^T, then P^T (fp32)
  float dp[kBlockM / 2];           // dP^T
  uint32_t p16[kBlockM / 16][4];   // P^T as the A fragments of dV += P^T dO
  uint32_t ds16[kBlockM / 16][4];  // dS^T as the A fragments of dK += dS^T Q
  float dq[kDqSwap ? kBlockM / 2 : 32];  // this consumer's 64 x 64 dQ tile (FC_DQ_SWAP: 64 x
                                        // kBlockM of dQ^T)
  uint32_t k_rows, v_rows;         // shared address of this warpgroup's 64 K / V rows (chunk 0)

  __device__ __forceinline__ void init(const Smem& sm, int wg_key0) {
    k_rows = sm.k() + wg_key0 * 128;  // 64-row offsets stay 1024-byte aligned
    v_rows = sm.v() + wg_key0 * 128;
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) dk[i] = dv[i] = 0.f;
  }

  // acc = X Y^T over kHeadDim / 16 k16 steps (one commit group): X = 64 K or V rows, Y = the
  // query tile (Q or dO), both K-major (d contiguous); step kk reads 32 bytes at column
  // (kk % 4) * 16 of chunk kk / 4, as the forward's Q K^T.
  __device__ __forceinline__ void issue_transposed_scores(float (&acc)[kBlockM / 2], uint32_t x,
                                                          uint32_t y) {
    const uint64_t a0 = smem_desc_k_major_sw128(x), b0 = smem_desc_k_major_sw128(y);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t col = kk / 4, within = (kk % 4) * 32;
      const uint64_t a = k_major_at(a0, x, col * kKVChunkBytes + within);
      const uint64_t b = k_major_at(b0, y, col * kQChunkBytes + within);
      wgmma_ss<kBlockM, T>(acc, a, b, kk > 0);
    }
    wgmma_commit();
  }

  // acc += A Y over kBlockM / 16 k16 steps: A = 16-bit fragments (keys x queries), Y = the query
  // tile (queries x d) read MN-major (imm-trans-b = 1); step kk reads query rows 16 kk .. + 15
  // (2048 bytes further per step), every d chunk (kQChunkBytes apart). No commit.
  __device__ __forceinline__ void issue_key_grad(float (&acc)[kHeadDim / 2],
                                                 const uint32_t (&a)[kBlockM / 16][4], uint32_t y) {
    const uint64_t b0 = smem_desc_mn_major_sw128(y, kQChunkBytes);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const uint64_t b = mn_major_at(b0, y, kk * 16 * 128, kQChunkBytes);
      wgmma_rs_tb<kHeadDim, T>(acc, a[kk], b, 1);
    }
  }

  // dq = dS K for query tile tm, d tile td (one commit group); step kk covers keys 16 kk .. + 15
  // of the whole block (both consumers' dS). B = K stored [key][d] (d contiguous, chunk td), read
  // MN-major. A = dS: stored [key][query] (chunk tm), read MN-major.
  // FC_DQ_SWAP: dq = dQ^T for d tile td (the consumer's 64 columns of dQ, all kBlockM queries) =
  // K^T dS^T: A = K^T, K's chunk td read MN-major (d contiguous; step kk: key rows 16 kk ..,
  // 2048 bytes further), B = dS stored [query][key], read K-major (step kk: 32 bytes at column
  // (kk % 4) * 16 of key chunk kk / 4), N = kBlockM query rows.
  __device__ __forceinline__ void issue_dq(uint32_t ds, uint32_t k, int tm, int td) {
    const uint32_t k_base = k + td * kKVChunkBytes;
#if FC_DQ_SWAP  // (not if constexpr: outside a template the other branch's calls must match too)
    {
      const uint64_t a0 = smem_desc_mn_major_sw128(k_base, kKVChunkBytes);
      const uint64_t b0 = smem_desc_k_major_sw128(ds);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint64_t a = mn_major_at(a0, k_base, kk * 16 * 128, kKVChunkBytes);
        const uint64_t b = k_major_at(b0, ds, (kk / 4) * kDsChunkBytes + (kk % 4) * 32);
        wgmma_ss_ta<kBlockM, T>(dq, a, b, kk > 0);
      }
    }
#else
    {
      const uint32_t ds_base = ds + tm * kDsChunkBytes;
      const uint64_t b0 = smem_desc_mn_major_sw128(k_base, kKVChunkBytes);
      const uint64_t a0 = smem_desc_mn_major_sw128(ds_base, kDsChunkBytes);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint64_t b = mn_major_at(b0, k_base, kk * 16 * 128, kKVChunkBytes);
        const uint64_t a = mn_major_at(a0, ds_base, kk * 16 * 128, kDsChunkBytes);
        wgmma_ss_tt<64, T>(dq, a, b, kk > 0);
      }
    }
#endif
    wgmma_commit();
  }

  // The A registers of in-flight wgmmas belong to the tensor cores until they drain.
  __device__ __forceinline__ void hold_p() {
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(p16[kk][r])::"memory");
  }
  __device__ __forceinline__ void hold_ds() {
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(ds16[kk][r])::"memory");
  }

  // P^T = exp2(S^T * scale_log2 - lse2[query]); with kMasked, 0 where the key is hidden from the
  // query. `lse2`: the stage's lse2 (shared) at this lane's column 2t; `key0`: key of row g;
  // `col0`: query of column 2t. (Loading lse2 / delta into registers while the step's wgmmas
  // run, FC_STATS_EARLY, measured 0 to -1.8% at d128 in session 12: removed, perf-notes.)
  // Column blocks j of [kJ0, kJ1) only (FC_PROBS_EARLY splits them around the dP^T wait).
  template <bool kMasked, int kJ0 = 0, int kJ1 = kBlockM / 8>
  __device__ __forceinline__ void probs(const float* lse2, float scale_log2, const Mask& mask,
                                        int key0, int col0) {
#pragma unroll
    for (int j = kJ0; j < kJ1; ++j) {
      const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * j);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = fmaf(s[4 * j + e], scale_log2, -((e & 1) ? l2.y : l2.x));
        float p = probs_on_fma(j) ? exp2_fma(x) : fast_exp2(x);
        if (kMasked && !mask.visible(col0 + 8 * j + (e & 1), key0 + 8 * (e >> 1))) p = 0.f;
        s[4 * j + e] = p;
      }
    }
  }

  // dS^T = P^T o (dP^T - delta[query]) into dp's registers; with kMasked, 0 wherever P^T is 0.
  // `delta`: the stage's delta (shared) at this lane's column 2t.
  template <bool kMasked, int kJ0 = 0, int kJ1 = kBlockM / 8>
  __device__ __forceinline__ void dsoftmax(const float* delta) {
#pragma unroll
    for (int j = kJ0; j < kJ1; ++j) {
      const float2 dl = *reinterpret_cast<const float2*>(delta + 8 * j);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float ds = s[4 * j + e] * (dp[4 * j + e] - ((e & 1) ? dl.y : dl.x));
#if !defined(FC_DS_SELECT) || FC_DS_SELECT  // (diagnostic 0: no select; NaN then leaks)
        if (kMasked && s[4 * j + e] == 0.f) ds = 0.f;
#endif
        dp[4 * j + e] = ds;
      }
    }
  }

  // fp32 C fragments -> 16-bit A fragments: n8 blocks 2kk, 2kk + 1 are k16 step kk.
  __device__ __forceinline__ static void pack(uint32_t (&a)[kBlockM / 16][4],
                                              const float (&c)[kBlockM / 2]) {
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const float* lo = &c[8 * kk];
      a[kk][0] = pack2<T>(lo[0], lo[1]);
      a[kk][1] = pack2<T>(lo[2], lo[3]);
      a[kk][2] = pack2<T>(lo[4], lo[5]);
      a[kk][3] = pack2<T>(lo[6], lo[7]);
    }
  }

  // dS^T (16-bit) -> shared. Fragment f of k16 step kk holds (key r, queries q, q + 1).
  // [key][query] layout: element (r, q) at chunk q / 64, row r, 16-byte unit ((q % 64) / 8) ^
  // (r % 8); a lane's 4-byte stores of one fragment hit 8 rows x 4 words: 32 banks. `r0`: key
  // of row g (r0 % 8 == g). ([query][key], FC_DQ_SWAP's: store_ds_trans.)
  // FC_DS_STMATRIX (the [key][query] layout; d64's default since session 12: +0.8-3.5% there,
  // -2.4 to +0.8% at d128, same-run A/B): one stmatrix.x4 per k16 step instead of four
  // st.shared.b32. Fragment f of step kk is the 8 x 8 matrix (keys 8 (f & 1) .., queries
  // 16 kk + 8 (f >> 1) ..) of the warp's 16 keys, in the stmatrix register layout (row = g,
  // columns 2t, 2t + 1); lane l gives the address of row l % 8 of matrix f = l / 8: key `row0`
  // + 8 (f & 1) + l % 8, its 16 queries' 16-byte unit swizzled as store_ds's
  // (tests/cpu/test_bwd_sm90_compile.py checks the two put every element at the same address).
  // `row0`: the warp's first key in the block (r0 - g).
  __device__ __forceinline__ void store_ds_stmatrix(uint32_t ds, int row0, int lane) const {
    const int f = lane >> 3;
    const int r = row0 + 8 * (f & 1) + (lane & 7);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const int q = 16 * kk + 8 * (f >> 1);  // the matrix row's first query
      const uint32_t unit = static_cast<uint32_t>(((q % 64) / 8) ^ (r % 8));
      stmatrix_x4(ds + (q / 64) * kDsChunkBytes + r * 128 + unit * 16, ds16[kk][0], ds16[kk][1],
                  ds16[kk][2], ds16[kk][3]);
    }
  }

  // FC_DQ_SWAP: the [query][key] layout by stmatrix.x4.trans, one per k16 step: matrix f (keys
  // row0 + 8 (f & 1) .., queries 16 kk + 8 (f >> 1) ..) goes out transposed, so memory row i of
  // it (the address lane 8 f + i gives) is query 16 kk + 8 (f >> 1) + i with its 8 keys — one
  // 16-byte unit of that query's row, ((key % 64) / 8) ^ (query % 8) in key chunk key / 64
  // (tests/cpu/test_bwd_sm90_layouts.py checks it against that layout element by element).
  // Rows q .. q + 7 of a matrix fall in 8 distinct units: no bank conflicts.
  __device__ __forceinline__ void store_ds_trans(uint32_t ds, int row0, int lane) const {
    const int f = lane >> 3;
    const int r = row0 + 8 * (f & 1);  // the matrix's first key
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const int q = 16 * kk + 8 * (f >> 1) + (lane & 7);
      const uint32_t unit = static_cast<uint32_t>(((r % 64) / 8) ^ (q % 8));
      stmatrix_x4_trans(ds + (r / 64) * kDsChunkBytes + q * 128 + unit * 16, ds16[kk][0],
                        ds16[kk][1], ds16[kk][2], ds16[kk][3]);
    }
  }

  __device__ __forceinline__ void store_ds(uint32_t ds, int r0, int t) const {
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const int r = r0 + 8 * (f & 1);
        const int q = 16 * kk + 8 * (f >> 1) + 2 * t;  // first of the fragment's two queries
        const uint32_t unit = static_cast<uint32_t>(((q % 64) / 8) ^ (r % 8));
        const uint32_t addr = ds + (q / 64) * kDsChunkBytes + r * 128 + unit * 16 + (q % 8) * 2;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(ds16[kk][f]) : "memory");
      }
  }


  // FC_DQ_FRAG: this consumer's dQ registers in their own order, thread w's float4 k at float
  // 512 k + 4 w of the 16 KB tile at `stage` (a warp's 32 float4 are 512 contiguous bytes;
  // FC_DQ_SWAP: 10 float4 of dQ^T, 20 KB).
  __device__ __forceinline__ void stage_dq_frag(uint32_t stage, int w) const {
#pragma unroll
    for (int k = 0; k < kDqFragBytes / 2048; ++k) {
      const uint32_t addr = stage + (512 * k + 4 * w) * 4;
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(dq[4 * k]),
                   "f"(dq[4 * k + 1]), "f"(dq[4 * k + 2]), "f"(dq[4 * k + 3])
                   : "memory");
    }
  }

  // FC_DQ_TMA: this consumer's 64 x 64 dQ tile -> its place (row0, col0) = (64 tm, 64 td) in
  // the step's staging boxes (dq_swizzled): lane (g, t) of warp w stores, per j and h, the
  // float2 (row row0 + 16w + g + 8h, columns col0 + 8j + 2t, + 1).
  __device__ __forceinline__ void stage_dq(uint32_t stage, int row0, int col0, int warp, int g,
                                           int t) const {
    // FC_DQ_SPREAD: lanes of odd g store fragment i ^ 2 at step i (see dq_swizzled)
    const bool swap = kDqSpread && (g & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float x = swap ? dq[4 * (i ^ 2) + 2 * h] : dq[4 * i + 2 * h];
        const float y = swap ? dq[4 * (i ^ 2) + 2 * h + 1] : dq[4 * i + 2 * h + 1];
        const int j = swap ? i ^ 2 : i;
        const int row = row0 + 16 * warp + g + 8 * h, col = col0 + 8 * j + 2 * t;
        const uint32_t addr = dq_swizzled(stage, row, col);
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y)
                     : "memory");
      }
  }
};

extern "C" __global__ void __launch_bounds__(kThreads, 1)
FC_KERNEL_NAME(const __grid_constant__ TmaMap map_q,   // q [B, Sq, H, D]: dims (D, Sq, H, B)
               const __grid_constant__ TmaMap map_k,   // k [B, Sk, Hkv, D]
               const __grid_constant__ TmaMap map_v,   // v [B, Sk, Hkv, D]
               const __grid_constant__ TmaMap map_do,  // dout [B, Sq, H, D]
#if FC_DQ_TMA
               const __grid_constant__ TmaMap map_dq,  // dq_accum as (D, B H Sq_pad) fp32
#endif
               const float* __restrict__ lse2,         // [B, H, Sq_pad] (PRE)
               const float* __restrict__ delta,        // [B, H, Sq_pad] (PRE)
               float* __restrict__ dq_accum,           // [B, H, Sq_pad, D] (PRE zeroed it)
               T* __restrict__ dk,                     // [B, Sk, Hkv, D]
               T* __restrict__ dv,                     // [B, Sk, Hkv, D]
#if FC_TIMELINE
               uint64_t* __restrict__ timeline,  // [gridDim.z][.y][.x][kTimelineWords]
#endif
#if FC_WAVE_SPLIT == 2
               const int4* __restrict__ pieces,  // [gridDim.x]: item, step0, step_end, slot
               float* __restrict__ part,         // [slots][2][kConsumers][kHeadDim / 2][128]
               int* __restrict__ part_steps,     // [slots] (zeroed): steps summed so far
#endif
               int64_t dk_sb, int64_t dk_ss, int64_t dk_sh, int64_t dv_sb, int64_t dv_ss,
               int64_t dv_sh, int seqlen_q, int seqlen_k, int nheads, int nheads_kv,
               int seqlen_q_pad, float scale_log2, float softmax_scale, int window_left,
               int window_right
#if FC_WAVE_SPLIT == 1
               , int first_main  // CTAs before it in blockIdx order: the pieces' items
#endif
               ) {
#if FC_WAVE_SPLIT == 1
  if (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z) < first_main) return;
  griddepcontrol_launch_dependents();  // the pieces may start once every CTA got here
#endif
#if FC_TIMELINE
  if (threadIdx.x == 128) timeline_mark(timeline, kTlEntry);
#endif
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = ((raw + 1023u) & ~1023u) - raw;
  const Smem sm{raw + pad, smem_raw + pad};
  // Warpgroup index, made visibly warp-uniform for ptxas (a shuffle from lane 0, as CUTLASS does).
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  const Mask mask{seqlen_q, seqlen_k, window_left, window_right};
  // the CTA's work item: its key block, KV head and batch, and the steps that see the key block
  // (FC_WAVE_SPLIT = 2: its piece's item and steps [step0, step0 + count) of them)
#if FC_WAVE_SPLIT == 2
  const int4 piece = pieces[blockIdx.x];
  const BlockCoord blk = item_coord(piece.x, (seqlen_k + kBlockN - 1) / kBlockN, nheads_kv);
#elif FC_WAVE_SPLIT == 3
  const BlockCoord blk = tail_grid_coord(blockIdx.x, blockIdx.y, nheads_kv);
#else
  const BlockCoord blk = block_coord<FC_LPT_TAIL>(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x,
                                                 gridDim.y, gridDim.z);
#endif
  const int n0 = blk.key_block * kBlockN, head_kv = blk.head_kv, batch = blk.batch;
  const Steps steps(mask, n0, nheads, nheads_kv);
#if FC_WAVE_SPLIT == 2
  const int step0 = piece.y, count = piece.z - piece.y;
#else
  constexpr int step0 = 0, count = 0;  // (own_steps: all of the item's)
#endif

  if (threadIdx.x == 0) {
    sm.init_barriers();
    tma_prefetch(map_q);
    tma_prefetch(map_k);
    tma_prefetch(map_v);
    tma_prefetch(map_do);
#if FC_DQ_TMA
    tma_prefetch(map_dq);
#endif
  }
  __syncthreads();

  if (wg == 0) {  // ---- producer warpgroup
    setmaxnreg_dec<kProducerRegs>();
#if FC_WAVE_SPLIT >= 2
    if (threadIdx.x == 64) griddepcontrol_wait();  // (the CTA ends after MAIN: see FC_WAVE_SPLIT)
#endif
    // one elected thread issues every load
    if (threadIdx.x < 32 && elect_one()) {
#if FC_TIMELINE
      timeline_mark(timeline, kTlFirstTma);
#endif
      produce(sm, steps, n0, head_kv, batch, map_q, map_k, map_v, map_do, lse2, delta, nheads,
              seqlen_q_pad, step0, count);
#if FC_TIMELINE
      timeline_mark(timeline, kTlProduced);
#endif
    }
    else if (threadIdx.x >= 32 && threadIdx.x < 64) {
      write_dq(sm, steps, step0, count, head_kv, batch, dq_accum,
#if FC_DQ_TMA
               &map_dq,
#else
               nullptr,
#endif
               nheads, seqlen_q_pad, static_cast<int>(threadIdx.x & 31));
#if FC_TIMELINE
      if (threadIdx.x == 32) timeline_mark(timeline, kTlDqEnd);
#endif
    }
    return;
  }

  // ---- consumer warpgroups
  setmaxnreg_inc<kConsumerRegs>();
  const int c = wg - 1;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int warp = static_cast<int>((threadIdx.x / 32) % 4);  // within the warpgroup
  const int g = lane >> 2, t = lane & 3;
  const int wg_key0 = 64 * c;                     // this warpgroup's first key in the block
  const int key_row = wg_key0 + 16 * warp + g;    // this lane's first key row in the block
  const int tm = c % kDqTilesM, td = c / kDqTilesM;  // this consumer's dQ tile
  bool stuck = false;  // the watchdog's verdict (FC_WATCHDOG)
  Consumer cs;
  cs.init(sm, wg_key0);
  // also when there are no steps: no TMA may outlive the CTA
  wait(sm.kv_full(), 0, stuck);
#if FC_TIMELINE
  if (threadIdx.x == 128) timeline_mark(timeline, kTlKv);
  if (own_steps(steps, count) > 0) {  // step 0's stage: the loop's wait then passes
    wait(sm.full(0), 0, stuck);
    if (threadIdx.x == 128) timeline_mark(timeline, kTlFirst);
  }
#endif

  // The step's query block by a counter, (step0 + it) % n_m of step it (Steps::m0 divides by
  // the runtime n_m: a 32-bit division per step). (The consumers need no query head: the
  // producer and the dQ writer address Q, dO and dq_accum.)
#if FC_WAVE_SPLIT == 2
  int step_mi = step0 % steps.n_m;  // (a piece has steps: n_m > 0)
#else
  int step_mi = 0;
#endif
  for (int it = 0; it < own_steps(steps, count); ++it) {  // (step step0 + it of the item)
    const int st = stage_of(it);
    const int m0 = (steps.m_first + step_mi) * kBlockM;
    if (++step_mi == steps.n_m) step_mi = 0;

    wait(sm.full(st), parity_of(it), stuck);
    wgmma_fence_operands(cs.s);
    wgmma_fence_operands(cs.dp);
    wgmma_fence();
    cs.issue_transposed_scores(cs.s, cs.k_rows, sm.q(st));
    cs.issue_transposed_scores(cs.dp, cs.v_rows, sm.dout(st));

    const float* st_lse2 = sm.lse2_ptr(st) + 2 * t;  // this lane's columns
    const float* st_delta = sm.delta_ptr(st) + 2 * t;
#if defined(FC_FORCE_MASKED)  // (diagnostic A/B: 1 every step masked, 0 none: wrong with a mask)
    const bool masked = FC_FORCE_MASKED;
#elif defined(FC_MASK_NEVER)  // (diagnostic A/B: both paths built, the masked one never taken:
    // wrong with a mask; a runtime-false test, where FC_FORCE_MASKED=0 lets ptxas drop the
    // masked path and reallocate the step's registers)
    const bool masked = mask.tile_needs_mask(m0, kBlockM, n0 + wg_key0, 64) && scale_log2 < 0.f;
#else
    const bool masked = mask.tile_needs_mask(m0, kBlockM, n0 + wg_key0, 64);
#endif
    wgmma_wait<1>();
    wgmma_fence_operands(cs.s);
#if FC_TIMELINE
    if (it == 0 && threadIdx.x == 128) timeline_mark(timeline, kTlS0);
#endif
    if (masked) {
      cs.probs<true, 0, kProbsEarly>(st_lse2, scale_log2, mask, n0 + key_row, m0 + 2 * t);
    } else {
      cs.probs<false, 0, kProbsEarly>(st_lse2, scale_log2, mask, n0 + key_row, m0 + 2 * t);
    }
    wgmma_wait<0>();
    wgmma_fence_operands(cs.dp);
    // (FC_PROBS_EARLY: the rest of P^T here, beside dS^T of the first blocks)
    if (masked) {
      cs.probs<true, kProbsEarly>(st_lse2, scale_log2, mask, n0 + key_row, m0 + 2 * t);
      cs.dsoftmax<true>(st_delta);
    } else {
      cs.probs<false, kProbsEarly>(st_lse2, scale_log2, mask, n0 + key_row, m0 + 2 * t);
      cs.dsoftmax<false>(st_delta);
    }
    Consumer::pack(cs.p16, cs.s);
    Consumer::pack(cs.ds16, cs.dp);

    // FA3's order: dV (a group), dS^T -> shared + barrier, dQ (a group), dK (a group); the dQ
    // epilogue below runs once dV and dQ are done, while the tensor cores still compute dK.
    wgmma_fence_operands(cs.dv);
    wgmma_fence();
    cs.issue_key_grad(cs.dv, cs.p16, sm.dout(st));
    wgmma_commit();
    const uint32_t ds = sm.ds(it & 1);
    if constexpr (kDqSwap) {
      cs.store_ds_trans(ds, key_row - g, lane);
    } else if constexpr (kDsStmatrix) {
      cs.store_ds_stmatrix(ds, key_row - g, lane);
    } else {
      cs.store_ds(ds, key_row, t);
    }
    fence_proxy_async();
    named_barrier_sync(1, 128 * kConsumers);
#if FC_TIMELINE
    if (it == 0 && threadIdx.x == 128) timeline_mark(timeline, kTlBar0);
#endif
    wgmma_fence_operands(cs.dq);
    wgmma_fence_operands(cs.dk);
    wgmma_fence();
    cs.issue_dq(ds, sm.k(), tm, td);
    cs.issue_key_grad(cs.dk, cs.ds16, sm.q(st));
    wgmma_commit();
    wgmma_wait<1>();  // dV and dQ (groups retire in order); dK may still run
    cs.hold_p();
    wgmma_fence_operands(cs.dv);
    wgmma_fence_operands(cs.dq);

    // dq_accum += this consumer's 64 x 64 tile. Rows past seqlen_q (inside Sq_pad) add zeros.
#if FC_DQ_FRAG
    // Into this consumer's own tile once the writer has read its previous one (dq_empty[c]),
    // visible to the async proxy, one arrival per warp on dq_full[c].
    wait(sm.dq_empty(c), (it & 1) ^ 1, stuck);
    cs.stage_dq_frag(sm.dq_frag(c), 32 * warp + lane);
    fence_proxy_async();
    __syncwarp();
    if (lane == 0) mbar_arrive(sm.dq_full(c));
#else
    // Into the staging tile once the writer warp has read the previous step's (dq_empty; it
    // starts empty), then visible to the async proxy, then one arrival per warp on dq_full.
    wait(sm.dq_empty(), (it & 1) ^ 1, stuck);
    cs.stage_dq(sm.dq_stage(), 64 * tm, 64 * td, warp, g, t);
    fence_proxy_async();
    __syncwarp();
    if (lane == 0) mbar_arrive(sm.dq_full());
#endif
    wgmma_wait<0>();  // dK: then Q / dO of the stage and the dS^T fragments are free
    cs.hold_ds();
    wgmma_fence_operands(cs.dk);
    release(sm.empty(st));
#if FC_TIMELINE
    if (it < 2 && threadIdx.x == 128) timeline_mark(timeline, it == 0 ? kTlEnd0 : kTlEnd1);
#endif
  }
#if FC_TIMELINE
  if (threadIdx.x == 128) timeline_mark(timeline, kTlLast);
#endif

#if FC_WAVE_SPLIT == 2
  // ---- a piece: its dK / dV into the item's slot; the piece that completes the item's steps
  // takes the sums back into its accumulators for the epilogue (FC_WAVE_SPLIT)
  {
    constexpr int kGradFloats = kConsumers * (kHeadDim / 2) * 128;  // dK (or dV) of one slot
    // this thread's float4 k of dK at at[512 k], of dV kGradFloats further
    float* at = part + static_cast<int64_t>(piece.w) * 2 * kGradFloats +
                c * (kHeadDim / 2) * 128 + 4 * (threadIdx.x & 127);
#pragma unroll
    for (int k = 0; k < kHeadDim / 8; ++k) {
      red_add_f32x4(at + 512 * k, cs.dk[4 * k], cs.dk[4 * k + 1], cs.dk[4 * k + 2],
                    cs.dk[4 * k + 3]);
      red_add_f32x4(at + kGradFloats + 512 * k, cs.dv[4 * k], cs.dv[4 * k + 1],
                    cs.dv[4 * k + 2], cs.dv[4 * k + 3]);
    }
    __threadfence();  // this thread's reductions before the count (the barrier passes it on)
    named_barrier_sync(2, 128 * kConsumers);
    // (a word of dS's buffer: both consumers' GEMMs are done)
    volatile int* last = reinterpret_cast<volatile int*>(sm.ptr + kSmemDS);
    if (threadIdx.x == 128) *last = atomicAdd(part_steps + piece.w, count) + count == steps.count();
    named_barrier_sync(2, 128 * kConsumers);
#if FC_TIMELINE
    if (threadIdx.x == 128) timeline_mark(timeline, kTlMerged);
    if (!*last) timeline_close(timeline, c, count);
#endif
    if (!*last) return;
    __threadfence();  // the other pieces' reductions, seen through the count, before the loads
#pragma unroll
    for (int k = 0; k < kHeadDim / 8; ++k) {
      const float4 a = __ldcg(reinterpret_cast<const float4*>(at + 512 * k));
      const float4 b = __ldcg(reinterpret_cast<const float4*>(at + kGradFloats + 512 * k));
      cs.dk[4 * k] = a.x, cs.dk[4 * k + 1] = a.y, cs.dk[4 * k + 2] = a.z, cs.dk[4 * k + 3] = a.w;
      cs.dv[4 * k] = b.x, cs.dv[4 * k + 1] = b.y, cs.dv[4 * k + 2] = b.z, cs.dv[4 * k + 3] = b.w;
    }
  }
#endif

  // ---- epilogue: dK * softmax_scale and dV from the accumulators, rows inside seqlen_k
  // (NaN from a thread the watchdog found stuck)
  const bool wrong = kWatchdog && stuck;
  const float v_scale = wrong ? __int_as_float(0x7fc00000) : 1.f;
  const float k_scale = softmax_scale * v_scale;
  // 16-byte stores: the four lanes of a quad hold one key row, each two columns of every
  // 8-column chunk (the accumulator layout); they transpose their packed words among themselves
  // (quad_transpose, common/sm90.cuh), so each lane then holds a whole chunk and one st.global.v4
  // writes it (a quarter of the 4-byte stores, every 32-byte sector written whole: +0.4 to +8.6%
  // at 1k-4k against them, session 13). (FA3 / FA4's epilogue — stmatrix into K's / V's tiles,
  // then tensor stores, also per consumer with dV first — measured 1-4% slower here, sessions
  // 34 / 37: the time is the 64 KB leaving the SM, not the instructions. Removed in session 39.)
  // (store_row_v4's transposes, written out for dK and dV together: the measured SASS)
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int key = n0 + key_row + 8 * hh;
    uint4* k_row = reinterpret_cast<uint4*>(dk + batch * dk_sb + key * dk_ss + head_kv * dk_sh);
    uint4* v_row = reinterpret_cast<uint4*>(dv + batch * dv_sb + key * dv_ss + head_kv * dv_sh);
#pragma unroll
    for (int c4 = 0; c4 < kHeadDim / 32; ++c4) {  // chunks 4 c4 .. 4 c4 + 3 of the row
      uint32_t kw[4], vw[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float* kk = &cs.dk[4 * (4 * c4 + i) + 2 * hh];
        const float* vv = &cs.dv[4 * (4 * c4 + i) + 2 * hh];
        kw[i] = pack2<T>(kk[0] * k_scale, kk[1] * k_scale);
        vw[i] = pack2<T>(vv[0] * v_scale, vv[1] * v_scale);
      }
      quad_transpose(kw, t);  // (outside the row check: every lane of the quad takes part)
      quad_transpose(vw, t);
      if (key < seqlen_k) {  // the same for the quad's four lanes (one row)
        k_row[4 * c4 + t] = make_uint4(kw[0], kw[1], kw[2], kw[3]);
        v_row[4 * c4 + t] = make_uint4(vw[0], vw[1], vw[2], vw[3]);
      }
    }
  }
#if FC_TIMELINE
  timeline_close(timeline, c, own_steps(steps, count));
#endif
}
