// Flash attention forward, sm90a kernel (the FlashAttention-3 design).
//
// Feature matrix
//   dtypes        fp16, bf16 in and out; fp32 accumulation and softmax
//   head dims     kHeadDim in {64, 128, 192, 256}, exactly (the runtime head dim equals the
//                 kernel's)
//   masking       bottom-right aligned band of mask.cuh (causal, sliding window, none); ragged
//                 seqlen_q / seqlen_k
//   heads         MHA, GQA, MQA (kv head = head / (nheads / nheads_kv))
//   layouts       (batch, row, head) strides that are multiples of 8 elements (16 bytes, a TMA
//                 rule), unit last stride, 16-byte aligned base pointers
//   outputs       out (B, Sq, H, D), lse (B, H, Sq) float32 natural log
//   boundary      (session 17) each consumer decodes its next work tile under its last P V
//                 ("decode ahead" below) by magic numbers the host computes (Magic), the
//                 masked-V kernels scan V in the producer warpgroup (scan_v_tiles); where they
//                 fit (fwd_sm90.with_boundary) two Q buffers (FC_Q_STAGES) and the TMA store
//                 epilogue (FC_O_TMA)
//   not yet       a dynamic (work-stealing) tile scheduler
//   removed       (session 39; each measured on the H200 as noise or a loss, perf-notes)
//                 a work tile's first S in the previous one's last turn (FC_CROSS_TILE), the
//                 wgmma descriptors made before the turn (FC_DESC_EARLY), the first key tile's
//                 softmax over its live half (FC_FIRST_HALF: a loss on the kernels dispatch runs
//                 there, without ping-pong), unused shared memory (FC_SMEM_PAD); and the A/B
//                 baselines of the defaults: the schedule's divisions (FC_FAST_DIV=0), the decode
//                 at the work tile's start (FC_DECODE_AHEAD=0), the consumers' own scans of
//                 masked V and their unroll (FC_MV_SCANNER=0, FC_MV_SCAN_UNROLL) and plain
//                 by_block order (FC_L2_SECTIONS=0); in session 49, the step's bookkeeping
//                 rewritten (FC_LEAN_STEP: unsigned ring arithmetic, the P V descriptors by one
//                 64-bit add; 436 -> 425 instructions per key tile at d64, +1.6 / +0.5% inside
//                 the spread on the H200, -0.9% at d128)
//   arch          sm_90a only (wgmma, setmaxnreg)
//
// Persistent: one CTA per SM (grid = min(work tiles, SMs)) walks work tiles of (query block of
// kBlockM = 128 or 192 rows, head, batch) in the order of `Schedule`; while its consumers finish one
// work tile (last P V, epilogue), the producer already loads the next one's Q, K and V.
// 3 warpgroups:
//   warpgroup 0  producer: gives registers back (setmaxnreg.dec to 24); one elected thread
//                issues TMA: per work tile the Q tile (once its last Q K^T is done: q_empty),
//                then per key tile K_j and V_j into a kStages-deep ring of shared-memory stages
//                (the ring runs on across work tiles), each guarded by mbarriers:
//                    k_full[s] / v_full[s]    TMA -> consumers (1 arrival + transaction bytes)
//                    k_empty[s] / v_empty[s]  consumers -> TMA (one arrival per consumer warp)
//   warpgroups 1..  consumers (setmaxnreg.inc to 240 with two, 160 with three): warpgroup c owns query rows
//                64 (c - 1) .. + 63 of the block, so the softmax of a row never leaves its
//                warpgroup (a row lives in one quad of one warp, as in the sm80 kernel).
// Per key tile i (visited from the last one down, masked diagonal tiles first, like sm80), with
// intra-warpgroup overlap (FA3): the softmax of tile i runs while the tensor cores finish
// O += P_{i-1} V_{i-1}:
//     wait k_full | issue S_i = Q K_i^T: kHeadDim / 16 wgmma m64n{kBlockN}k16, Q and K from shared
//     memory (K-major, 128B swizzle) | wait v_full of i-1, issue O += P_{i-1} V_{i-1}: kBlockN / 16
//     wgmma m64n{kHeadDim}k16, A = P from registers, B = V from shared memory read MN-major
//     (imm-trans-b = 1: V is stored [key][d], d contiguous, and B of P V is keys x d) | wait for
//     S_i only (wgmma groups complete in order); release K_i | mask if the tile needs it | row max
//     (2 quad shuffles), P = exp2(S * scale_log2 - m) in registers, per-thread partial row sums |
//     wait for P V; release V_{i-1} | rescale O | P_i -> 16-bit A fragments
// and after the loop, the last tile's P V.
// Deferred normalisation: O / l once, in the epilogue, which stores O straight from the
// accumulator registers (16-byte stores after a transpose within each quad, FC_O_QUAD; through
// shared memory and a TMA store with FC_O_TMA, the host's default since session 17).
//
// Shared memory (sm90.cuh header for the swizzled layout): Q [kBlockM][kHeadDim] (kQStages of
// them, FC_Q_STAGES) and kStages K
// and V tiles [kBlockN][kHeadDim], each as kHeadDim / 64 chunks of [rows][64] 128-byte rows,
// every chunk 1024-byte aligned; then the mbarriers. The dynamic allocation has 1024 bytes of
// slack so the base can be rounded up to 1024.
//
// Out-of-range rows: TMA zero-fills rows past seqlen (the tensor maps carry the true bounds), so
// a key tile may run past seqlen_k (those keys are masked: tile_needs_mask says so) and a query
// tile past seqlen_q (those rows are never stored). Unlike the sm80 kernel, keys inside seqlen_k
// but outside every row's band are loaded, not zero-filled; their scores are masked to -inf, and
// a NaN/Inf in such a V row would reach the loaded tile's rows through 0 * NaN (as in FA3) but
// for the "masked V" treatment below (FC_MASKED_V). Windowed calls run in two passes since
// session 22: this kernel without it, reporting non-finite O (FC_NAN_FLAGS), then with it for
// the CTAs that reported (FC_NAN_FIXUP).
// A row that sees no key gets out = 0 and lse = -inf (OnlineSoftmax's guards).
#include "common/types.cuh"
#include "common/sm90.cuh"
#include "common/smem.cuh"
#include "attention/mask.cuh"
#include "attention/online_softmax.cuh"
#include "attention/nonfinite.cuh"

using T = typename dtype_of<FC_DTYPE>::type;
constexpr int kHeadDim = FC_HEAD_DIM;
constexpr int kBlockM = FC_BLOCK_M;  // query rows per work tile (64 per consumer warpgroup)
constexpr int kBlockN = FC_BLOCK_N;  // keys per tile
constexpr int kStages = FC_STAGES;   // K/V ring depth
#ifndef FC_Q_STAGES
// Q buffers (the host's default 2 where it fits since session 17, with the boundary's other
// parts; alone, session 15 on the H200: -4 to +4%, noise, and the timeline's wait before a
// work tile's first GEMM did not move: by the SASS most likely the tile's decode, since decoded
// ahead). 1: one Q tile, whose next work tile's load waits for the current one's last
// Q K^T (q_empty) — and the producer, which issues in program order, holds the next work tile's
// first K / V behind that wait too. 2: work tile r's Q goes to buffer r % 2, so its load (and the
// K / V behind it) issue as soon as the ring has room, a work tile ahead. + kQBytes of shared
// memory: the host builds it where that fits (fwd_sm90; FLASHCUDA_SM90_FWD_Q_STAGES=1 the A/B;
// not beside the d128 masked-V clean tiles).
#define FC_Q_STAGES 1
#endif
constexpr int kQStages = FC_Q_STAGES;
static_assert(kQStages == 1 || kQStages == 2, "one or two Q buffers");
constexpr int kConsumers = kBlockM / 64;            // consumer warpgroups
constexpr int kThreads = 128 * (1 + kConsumers);    // + the producer warpgroup
constexpr int kConsumerWarps = 4 * kConsumers;
constexpr int kProducerRegs = FC_PRODUCER_REGS;
constexpr int kConsumerRegs = FC_CONSUMER_REGS;
constexpr bool kPingPong = FC_PINGPONG;  // consumer warpgroups take turns issuing their GEMMs
constexpr bool kSnake = FC_SNAKE;        // snake order of work tiles over the CTAs (Schedule)
#ifndef FC_TIMELINE
#define FC_TIMELINE 0  // 1: each work tile's times into a buffer (a profiling variant, Timeline)
#endif
// FC_L2_HINTS (A/B, default 0): L2 eviction priorities on the TMA traffic. 1: K / V loaded
// evict_last, Q loaded and O stored evict_first; 2: K / V evict_last only. Why (session 56,
// ncu on an H100 at 32 x 512 causal): the short causal forward is DRAM-bound there (77% of
// peak) and reads 270 / 317 MB (d128 / d64) where Q, K and V are 201 MB (cuDNN's kernel reads
// 201): a section's K and V leave the L2 under the Q / O stream before its next query blocks
// read them again. Measured (H100, share 0.75): hints 1 +5 to +7% at 512 / 1k, reads 270 -> 243
// MB; the smaller L2 sections (fwd_sm90.L2_SECTION_SHARE 0.35) gained more, and on top of them
// the hints were mixed (perf-notes). (The hinted d64 fused kernel spills 8 bytes, its second
// pass's producer at 24 registers.)
#ifndef FC_L2_HINTS
#define FC_L2_HINTS 0
#endif
static_assert(FC_L2_HINTS >= 0 && FC_L2_HINTS <= 2, "FC_L2_HINTS: 0, 1 or 2");
#ifndef FC_MASKED_V
#define FC_MASKED_V 0  // 1: NaN / Inf in V reaches only rows that see its key (see "masked V");
                       // the host builds windowed kernels with 1 (0: the A/B variant)
