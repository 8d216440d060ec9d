// The tensor pipe's rate for one wgmma shape, alone (scripts/wgmma_rate.py): which N of
// m64nNk16 costs how many cycles per FLOP. Session 13 found the d128 forward's 176-key tiles
// taking ~2.7% more tensor-pipe cycles for the same FLOPs than 128-key tiles (ncu); this
// measures the instruction itself, without the kernel around it.
//
// One CTA per SM, FC_WARPGROUPS warpgroups; each issues `iters` batches of 8 back-to-back
// m64n{FC_N}k16 wgmma (a K = 128 GEMM) from shared memory into its own accumulators, committing
// each batch and keeping at most one batch in flight, like the forward's S GEMMs. The operands
// are whatever the shared memory holds (zeroed first): the rate does not depend on the values.
// Thread 0 of each warpgroup writes its clock64 span; (FLOPs / cycles) gives the rate per SM.
#include "common/sm90.cuh"

#ifndef FC_N
#define FC_N 128
#endif
#ifndef FC_WARPGROUPS
#define FC_WARPGROUPS 2
#endif

constexpr int kN = FC_N;
constexpr int kTileA = 64 * 128 * 2;   // A: 64 rows x K 128, bf16, 128B-swizzled K-major
constexpr int kTileB = kN * 128 * 2;   // B: N rows x K 128
constexpr int kSmemBytes = 1024 + FC_WARPGROUPS * kTileA + kTileB;

extern "C" __global__ void __launch_bounds__(128 * FC_WARPGROUPS, 1)
    FC_KERNEL_NAME(long long* __restrict__ cycles,  // [gridDim.x][FC_WARPGROUPS]
                   float* __restrict__ sink,        // [gridDim.x][FC_WARPGROUPS]: keeps d live
                   int iters) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  for (int i = threadIdx.x; i < kSmemBytes / 4 - 256; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem_raw + (base - raw))[i] = 0;
  __syncthreads();
  const int wg = threadIdx.x / 128;
  const uint32_t a = base + wg * kTileA, b = base + FC_WARPGROUPS * kTileA;
  const uint64_t da = smem_desc_k_major_sw128(a), db = smem_desc_k_major_sw128(b);
  float d[kN / 2];
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) d[i] = 0.f;
  const long long t0 = clock64();
#pragma unroll 1
  for (int it = 0; it < iters; ++it) {
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 8; ++k)  // K 128: 8 k16 steps, 32 bytes apart inside the swizzle atom
      wgmma_ss<kN, bf16_t>(d, desc_advance(da, 32 * (k & 3) + 8192 * (k >> 2)),
                           desc_advance(db, 32 * (k & 3) + kN * 128 * (k >> 2)), 1);
    wgmma_commit();
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
  wgmma_fence_operands(d);
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) s += d[i];
  if (threadIdx.x % 128 == 0) {
    cycles[blockIdx.x * FC_WARPGROUPS + wg] = t1 - t0;
    sink[blockIdx.x * FC_WARPGROUPS + wg] = s;
  }
}
