// Flash attention forward, sm80 tensor-core kernel (the FlashAttention-2 algorithm).
//
// Feature matrix
//   dtypes        fp16, bf16 in and out; fp32 accumulation and softmax
//   head dims     kHeadDim in {32, 64, 96, 128, 192, 256}; a smaller runtime head_dim (multiple of
//                 8) runs in the next kernel head dim with columns >= head_dim zero-filled on load
//                 and not stored
//   masking       bottom-right aligned band of mask.cuh (causal, sliding window, top-left causal
//                 as a negative window_right, none); ragged seqlen_q / seqlen_k
//   heads         MHA, GQA, MQA (kv head = head / (nheads / nheads_kv))
//   layouts       any (batch, row, head) strides that are multiples of 8 elements, unit last
//                 stride, 16-byte aligned base pointers (e.g. views of one packed qkv tensor)
//   outputs       out (B, Sq, H, D), lse (B, H, Sq) float32 natural log
//   not here      dropout, softcap, alibi, varlen, paged KV, split-KV, backward
//   arch          sm_80 and newer (runs on Hopper, where the sm90 kernel is the fast one)
//
// One CTA per (query block, head, batch), grid (ceil(Sq / kBlockM), H, B), query blocks in
// reverse order so that with causal masking the longest CTAs start first. kWarps warps split the
// kBlockM query rows (kWarpRows each), so the softmax of a row never leaves its warp: each row
// lives in one quad (4 lanes), the reductions are two shuffles.
//
// Per key tile j (visited from the last one down, like FA2), with K_j already in flight:
//     wait K_j; sync | issue V_j | S = Q K_j^T (ldmatrix Q, K; mma.sync) | mask if the tile needs
//     it | wait V_j; sync | issue K_{j-1} | new row maxima, rescale O | per 16 keys: P = exp2(S -
//     max) (scale folded into one FFMA) straight from C-fragment into A-fragment registers, then
//     O += P V_j (ldmatrix.trans) and l += P 1 (see below)
// so each load overlaps the other GEMM. Deferred normalisation: O / l once, in the epilogue. K and V have one buffer each (kBlockM + 2 kBlockN rows
// of smem in all); the first sync of an iteration also guarantees every warp is done reading V_{j+1}
// before V_j overwrites it, the second that every warp is done with K_j before K_{j-1} lands.
//
// What masked keys can and cannot do (NaN / Inf in K or V):
//   * Key tiles no row of the block can see are never loaded.
//   * Inside a loaded tile, keys outside [key_begin(first row), key_end(last row)) of the block --
//     beyond seqlen_k, after the last row's band, before the first row's band -- are zero-filled on
//     load, never read, so any value there never reaches the output.
//   * A masked (row, key) pair gets score -inf, replacing whatever Q K^T gave: K values never
//     leak into a row that cannot see them.
//   * A V row that some row of the block sees is multiplied by p = 0 for the rows that do not see
//     it; a NaN/Inf there would leak (0 * NaN = NaN), as in FlashAttention.
// A row that sees no key gets out = 0 and lse = -inf (OnlineSoftmax's guards).
//
// Registers (the budget that shapes the code; ptxas report in tests/cpu/test_fwd_sm80_compile.py):
// at d128 a thread holds O (128 floats) and S (64) and must stay under 255 registers.
//   * Row sums l come from the tensor cores: one extra mma per 16 keys multiplies P by a ones
//     fragment into a 4-float accumulator, instead of 2 FADDs per probability. ptxas sank those
//     FADDs below the P V mmas, keeping every fp32 probability alive (~30 registers of spills);
//     the mma costs 1/(2 * kHeadDim / 16) more tensor work (3% at d128) and sums the bf16/fp16 P
//     that actually multiplies V, so out is an exact weighted mean of those weights. The mma also
//     sums across the quad, so l needs no shuffles.
//   * The exp2 of a 16-key slice of S feeds its P V mma at once (not a separate softmax pass).
//   * Global->shared copies keep 3 registers per thread (TileLoader); the K/V base pointers
//     and the mask's row / key of a lane are recomputed per tile rather than held across the loop.
//   Result (NVRTC 13.0): no spills except d128 (12-20 bytes: the loop counter and one invariant,
//   one L1 reload per key tile) and d96 on sm_90a (16 bytes); FA2 spills 172 bytes at d128.
#include "common/types.cuh"
#include "common/sm80.cuh"
#include "attention/mask.cuh"
#include "attention/online_softmax.cuh"
#include "attention/nonfinite.cuh"