#endif
#ifndef FC_NAN_FLAGS
// 1 (the host's first pass of a windowed call since session 22: fwd_sm90.NAN_FIXUP): a kernel
// without masked V reports whether any O value it computed is NaN / Inf, one byte per consumer
// warp in its CTA's kNanFlagBytes of nan_flags (always written, so the buffer needs no clearing).
// A NaN / Inf in a V row outside some row's band reaches that row only as 0 * NaN or 0 * Inf
// in its P V, which is NaN, and a NaN in the accumulator stays NaN through every rescale: a CTA
// whose bytes are all 0 wrote exactly what the masked-V kernel would have written, up to
// rounding. The masked-V kernel then runs as the second pass (FC_NAN_FIXUP) for the CTAs that
// reported one. The check: fold_nonfinite over each work tile's accumulator, 32 / 16 FFMA per
// thread at d128 / d64 (nonfinite.cuh); where masked V cost its kernels 8-13% at d128 causal
// 512-1k (session 22, same-process A/B), this pass costs one check per work tile.
#define FC_NAN_FLAGS 0
#endif
#ifndef FC_NAN_FIXUP
// 1: the masked-V kernel as the second pass of FC_NAN_FLAGS's: launched with the first pass's
// grid and schedule, so that CTA b walks the same work tiles; a CTA whose bytes are all 0 exits
// before it touches shared memory, the others redo every work tile they walk (O and lse).
#define FC_NAN_FIXUP 0
#endif
#ifndef FC_FUSED_PART
// 1: this file as one part of flash_fwd_sm90_fused.cu (both passes in one kernel): a device
// function `run` in place of the kernel, the first pass ending in the FC_FUSED_*_TAIL hooks
#define FC_FUSED_PART 0
#endif
#ifndef FC_ROLE_ONLY
// with FC_FUSED_PART: 1 the producer warpgroup's code only, 2 the consumer warpgroups' only (the
// second pass, entered from either role's end of the first, each keeping its register count)
#define FC_ROLE_ONLY 0
#endif
static_assert(!FC_ROLE_ONLY || FC_FUSED_PART, "one role's code: a part of the fused kernel");
static_assert(!FC_NAN_FLAGS || !FC_MASKED_V, "the first pass is a kernel without masked V");
static_assert(!FC_NAN_FIXUP || FC_MASKED_V, "the second pass is the masked-V kernel");
constexpr int kNanFlagBytes = 16;  // per CTA in nan_flags: one per consumer warp, the rest unused
static_assert(kConsumerWarps <= kNanFlagBytes, "one flag byte per consumer warp");
// The V scanner (session 16; every masked-V kernel's since session 17): warps 1 .. 3 of the
// producer warpgroup (idle otherwise) scan each V tile some consumer's rows see only in part as
// soon as it lands, and publish the result in verdict words and an mbarrier per scan
// (v_scanned); a consumer's masked tile waits for that barrier and reads the verdicts instead of
// scanning the stage itself: the scan stays off the consumers' critical path (on the H200,
// session 16, the masked-V kernels ran 4-10% slower than the kernels without masked V at causal
// 512-2k when the consumers scanned). The scanners also arrive on every v_empty, so TMA never
// rewrites a stage they are still reading (scan_v_tiles).
#if FC_MASKED_V
constexpr uint32_t kScanSkip = 0, kScanTile = 1, kScanEnd = 2;  // the producer's request for a tile
constexpr int kScanners = 3;  // warps 1 .. 3 of the producer warpgroup
#endif
#ifndef FC_SOFTMAX_IN_ARMS
// 1: the softmax is written into both arms of the mask branch, so the wait for the P V starts a
// basic block of its own: ptxas schedules that wait as early as its block allows, and in the
// block it shared with the softmax it placed it before the first exp2 (every variant, session 9:
// the intra-warpgroup overlap of the softmax with the P V did not exist in the SASS)
#define FC_SOFTMAX_IN_ARMS 0
#endif
constexpr bool kSoftmaxInArms = FC_SOFTMAX_IN_ARMS;
#ifndef FC_MASK_BITS
// 1 (the host's default for the windowed kernels since session 18: fwd_sm90.MASK_BITS): apply_mask
// tests one bit of a per-row mask of the lane's visible columns (mask.cuh's fragment_bits;
// ptxas loads the bits into predicates with R2P) per score instead of comparing its key against
// both ends of the row's band (two compares and a select per score). Static SASS at kBlockN =
// 128: ~70 instructions fewer per lane and masked tile (the first tile of every causal work
// tile); on the H200, session 18: forward causal +0.3 to +3.4% at 512-8k. 0: the compares (the
// unwindowed kernels, whose only masked tiles are ragged edges, and the 176-key A/B tile, whose
// 44 columns per row exceed the 32 bits).
#define FC_MASK_BITS 0
#endif
constexpr bool kMaskBits = FC_MASK_BITS && kBlockN <= 128;
constexpr int kMaskPairs = kBlockN <= 128 ? kBlockN / 8 : 16;  // fragment_bits' column pairs
#ifndef FC_EXP_SPLIT
// k > 0: the exp2s of a tile's column groups k .. kBlockN / 8 - 1 move after the previous P V's
// wait (Consumer::softmax_tail), so they run interleaved with the rescale and the packing instead
// of all before the wait, where the ~100 FMUL / F2FP after it then have no MUFU work to hide
// behind. FlashAttention 4's Hopper forward schedules its exp2s that way (its SASS: 10 of 66 MUFU
// before the P V wait). The host sets k = 6 at d128 (fwd_sm90.EXP_SPLIT; 8 from session 13, 6
// from session 19's same-process A/B, perf-notes) and leaves d64 at 0 (noise there).
#define FC_EXP_SPLIT 0
#endif
#ifndef FC_O_QUAD
// 1: O leaves in 16-byte stores after a transpose within each quad (store_row_v4,
// common/sm90.cuh), as the backward's dK / dV (FC_DKV_QUAD): a quarter of the store
// instructions, whole sectors. The host sets it at d128 and for d64's 192-row tiles
// (fwd_sm90.O_QUAD; session 14 on the H200: d128 +2-11%, the work tile's epilogue 2.1 -> 0.9 us
// in the forward timeline; d64 192-row +1.4-3.4%, 128-row -1 to -3.6%, so 0 there).
#define FC_O_QUAD 0
#endif
#ifndef FC_O_TMA
// 1 (the host's default since session 17; session 16 on the H200: -3 to +4% alone; the
// boundary's parts together -2.8 to +11.7% at 512-4k, perf-notes): the epilogue writes O through shared memory and a TMA store instead of
// 16-byte global stores: each consumer warpgroup stmatrix-es its normalised 64 x kHeadDim tile
// into its own staging tile (128B-swizzled [64][64] chunks, as Q), fences, syncs its 128
// threads, and one thread issues kChunks tensor stores (map_o: out with a 64 x 64 box; rows
// past seqlen_q are not written) and goes on; the next work tile's
// epilogue first waits until that store has read the tile. No quad transposes (the ~150
// shuffles and selects per thread of FC_O_QUAD's store_row_v4) and no wait on the stores: the
// forward timeline puts the epilogue at 0.9-1.0 us of a 4-8 us work tile at 512-1k. The staging
// tiles take kConsumers x 64 x kHeadDim x 2 bytes of shared memory; with FC_MASKED_V each is its
// consumer's clean V tile instead (touched only on the non-finite path: scanned_v waits for the
// store's read before it copies V there), so d128's causal / window kernels fit too
// (FLASHCUDA_SM90_FWD_O_TMA=0 the A/B without it).
#define FC_O_TMA 0
#endif
#if FC_O_TMA
constexpr int kOBarrier = 12;  // + c: FC_O_TMA's staging tile, per consumer warpgroup (named
                               // barriers 1 .. 3: the ping-pong turns, 8 ..: masked V's copies)
#endif
#ifndef FC_RESCALE_EARLY
// 1 (session 32; on at d256 since session 33, fwd_sm90.RESCALE_EARLY): O's rescale by a key
// tile's correction waits for the next tile and runs between issuing its S and the P V that adds
// to O (FA4's order for head dims above 128, `rescale_O_before_gemm`), so the kHeadDim / 2 FMULs
// per thread run while the S GEMM is in flight instead of between the P V wait and the next
// issue. FA4 also drops the warpgroups' turn-taking there; ours keeps it (without the turns it
// lost 3-6% at d256; with them the early rescale won up to 3.3% at d256 and lost 1-2% at d192).
// O sees the same multiplications in the same order (O c_i + P_i V_i), so the results are the
// same bits. Ignored by the masked-V kernels (their put-back follows the rescale; a windowed
// call's second pass keeps the order).
#define FC_RESCALE_EARLY 0
#endif
#define FC_RESCALE_EARLY_ON (FC_RESCALE_EARLY && !FC_MASKED_V)

constexpr int kChunkCols = 64;                     // 16-bit elements per 128-byte swizzled row
constexpr int kChunks = kHeadDim / kChunkCols;     // swizzled chunks per row of a tile
constexpr int kQChunkBytes = kBlockM * 128;
constexpr int kKVChunkBytes = kBlockN * 128;
constexpr int kQBytes = kChunks * kQChunkBytes;
constexpr int kKVBytes = kChunks * kKVChunkBytes;

constexpr int kSmemQ = 0;
constexpr int kSmemK = kSmemQ + kQStages * kQBytes;
constexpr int kSmemV = kSmemK + kStages * kKVBytes;
constexpr int kSmemClean = kSmemV + kStages * kKVBytes;  // FC_MASKED_V: a V tile per consumer
constexpr int kOBytes = kChunks * 64 * 128;              // FC_O_TMA: a consumer's staging tile
constexpr int kSmemO = kSmemClean;  // FC_O_TMA's staging tiles: the clean V tiles with
                                    // FC_MASKED_V, else a region of their own at the same place
constexpr int kSmemBar = kSmemClean + (FC_MASKED_V ? kConsumers * kKVBytes : 0) +
                         (FC_O_TMA && !FC_MASKED_V ? kConsumers * kOBytes : 0);
static_assert(kOBytes <= kKVBytes, "a staging tile fits its consumer's clean V tile");
// q_full[], q_empty[], k_full[], v_full[], k_empty[], v_empty[] (+ FC_MASKED_V: the scanners'
// v_scanned[], the requests, and the scanner warps' verdicts, 8-byte slots: one, one and two
// per stage)
constexpr int kBarriers = 2 * kQStages + 4 * kStages + (FC_MASKED_V ? 4 * kStages : 0);
constexpr int kSmemBytes = 1024 + kSmemBar + 8 * kBarriers;  // + slack to align the base

