// The order of the sm90 backward kernels' CTAs (flash_bwd_sm90.cu, flash_bwd_sm90_wide.cu,
// flash_bwd_sm90_keys.cu): one CTA per (key block, KV head, batch), which the GPU starts in
// blockIdx order (the backward timeline, session 13). Under a causal mask key block 0 has the
// most steps, so a grid walked pair after pair starts its last pairs' heaviest CTAs near its end;
// FC_LPT_TAIL = K runs the last K pairs longest-first across them (bwd_sm90.LPT_TAIL,
// bwd_sm90_wide.LPT_TAIL: causal calls only).
#pragma once

#ifndef FC_HEADS_FIRST
// 1: the host launches the grid as (G, key blocks, KV heads / G x batch) for a group size G that
// divides the KV heads (instead of (key blocks, KV heads, batch)): the GPU starts a group's CTAs
// key block by key block, each over the group's G heads, so under a causal mask every group runs
// longest-first (key block 0 has the most steps) and the grid ends with its shortest CTAs. The
// key block stays one blockIdx component (heads_first_coord): the consumers' loop needs only it.
// FC_LPT_TAIL's remap gets that order for the grid's last pairs by arithmetic on blockIdx whose
// key block the consumers must then keep through their loop: at d64 that cost ptxas its uniform
// wgmma descriptors (R2UR 22 -> 111 in the kernel's SASS; the same-order diagnostic
// FC_LPT_SAME_ORDER measured -4.5 to -9.5% at d64 causal 512-4k, session 37).
#define FC_HEADS_FIRST 0
#endif
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
  static_assert(!(FC_HEADS_FIRST && kTail), "FC_HEADS_FIRST orders the whole grid: no tail");
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

// FC_HEADS_FIRST's (key block, KV head, batch) of CTA (x, y, z): a grid of (G, key blocks,
// nheads_kv / G x batch), G = gx; z counts the groups of G heads of each batch
__device__ __forceinline__ BlockCoord heads_first_coord(int x, int y, int z, int gx,
                                                        int nheads_kv) {
  const int groups = nheads_kv / gx;
  const int batch = z / groups;
  return {y, (z - batch * groups) * gx + x, batch};
}

// The kernels' (key block, KV head, batch): FC_HEADS_FIRST's or block_coord<kTail>'s.
template <int kTail>
__device__ __forceinline__ BlockCoord cta_coord(int nheads_kv) {
  if constexpr (FC_HEADS_FIRST)
    return heads_first_coord(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, nheads_kv);
  return block_coord<kTail>(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z);
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