using T = typename dtype_of<FC_DTYPE>::type;
constexpr int kHeadDim = FC_HEAD_DIM;  // kernel head dim (runtime head_dim <= kHeadDim)
constexpr int kBlockM = FC_BLOCK_M;    // query rows per CTA
constexpr int kBlockN = FC_BLOCK_N;    // keys per tile
constexpr int kWarps = FC_WARPS;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpRows = kBlockM / kWarps;  // query rows per warp
constexpr int kMTiles = kWarpRows / 16;      // m16 tiles per warp
constexpr int kNTiles = kBlockN / 8;         // n8 tiles of S
constexpr int kDTiles = kHeadDim / 8;        // n8 tiles of O
constexpr int kDSteps = kHeadDim / 16;       // k16 steps of Q K^T
constexpr int kNSteps = kBlockN / 16;        // k16 steps of P V
// 1: each key tile's row sum carried with round-to-nearest adds (default); 0: the mma sums the
// whole row (FLASHCUDA_SM80_FWD_ROWSUM=mma, A/B; lse low on long rows, see FwdCta::l).
#ifndef FC_EXACT_ROWSUM
#define FC_EXACT_ROWSUM 1
#endif
// Two 16-bit 1.0s: the B fragment of the row-sum mma.
constexpr uint32_t kOnes = FC_DTYPE == 1 ? 0x3c003c00u : 0x3f803f80u;

static_assert(FC_DTYPE == 1 || FC_DTYPE == 2, "sm80 kernel: fp16 or bf16");
static_assert(kWarpRows % 16 == 0 && kWarpRows * kWarps == kBlockM, "rows per warp: 16k");
static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0, "tile shapes");

using QTile = SwizzledTile<kBlockM, kHeadDim>;
using KVTile = SwizzledTile<kBlockN, kHeadDim>;
using QLoader = TileLoader<kBlockM, kHeadDim, kThreads>;
using KVLoader = TileLoader<kBlockN, kHeadDim, kThreads>;
constexpr int kSmemQ = 0;
constexpr int kSmemK = kSmemQ + QTile::kBytes;
constexpr int kSmemV = kSmemK + KVTile::kBytes;
#ifndef FC_MASKED_V
#define FC_MASKED_V 1  // non-finite V in a partly seen tile reaches only its rows (default since
                       // session 8; 0 = the A/B variant without the scan, see below)
#endif
// FC_MASKED_V: where the non-finite values of a partly seen tile's V are, as bits per key: kind
// (0 NaN, 1 +Inf, 2 -Inf) x column x kBlockN / 32 words.
constexpr int kBadWords = kBlockN / 32;
constexpr int kSmemBad = kSmemV + KVTile::kBytes;
constexpr int kBadBytes = FC_MASKED_V ? 3 * kHeadDim * kBadWords * 4 : 0;
constexpr int kSmemBytes = kSmemBad + kBadBytes;
// The host config (flashcuda/ops/fwd_sm80.py) computes the launch's dynamic smem; it must agree.
static_assert(kSmemBytes == FC_SMEM_BYTES, "smem layout disagrees with Sm80FwdConfig.smem_bytes");

// What each thread holds in registers for its rows, and the tile verbs that work on it.
struct FwdCta {
  float o[kMTiles][kDTiles][4];  // O accumulator (C fragments), kWarpRows x kHeadDim per warp
  float s[kMTiles][kNTiles][4];  // S of the current key tile
  // Row sums of P (C fragment of P x ones: c0 = c1, c2 = c3). The tensor cores' fp32
  // accumulation drops low bits at every k16 step (toward zero), so over a long row the sum
  // comes out low: 2.42e-4 relative at 65537 keys (session 6). out = O / l does not see it (O's
  // accumulator loses the same share), lse = m + log l does. So FC_EXACT_ROWSUM (the default
  // since session 7; 0-2% slower than the whole-row mma sum in the same-run A/B) keeps the
  // running sum in c1 / c3 with round-to-nearest adds per tile instead.
  float l[kMTiles][4];
  OnlineSoftmax row[kMTiles][2]; // running max per owned row: [m tile][0: row g, 1: row g + 8]
  uint32_t q_lane, k_lane, v_lane;  // this lane's ldmatrix addresses (SwizzledTile::lane_address)

