// Flash attention forward, sm90a: a windowed call's two passes in one kernel.
//
// flash_fwd_sm90.cu runs a causal / windowed call in two passes (fwd_sm90.two_passes): the
// kernel without masked V, which reports whether any O value a CTA computed is NaN / Inf, then
// the masked-V kernel on the same grid, which exits at once in the CTAs that reported none. That
// second launch costs ~3 µs per call whatever the inputs (session 22: 2.2 µs of kernel time plus
// the gap between two kernels). Here both passes are one kernel: each CTA walks its work tiles
// as the first pass, and only a CTA whose report is set walks them again as the masked-V kernel,
// in the same shared memory (the first pass's barriers invalidated, the second's laid out anew).
//
// The file includes flash_fwd_sm90.cu three times, each in a namespace of its own and with its
// pass's macros (fwd_sm90_pass.cuh; FC_FUSED_PART makes it a device function `run`): the second
// pass twice, once with the producer warpgroup's code only and once with the consumers' only
// (FC_ROLE_ONLY), and then the first pass, whose producer and consumer roles each end in a hook
// (FC_FUSED_*_TAIL) that votes with the whole CTA and, when any consumer warp reported, enters
// its own role of the second pass. Each role's code thus stays in its own region of
// setmaxnreg's register count (moved to the second pass's split where that differs), and ptxas
// never merges the roles' code.
//
// The vote and the hand-over use two mbarriers and a word past both passes' layouts (Vote), not
// a CTA barrier: the roles reach them from different places in the code, which an .aligned
// barrier (bar.sync / bar.red, __syncthreads*) does not allow — compute-sanitizer synccheck
// reported the first version's __syncthreads_or as divergent (session 35). Every warp adds its
// report to the word and arrives on `vote`; every thread waits for it and reads the word. Where
// it is set, thread 0 ends the first pass's barriers, initialises the second's and arrives on
// `go`, which every thread waits for before the second pass touches shared memory.
//
// The guarantee is the two passes': a NaN / Inf of V reaches only the rows that see its key, and
// a CTA that reported nothing wrote exactly what the masked-V kernel would have (up to
// rounding: flash_fwd_sm90.cu, FC_NAN_FLAGS).
#include "common/types.cuh"
#include "common/sm90.cuh"
#include "common/smem.cuh"
#include "attention/mask.cuh"
#include "attention/online_softmax.cuh"
#include "attention/nonfinite.cuh"

#define FC_FUSED_PART 1

// ---- the second pass (the masked-V kernel): the producer warpgroup's role, then the consumers'
#define FC_PASS 2
#include "attention/fwd_sm90_pass.cuh"
#define FC_ROLE_ONLY 1
namespace pass2p {
#include "attention/flash_fwd_sm90.cu"
}  // namespace pass2p

#include "attention/fwd_sm90_pass.cuh"
#define FC_ROLE_ONLY 2
namespace pass2c {
#include "attention/flash_fwd_sm90.cu"
}  // namespace pass2c

// ---- the first pass, whose roles end in the second's
#undef FC_PASS
#define FC_PASS 1
#include "attention/fwd_sm90_pass.cuh"
#define FC_ROLE_ONLY 0
static_assert(FC_P1_NAN_FLAGS && FC_P2_MASKED_V, "first the report, then the masked-V kernel");

// (flash_fwd_sm90.cu's parameter names: the kernel's below, each pass's run)
#define FC_FUSED_ARGS map_q, map_k, map_v, map_o, out, lse, FC_FWD_SCALAR_ARGS
// Past the larger pass's layout (FC_FUSED_VOTE_OFFSET from the 1024-aligned base, as each pass
// aligns it): `vote` (one arrival per warp), `go` (thread 0's), the word of reports.
namespace fused {
constexpr int kWarps = pass2p::kThreads / 32;
struct Vote {
  uint32_t vote, go, word;  // two mbarriers and the word of reports (shared window)
};
// Both passes' 1024-aligned base, as each pass computes it (recomputed where it is needed: the
// producer's 24 registers keep nothing live across its loads for the tail)
__device__ __forceinline__ uint32_t smem_base() {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  return (smem_addr(smem_raw) + 1023u) & ~1023u;
}
__device__ __forceinline__ Vote vote_slots() {
  const uint32_t at = smem_base() + FC_FUSED_VOTE_OFFSET;
  return {at, at + 8, at + 16};
}
// Every warp, once it is done with the first pass: true where any consumer warp reported
__device__ __forceinline__ bool vote(bool reported) {
  const Vote v = vote_slots();
  __syncwarp();
  uint32_t lane;  // (%laneid, not threadIdx.x & 31: ptxas would keep that one live, and spill it,
                  // across the producer's second pass at 24 registers)
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
  if (lane == 0) {
    if (reported) or_shared_32(v.word, 1u);
    mbar_arrive(v.vote);  // (release: the report before it)
  }
  mbar_wait(v.vote, 0);
  return load_shared_32(v.word) != 0;  // (asm volatile: read after the wait)
}
__device__ __forceinline__ void wait_go() { mbar_wait(vote_slots().go, 0); }
}  // namespace fused