static_assert(FC_DTYPE == 1 || FC_DTYPE == 2, "sm90 kernel: fp16 or bf16");
static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
              "sm90 kernel: head dim 64, 128, 192 or 256");
static_assert(kBlockM == 128 || kBlockM == 192, "two or three consumer warpgroups of 64 rows");
static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma n, TMA box rows <= 256");
static_assert(kBlockN == 64 || kBlockN == 80 || kBlockN == 112 || kBlockN == 128 || kBlockN == 176,
              "wgmma_ss is instantiated for n = 64, 80, 112, 128, 176");
static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= register_pool(kThreads),
              "register split over the CTA's pool at launch (register_pool, sm90.cuh)");
// The host config (flashcuda/ops/fwd_sm90.py) computes the launch's dynamic smem; it must agree.
static_assert(kSmemBytes == FC_SMEM_BYTES, "smem layout disagrees with Sm90FwdConfig.smem_bytes");

// The pipeline's shared-memory addresses (32-bit shared window).
struct Smem {
  uint32_t base;  // 1024-byte aligned

  __device__ __forceinline__ uint32_t q(int b) const { return base + kSmemQ + b * kQBytes; }
  __device__ __forceinline__ uint32_t k(int s) const { return base + kSmemK + s * kKVBytes; }
  __device__ __forceinline__ uint32_t v(int s) const { return base + kSmemV + s * kKVBytes; }
  __device__ __forceinline__ uint32_t clean_v(int c) const {
    return base + kSmemClean + c * kKVBytes;
  }
  __device__ __forceinline__ uint32_t o(int c) const {
    return base + kSmemO + c * (FC_MASKED_V ? kKVBytes : kOBytes);  // (clean_v(c) with masked V)
  }
  __device__ __forceinline__ uint32_t bar(int i) const { return base + kSmemBar + 8 * i; }
  __device__ __forceinline__ uint32_t q_full(int b) const { return bar(b); }
  __device__ __forceinline__ uint32_t q_empty(int b) const { return bar(kQStages + b); }
  __device__ __forceinline__ uint32_t k_full(int s) const { return bar(2 * kQStages + s); }
  __device__ __forceinline__ uint32_t v_full(int s) const {
    return bar(2 * kQStages + kStages + s);
  }
  __device__ __forceinline__ uint32_t k_empty(int s) const {
    return bar(2 * kQStages + 2 * kStages + s);
  }
  __device__ __forceinline__ uint32_t v_empty(int s) const {
    return bar(2 * kQStages + 3 * kStages + s);
  }
  // masked V's scanners: scan number n is done (an arrival per scanner warp; slot stage_of(n),
  // phase parity_of(n): two slots, as the stages); the producer's request for the tile in stage s
  // (kScanSkip / kScanTile / kScanEnd); scanner warp w's verdict on scan n in word w of slot
  // stage_of(n)'s 16 bytes (nonzero: its part of the tile holds a NaN / Inf)
  __device__ __forceinline__ uint32_t v_scanned(int s) const {
    return bar(2 * kQStages + 4 * kStages + s);
  }
  __device__ __forceinline__ uint32_t v_request(int s) const {
    return bar(2 * kQStages + 5 * kStages + s);
  }
  __device__ __forceinline__ uint32_t v_flag(int s, int w) const {
    return bar(2 * kQStages + 6 * kStages + 2 * s) + 4 * w;
  }

  __device__ __forceinline__ void init_barriers() const {
#pragma unroll
    for (int b = 0; b < kQStages; ++b) {
      mbar_init(q_full(b), 1);
      mbar_init(q_empty(b), kConsumerWarps);
    }
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(k_full(s), 1);
      mbar_init(v_full(s), 1);
      mbar_init(k_empty(s), kConsumerWarps);
#if FC_MASKED_V
      mbar_init(v_empty(s), kConsumerWarps + kScanners);  // (+ the scanner warps)
      mbar_init(v_scanned(s), kScanners);
#else
      mbar_init(v_empty(s), kConsumerWarps);
#endif
    }
    fence_barrier_init();
  }
  // FC_FUSED_PART: the first pass's barriers, once both roles are past them, before the second
  // pass lays its tiles and barriers over the same shared memory
  __device__ __forceinline__ void inval_barriers() const {
    for (int i = 0; i < kBarriers; ++i) mbar_inval(bar(i));
  }
};

// One work tile: which query rows and key tiles it covers (the same numbers in every role).
struct Block {
  int m0, head, head_kv, batch;
  int n_first, n_last;  // key tiles [n_first, n_last], visited from n_last down

  __device__ __forceinline__ int tiles() const { return n_last - n_first + 1; }
};

// The persistent schedule: CTA c takes work tiles c, c + gridDim.x, ... of one fixed order.
//   by_head (uniform cost: no causal / window): head-major, the query blocks of one head next to
//            each other, so CTAs running at the same time share that head's K and V in L2;
//   by_block (causal, window): query-block-major from the last (heaviest) block down, so every
//            CTA gets a mix of heavy and light tiles (longest first) and no CTA ends late.
// L2 sections (session 12): by_block walks the (batch, head) pairs in sections of `by_block`
// pairs whose K and V fit in L2 together (the host sizes them: fwd_sm90.l2_section's most,
// balanced_section's size where a ragged last section would leave the walk uneven), each
// section query-block-major — FlashAttention 4's causal order. Plain by_block keeps every head's
// K and V live at once (128 MB at 4 x 4096 x 16 d128 against a 50 MB L2; ncu at that shape: DRAM
// 49% busy on a compute-bound kernel, session 11; its A/B variant, FC_L2_SECTIONS=0, was removed
// in session 39). The sections alternate direction, the last one heaviest-first: each section
// heaviest-first makes the costs a sawtooth, and walk_next's static snake balances a ramp, not a
// sawtooth (a cost model put the last CTA 9-29% past the mean at the bench's causal shapes, 0-2%
// alternating; session 12 measured the sawtooth at -3.6% against plain by_block at 16k,
// +5.5-12% at 2k-8k).
// The schedule's divisions by runtime values (Schedule::block, next_tile: four to five per work
// tile) are a multiply-high and a shift by magic numbers the host computes per call
// (fwd_sm90.fast_div_magic / fast_div_args, ten kernel arguments; session 16, the default since
// session 17: a 32-bit division is an I2F / RCP / multiply / correction chain, and the decode's
// chain of them stayed on the warp's path under the last P V). Each is mul | shift << 32 for
// fast_quo; `sections` and `last_size` are Schedule::block's section count and the last
// section's pairs. (`heads`, the divisor of the plain by_block order, is unused since that order
// went in session 39; the host still passes it, so the parameters stay as they were.)
struct Magic {
  uint64_t num_m = 0, heads = 0, section = 0, by_block = 0, last = 0, nheads = 0, group = 0,
           grid = 0;
  int sections = 0, last_size = 0;
};

// n / d for 0 <= n < 2^31 and 0 < d < 2^31 from magic = mul | shift << 32 (the host's
// fast_div_magic: shift = ceil(log2 d), mul = floor(2^32 (2^shift - d) / d) + 1): (umulhi(n, mul)
// + n) >> shift, whose sum stays below 2^32 because umulhi(n, mul) < n.
__device__ __forceinline__ int fast_quo(int n, uint64_t magic) {
  const uint32_t u = static_cast<uint32_t>(n);
  return static_cast<int>((__umulhi(u, static_cast<uint32_t>(magic)) + u) >>
                          static_cast<uint32_t>(magic >> 32));
}
// n % d by d's magic number
__device__ __forceinline__ int fast_rem(int n, int d, uint64_t magic) {
  return n - fast_quo(n, magic) * d;
}

struct Schedule {
  int num_m, nheads, batch;
  int by_block;
  Magic magic;

  __device__ __forceinline__ int total() const { return num_m * nheads * batch; }

  __device__ __forceinline__ Block block(int t, const Mask& mask) const {
    int m, bh;
    if (by_block) {
      const int heads = nheads * batch;
      // section s holds pairs [s by_block, + size); its num_m * size tiles are consecutive,
      // lightest-first when an odd number of sections follows it
      const int s = fast_quo(t, magic.section);
      const int first = s * by_block;
      const int size = min(by_block, heads - first);
      const int sections = magic.sections;
      int within = t - s * num_m * by_block;
      if ((sections - 1 - s) & 1) within = num_m * size - 1 - within;
      const uint64_t by_size = size == by_block ? magic.by_block : magic.last;
      m = num_m - 1 - fast_quo(within, by_size);
      bh = first + fast_rem(within, size, by_size);
    } else {
      m = num_m - 1 - fast_rem(t, num_m, magic.num_m);
      bh = fast_quo(t, magic.num_m);
    }
    Block blk;
    blk.m0 = m * kBlockM;
    blk.head = fast_rem(bh, nheads, magic.nheads);
    blk.batch = fast_quo(bh, magic.nheads);
    blk.head_kv = fast_quo(blk.head, magic.group);
    const int row_end = min(blk.m0 + kBlockM, mask.seqlen_q);
    const int key_lo = mask.key_begin(blk.m0);
    const int key_hi = mask.key_end(row_end);
    blk.n_first = key_lo / kBlockN;
    blk.n_last = key_hi > key_lo ? (key_hi - 1) / kBlockN : blk.n_first - 1;
    return blk;
  }
};

// The work tile after `t` (of round `round` = t / g) of this CTA, over g CTAs: round r gives CTA
// c tile r * g + c; with kSnake odd rounds go the other way (tile r * g + g - 1 - c), so under
// causal / window the CTA that took the heaviest tile of one round takes the lightest of the next
// (a static list schedule within ~3% of greedy; plain round robin ends up to 21% late when the
// query blocks per head and the CTA count share factors). `round` is unused without kSnake.
__device__ __forceinline__ int walk_next(int t, int g, int round) {
  if constexpr (kSnake) {
    const int c = static_cast<int>(blockIdx.x), r = round + 1;
    return r * g + ((r & 1) ? g - 1 - c : c);
  } else {
    return t + g;
  }
}