  // ldmatrix lane roles (header of sm80.cuh for the fragment layouts):
  //   Q (A operand, [row][d]): matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15) in a0..a3 order,
  //     lane -> row lane % 16, chunk lane / 16.
  //   K (B operand, stored [key][d]): matrices (keys 0-7, k 0-7), (keys 0-7, k 8-15),
  //     (keys 8-15, k 0-7), (keys 8-15, k 8-15) = b0, b1 of key tile 2np, then of 2np + 1;
  //     lane -> key lane % 8 + 8 (lane / 16), chunk (lane / 8) % 2.
  //   V (B operand, stored [key][d], read transposed): matrices (keys 0-7, d 0-7),
  //     (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15) = b0, b1 of d tile 2dp, then
  //     of 2dp + 1; lane -> key lane % 16, chunk lane / 16.
  __device__ __forceinline__ void init(uint32_t smem, int lane, int warp_row0) {
    q_lane = QTile::lane_address(smem + kSmemQ, warp_row0 + (lane & 15), lane >> 4);
    k_lane = KVTile::lane_address(smem + kSmemK, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    v_lane = KVTile::lane_address(smem + kSmemV, lane & 15, lane >> 4);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      row[mt][0].init();
      row[mt][1].init();
#pragma unroll
      for (int e = 0; e < 4; ++e) l[mt][e] = 0.f;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
    }
  }

  // ---- S = Q K^T for this warp's rows ----------------------------------------------------------
  __device__ __forceinline__ void scores() {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kDSteps; ++ks) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
        ldmatrix_x4(a[mt], QTile::at(q_lane, mt * 16, 2 * ks));
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, KVTile::at(k_lane, np * 16, 2 * ks));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<T>(s[mt][2 * np], a[mt], b[0], b[1]);
          mma_16816<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

  // ---- mask: scores of (row, key) pairs the rule hides become -inf ------------------------------
  // `row0`: the query row of this lane's first C-fragment element; `col0`: its key. Row i sees
  // exactly the keys [key_begin(i), key_end(i + 1)) (mask.cuh), so each row needs two bounds and
  // each element two compares against a compile-time column offset.
  __device__ __forceinline__ void apply_mask(const Mask& mask, int row0, int col0) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = row0 + mt * 16 + h * 8;
        const int lo = mask.key_begin(i) - col0;    // first visible key, relative to col0
        const int hi = mask.key_end(i + 1) - col0;  // one past the last
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int j = nt * 8 + c;
            if (j < lo || j >= hi) s[mt][nt][2 * h + c] = neg_inf();
          }
      }
  }

  // ---- online softmax, part 1: new row maxima; rescale O and l ---------------------------------
  // Leaves in ref[][] the value each row subtracts (log2 domain) before exp2.
  __device__ __forceinline__ void rescale(float scale_log2, float (&ref)[kMTiles][2]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = neg_inf();
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
          mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
        mx = quad_max(mx);
        // scale_log2 > 0 (checked on the host), so max(s) * scale is the max of the scaled scores.
        const float corr = row[mt][h].update(mx * scale_log2);
        ref[mt][h] = row[mt][h].ref();
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          o[mt][dt][2 * h] *= corr;
          o[mt][dt][2 * h + 1] *= corr;
        }
#if FC_EXACT_ROWSUM
        // the previous tile's sum (c0 / c2) carried into the running one (c1 / c3), then rescaled
        l[mt][2 * h + 1] = (l[mt][2 * h + 1] + l[mt][2 * h]) * corr;
        l[mt][2 * h] = 0.f;
#else
        l[mt][2 * h] *= corr;
        l[mt][2 * h + 1] *= corr;
