// The order of the sm90 backward kernels' CTAs (flash_bwd_sm90.cu, flash_bwd_sm90_wide.cu,
// flash_bwd_sm90_keys.cu): one CTA per (key block, KV head, batch), which the GPU starts in
// blockIdx order (the backward timeline, session 13). Under a causal mask key block 0 has the
// most steps, so a grid walked pair after pair starts its last pairs' heaviest CTAs near its end;
// FC_LPT_TAIL = K runs the last K pairs longest-first across them (bwd_sm90.LPT_TAIL,
// bwd_sm90_wide.LPT_TAIL: causal calls only).
#pragma once

// (Tried and removed in session 39, perf-notes: the whole causal grid heads first, each group of
// KV heads longest-first with the key block a blockIdx component (FC_HEADS_FIRST, session 37:
// -3.1 to +0.4% at d64); the tail's arithmetic with blockIdx order kept (FC_LPT_SAME_ORDER, a
// diagnostic: -4.5 to -9.5% at d64, the remap's cost without its order.)
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
      const int p = first + j % tail;
      return {j / tail, p % gy, p / gy};
    }
  }
  return {x, y, z};
}

// FC_WAVE_SPLIT's pieces: the (key block, KV head, batch) of work item `item` of the grid (key
// blocks, KV heads, batch) in blockIdx order
__device__ __forceinline__ BlockCoord item_coord(int item, int key_blocks, int nheads_kv) {
  const int pair = item / key_blocks;
  return {item - pair * key_blocks, pair % nheads_kv, pair / nheads_kv};
}

// FC_WAVE_SPLIT = 3's grid (pairs, key blocks): CTA (x, y) runs key block y of pair x (pair =
// KV head + nheads_kv x batch), so blockIdx order is key block 0 of every pair first
__device__ __forceinline__ BlockCoord tail_grid_coord(int x, int y, int nheads_kv) {
  return {y, x % nheads_kv, x / nheads_kv};
}
