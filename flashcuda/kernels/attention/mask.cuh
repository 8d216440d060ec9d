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