#endif
      }
  }

  // ---- online softmax, part 2, fused with O += P V and l += P 1 --------------------------------
  // Per k16 step: P = exp2(S - ref) of its 16 keys goes from C-fragment registers straight into
  // the A fragment of the mma with V (key tiles 2kk, 2kk + 1 -> A registers {0, 1}, {2, 3}).
  __device__ __forceinline__ void exp_accumulate(float scale_log2,
                                                 const float (&ref)[kMTiles][2]) {
#if FC_EXACT_ROWSUM
    // B of the row-sum mma: ones in its even columns, zeros in its odd ones (lane (g, t) holds
    // column g), so c1 / c3 only ever gain exact zeros from the mma. Each tile's sum starts
    // fresh in c0 / c2 and is carried into c1 / c3 with one round-to-nearest add in the next
    // tile's rescale (and in the epilogue): the mma's truncating accumulation then spans the
    // k16 steps of one tile, not every step of the row (see l).
    const uint32_t ones = (threadIdx.x >> 2) & 1 ? 0u : kOnes;
#else
    const uint32_t ones = kOnes;
#endif
#pragma unroll
    for (int kk = 0; kk < kNSteps; ++kk) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float* c = &s[mt][2 * kk + half][2 * h];
            const float p0 = fast_exp2(fmaf(c[0], scale_log2, -ref[mt][h]));
            const float p1 = fast_exp2(fmaf(c[1], scale_log2, -ref[mt][h]));
            a[mt][2 * half + h] = pack2<T>(p0, p1);
          }
        mma_16816<T>(l[mt], a[mt], ones, ones);
      }
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, KVTile::at(v_lane, kk * 16, 2 * dp));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<T>(o[mt][2 * dp], a[mt], b[0], b[1]);
          mma_16816<T>(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

#if FC_MASKED_V
  // Slow path, part 2 (see v_tile_take_nonfinite): O element (row i, column c) becomes NaN if a key
  // row i sees holds NaN in column c, or +Inf and -Inf; else +-Inf if one of its keys holds it.
  // `row0`: this lane's first row (as apply_mask's); `n0`: the tile's first key; `t`: lane % 4.
  __device__ __forceinline__ void put_back_nonfinite(const uint32_t* table, const Mask& mask,
                                                     int row0, int n0, int t) {
    // Which of the tile's keys each of this lane's rows sees, as bits: seen[mt][h][word].
    uint32_t seen[kMTiles][2][kBadWords];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = row0 + mt * 16 + h * 8;
        const int lo = max(mask.key_begin(i) - n0, 0);          // first key of the tile row i sees
        const int hi = min(mask.key_end(i + 1) - n0, kBlockN);  // one past its last
#pragma unroll
        for (int w = 0; w < kBadWords; ++w) {
          const int a = max(lo - 32 * w, 0), b = min(hi - 32 * w, 32);
          seen[mt][h][w] = a >= b ? 0u : ((b == 32 ? 0u : (1u << b)) - (1u << a));
        }
      }
    // Column by column (the compiler barrier keeps one column's table words live at a time).
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 8 * dt + 2 * t + e;
        uint32_t bits[3][kBadWords];
#pragma unroll
        for (int kind = 0; kind < 3; ++kind)
#pragma unroll
          for (int w = 0; w < kBadWords; ++w)
            bits[kind][w] = table[(kind * kHeadDim + c) * kBadWords + w];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            uint32_t nan = 0, pinf = 0, ninf = 0;
#pragma unroll
            for (int w = 0; w < kBadWords; ++w) {
              nan |= bits[0][w] & seen[mt][h][w];
              pinf |= bits[1][w] & seen[mt][h][w];
              ninf |= bits[2][w] & seen[mt][h][w];
            }
            // added, not assigned: an Inf an earlier tile put there meets this one's as IEEE says
            float& acc = o[mt][dt][2 * h + e];
            if (nan || (pinf && ninf)) acc = __int_as_float(0x7fffffff);
            else if (pinf) acc += pos_inf();
            else if (ninf) acc += neg_inf();
          }
        asm volatile("" ::: "memory");
      }
  }
#endif
};

// Where this CTA's key / value tiles come from, and which of their rows are real.
struct KVSource {
  const T* k;  // the kernel's k and v (also the readable addresses that the cp.async of
  const T* v;  // zero-filled chunks names)
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int batch, head_kv;
  int key_lo, key_hi;  // keys outside [key_lo, key_hi) are zero-filled: no row of the block sees them
  int head_dim;
};