// The producer warpgroup, its first-pass loads issued (every first-pass barrier operation of
// every warp precedes its arrival on `vote`): where the vote says so, thread 0 invalidates the
// first pass's barriers, lays out the second's over them and lets every role go.
// The second pass's register split where it differs (the masked-V kernel's producer keeps 32
// registers from d128: fwd_sm90.scanner_regs): the consumers give theirs back first
// (setmaxnreg.dec does not wait), the producer's setmaxnreg.inc waits until the pool has them.
static_assert(FC_P2_PRODUCER_REGS >= FC_P1_PRODUCER_REGS &&
                  FC_P2_CONSUMER_REGS <= FC_P1_CONSUMER_REGS,
              "the second pass moves registers from the consumers to the producer, if at all");
#define FC_FUSED_PRODUCER_TAIL                                                                  \
  if (::fused::vote(false)) {                                                                   \
    if (threadIdx.x == 0) {                                                                     \
      Smem{::fused::smem_base()}.inval_barriers();                                              \
      ::pass2p::Smem{::fused::smem_base()}.init_barriers();                                     \
      mbar_arrive(::fused::vote_slots().go);                                                    \
    }                                                                                           \
    __syncwarp();                                                                               \
    if constexpr (FC_P2_PRODUCER_REGS != FC_P1_PRODUCER_REGS)                                   \
      setmaxnreg_inc<FC_P2_PRODUCER_REGS>();                                                    \
    ::fused::wait_go();                                                                         \
    ::pass2p::run(FC_FUSED_ARGS);                                                               \
  }
// A consumer warpgroup, its first-pass work tiles stored (O's tensor stores complete): its vote
#define FC_FUSED_CONSUMER_TAIL(reported)                                                        \
  if (::fused::vote(reported)) {                                                                \
    if constexpr (FC_P2_CONSUMER_REGS != FC_P1_CONSUMER_REGS)                                   \
      setmaxnreg_dec<FC_P2_CONSUMER_REGS>();                                                    \
    ::fused::wait_go();                                                                         \
    ::pass2c::run(FC_FUSED_ARGS);                                                               \
  }

namespace pass1 {
#include "attention/flash_fwd_sm90.cu"
}  // namespace pass1

static_assert(pass1::kThreads == pass2p::kThreads, "one CTA shape for both passes");
constexpr int kLargerPass =
    pass1::kSmemBytes > pass2p::kSmemBytes ? pass1::kSmemBytes : pass2p::kSmemBytes;
static_assert(FC_FUSED_VOTE_OFFSET == kLargerPass - 1024 && FC_FUSED_VOTE_OFFSET % 8 == 0 &&
                  FC_FUSED_SMEM_BYTES == kLargerPass + 24,
              "the launch's shared memory: the larger pass's and the vote's 24 bytes "
              "(Sm90FwdFused.smem_bytes)");

extern "C" __global__ void __launch_bounds__(pass1::kThreads, 1)
FC_KERNEL_NAME(const __grid_constant__ TmaMap map_q,  // q [B, Sq, H, D]: dims (D, Sq, H, B)
               const __grid_constant__ TmaMap map_k,  // k [B, Sk, Hkv, D]: dims (D, Sk, Hkv, B)
               const __grid_constant__ TmaMap map_v,  // v [B, Sk, Hkv, D]: dims (D, Sk, Hkv, B)
               const __grid_constant__ TmaMap map_o,  // out, as q, box 64 x 64 (the store)
               pass1::T* __restrict__ out,            // [B, Sq, H, D]
               float* __restrict__ lse,               // [B, H, Sq]
               FC_FWD_SCALAR_PARAMS) {
  if (threadIdx.x == 0) {  // (the first pass's setup ends in a CTA barrier before any use)
    const fused::Vote v = fused::vote_slots();
    mbar_init(v.vote, fused::kWarps);
    mbar_init(v.go, 1);
    store_shared_32(v.word, 0u);
  }
  pass1::run(FC_FUSED_ARGS);
}