// The work tile after `t` of this CTA: walk_next over gridDim.x CTAs, the round's division by
// magic
__device__ __forceinline__ int next_tile(const Schedule& sched, int t) {
  return walk_next(t, gridDim.x, fast_quo(t, sched.magic.grid));
}

// Work tile w's decode, pinned between empty asm statements where it is called (the next work
// tile's, under the last P V in flight: "decode ahead" in the consumers' loop), which ptxas would
// otherwise hoist or sink as pure arithmetic: not before the first (w made opaque there), not
// after the second (the result used).
__device__ __forceinline__ Block decode_pinned(const Schedule& sched, int w, const Mask& mask) {
  asm volatile("" : "+r"(w));
  const Block b = sched.block(w, mask);
  asm volatile("" ::"r"(b.m0), "r"(b.head), "r"(b.head_kv), "r"(b.batch), "r"(b.n_first),
               "r"(b.n_last));
  return b;
}

// Ring index r (K/V tiles counted over all of a CTA's work tiles) lives in stage r % kStages;
// its barriers' phase parity is (r / kStages) & 1.
__device__ __forceinline__ int stage_of(int r) { return r % kStages; }
__device__ __forceinline__ uint32_t parity_of(int r) { return (r / kStages) & 1; }

// ---- producer: one thread issues every TMA load -------------------------------------------------
__device__ __forceinline__ void produce(const Smem& sm, const Schedule& sched, const Mask& mask,
                                        const TmaMap& map_q, const TmaMap& map_k,
                                        const TmaMap& map_v) {
  int ring = 0, q_round = 0;
  for (int t = blockIdx.x; t < sched.total(); t = next_tile(sched, t)) {
    const Block blk = sched.block(t, mask);
    const int tiles = blk.tiles();
    if (tiles <= 0) continue;
#if FC_MASKED_V
    // the V tiles the scanner scans: masked for some row of the work tile (a superset of each
    // consumer warpgroup's own masked visits)
    const MaskedVisits masked = masked_visits(mask, blk.m0, kBlockM, blk.n_last, kBlockN);
#endif
    // Q round r in buffer r % kQStages; its barriers' parity is (r / kQStages) & 1
    const int qb = q_round % kQStages;
    mbar_wait_producer(sm.q_empty(qb), ((q_round / kQStages) & 1) ^ 1);  // first: Q empty
    mbar_arrive_expect_tx(sm.q_full(qb), kQBytes);
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      tma_load_4d(sm.q(qb) + c * kQChunkBytes, map_q, sm.q_full(qb), c * kChunkCols, blk.m0,
                  blk.head, blk.batch
#if FC_L2_HINTS == 1
                  , l2_evict_first()  // Q: read once
#endif
      );
    for (int i = 0; i < tiles; ++i, ++ring) {
      const int s = stage_of(ring);
      const uint32_t empty_parity = parity_of(ring) ^ 1;  // first pass: stages start empty
      const int n0 = (blk.n_last - i) * kBlockN;
      mbar_wait_producer(sm.k_empty(s), empty_parity);
      mbar_arrive_expect_tx(sm.k_full(s), kKVBytes);
#pragma unroll
      for (int c = 0; c < kChunks; ++c)
        tma_load_4d(sm.k(s) + c * kKVChunkBytes, map_k, sm.k_full(s), c * kChunkCols, n0,
                    blk.head_kv, blk.batch
#if FC_L2_HINTS
                    , l2_evict_last()  // K / V: read again by the section's next blocks
#endif
        );
      mbar_wait_producer(sm.v_empty(s), empty_parity);
#if FC_MASKED_V
      store_shared_32(sm.v_request(s), masked(i) ? kScanTile : kScanSkip);  // (released below)
#endif
      mbar_arrive_expect_tx(sm.v_full(s), kKVBytes);
#pragma unroll
      for (int c = 0; c < kChunks; ++c)
        tma_load_4d(sm.v(s) + c * kKVChunkBytes, map_v, sm.v_full(s), c * kChunkCols, n0,
                    blk.head_kv, blk.batch
#if FC_L2_HINTS
                    , l2_evict_last()
#endif
        );
    }
    ++q_round;
  }
#if FC_MASKED_V
  // the scanner's end: the next stage's phase completed without a load, its request kScanEnd
  const int s = stage_of(ring);
  mbar_wait(sm.v_empty(s), parity_of(ring) ^ 1);
  store_shared_32(sm.v_request(s), kScanEnd);
  mbar_arrive(sm.v_full(s));
#endif
}

#if FC_MASKED_V
// ---- the V scanner (masked V): warps 1 .. 3 of the producer warpgroup --------------------------
// Follow the producer's ring: for each V tile, wait for it to land and read the producer's request
// (written before the v_full arrival that the wait acquires): for a tile that needs the mask for
// some rows of its work tile, scan it (warp w the 16-byte units w * 32 + lane + 96 k, two loads
// in flight per lane), vote over the warp, write the warp's verdict for this scan number and
// arrive on the scan's v_scanned (the consumer warpgroups that mask the tile wait there and OR
// the verdicts: Visits::scan gives them the number); then, the reads fenced to the async proxy,
// arrive on v_empty (TMA's next load into the stage waits for the scanners too). Every tile's V
// is waited for, scanned or not, so the v_empty arrivals stay in their phase: the stage's next
// v_full phase needs this phase's v_empty (never two phases behind). Only scanned tiles complete a
// v_scanned phase, and each such tile is masked for some consumer warpgroup, which waits for it
// (a phase nobody waits for is synccheck's "missing wait": session 16, when every tile arrived);
// scan n + 2 reuses scan n's slot only after its tile's v_full, which needs the release of a
// ring entry at or after scan n's, which its waiters give after reading the verdicts. The
// producer ends the loop with a request of kScanEnd. (The requests come from the producer thread,
// not from a decode of the schedule here: with it, the loop spilled at the producer warpgroup's 24
// registers. One warp scanning alone, one load in flight, made causal calls 8-15% slower than
// the consumers' own scans on the H200: a V tile's scan then took ~0.7 / 1.4 us at d64 / d128.)
__device__ __forceinline__ void scan_v_tiles(const Smem& sm, int w) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  int scan = 0;  // scans so far: verdict slot and v_scanned barrier stage_of(scan)
  for (int ring = 0;; ++ring) {
    const int s = stage_of(ring);
    mbar_wait(sm.v_full(s), parity_of(ring));
    const uint32_t request = load_shared_32(sm.v_request(s));
    if (request == kScanEnd) return;
    if (request == kScanTile) {
      bool bad = false;
#pragma unroll 2
      for (int e = w * 32 + lane; e < kKVBytes / 16; e += 32 * kScanners) {
        const Bytes16 x = load_shared_16(sm.v(s) + 16 * e);
        bad |= word_nonfinite<T>(x.x) | word_nonfinite<T>(x.y) | word_nonfinite<T>(x.z) |
               word_nonfinite<T>(x.w);
      }
      const bool any = __any_sync(0xffffffffu, bad);
      fence_proxy_async();  // this lane's reads of the stage, before TMA's next write
      __syncwarp();
      if (lane == 0) {
        store_shared_32(sm.v_flag(stage_of(scan), w), any ? 1u : 0u);
        mbar_arrive(sm.v_scanned(stage_of(scan)));  // (release: the verdict is visible to waiters)
      }
      ++scan;
    }
    if (lane == 0) mbar_arrive(sm.v_empty(s));
  }
}
#endif

// ---- consumer: what one thread of a consumer warpgroup holds, and the tile verbs ----------------
// Intra-warpgroup overlap (FA3): while the tensor cores run O += P_{i-1} V_{i-1}, the warpgroup
// computes the softmax of tile i, whose S = Q K_i^T was issued just before that GEMM. O is
// rescaled only once the P V GEMM has drained.
struct Consumer {
  float o[kHeadDim / 2];        // O accumulator: m64n{kHeadDim} wgmma layout (sm90.cuh header)
  float s[kBlockN / 2];         // S of the current key tile, then its P (fp32)
  uint32_t p[kBlockN / 16][4];  // P of the previous tile as 16-bit A fragments of P V
  OnlineSoftmax row[2];         // rows g and g + 8 of this warp's 16; l is this lane's partial sum
#if FC_RESCALE_EARLY_ON
  float corr_next[2];  // the last tile's correction, applied before the next P V
#endif
  uint32_t q_rows;              // shared address of this warpgroup's 64 rows of Q (chunk 0)
#if FC_TIMELINE
  uint64_t t_s0;  // when the work tile's first S was ready (Timeline)
#endif

  __device__ __forceinline__ void init(const Smem& sm, int wg_row0, int q_buffer) {
    q_rows = sm.q(q_buffer) + wg_row0 * 128;  // 64-row offsets stay 1024-byte aligned
    row[0].init();
    row[1].init();
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;
  }