// This (batch, kv head)'s rows of K or V, recomputed per tile from two 32-bit indices: 64-bit
// pointers held across the key loop cost registers the loop does not have (they spilled). The
// empty asm hides the indices' values so that the compiler cannot hoist the products.
__device__ __forceinline__ const T* kv_rows(const T* base, int64_t batch_stride,
                                            int64_t head_stride, int batch, int head_kv) {
  asm volatile("" : "+r"(batch), "+r"(head_kv));
  return base + batch * batch_stride + head_kv * head_stride;
}

#if FC_MASKED_V
// ---- non-finite V in a partly seen tile (FC_MASKED_V) ----------------------------------------
// In a tile that some rows of the block see only in part (the causal diagonal, a window edge),
// P V multiplies a key's V row by p = 0 for the rows that do not see it, and 0 x NaN / Inf is
// NaN: without care a NaN or Inf in V would reach rows that never see its key. So, in masked
// tiles only: every thread scans the V chunks it copied itself once its copies landed; if any
// value is not finite (a CTA-wide vote, in the barrier the loop takes there anyway), the slow
// path records each one's (kind, column, key) as a bit, zeroes it for the GEMM, and after the
// GEMM puts NaN / +Inf / -Inf back into O on exactly the (row, column) pairs whose row sees
// such a key, with IEEE's rules (NaN wins; +Inf and -Inf together give NaN). The fast path
// costs one scan per masked tile (until session 7 the vote was a barrier of its own after a
// scan of the whole tile: 7-9% at 1k causal in the A/B).
// (A seen key whose p underflowed to 0 counts as weighted: IEEE would give 0 x Inf = NaN there.)
// Whether a value in the V chunks this thread copied (the loader's passes and atoms) is not
// finite. Called after this thread's cp.async wait, when its own copies are visible to it, so
// that the CTA's vote rides on the barrier the loop takes there anyway.
__device__ __forceinline__ bool own_v_chunks_nonfinite(const KVLoader& loader,
                                                       const uint8_t* v_tile) {
  uint32_t bad = 0;
#pragma unroll 1  // S and O are live here: one chunk at a time
  for (int i = 0; i < KVLoader::kPasses * KVLoader::kAtoms; ++i) {
    const int pass = i / KVLoader::kAtoms, atom = i % KVLoader::kAtoms;
    const uint4 w = *reinterpret_cast<const uint4*>(
        v_tile + loader.smem_offset + atom * KVTile::kAtomBytes +
        pass * KVLoader::kRowsPerPass * KVTile::kAtomCols * 2);
    bad |= word_nonfinite<T>(w.x) | word_nonfinite<T>(w.y) | word_nonfinite<T>(w.z) |
           word_nonfinite<T>(w.w);
  }
  return bad != 0;
}

// Slow path, part 1: the bit table, and the non-finite values replaced by zeros.
__device__ __forceinline__ void v_tile_take_nonfinite(uint8_t* v_tile, uint32_t* table,
                                                      unsigned tid) {
#pragma unroll 1
  for (int i = static_cast<int>(tid); i < 3 * kHeadDim * kBadWords; i += kThreads) table[i] = 0u;
  __syncthreads();
#pragma unroll 1
  for (int e = static_cast<int>(tid); e < KVTile::kChunks; e += kThreads) {
    int row, chunk;
    KVTile::coords(e, row, chunk);
    uint16_t* x = reinterpret_cast<uint16_t*>(v_tile + KVTile::offset(row, chunk));
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint16_t bits = x[k];
      if (!half_nonfinite<T>(bits)) continue;
      const int kind = nonfinite_kind<T>(bits);
      const int col = chunk * 8 + k;
      atomicOr(&table[(kind * kHeadDim + col) * kBadWords + row / 32], 1u << (row % 32));
      x[k] = 0;
    }
  }
  __syncthreads();
}
#endif

