// Pieces the two wide sm90 backward kernels share (flash_bwd_sm90_wide.cu: dK^T / dV^T split by
// head-dim rows; flash_bwd_sm90_keys.cu: split by keys): the consumers' softmax gradients on a
// m64nN accumulator slice, the hand-back of a ring buffer, and the dK / dV epilogue (transposed
// through shared memory, then 16-byte rows out). Templates over the kernel's sizes; T is the
// kernel's 16-bit type.
#pragma once
#include "common/types.cuh"
#include "common/sm90.cuh"
#include "common/smem.cuh"
#include "attention/block_order.cuh"
#include "attention/mask.cuh"
#include "attention/online_softmax.cuh"

// FC_LPT_TAIL (block_order.cuh) in the wide kernels, bwd_sm90's session-14 order: under a causal
// mask key block 0 has the most steps, so a grid in blockIdx order starts its last pairs'
// heaviest CTAs near its end. A list-schedule model of d192's 96-key CTAs in blockIdx order puts
// the last SM 3-8% past an even split at causal 512-8k (perf-notes, session 32); K = 8 ->
// 0.3-4.7%, K = 16 -> 0.2-2.6%.

namespace wide_bwd {

// One arrival per consumer warp once every lane's wgmmas reading the buffer have completed
// (flash_bwd_sm90.cu's release without the proxy fence: each lse2 / delta value a lane loaded
// fed the arithmetic of this step's completed wgmmas).
__device__ __forceinline__ void release(uint32_t bar) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(bar);
}

// P = exp2(S scale_log2 - lse2[query]) in place on a m64n{kKeys} accumulator, 0 where the key is
// hidden from the query (kMasked). `row` = the lane's first query row in the block (16 warp + g),
// `key0` = its first key column in the block (the warpgroup's first key + 2t).
template <bool kMasked, int kKeys>
__device__ __forceinline__ void probs(float (&s)[kKeys / 2], const float* lse2, float scale_log2,
                                      const Mask& mask, int m0, int n0, int row, int key0) {
  const float l0 = lse2[row], l1 = lse2[row + 8];
#pragma unroll
  for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = fast_exp2(fmaf(s[4 * j + e], scale_log2, -((e & 2) ? l1 : l0)));
      if (kMasked && !mask.visible(m0 + row + 4 * (e & 2), n0 + key0 + 8 * j + (e & 1))) p = 0.f;
      s[4 * j + e] = p;
    }
  }
}

// dS = P o (dP - delta[query]) in dp's registers, 0 wherever P is 0 (kMasked: whatever dP holds
// there, e.g. from a V row outside the band).
template <bool kMasked, int kKeys>
__device__ __forceinline__ void dsoftmax(const float (&p)[kKeys / 2], float (&dp)[kKeys / 2],
                                         const float* delta, int row) {
  const float d0 = delta[row], d1 = delta[row + 8];
#pragma unroll
  for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float ds = p[4 * j + e] * (dp[4 * j + e] - ((e & 2) ? d1 : d0));
      if (kMasked && p[4 * j + e] == 0.f) ds = 0.f;
      dp[4 * j + e] = ds;
    }
  }
}

// kDTiles m64n{kKeys} accumulators of dK^T or dV^T (head-dim rows d0 + 64 i + .., keys key0 -
// 2t + ..) * scale, transposed, into a [key][kStride] 16-bit staging tile: element (d, key) at
// key * kStride + d. With kStride = head dim + 8 a warp's 2-byte stores fall in distinct banks.
template <typename T, int kDTiles, int kKeys, int kStride>
__device__ __forceinline__ void stage_transposed(uint32_t stage,
                                                 const float (&acc)[kDTiles][kKeys / 2],
                                                 float scale, int d0, int row, int key0) {
#pragma unroll
  for (int i = 0; i < kDTiles; ++i) {
    const int d = d0 + 64 * i + row;
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + 8 * j + (e & 1), dd = d + 4 * (e & 2);
        store_shared_2(stage + 2 * (key * kStride + dd),
                       from_float<T>(acc[i][4 * j + e] * scale).bits);
      }
    }
  }
}

// The staging tile's first `keys` rows (of kRows) -> dst ([key][..] rows `row_stride` elements
// apart), 16 bytes per thread and iteration; `tid` counts the kThreads consumer threads.
template <typename T, int kRows, int kHeadDim, int kStride, int kThreads>
__device__ __forceinline__ void copy_rows(const uint8_t* stage, T* dst, int64_t row_stride,
                                          int keys, int tid) {
  constexpr int kPieces = kHeadDim * 2 / 16;  // 16-byte pieces per row
  for (int i = tid; i < kRows * kPieces; i += kThreads) {
    const int key = i / kPieces, piece = i % kPieces;
    if (key < keys) {
      const uint4 x = *reinterpret_cast<const uint4*>(stage + key * kStride * 2 + 16 * piece);
      *reinterpret_cast<uint4*>(dst + key * row_stride + 8 * piece) = x;
    }
  }
}

}  // namespace wide_bwd
