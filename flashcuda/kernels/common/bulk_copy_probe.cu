// The synchronisation pattern of the sm90 kernels' cp.async.bulk loads, alone, for checking what
// compute-sanitizer racecheck reports about it (scripts/racecheck_probe.py bulk, docs/GUARANTEES.md).
//
// One CTA, 128 threads (4 warps), one 1 KiB shared buffer, two rounds. In each round thread 0
// issues a cp.async.bulk of 256 floats into the buffer, completing on the "full" mbarrier; every
// thread waits for it and reads its element; every warp then arrives on the "empty" mbarrier
// (one arrival per warp after a __syncwarp, like flash_bwd_sm90.cu's release), and thread 0
// waits for "empty" before the next round overwrites the buffer: read-after-write and
// write-after-read both ordered by mbarriers, exactly as the kernels' ring stages.
// mode 0: as above. mode 1: every thread reads before waiting on "full" (a real race). mode 2: as
// mode 0 with a fence.proxy.async after the reads, before the "empty" arrival.
#include "common/sm90.cuh"

extern "C" __global__ void FC_KERNEL_NAME(const float* __restrict__ src,  // [2][256]
                                          float* __restrict__ dst,        // [2][256]
                                          int mode) {
  __shared__ alignas(128) float buf[256];
  __shared__ alignas(8) uint64_t bars[2];
  const uint32_t full = smem_addr(&bars[0]), empty = smem_addr(&bars[1]);
  if (threadIdx.x == 0) {
    mbar_init(full, 1);
    mbar_init(empty, blockDim.x / 32);
    fence_barrier_init();
  }
  __syncthreads();
  for (int round = 0; round < 2; ++round) {
    if (threadIdx.x == 0) {
      if (round > 0) mbar_wait(empty, (round - 1) & 1);
      mbar_arrive_expect_tx(full, sizeof(buf));
      bulk_load(smem_addr(buf), src + 256 * round, sizeof(buf), full);
    }
    float x[2];
    for (int i = 0; i < 2; ++i) {
      const int e = threadIdx.x + 128 * i;
      if (mode == 1) x[i] = buf[e];
      mbar_wait(full, round & 1);
      if (mode != 1) x[i] = buf[e];
    }
    for (int i = 0; i < 2; ++i) dst[256 * round + threadIdx.x + 128 * i] = x[i];
    if (mode == 2) fence_proxy_async();
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(empty);
  }
}