// The CTA barrier after V_n landed. With FC_MASKED_V, in masked tiles, it is also the vote on
// the V tile: true when some thread's own chunks hold a non-finite value (else always false).
template <bool kMasked>
__device__ __forceinline__ bool v_landed_barrier(const KVLoader& loader) {
#if FC_MASKED_V
  if constexpr (kMasked) {
    extern __shared__ __align__(128) uint8_t smem_bytes[];
    return __syncthreads_or(own_v_chunks_nonfinite(loader, smem_bytes + kSmemV)) != 0;
  }
#endif
  __syncthreads();
  return false;
}

// Key tile n: the loop body, written once; masking is its compile-time flag.
// On entry K_n is in flight (or landed); on exit K_{n-1} is in flight if n > n_first.
template <bool kMasked>
__device__ __forceinline__ void attend_key_tile(FwdCta& cta, const KVSource& src,
                                                const KVLoader& loader, uint32_t smem, int n,
                                                int n_first, const Mask& mask, int m0,
                                                float scale_log2) {
  const int n0 = n * kBlockN;
  cp_async_wait<0>();  // K_n (and Q) landed
  __syncthreads();     // ... for every thread; and every warp is done reading V_{n+1}
  loader.load(smem + kSmemV,
              kv_rows(src.v, src.v_batch_stride, src.v_head_stride, src.batch, src.head_kv),
              src.v_row_stride, n0, src.key_lo, src.key_hi, src.head_dim, src.v);
  cp_async_commit();
  cta.scores();
  if constexpr (kMasked) {
    // This lane's first C-fragment element: query row and key. threadIdx is re-read here rather
    // than the two values held in registers across the loop.
    const unsigned tid = threadIdx.x;
    const int warp = static_cast<int>(tid / 32), lane = static_cast<int>(tid % 32);
    cta.apply_mask(mask, m0 + warp * kWarpRows + lane / 4, n0 + 2 * static_cast<int>(tid % 4));
  }
  cp_async_wait<0>();  // V_n landed
  // ... for every thread; and every warp is done reading K_n. With FC_MASKED_V the same barrier
  // votes, in masked tiles, on whether any V value is not finite.
  const bool poisoned = v_landed_barrier<kMasked>(loader);
  if (n > n_first) {
    loader.load(smem + kSmemK,
                kv_rows(src.k, src.k_batch_stride, src.k_head_stride, src.batch, src.head_kv),
                src.k_row_stride, n0 - kBlockN, src.key_lo, src.key_hi, src.head_dim, src.k);
    cp_async_commit();
  }
#if FC_MASKED_V
  extern __shared__ __align__(128) uint8_t smem_bytes[];
  if (kMasked && poisoned)
    v_tile_take_nonfinite(smem_bytes + kSmemV, reinterpret_cast<uint32_t*>(smem_bytes + kSmemBad),
                          threadIdx.x);
#endif
  float ref[kMTiles][2];
  cta.rescale(scale_log2, ref);
  cta.exp_accumulate(scale_log2, ref);
#if FC_MASKED_V
  if constexpr (kMasked) {
    if (poisoned) {
      const unsigned tid = threadIdx.x;
      const int warp = static_cast<int>(tid / 32), lane = static_cast<int>(tid % 32);
      cta.put_back_nonfinite(reinterpret_cast<const uint32_t*>(smem_bytes + kSmemBad), mask,
                             m0 + warp * kWarpRows + lane / 4, n0, lane % 4);
    }
  }
#endif
}

