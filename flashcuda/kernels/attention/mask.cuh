// Which keys a query row sees: the one visibility rule of every attention kernel (DESIGN.md §3).
//
// Query row i (0 <= i < seqlen_q) sees key j (0 <= j < seqlen_k) iff
//     i + shift - window_left <= j <= i + shift + window_right,   shift = seqlen_k - seqlen_q,
// An unbounded side is passed as a window of seqlen_q + seqlen_k (the host does this, see
// flashcuda/ops/call.py), so the rule has no special cases and a negative window_right is legal:
// the SDPA shim's top-left causal is window_right = seqlen_q - seqlen_k. FlashAttention's causal
// (bottom-right aligned) is window (unbounded, 0).
//
// Kernels iterate only over key tiles that `key_begin`/`key_end` admit, and apply `visible` only
// to tiles for which `tile_needs_mask` says so (diagonal and ragged-edge tiles): the loop body is
// written once, with masking a compile-time flag of the tile step (STYLE.md §2).
#pragma once
#include "common/types.cuh"

struct Mask {
  int seqlen_q;
  int seqlen_k;
  int window_left;   // keys before the diagonal a row may see
  int window_right;  // keys after the diagonal a row may see (may be negative)

  __device__ __forceinline__ int shift() const { return seqlen_k - seqlen_q; }

  __device__ __forceinline__ bool visible(int i, int j) const {
    const int d = j - i - shift();
    return j < seqlen_k && d <= window_right && d >= -window_left;
  }

  // First key any row in [row_begin, row_end) can see (clamped to 0).
  __device__ __forceinline__ int key_begin(int row_begin) const {
    const int j = row_begin + shift() - window_left;
    return j > 0 ? j : 0;
  }

  // One past the last key any row in [row_begin, row_end) can see (clamped to [0, seqlen_k]).
  __device__ __forceinline__ int key_end(int row_end) const {
    const int j = row_end - 1 + shift() + window_right + 1;
    return j < 0 ? 0 : (j < seqlen_k ? j : seqlen_k);
  }

  // True unless every (row, key) of the tile is visible, i.e. unless the tile lies wholly inside
  // the band and inside seqlen_k. Rows past seqlen_q are never stored, so they do not count.
  __device__ __forceinline__ bool tile_needs_mask(int row0, int rows, int col0, int cols) const {
    int row_last = row0 + rows - 1;
    if (row_last > seqlen_q - 1) row_last = seqlen_q - 1;
    const int col_last = col0 + cols - 1;
    if (col_last >= seqlen_k) return true;
    if (col_last > row0 + shift() + window_right) return true;
    if (col0 < row_last + shift() - window_left) return true;
    return false;
  }
};

// The steps of a backward CTA that owns key block [n0, n0 + kBlockN) (flash_bwd_sm90.cu,
// flash_bwd_sm90_wide.cu): the query blocks of kBlockM rows whose rows see one of its keys,
// m_first .. m_first + n_m - 1, for each of the `group` query heads of its KV head; step it is
// (query head it / n_m of the group, query block m_first + it % n_m).
template <int kBlockM, int kBlockN>
struct KeyBlockSteps {
  int m_first, n_m, group;

  __device__ __forceinline__ KeyBlockSteps(const Mask& mask, int n0, int nheads, int nheads_kv) {
    // Key j is seen by rows j - shift - window_right .. j - shift + window_left.
    const int n_end = min(n0 + kBlockN, mask.seqlen_k);
    const int q_begin = max(0, n0 - mask.shift() - mask.window_right);
    const int q_end = min(mask.seqlen_q, n_end - 1 - mask.shift() + mask.window_left + 1);
    m_first = q_begin / kBlockM;
    n_m = q_end > q_begin ? (q_end - 1) / kBlockM - m_first + 1 : 0;
    group = nheads / nheads_kv;
  }
  __device__ __forceinline__ int count() const { return n_m * group; }
  __device__ __forceinline__ int head(int it, int head_kv) const {
    return head_kv * group + it / n_m;
  }
  __device__ __forceinline__ int m0(int it) const { return (m_first + it % n_m) * kBlockM; }
};

// tile_needs_mask over a run of key tiles, decided once: for rows [row0, row0 + rows) and the
// key tiles n_first .. n_last of `cols` keys each, visited from n_last down (visit index
// i = n_last - n), the tiles that need the mask are exactly the first `head` visits (the band's
// right edge and seqlen_k) and the visits from `tail` on (the band's left edge). A loop then tests
// two integers per tile instead of redoing the band arithmetic (tests/gpu/test_mask.py checks the
// equivalence tile by tile, mask_test.cu).
struct MaskedVisits {
  int head, tail;