  // Issue S = Q K^T over kHeadDim / 16 k16 steps (one commit group); step kk reads 32 bytes at
  // column (kk % 4) * 16 of chunk kk / 4 of both tiles. The caller fenced.
  __device__ __forceinline__ void issue_scores(uint32_t k_tile) {
    const uint64_t a0 = smem_desc_k_major_sw128(q_rows);
    const uint64_t b0 = smem_desc_k_major_sw128(k_tile);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t col = (kk / 4), within = (kk % 4) * 32;
      const uint64_t a = k_major_at(a0, q_rows, col * kQChunkBytes + within);
      const uint64_t b = k_major_at(b0, k_tile, col * kKVChunkBytes + within);
      wgmma_ss<kBlockN, T>(s, a, b, kk > 0);
    }
    wgmma_commit();
  }

  // Issue O += P V (one commit group): P's C fragments of n8 blocks 2kk, 2kk + 1 are the A
  // fragment of k16 step kk; step kk reads V rows 16kk .. 16kk + 15 (2048 bytes further per
  // step), both d chunks.
  __device__ __forceinline__ void issue_accumulate(uint32_t v_tile) {
    const uint64_t b0 = smem_desc_mn_major_sw128(v_tile, kKVChunkBytes);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t b = mn_major_at(b0, v_tile, kk * 16 * 128, kKVChunkBytes);
      wgmma_rs_tb<kHeadDim, T>(o, p[kk], b, 1);
    }
    wgmma_commit();
  }

  // The A registers of an in-flight P V belong to the tensor cores until it drains: keep them
  // live (and unmoved) up to the wait, so the compiler cannot reuse them for softmax temporaries.
  __device__ __forceinline__ void hold_p() {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(p[kk][r])::"memory");
  }

  // Scores of (row, key) pairs the rule hides become -inf. `i0`: query row of this lane's first
  // row; `col0`: key of its first column (n0 + 2t).
  __device__ __forceinline__ void apply_mask(const Mask& mask, int i0, int col0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = i0 + 8 * h;
      const int lo = mask.key_begin(i) - col0;    // first visible key, relative to col0
      const int hi = mask.key_end(i + 1) - col0;  // one past the last
      // (kMaskBits) bit 2j + c: key 8j + c is visible
      const uint32_t visible = kMaskBits ? fragment_bits<kMaskPairs>(lo, hi) : 0u;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int key = 8 * j + c;
          const bool hidden = kMaskBits ? !((visible >> (2 * j + c)) & 1u) : key < lo || key >= hi;
          if (hidden) s[4 * j + 2 * h + c] = neg_inf();
        }
    }
  }

  // Row h's new maximum over this tile (over the quad) into row[h]; returns the factor O's row
  // must still be multiplied by. scale_log2 > 0 (checked on the host), so max(s) * scale is the
  // max of the scaled scores.
  __device__ __forceinline__ float update_row(int h, float scale_log2) {
    float mx = neg_inf();
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
      mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    return row[h].update(mx * scale_log2);
  }

  // Online softmax of this tile in one piece: new row maxima (over the quad), P = exp2(S - m) in
  // place, partial row sums into row[h].l (summed over the quad once, in the epilogue). Returns in
  // corr[h] the factor O's rows must still be multiplied by (see rescale).
  __device__ __forceinline__ void whole_softmax(float scale_log2, float (&corr)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      corr[h] = update_row(h, scale_log2);
      const float ref = row[h].ref();
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& x = s[4 * j + 2 * h + c];
          x = fast_exp2(fmaf(x, scale_log2, -ref));
          sum += x;
        }
      row[h].add(sum);
    }
  }

#if FC_EXP_SPLIT
  static_assert(FC_EXP_SPLIT > 0 && FC_EXP_SPLIT <= kBlockN / 8, "FC_EXP_SPLIT: 1 .. kBlockN / 8");
  float split_ref[2], split_sum[2];  // the rows' exp2 reference and partial sums, part 1 -> 2

  // P = exp2(S - m) of column groups [kJ0, kJ1) of both rows, summed into split_sum.
  template <int kJ0, int kJ1>
  __device__ __forceinline__ void exp_groups(float scale_log2) {
#pragma unroll
    for (int j = kJ0; j < kJ1; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& x = s[4 * j + 2 * h + c];
          x = fast_exp2(fmaf(x, scale_log2, -split_ref[h]));
          split_sum[h] += x;
        }
  }

  // softmax in two parts: here the rows' maxima, corr and the first FC_EXP_SPLIT column groups;
  // softmax_tail (after the previous P V's wait) the rest and the row sums.
  __device__ __forceinline__ void softmax(float scale_log2, float (&corr)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      corr[h] = update_row(h, scale_log2);
      split_ref[h] = row[h].ref();
      split_sum[h] = 0.f;
    }
    exp_groups<0, FC_EXP_SPLIT>(scale_log2);
  }
  __device__ __forceinline__ void softmax_tail(float scale_log2) {
    exp_groups<FC_EXP_SPLIT, kBlockN / 8>(scale_log2);
#pragma unroll
    for (int h = 0; h < 2; ++h) row[h].add(split_sum[h]);
  }
#else
  __device__ __forceinline__ void softmax_tail(float) {}  // (the whole softmax is in softmax)

  __device__ __forceinline__ void softmax(float scale_log2, float (&corr)[2]) {
    whole_softmax(scale_log2, corr);
  }
#endif

  // The tile's mask where it needs one (`col0`: apply_mask's), then its softmax; with
  // kSoftmaxInArms the softmax is written into both arms of the branch (FC_SOFTMAX_IN_ARMS).
  __device__ __forceinline__ void masked_softmax(bool needs_mask, const Mask& mask, int i0,
                                                 int col0, float scale_log2, float (&corr)[2]) {
    if constexpr (kSoftmaxInArms) {
      if (needs_mask) {
        apply_mask(mask, i0, col0);
        softmax(scale_log2, corr);
      } else {
        softmax(scale_log2, corr);
      }
    } else {
      if (needs_mask) apply_mask(mask, i0, col0);
      softmax(scale_log2, corr);
    }
  }

  __device__ __forceinline__ void rescale(const float (&corr)[2]) {
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        o[4 * j + 2 * h] *= corr[h];
        o[4 * j + 2 * h + 1] *= corr[h];
      }
  }

  // P (fp32, in s) -> 16-bit A fragments.
  __device__ __forceinline__ void pack_p() {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const float* lo = &s[8 * kk];
      p[kk][0] = pack2<T>(lo[0], lo[1]);
      p[kk][1] = pack2<T>(lo[2], lo[3]);
      p[kk][2] = pack2<T>(lo[4], lo[5]);
      p[kk][3] = pack2<T>(lo[6], lo[7]);
    }
  }
};

// One arrival per consumer warp on an "empty" barrier: every lane's wgmma reading the stage has
// completed (a wgmma_wait in each lane before the __syncwarp).
__device__ __forceinline__ void release(uint32_t bar) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(bar);
}

// Ping-pong (FA3's warp scheduler barriers): consumer warpgroup c issues its GEMMs only in its
// turn — bar.sync on named barrier 1 + c, which completes when the previous warpgroup in the
// round (c - 1) has issued its own and arrived there — so one warpgroup's softmax runs while the
// next one's GEMMs keep the tensor cores busy. The last warpgroup opens the first round; the first
// closes the last (turn_close) so every bar.arrive is matched before the CTA exits.
__device__ __forceinline__ void turn_begin(int c) {
  if constexpr (kPingPong) named_barrier_sync(1 + c, 256);
}
__device__ __forceinline__ void turn_end(int c) {
  if constexpr (kPingPong) named_barrier_arrive(1 + (c + 1) % kConsumers, 256);
}
__device__ __forceinline__ void turn_open(int c) {
  if constexpr (kPingPong)
    if (c == kConsumers - 1) named_barrier_arrive(1, 256);
}
__device__ __forceinline__ void turn_close(int c) {
  if constexpr (kPingPong)
    if (c == 0) named_barrier_sync(1, 256);
}

// ---- masked V (FC_MASKED_V) ---------------------------------------------------------------------
// In a key tile that some rows of a warpgroup see only in part (the causal diagonal, a window
// edge), P V multiplies a key's V row by p = 0 for the rows that do not see it, and 0 x NaN / Inf
// is NaN: a NaN or Inf in V would reach rows that never see its key (FA3 behaves so). The V stage
// is shared by the consumer warpgroups, whose rows see different keys, and read by wgmma through
// the async proxy; so each warpgroup decides for itself, for the tiles masked for its own rows,
// from the verdict of the producer warpgroup's scanner warps (scan_v_tiles). Fast path (no
// NaN / Inf): nothing else. Slow path: the warpgroup copies the stage into its own clean tile
// with every NaN / Inf replaced by 0 (same 1024-byte alignment, so the same swizzle), fences the
// copy to the async proxy, runs its P V from that copy, and afterwards adds NaN / +Inf / -Inf
// into the O elements whose row sees a key holding one in that column, read from the stage
// (IEEE: NaN wins, +Inf + -Inf is NaN, O's earlier value joins the sum). A seen key whose p
// underflowed to 0 counts as weighted (IEEE would give 0 x Inf = NaN there). A warpgroup that
// read a stage with generic loads fences them to the async proxy before releasing it (v_empty),
// so TMA's next write into it cannot overtake them.
#if FC_MASKED_V
constexpr int kCleanBarrier = 8;  // + c: warpgroup c's copy of V (1 .. kConsumers: the turns)

// Slow path, part 1: the warpgroup's clean copy of the tile, visible to its wgmma.
__device__ __forceinline__ void copy_clean_v(uint32_t dst, uint32_t v, int c) {
  const int lt = static_cast<int>(threadIdx.x & 127);
#pragma unroll 1
  for (int e = lt; e < kKVBytes / 16; e += 128) {
    Bytes16 w = load_shared_16(v + 16 * e);
    w.x = word_zero_nonfinite<T>(w.x);
    w.y = word_zero_nonfinite<T>(w.y);
    w.z = word_zero_nonfinite<T>(w.z);
    w.w = word_zero_nonfinite<T>(w.w);
    store_shared_16(dst + 16 * e, w);
  }
  fence_proxy_async();
  named_barrier_sync(kCleanBarrier + c, 128);
}

// Byte offset of element (key, d) in a [kBlockN][kHeadDim] tile of 128B-swizzled chunks.
__device__ __forceinline__ uint32_t v_offset(int key, int d) {
  const int unit = (d % 64) / 8;
  return (d / 64) * kKVChunkBytes + key * 128 + ((unit ^ (key & 7)) * 16) + (d % 8) * 2;
}