extern "C" __global__ void __launch_bounds__(kThreads, 1)
FC_KERNEL_NAME(const T* __restrict__ q,  // [B, Sq, H, D]
               const T* __restrict__ k,  // [B, Sk, Hkv, D]
               const T* __restrict__ v,  // [B, Sk, Hkv, D]
               T* __restrict__ out,      // [B, Sq, H, D]
               float* __restrict__ lse,  // [B, H, Sq]
               int64_t q_batch_stride, int64_t q_row_stride, int64_t q_head_stride,
               int64_t k_batch_stride, int64_t k_row_stride, int64_t k_head_stride,
               int64_t v_batch_stride, int64_t v_row_stride, int64_t v_head_stride,
               int64_t o_batch_stride, int64_t o_row_stride, int64_t o_head_stride,
               int batch, int seqlen_q, int seqlen_k, int nheads, int nheads_kv, int head_dim,
               float scale_log2, int window_left, int window_right) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const unsigned tid = threadIdx.x;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // heavy (late, causal) blocks first
  const int head = blockIdx.y;
  const int b = blockIdx.z;
  const int head_kv = head / (nheads / nheads_kv);
  const int m0 = m_block * kBlockM;

  const Mask mask{seqlen_q, seqlen_k, window_left, window_right};
  const int row_end = min(m0 + kBlockM, seqlen_q);
  // Keys some row of the block can see, and the key tiles [n_first, n_last] that hold them.
  const int key_lo = mask.key_begin(m0);
  const int key_hi = mask.key_end(row_end);
  const int n_first = key_lo / kBlockN;
  const int n_last = key_hi > key_lo ? (key_hi - 1) / kBlockN : n_first - 1;

  const uint32_t smem = shared_address(smem_raw);
  const int lane = static_cast<int>(tid % 32);
  const int warp_row0 = static_cast<int>(tid / 32) * kWarpRows;  // this warp's first row
  FwdCta cta;
  cta.init(smem, lane, warp_row0);

  const KVLoader kv_loader(tid);
  const KVSource src{k, v, k_batch_stride, k_row_stride, k_head_stride, v_batch_stride,
                     v_row_stride, v_head_stride, b, head_kv, key_lo, key_hi, head_dim};
  if (n_first <= n_last) {
    const QLoader q_loader(tid);
    const T* q_bh = q + b * q_batch_stride + head * q_head_stride;
    q_loader.load(smem + kSmemQ, q_bh, q_row_stride, m0, 0, seqlen_q, head_dim, q);
    const T* k_bh = k + b * k_batch_stride + head_kv * k_head_stride;
    kv_loader.load(smem + kSmemK, k_bh, k_row_stride, n_last * kBlockN, key_lo, key_hi, head_dim,
                   k);
    cp_async_commit();
  }

  for (int n = n_last; n >= n_first; --n) {
    if (mask.tile_needs_mask(m0, kBlockM, n * kBlockN, kBlockN))
      attend_key_tile<true>(cta, src, kv_loader, smem, n, n_first, mask, m0, scale_log2);
    else
      attend_key_tile<false>(cta, src, kv_loader, smem, n, n_first, mask, m0, scale_log2);
  }

  // ---- epilogue: normalise, lse, O through this warp's own rows of the Q tile -----------------
  // Each warp only ever read its own kWarpRows rows of sQ and has no copy in flight (the last
  // iteration waited for everything), so it may overwrite them without a CTA barrier.
  const int g = lane >> 2, t = lane & 3;
  const int64_t lse_row0 = (static_cast<int64_t>(b) * nheads + head) * seqlen_q;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      OnlineSoftmax& st = cta.row[mt][h];
#if FC_EXACT_ROWSUM
      st.l = cta.l[mt][2 * h] + cta.l[mt][2 * h + 1];  // this tile's sum + the earlier ones
#else
      st.l = cta.l[mt][2 * h];  // the mma already summed the row over the quad
#endif
      const float inv = st.inv_sum();
      const int r = warp_row0 + mt * 16 + h * 8 + g;  // row within the block
      if (t == 0 && m0 + r < seqlen_q) lse[lse_row0 + m0 + r] = st.lse();
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        store_shared_32(smem + kSmemQ + QTile::offset(r, dt) + 4 * t,
                        pack2<T>(cta.o[mt][dt][2 * h] * inv, cta.o[mt][dt][2 * h + 1] * inv));
    }
  __syncwarp();
  using WarpRows = SwizzledTile<kWarpRows, kHeadDim>;
  static_assert(WarpRows::kChunks % 32 == 0, "epilogue: whole warp iterations");
  T* o_bh = out + b * o_batch_stride + head * o_head_stride;
#pragma unroll
  for (int i = 0; i < WarpRows::kChunks / 32; ++i) {
    int r, chunk;
    WarpRows::coords(lane + 32 * i, r, chunk);
    r += warp_row0;
    const Bytes16 val = load_shared_16(smem + kSmemQ + QTile::offset(r, chunk));
    if (m0 + r < seqlen_q && chunk * 8 < head_dim)
      store_global_16(o_bh + (m0 + r) * o_row_stride + chunk * 8, val);
  }
}