  __device__ __forceinline__ bool operator()(int i) const { return i < head || i >= tail; }
};

__device__ __forceinline__ int floor_div(int a, int b) {  // b > 0
  return a >= 0 ? a / b : -((b - 1 - a) / b);
}

// Derivation: with row_last = min(row0 + rows - 1, seqlen_q - 1), tile n (keys n*cols ..
// n*cols + cols - 1) needs the mask iff its last key passes R = min(seqlen_k - 1, row0 + shift +
// window_right), i.e. n >= floor((R + 1) / cols), or its first key precedes L = row_last + shift
// - window_left, i.e. n < ceil(L / cols).
__device__ __forceinline__ MaskedVisits masked_visits(const Mask& mask, int row0, int rows,
                                                      int n_last, int cols) {
  int row_last = row0 + rows - 1;
  if (row_last > mask.seqlen_q - 1) row_last = mask.seqlen_q - 1;
  int r = row0 + mask.shift() + mask.window_right;
  if (r > mask.seqlen_k - 1) r = mask.seqlen_k - 1;
  const int n_right = floor_div(r + 1, cols);                                 // first right-masked
  const int n_left = -floor_div(-(row_last + mask.shift() - mask.window_left), cols);  // ceil
  return MaskedVisits{n_last - n_right + 1, n_last - n_left + 1};
}

// The band's verdict on column blocks of 8 queries for one warp's 16 keys (the sm90 backward's
// FC_MASK_BLOCKS): for keys [k0, k0 + 16) and blocks j < nj (nj <= 32) of queries [q0 + 8 j,
// q0 + 8 j + 8), bit j of `hidden` is set iff no (query, key) pair of the block is visible, and
// bit j of `whole` iff every pair is. With d = key - query - shift over the keys below seqlen_k,
// block j spans d in [lo - 8 j, hi - 8 j] (lo = k0 - q0 - 7 - shift, hi = min(k0 + 15, seqlen_k
// - 1) - q0 - shift): it is hidden where lo - 8 j passes window_right (j < ceil((lo -
// window_right) / 8)) or hi - 8 j precedes -window_left (j > floor((hi + window_left) / 8)), and
// whole where hi - 8 j <= window_right, lo - 8 j >= -window_left and all 16 keys lie below
// seqlen_k. Every block is hidden where no key is below seqlen_k or the band is empty
// (window_right < -window_left: the two edges' rules alone miss a block whose d range holds the
// whole empty band). 64-bit sums: the bounds and the windows each reach 2^30. (tests/cpu/test_mask_emulated.py and tests/gpu/test_mask.py check the bits against
// `visible`, pair by pair.)
struct BlockVerdicts {
  uint32_t hidden, whole;
};

__device__ __forceinline__ uint32_t low_bits(int64_t n) {  // bits 0 .. n - 1, n clamped to [0, 32]
  return n <= 0 ? 0u : (n >= 32 ? ~0u : (1u << n) - 1u);
}

__device__ __forceinline__ BlockVerdicts block_verdicts(const Mask& mask, int q0, int k0, int nj) {
  const uint32_t all = low_bits(nj);
  if (k0 >= mask.seqlen_k || mask.window_right < -mask.window_left) return BlockVerdicts{all, 0u};
  const int k_last = k0 + 15 < mask.seqlen_k ? k0 + 15 : mask.seqlen_k - 1;
  const int64_t lo = static_cast<int64_t>(k0) - q0 - 7 - mask.shift();
  const int64_t hi = static_cast<int64_t>(k_last) - q0 - mask.shift();
  const int64_t wl = mask.window_left, wr = mask.window_right;
  const int64_t right = -((wr - lo) >> 3);     // ceil((lo - wr) / 8): first block not hidden
  const int64_t left = ((hi + wl) >> 3) + 1;   // first block hidden on the left
  const int64_t from = -((wr - hi) >> 3);      // ceil((hi - wr) / 8): first block whole
  const int64_t to = ((lo + wl) >> 3) + 1;     // one past the last block whole
  const uint32_t whole = k0 + 16 <= mask.seqlen_k ? low_bits(to) & ~low_bits(from) : 0u;
  return BlockVerdicts{(low_bits(right) | ~low_bits(left)) & all, whole & all};
}

