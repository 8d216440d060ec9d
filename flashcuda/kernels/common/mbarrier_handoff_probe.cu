// The hand-off of the forward's V scanner (FC_MV_SCANNER in flash_fwd_sm90.cu), alone, for
// checking what compute-sanitizer racecheck reports about it (scripts/racecheck_probe.py handoff,
// docs/GUARANTEES.md): generic 32-bit shared-memory words written by one thread and read by other
// warps, ordered by mbarriers only.
//
// One CTA, 128 threads (4 warps), four rounds over two slots (a ring of two stages, as the
// kernel's). In each round thread 0 waits for the slot's "empty" mbarrier (from the third round
// on), writes the round's word into the slot with st.shared and arrives on the slot's "full"
// mbarrier; warps 1 .. 3 wait for "full", read the word with ld.shared, and lane 0 of each
// arrives on "empty" (the slot's next write waits for all three): read-after-write and
// write-after-read ordered by mbarriers, as the producer's requests and the scanner's reads.
// mode 0: as above, "full" completed by thread 0's plain arrival (the kernel's kScanEnd).
// mode 1: the readers read before waiting on "full" (a real race).
// mode 2: "full" completed by an arrive.expect_tx and a 16-byte cp.async.bulk into the slot's
// other half (the kernel's in-loop requests, whose stage's phase the V tile's TMA completes).
// mode 3: as mode 0, but between rounds 1 and 2 the CTA hands over as the fused forward kernel
// does between its passes (flash_fwd_sm90_fused.cu): every warp arrives on `vote` and waits for
// it, thread 0 invalidates the four barriers, initialises them anew and arrives on `go`, every
// thread waits for `go`; rounds 2 and 3 then start from the fresh barriers' first phase. The
// barriers' re-initialisation and the rounds' waits on both sides are ordered by `vote` / `go`.
#include "common/sm90.cuh"
#include "common/smem.cuh"

extern "C" __global__ void FC_KERNEL_NAME(const float* __restrict__ src,  // [4][4]
                                          uint32_t* __restrict__ dst,     // [4 rounds][3 warps]
                                          int mode) {
  __shared__ alignas(128) uint32_t slot[2][8];  // word 0: the hand-off; words 4 .. 7: the copy
  __shared__ alignas(8) uint64_t bars[4], handover[2];
  const uint32_t full[2] = {smem_addr(&bars[0]), smem_addr(&bars[1])};
  const uint32_t empty[2] = {smem_addr(&bars[2]), smem_addr(&bars[3])};
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const auto init_ring = [&] {
    for (int s = 0; s < 2; ++s) {
      mbar_init(full[s], 1);
      mbar_init(empty[s], 3);
    }
  };
  if (threadIdx.x == 0) {
    init_ring();
    mbar_init(smem_addr(&handover[0]), 4);  // vote: one arrival per warp
    mbar_init(smem_addr(&handover[1]), 1);  // go: thread 0's
    fence_barrier_init();
  }
  __syncthreads();
  for (int round = 0; round < 4; ++round) {
    const int s = round & 1;
    const bool fresh = mode == 3 && round >= 2;  // (the barriers re-initialised before round 2)
    const uint32_t parity = fresh ? 0 : (round >> 1) & 1;
    if (mode == 3 && round == 2) {
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&handover[0]));
      mbar_wait(smem_addr(&handover[0]), 0);
      if (threadIdx.x == 0) {
        for (int b = 0; b < 4; ++b) mbar_inval(smem_addr(&bars[b]));
        init_ring();
        fence_barrier_init();
        mbar_arrive(smem_addr(&handover[1]));
      }
      mbar_wait(smem_addr(&handover[1]), 0);
    }
    if (warp == 0) {
      if (threadIdx.x == 0) {
        if (round >= 2 && !fresh) mbar_wait(empty[s], parity ^ 1);
        store_shared_32(smem_addr(&slot[s][0]), 1000u + round);
        if (mode == 2) {
          mbar_arrive_expect_tx(full[s], 16);
          bulk_load(smem_addr(&slot[s][4]), src + 4 * round, 16, full[s]);
        } else {
          mbar_arrive(full[s]);
        }
      }
      continue;
    }
    uint32_t word = 0;
    if (mode == 1) word = load_shared_32(smem_addr(&slot[s][0]));
    mbar_wait(full[s], parity);
    if (mode != 1) word = load_shared_32(smem_addr(&slot[s][0]));
    __syncwarp();
    if (lane == 0) {
      dst[3 * round + warp - 1] = word;
      mbar_arrive(empty[s]);
    }
  }
}