// Slow path, part 2, once the P V from the clean copy has completed (so the warpgroup's clean
// tile is free again): this thread's O elements (rows row0, row0 + 8; columns 8j + 2t, + 1) go
// to its slot of the clean tile, gain there the NaN / +-Inf of the keys of this tile (first key
// n0) that their rows see, read from the stage `v`, and come back. Rolled loops over shared
// memory, not code unrolled over the registers: the slow path is rare, and its code sits in the
// loop body the fast path runs (unrolled over the head dim's column groups it doubled the
// kernel's SASS; session 8 measured that variant 4-16% slower on causal calls). Adding each
// value straight into O gives IEEE's result of adding their sum: NaN stays NaN, +Inf with -Inf
// is NaN, an infinity absorbs every finite value. Where it runs after O's rescale by corr (the
// following tile's correction; the drain passes corr = 1), each value is scaled by its row's
// corr first: for x NaN / +-Inf and corr >= 0, O corr + x corr is (O + x) corr in IEEE
// arithmetic.
__device__ __forceinline__ void put_back_nonfinite(Consumer& cs, uint32_t v, uint32_t scratch,
                                                   const Mask& mask, int row0, int n0,
                                                   const float (&corr)[2]) {
  // O goes through the clean tile in kParts parts of kHeadDim / kParts columns (one at d64 /
  // d128 / d192, two at d256 with 64-key tiles, where a warpgroup's O is twice a V tile)
  constexpr int kParts = (128 * (kHeadDim / 2) * 4 + kKVBytes - 1) / kKVBytes;
  constexpr int kPartGroups = kHeadDim / 8 / kParts;  // column groups of 8 per part
  static_assert(kPartGroups * kParts * 8 == kHeadDim && 128 * kPartGroups * 4 * 4 <= kKVBytes,
                "a part of a warpgroup's O fits its clean V tile");
  const int t = static_cast<int>(threadIdx.x & 3);
  const uint32_t mine = scratch + (threadIdx.x & 127) * kPartGroups * 4 * 4;
  int lo[2], hi[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    lo[h] = max(mask.key_begin(row0 + 8 * h) - n0, 0);
    hi[h] = min(mask.key_end(row0 + 8 * h + 1) - n0, kBlockN);
  }
  const int first = min(lo[0], lo[1]), last = max(hi[0], hi[1]);
#pragma unroll
  for (int part = 0; part < kParts; ++part) {
    const int i0 = part * kPartGroups * 4;  // the part's first accumulator
#pragma unroll
    for (int i = 0; i < kPartGroups * 4; ++i)
      store_shared_32(mine + 4 * i, __float_as_uint(cs.o[i0 + i]));
#pragma unroll 1
    for (int key = first; key < last; ++key) {
#pragma unroll 1
      for (int jj = 0; jj < kPartGroups; ++jj) {
        const int j = part * kPartGroups + jj;
        const uint32_t w = load_shared_32(v + v_offset(key, 8 * j + 2 * t));
        if (!word_nonfinite<T>(w)) continue;
#pragma unroll  // e, h: two each, kept unrolled so that lo / hi stay in registers
        for (int e = 0; e < 2; ++e) {
          const uint32_t bits = e ? (w >> 16) : (w & 0xffffu);
          if (!half_nonfinite<T>(bits)) continue;
          const float x = nonfinite_value<T>(bits);  // (scaled below by its row's corr)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (key < lo[h] || key >= hi[h]) continue;
            const uint32_t at = mine + 4 * (4 * jj + 2 * h + e);
            const float o_at = __uint_as_float(load_shared_32(at));
            store_shared_32(at, __float_as_uint(o_at + x * corr[h]));
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kPartGroups * 4; ++i)
      cs.o[i0 + i] = __uint_as_float(load_shared_32(mine + 4 * i));
  }
}
#endif

// A consumer warpgroup's view of a work tile's visits: which need the mask for its rows
// (MaskedVisits), and with FC_MASKED_V which scan of the CTA's scanners holds each masked
// visit's verdict: the scanners number the tiles they scan in ring order, and they scan every
// visit that needs the mask for some row of the work tile (its first `scan_head` visits and those
// from `scan_tail` on, after the `scan_base` scans of the CTA's earlier work tiles).
struct Visits : MaskedVisits {
#if FC_MASKED_V
  int scan_base, scan_head, scan_tail;
  __device__ __forceinline__ int scan(int i) const {
    return scan_base + (i < scan_head ? i : scan_head + i - scan_tail);
  }
#else
  __device__ __forceinline__ int scan(int) const { return 0; }
#endif
};

// The V tile the P V of a masked tile reads (FC_MASKED_V): its stage, or, when the stage holds a
// NaN / Inf, the warpgroup's clean copy (`poisoned`). Warpgroup-uniform: every thread of it takes
// the same branches and barriers.
__device__ __forceinline__ uint32_t scanned_v(const Smem& sm, int stage, int scan, int c,
                                              bool& poisoned) {
#if FC_MASKED_V
  // the scanners' verdicts on the work tiles' scan number `scan` (Visits::scan), read through
  // lane 0: the same in every thread, but so ptxas knows it is warp-uniform, and the V address
  // chosen from it stays in uniform registers (the P V wgmma's descriptors need no R2UR per
  // tile; session 8: without this masked V cost 4-16% on causal calls)
  mbar_wait(sm.v_scanned(stage_of(scan)), parity_of(scan));
  uint32_t verdict = 0;
#pragma unroll
  for (int w = 0; w < kScanners; ++w) verdict |= load_shared_32(sm.v_flag(stage_of(scan), w));
  poisoned = __shfl_sync(0xffffffffu, verdict, 0) != 0;
  if (poisoned) {
#if FC_O_TMA
    // the clean tile is the last epilogue's O staging tile: its store has read it first
    if ((threadIdx.x & 127) == 0) bulk_wait_group_read<0>();
    named_barrier_sync(kCleanBarrier + c, 128);
#endif
    copy_clean_v(sm.clean_v(c), sm.v(stage), c);
    return sm.clean_v(c);
  }
#else
  poisoned = false;
  (void)scan;
  (void)c;
#endif
  return sm.v(stage);
}

// After the P V from a scanned stage completed and O was rescaled by `corr`: the slow path's
// put-back, the fence that orders this thread's generic reads of the stage before TMA rewrites
// it, and the stage's release.
__device__ __forceinline__ void finish_scanned_v(bool poisoned, Consumer& cs, const Smem& sm,
                                                 int stage, const Block& blk, const Mask& mask,
                                                 int i, int row0, int c,
                                                 const float (&corr)[2]) {
#if FC_MASKED_V
  if (poisoned)
    put_back_nonfinite(cs, sm.v(stage), sm.clean_v(c), mask, row0, (blk.n_last - i) * kBlockN,
                       corr);
  if (poisoned) fence_proxy_async();  // (only the slow path read the stage here)
#endif
  release(sm.v_empty(stage));
}

// Key tile i of the visit order, the loop body written once:
//     issue S_i = Q K_i^T | issue O += P_{i-1} V_{i-1} (not for the first tile) | wait S_i,
//     release K_i | mask if the tile needs it | softmax of S_i | wait P V, release V_{i-1} |
//     rescale O | P_i -> A fragments
// The first tile is a compile-time case and masking a warp-uniform runtime branch around
// apply_mask alone: wgmma issued on a path ptxas sees as divergent gets serialized (C7520).
// `masked` (decided once per work tile) says which visits need the mask for this warpgroup's rows:
// redoing the band arithmetic per tile cost the masked-V variant 13% at d64 (session 9, ncu).
// kScanPrev (FC_MASKED_V only): tile i - 1 was masked for these rows, so its V stage is scanned
// before its P V and, after the rescale and packing, the slow path's put-back may run before the
// stage is released. The caller runs the copy without it on the unmasked run of tiles, so there
// the loop is the default kernel's (session 9: with the scan's branches in every tile's body the
// variant cost 4-14%, most of it on tiles that never scan).
template <bool kFirst, bool kScanPrev>
__device__ __forceinline__ void attend_key_tile(Consumer& cs, const Smem& sm, const Block& blk,
                                                const Mask& mask, const Visits& masked,
                                                int i, int ring, int row0, int c,
                                                float scale_log2) {
  static_assert(!(kFirst && kScanPrev), "the first tile has no previous tile");
  const int st = stage_of(ring);
  const int prev = stage_of(ring + kStages - 1);
  bool poisoned = false;  // (kScanPrev) tile i - 1's V holds a NaN / Inf its P V left out
  uint32_t v_prev = sm.v(prev);
  mbar_wait(sm.k_full(st), parity_of(ring));
  // With ping-pong, wait for V before taking the turn (never hold it while waiting for data);
  // without, issue S first and wait for V while that GEMM runs (but not before a scan: between
  // the two GEMMs it would make ptxas fence the in-flight S wgmma, C7519).
  constexpr bool kVBeforeTurn = kPingPong || kScanPrev;
  if constexpr (kVBeforeTurn && !kFirst) {
    mbar_wait(sm.v_full(prev), parity_of(ring - 1));
    if constexpr (kScanPrev) v_prev = scanned_v(sm, prev, masked.scan(i - 1), c, poisoned);
  }
  turn_begin(c);
  wgmma_fence_operands(cs.s);
  wgmma_fence_operands(cs.o);
  wgmma_fence();
  cs.issue_scores(sm.k(st));
#if FC_RESCALE_EARLY_ON
  if constexpr (!kFirst) {  // O (no GEMM writes it now) by the previous tile's correction
    cs.rescale(cs.corr_next);
    wgmma_fence_operands(cs.o);
    wgmma_fence();
  }
#endif
  if constexpr (!kFirst) {
    if constexpr (!kVBeforeTurn) {
      mbar_wait(sm.v_full(prev), parity_of(ring - 1));
      v_prev = sm.v(prev);  // (the same address; computed here it keeps the SASS of before)
    }
    cs.issue_accumulate(v_prev);
  }
  turn_end(c);
  if constexpr (!kFirst) {
    wgmma_wait<1>();
  } else {
    wgmma_wait<0>();
#if FC_TIMELINE
    cs.t_s0 = globaltimer_ns();
#endif
  }
  wgmma_fence_operands(cs.s);
  release(sm.k_empty(st));
  float corr[2];
  cs.masked_softmax(masked(i), mask, row0,
                    (blk.n_last - i) * kBlockN + 2 * static_cast<int>(threadIdx.x & 3), scale_log2,
                    corr);
  if constexpr (!kFirst) {
    wgmma_wait<0>();
    cs.hold_p();
    wgmma_fence_operands(cs.o);
    if constexpr (!kScanPrev) release(sm.v_empty(prev));
  }
  cs.softmax_tail(scale_log2);  // (FC_EXP_SPLIT; nothing otherwise)
#if FC_RESCALE_EARLY_ON
  cs.corr_next[0] = corr[0];  // (rescaled before the next P V)
  cs.corr_next[1] = corr[1];
#else
  cs.rescale(corr);
#endif
  cs.pack_p();
  // The slow path's branch comes after the softmax, rescale and packing, not between them: there
  // it split their basic block, and ptxas no longer hid the exp2s' latency behind the rescale
  // and the conversions (session 9: 11% at d64).
  if constexpr (kScanPrev)
    finish_scanned_v(poisoned, cs, sm, prev, blk, mask, i - 1, row0, c, corr);
}

// Tiles [i, end) of the visit order, `kScanPrev` for each (see attend_key_tile).
template <bool kScanPrev>
__device__ __forceinline__ void attend_key_tiles(Consumer& cs, const Smem& sm, const Block& blk,
                                                 const Mask& mask, const Visits& masked,
                                                 int i, int end, int ring, int row0, int c,
                                                 float scale_log2) {
  for (; i < end; ++i)
    attend_key_tile<false, kScanPrev>(cs, sm, blk, mask, masked, i, ring + i, row0, c,
                                      scale_log2);
}

// Every key tile of a work tile after the first. With FC_MASKED_V the visits split into the runs
// masked_visits describes (masked, unmasked, masked: tile i - 1 decides whether visit i scans), so
// the scan's code runs only where a scan can happen.
__device__ __forceinline__ void attend_rest(Consumer& cs, const Smem& sm, const Block& blk,
                                            const Mask& mask, const Visits& masked,
                                            int tiles, int ring, int row0, int c,
                                            float scale_log2) {
#if FC_MASKED_V
  const int head = min(max(masked.head, 0), tiles - 1) + 1;  // visits 1 .. head - 1 scan
  const int tail = max(min(masked.tail, tiles - 1), head - 1) + 1;  // visits from tail on scan
  attend_key_tiles<true>(cs, sm, blk, mask, masked, 1, head, ring, row0, c, scale_log2);
  attend_key_tiles<false>(cs, sm, blk, mask, masked, head, tail, ring, row0, c, scale_log2);
  attend_key_tiles<true>(cs, sm, blk, mask, masked, tail, tiles, ring, row0, c, scale_log2);
#else
  attend_key_tiles<false>(cs, sm, blk, mask, masked, 1, tiles, ring, row0, c, scale_log2);
#endif
}

// The last tile's P V, after the loop (`i`: its visit index, `last`: its ring index). `between`
// runs after that P V is issued and before the wait for it (the next work tile's decode, under
// the tensor cores: "decode ahead" in the consumers' loop)
template <class Between>
__device__ __forceinline__ void drain(Consumer& cs, const Smem& sm, const Block& blk,
                                      const Mask& mask, const Visits& masked, int i,
                                      int last, int row0, int c, Between between) {
  const int stage = stage_of(last);
  const bool scan = FC_MASKED_V && masked(i);
  bool poisoned = false;
#if FC_RESCALE_EARLY_ON
  cs.rescale(cs.corr_next);  // (the last tile's correction, before its P V)
#endif
  mbar_wait(sm.v_full(stage), parity_of(last));
  const uint32_t v = scan ? scanned_v(sm, stage, masked.scan(i), c, poisoned) : sm.v(stage);
  turn_begin(c);
  wgmma_fence_operands(cs.o);
  wgmma_fence();
  cs.issue_accumulate(v);
  turn_end(c);
  between();
  wgmma_wait<0>();
  cs.hold_p();
  wgmma_fence_operands(cs.o);
  if (scan) {
    const float no_rescale[2] = {1.f, 1.f};
    finish_scanned_v(poisoned, cs, sm, stage, blk, mask, i, row0, c, no_rescale);
  } else {
    release(sm.v_empty(stage));
  }
}

#if FC_TIMELINE
// ---- profiling variant: where each persistent CTA spends its time ------------------------------
// One entry of kTimelineWords per work tile a consumer warpgroup finishes, written by its first
// thread: {smid << 32 | work tile, setup ns << 32 | key tiles, start ns, Q ready ns, epilogue
// start ns, end ns, first S ns << 32 | first tile ns, drain ns} (setup: start to the q_full
// wait's first try, the work tile's decode and mask set-up, session 15; Q ready: its q_full wait
// returned; first S / first tile: Q ready to the first S's wait returning / to the first tile's
// softmax and packing done, both ns after Q ready, session 16; drain: the last tile's P V about to
// be issued; epilogue start: that P V done; all = start for a work tile without key tiles).
// scripts/sm90_timeline.py reads them; entries past timeline_slots are dropped, unused ones stay
// as the host zeroed them.
constexpr int kTimelineWords = 8;

struct Timeline {
  uint64_t* base;
  int slots, c, next = 0;

  __device__ __forceinline__ void record(int w, int tiles, uint64_t start, uint64_t q_try,
                                         uint64_t q_ready, uint64_t epilogue, uint64_t s0,
                                         uint64_t first, uint64_t drain) {
    if ((threadIdx.x & 127) == 0 && next < slots) {
      uint64_t* e = base + ((static_cast<int64_t>(blockIdx.x) * kConsumers + c) * slots + next) *
                               kTimelineWords;
      e[0] = (static_cast<uint64_t>(sm_id()) << 32) | static_cast<uint32_t>(w);
      e[1] = ((q_try - start) << 32) | static_cast<uint32_t>(tiles > 0 ? tiles : 0);
      e[2] = start;
      e[3] = q_ready;
      e[4] = epilogue;
      e[5] = globaltimer_ns();
      e[6] = ((s0 - q_ready) << 32) | static_cast<uint32_t>(first - q_ready);
      e[7] = drain;
    }
    ++next;
  }
};
#endif

// The parameters after the tensor maps and the out / lse pointers (fwd_sm90.constant_args, then
// fast_div_args: the schedule's magic numbers, Magic), and their names: the kernel's, and the
// fused kernel's and its passes' `run` (flash_fwd_sm90_fused.cu)
#define FC_FWD_SCALAR_PARAMS                                                                   \
  int64_t o_batch_stride, int64_t o_row_stride, int64_t o_head_stride, int seqlen_q,           \
      int seqlen_k, int nheads, int nheads_kv, float scale_log2, int window_left,              \
      int window_right, int batch, int by_block, uint64_t magic_num_m, uint64_t magic_heads,   \
      uint64_t magic_section, uint64_t magic_by_block, uint64_t magic_last,                    \
      uint64_t magic_nheads, uint64_t magic_group, uint64_t magic_grid, int sections,          \
      int last_size
#define FC_FWD_SCALAR_ARGS                                                                     \
  o_batch_stride, o_row_stride, o_head_stride, seqlen_q, seqlen_k, nheads, nheads_kv,          \
      scale_log2, window_left, window_right, batch, by_block, magic_num_m, magic_heads,        \
      magic_section, magic_by_block, magic_last, magic_nheads, magic_group, magic_grid,        \
      sections, last_size

#if FC_FUSED_PART
// One pass of flash_fwd_sm90_fused.cu's kernel (its parameters, by reference to its own)
__device__ __forceinline__ void run(const TmaMap& map_q, const TmaMap& map_k, const TmaMap& map_v,
                                    const TmaMap& map_o, T* __restrict__ out,
                                    float* __restrict__ lse, FC_FWD_SCALAR_PARAMS) {
  static_assert(!FC_TIMELINE && !FC_NAN_FIXUP, "the fused kernel: no timeline, no flags");
#else
extern "C" __global__ void __launch_bounds__(kThreads, 1)
FC_KERNEL_NAME(const __grid_constant__ TmaMap map_q,  // q [B, Sq, H, D]: dims (D, Sq, H, B)
               const __grid_constant__ TmaMap map_k,  // k [B, Sk, Hkv, D]: dims (D, Sk, Hkv, B)
               const __grid_constant__ TmaMap map_v,  // v [B, Sk, Hkv, D]: dims (D, Sk, Hkv, B)
#if FC_O_TMA
               const __grid_constant__ TmaMap map_o,  // out, as q, box 64 x 64 (the store)
#endif
               T* __restrict__ out,                   // [B, Sq, H, D]
               float* __restrict__ lse,               // [B, H, Sq]
#if FC_NAN_FLAGS || FC_NAN_FIXUP
               uint8_t* __restrict__ nan_flags,       // [gridDim.x][kNanFlagBytes]: FC_NAN_FLAGS
#endif
               FC_FWD_SCALAR_PARAMS
#if FC_TIMELINE
               // [gridDim.x][kConsumers][timeline_slots][kTimelineWords]: see Timeline
               , uint64_t* __restrict__ timeline, int timeline_slots
#endif
               ) {
#endif  // FC_FUSED_PART
#if FC_NAN_FLAGS && !FC_FUSED_PART
  // the second pass may start launching where it is this grid's programmatic dependent
  // (fwd_sm90.PDL_ENV, an A/B: measured as noise): its CTAs take the SMs this grid's CTAs leave
  // and wait there (griddepcontrol.wait) for this grid
  griddepcontrol_launch_dependents();
#endif
#if FC_NAN_FIXUP
  // every write of the first pass visible (a no-op when not launched as its programmatic
  // dependent: stream order then did it)
  griddepcontrol_wait();
  {  // the first pass's report for the work tiles this CTA walks (the same for every thread)
    uint32_t reported = 0;
#pragma unroll
    for (int i = 0; i < kConsumerWarps; ++i) reported |= nan_flags[kNanFlagBytes * blockIdx.x + i];
    if (reported == 0) return;
  }
#endif
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const Smem sm{(smem_addr(smem_raw) + 1023u) & ~1023u};
  // Warpgroup index, made visibly warp-uniform for ptxas (a shuffle from lane 0, as CUTLASS does).
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

  const Mask mask{seqlen_q, seqlen_k, window_left, window_right};
  const Schedule sched{(seqlen_q + kBlockM - 1) / kBlockM, nheads, batch, by_block,
                       Magic{magic_num_m, magic_heads, magic_section, magic_by_block, magic_last,
                             magic_nheads, magic_group, magic_grid, sections, last_size}};

  if (threadIdx.x == 0) {
#if !FC_ROLE_ONLY
    sm.init_barriers();  // (FC_ROLE_ONLY: the first pass's end did, before it let the roles go)
#endif
    tma_prefetch(map_q);
    tma_prefetch(map_k);
    tma_prefetch(map_v);
#if FC_O_TMA
    tma_prefetch(map_o);
#endif
  }
#if !FC_ROLE_ONLY
  __syncthreads();
#endif

#if FC_ROLE_ONLY != 2
  if (FC_ROLE_ONLY == 1 || wg == 0) {  // ---- producer warpgroup
#if !FC_ROLE_ONLY
    setmaxnreg_dec<kProducerRegs>();
#endif
    if (threadIdx.x < 32 && elect_one()) produce(sm, sched, mask, map_q, map_k, map_v);
#if FC_MASKED_V
    if (threadIdx.x >= 32) scan_v_tiles(sm, static_cast<int>(threadIdx.x / 32) - 1);
#endif
#ifdef FC_FUSED_PRODUCER_TAIL
    FC_FUSED_PRODUCER_TAIL  // (flash_fwd_sm90_fused.cu: the second pass's producer role)
#endif
    return;
  }
#endif
#if FC_ROLE_ONLY != 1
  // ---- consumer warpgroups
#if !FC_ROLE_ONLY
  setmaxnreg_inc<kConsumerRegs>();
#endif
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int c = wg - 1;               // consumer index
  const int wg_row0 = c * 64;         // this warpgroup's first row in the block
  const int warp_row0 = wg_row0 + static_cast<int>((threadIdx.x / 32) % 4) * 16;
  const int g = lane >> 2, t = lane & 3;
  int ring = 0, q_round = 0;
#if FC_TIMELINE
  Timeline timeline_rec{timeline, timeline_slots, c};
#endif
#if FC_MASKED_V
  int scans = 0;  // the scanners' scans of this CTA's earlier work tiles (Visits)
#endif
#if FC_NAN_FLAGS
  float nonfinite_probe = 0.f;  // NaN / Inf once some accumulator value was (fold_nonfinite)
#endif
  // A work tile's visits for this warpgroup's rows (with FC_MASKED_V numbered from `scans`, the
  // scanners' scans so far, which it advances past the work tile's)
  auto visits_of = [&](const Block& blk) {
    Visits v{masked_visits(mask, blk.m0 + wg_row0, 64, blk.n_last, kBlockN)};
#if FC_MASKED_V
    // the visits the scanners scan (as the producer requests them)
    const int tiles = blk.tiles();
    const MaskedVisits all = masked_visits(mask, blk.m0, kBlockM, blk.n_last, kBlockN);
    v.scan_base = scans;
    v.scan_head = min(max(all.head, 0), tiles);
    v.scan_tail = min(max(all.tail, v.scan_head), tiles);
    scans += v.scan_head + tiles - v.scan_tail;
#endif
    return v;
  };
  // ---- epilogue: finish l over the quad, normalise, store O and lse of a work tile (the producer
  // is already loading the next work tile's Q, K and V)
  auto store_out = [&](Consumer& cs, const Block& blk, int row0) {
    const int64_t lse_row0 = (static_cast<int64_t>(blk.batch) * nheads + blk.head) * seqlen_q;
#if FC_NAN_FLAGS
    nonfinite_probe = fold_nonfinite(cs.o, nonfinite_probe);
#endif
#if FC_O_TMA
    // the previous work tile's store (issued by this warpgroup's first thread) has read the tile
    if ((threadIdx.x & 127) == 0) bulk_wait_group_read<0>();
    named_barrier_sync(kOBarrier + c, 128);
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      OnlineSoftmax& st = cs.row[h];
      st.l += __shfl_xor_sync(0xffffffffu, st.l, 1);
      st.l += __shfl_xor_sync(0xffffffffu, st.l, 2);
      inv[h] = st.inv_sum();
      const int r = row0 + 8 * h;
      if (r < seqlen_q && t == 0) lse[lse_row0 + r] = st.lse();
    }
    // stmatrix.x4 per pair of 8-column groups (j, j + 1): matrix k of lane l's address is row
    // 16 (warp in the warpgroup) + 8 (k % 2) + l % 8 (h = k % 2), column group j + k / 2; its
    // register is this lane's (h, group) pair, the accumulator's fragment order
    const int st_row = static_cast<int>((threadIdx.x / 32) % 4) * 16 + 8 * ((lane >> 3) & 1) +
                       (lane & 7);
    const uint32_t st_base = sm.o(c) + st_row * 128;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; j += 2) {
      const int group = j + (lane >> 4);  // this lane's address: column group j or j + 1
      const uint32_t addr =
          st_base + (group / 8) * (64 * 128) + (((group % 8) ^ (st_row & 7)) << 4);
      stmatrix_x4(addr, pack2<T>(cs.o[4 * j] * inv[0], cs.o[4 * j + 1] * inv[0]),
                  pack2<T>(cs.o[4 * j + 2] * inv[1], cs.o[4 * j + 3] * inv[1]),
                  pack2<T>(cs.o[4 * j + 4] * inv[0], cs.o[4 * j + 5] * inv[0]),
                  pack2<T>(cs.o[4 * j + 6] * inv[1], cs.o[4 * j + 7] * inv[1]));
    }
    fence_proxy_async();
    named_barrier_sync(kOBarrier + c, 128);
    if ((threadIdx.x & 127) == 0) {
#pragma unroll
      for (int ch = 0; ch < kChunks; ++ch)
        tma_store_4d(map_o, sm.o(c) + ch * (64 * 128), ch * kChunkCols, blk.m0 + wg_row0,
                     blk.head, blk.batch
#if FC_L2_HINTS == 1
                     , l2_evict_first()  // O: not read again here
#endif
        );
      bulk_commit_group();
    }
#else
    T* o_bh = out + blk.batch * o_batch_stride + blk.head * o_head_stride;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      OnlineSoftmax& st = cs.row[h];
      st.l += __shfl_xor_sync(0xffffffffu, st.l, 1);
      st.l += __shfl_xor_sync(0xffffffffu, st.l, 2);
      const float inv = st.inv_sum();
      const int r = row0 + 8 * h;
#if FC_O_QUAD
      if (r < seqlen_q && t == 0) lse[lse_row0 + r] = st.lse();
      uint32_t words[kHeadDim / 8];
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j)
        words[j] = pack2<T>(cs.o[4 * j + 2 * h] * inv, cs.o[4 * j + 2 * h + 1] * inv);
      store_row_v4(reinterpret_cast<uint4*>(o_bh + r * o_row_stride), words, t, r < seqlen_q);
#else
      if (r < seqlen_q) {
        if (t == 0) lse[lse_row0 + r] = st.lse();
        uint32_t* dst = reinterpret_cast<uint32_t*>(o_bh + r * o_row_stride + 2 * t);
#pragma unroll
        for (int j = 0; j < kHeadDim / 8; ++j)
          dst[4 * j] = pack2<T>(cs.o[4 * j + 2 * h] * inv, cs.o[4 * j + 2 * h + 1] * inv);
      }
#endif
    }
#endif  // FC_O_TMA
  };
  turn_open(c);
  // Decode ahead (session 15; the default since session 17): a consumer decodes its next work
  // tile (Schedule::block, ~150 uniform-datapath instructions in a dependent chain, ~0.38 us of a
  // work tile's set-up when it ran at the top, session 15) while its last P V runs on the tensor
  // cores (drain, between the issue and the wait), not at the top of the next work tile, where
  // nothing hides it. With the magic-number divisions (Magic) the forward timeline put a work
  // tile's set-up at 0.10-0.13 us (session 17).
  Block ahead = sched.block(blockIdx.x, mask);  // the work tile the loop takes next
  for (int w = blockIdx.x; w < sched.total(); w = next_tile(sched, w)) {
#if FC_TIMELINE
    const uint64_t t_start = globaltimer_ns();
    uint64_t t_q_try = t_start, t_q = t_start, t_epilogue = t_start;
    uint64_t t_s0 = t_start, t_first = t_start, t_drain = t_start;
#endif
    const Block blk = ahead;
    const int w_next = next_tile(sched, w);  // (decoded past the end too: arithmetic only)
    auto decode_next = [&] { ahead = decode_pinned(sched, w_next, mask); };
    const int row0 = blk.m0 + warp_row0 + g;  // query row of this lane's first row (h = 0)
    const int qb = q_round % kQStages;  // this work tile's Q buffer (as the producer's)
    Consumer cs;
    cs.init(sm, wg_row0, qb);

    const int tiles = blk.tiles();
    if (tiles > 0) {
      const Visits masked = visits_of(blk);
#if FC_TIMELINE
      t_q_try = globaltimer_ns();
#endif
      mbar_wait(sm.q_full(qb), (q_round / kQStages) & 1);
#if FC_TIMELINE
      t_q = globaltimer_ns();
#endif
      attend_key_tile<true, false>(cs, sm, blk, mask, masked, 0, ring, row0, c, scale_log2);
#if FC_TIMELINE
      t_first = globaltimer_ns();
      t_s0 = cs.t_s0;
#endif
      attend_rest(cs, sm, blk, mask, masked, tiles, ring, row0, c, scale_log2);
      release(sm.q_empty(qb));  // every Q K^T of this work tile has completed
#if FC_TIMELINE
      t_drain = globaltimer_ns();
#endif
      drain(cs, sm, blk, mask, masked, tiles - 1, ring + tiles - 1, row0, c, decode_next);
      ring += tiles;
      ++q_round;
#if FC_TIMELINE
      t_epilogue = globaltimer_ns();
#endif
    } else {
      decode_next();  // (a work tile without key tiles has no P V to hide it under)
    }

    store_out(cs, blk, row0);
#if FC_TIMELINE
    timeline_rec.record(w, tiles, t_start, t_q_try, t_q, t_epilogue, t_s0, t_first, t_drain);
#endif
  }
#if FC_O_TMA
  if ((threadIdx.x & 127) == 0) bulk_wait_group<0>();  // no store outlives the shared memory
#endif
#if FC_NAN_FLAGS
  const bool reported = __any_sync(0xffffffffu, float_nonfinite(nonfinite_probe));
#if !FC_FUSED_PART
  if (lane == 0) nan_flags[kNanFlagBytes * blockIdx.x + threadIdx.x / 32 - 4] = reported;
#endif
#endif
  turn_close(c);
#ifdef FC_FUSED_CONSUMER_TAIL
  FC_FUSED_CONSUMER_TAIL(reported)  // (flash_fwd_sm90_fused.cu: the second pass's consumer role)
#endif
#endif  // FC_ROLE_ONLY != 1
}