// FC_MASK_SKIP (the sm90 backward): the k16 steps a warpgroup's GEMMs may leave out on a masked
// step, as bit masks (nj <= 32). hidden_query_blocks<kQ, kKeys>: bit j iff no key of [k0, k0 +
// kKeys) is visible to any query of [q0 + kQ j, q0 + kQ j + kQ) (block_verdicts' `hidden` rule for
// other block sizes, exact). hidden_key_blocks<kK, kQueries>: bit j iff no key of [k0 + kK j, k0 +
// kK j + kK) is visible to any query of [q0, q0 + kQueries): exact, but for a block that straddles
// seqlen_k, which it may leave clear though its keys below seqlen_k are all hidden (its greatest
// d is taken over its last key, past seqlen_k: never a block with a visible pair set).
// (tests/cpu/test_mask_emulated.py and tests/gpu/test_mask.py check both pair by pair.)
template <int kBlock>
__device__ __forceinline__ int64_t floor_div_block(int64_t x) {  // kBlock a power of two
  static_assert(kBlock > 0 && (kBlock & (kBlock - 1)) == 0, "a power of two");
  return x >= 0 ? x / kBlock : -((kBlock - 1 - x) / kBlock);
}

template <int kQ, int kKeys>
__device__ __forceinline__ uint32_t hidden_query_blocks(const Mask& mask, int q0, int k0, int nj) {
  const uint32_t all = low_bits(nj);
  if (k0 >= mask.seqlen_k || mask.window_right < -mask.window_left) return all;  // (empty band)
  const int k_last = k0 + kKeys - 1 < mask.seqlen_k ? k0 + kKeys - 1 : mask.seqlen_k - 1;
  const int64_t lo = static_cast<int64_t>(k0) - q0 - (kQ - 1) - mask.shift();
  const int64_t hi = static_cast<int64_t>(k_last) - q0 - mask.shift();
  const int64_t wl = mask.window_left, wr = mask.window_right;
  const int64_t right = -floor_div_block<kQ>(wr - lo);  // ceil((lo - wr) / kQ)
  const int64_t left = floor_div_block<kQ>(hi + wl) + 1;
  return (low_bits(right) | ~low_bits(left)) & all;
}

template <int kK, int kQueries>
__device__ __forceinline__ uint32_t hidden_key_blocks(const Mask& mask, int q0, int k0, int nj) {
  if (mask.window_right < -mask.window_left) return low_bits(nj);  // (an empty band)
  const int64_t a = static_cast<int64_t>(k0) - q0 - (kQueries - 1) - mask.shift();  // least d, j 0
  const int64_t b = static_cast<int64_t>(k0) + kK - 1 - q0 - mask.shift();  // greatest d, j 0
  const int64_t wl = mask.window_left, wr = mask.window_right;
  const int64_t right = floor_div_block<kK>(wr - a) + 1;     // first block past the right edge
  const int64_t left = -floor_div_block<kK>(b + wl);         // ceil((-wl - b) / kK): blocks before
  const int64_t past = -floor_div_block<kK>(k0 - static_cast<int64_t>(mask.seqlen_k));  // ceil
  return (~low_bits(right) | low_bits(left) | ~low_bits(past)) & low_bits(nj);
}

// The visible columns of one accumulator row of a lane, as bits: in the m64nN wgmma (and mma)
// accumulator layout a lane holds, per row, the columns col0 + 8j + c (j < kPairs, c < 2); bit
// 2j + c of the result is set iff that column lies in [col0 + lo, col0 + hi). A masking loop
// then tests one bit per element (ptxas turns the constant-bit tests into R2P / predicate
// logic) instead of comparing the column against both bounds (FC_MASK_BITS in the sm90
// forward). The number of a lane's columns below column col0 + x is 2 floor(x / 8) + min(x mod
// 8, 2) for x in [0, 8 kPairs].
template <int kPairs>
__device__ __forceinline__ uint32_t fragment_bits(int lo, int hi) {
  static_assert(kPairs >= 1 && kPairs <= 16, "32 columns per lane and row at most");
  const auto below = [](int x) {
    x = x < 0 ? 0 : (x > 8 * kPairs ? 8 * kPairs : x);
    const int r = x & 7;
    return 2 * (x >> 3) + (r < 2 ? r : 2);
  };
  const int a = below(lo), b = below(hi);  // bits [a, b): empty when lo >= hi
  const uint32_t upto_b = b >= 32 ? 0xffffffffu : (1u << b) - 1u;
  const uint32_t upto_a = a >= 32 ? 0xffffffffu : (1u << a) - 1u;
  return upto_b & ~upto_a;
}
