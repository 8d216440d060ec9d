// The order of the sm90 backward kernels' CTAs (flash_bwd_sm90.cu, flash_bwd_sm90_wide.cu,
// flash_bwd_sm90_keys.cu): one CTA per (key block, KV head, batch), which the GPU starts in
// blockIdx order (the backward timeline, session 13). Under a causal mask key block 0 has the
// most steps, so a grid walked pair after pair starts its last pairs' heaviest CTAs near its end;
// FC_LPT_TAIL = K runs the last K pairs longest-first across them (bwd_sm90.LPT_TAIL,
// bwd_sm90_wide.LPT_TAIL: causal calls only).
#pragma once

#ifndef FC_LPT_SAME_ORDER
#define FC_LPT_SAME_ORDER 0  // 1 (diagnostic A/B): FC_LPT_TAIL's arithmetic, blockIdx order kept
#endif
#ifndef FC_LPT_TAIL
#define FC_LPT_TAIL 0  // K of the kernels' block_coord<FC_LPT_TAIL>; the hosts set it per call
#endif

struct BlockCoord {
  int key_block, head_kv, batch;
};

// The (key block, KV head, batch) of CTA (x, y, z) of a (gx, gy, gz) grid (the block index and
// gridDim): the index itself, or for kTail = K > 0 inside the tail, the CTA's rank j in blockIdx
// order gives key block j / K of pair first + j % K (a bijection of the tail's gx * K CTAs onto
// themselves). With fewer than K pairs the whole grid is the tail.
template <int kTail>
__device__ __forceinline__ BlockCoord block_coord(int x, int y, int z, int gx, int gy, int gz) {
  if constexpr (kTail > 0) {
    const int pairs = gy * gz;
    const int tail = kTail < pairs ? kTail : pairs;
    const int first = pairs - tail;
    const int pair = y + gy * z;
    if (pair >= first) {
      const int j = x + gx * (pair - first);
#if FC_LPT_SAME_ORDER
      // (diagnostic: the tail's arithmetic, giving blockIdx order back: its cost without its
      // order)
      const int p = first + j / gx;
      return {j % gx, p % gy, p / gy};
#else
      const int p = first + j % tail;
      return {j / tail, p % gy, p / gy};
#endif
    }
  }
  return {x, y, z};
}
