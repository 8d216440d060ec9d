// CUDA C++ on the host, for the logic of SIMT kernels (tests/cpu/simt_emu): every CUDA thread
// of a CTA is a fiber on one OS thread, switched at __syncthreads and at each warp shuffle, so
// the kernel source runs unchanged (after __init__.py's two textual substitutions for shared
// memory). CTAs run one after another. cp.async copies are deferred to the wait that covers
// them, and their destinations read as NaN until then. Not a model of timing or of the memory
// model beyond that: it proves index arithmetic, control flow and numerics, not a GPU run.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

// Code that depends on the architecture takes its sm_80 form (the sm_90 forms are PTX the
// emulator does not have, e.g. red.global.add.v4.f32)
#define __CUDA_ARCH__ 800
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))

namespace emu {
struct Dim3 {
  unsigned x, y, z;
};
extern Dim3 g_block_idx, g_block_dim, g_grid_dim;
const Dim3& thread_idx();
void syncthreads();
int syncthreads_or(int pred);
void syncwarp();
uint32_t shfl_xor_bits(uint32_t v, int lane_mask, int width);
void* dynamic_smem();
uint32_t dynamic_smem_size();
[[noreturn]] void trap();
uint32_t shared_offset(const void* p);  // a pointer's shared-window address
void* shared_at(uint32_t addr, int bytes);  // and back (bounds-checked)
void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr, bool trans);
void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16);
void cp_async(uint32_t dst, const void* src, int bytes, int src_bytes);
void cp_async_commit();
void cp_async_wait(int pending);

template <typename X> inline X shfl_xor(X v, int lane_mask, int width) {
  static_assert(sizeof(X) == 4, "32-bit shuffles");
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = shfl_xor_bits(bits, lane_mask, width);
  std::memcpy(&v, &bits, 4);
  return v;
}
}  // namespace emu

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::g_block_idx)
#define blockDim (emu::g_block_dim)
#define gridDim (emu::g_grid_dim)

inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::syncwarp(); }
template <typename X> inline X __shfl_xor_sync(unsigned, X v, int lane_mask, int width = 32) {
  return emu::shfl_xor(v, lane_mask, width);
}
template <typename X> inline X __ldg(const X* p) { return *p; }
template <typename X> inline X __ldcg(const X* p) { return *p; }
// (CTAs run one after another, each thread's writes seen at once: nothing to order)
inline void __threadfence() {}
// (the fibers of a CTA run one at a time and CTAs one after another: a plain add is atomic)
template <typename X> inline X atomicAdd(X* p, X v) {
  const X old = *p;
  *p = old + v;
  return old;
}
template <typename X> inline X atomicOr(X* p, X v) {
  const X old = *p;
  *p = old | v;
  return old;
}
[[noreturn]] inline void __trap() { emu::trap(); }
inline int __syncthreads_or(int pred) { return emu::syncthreads_or(pred); }

inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

struct __attribute__((aligned(16))) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct __attribute__((aligned(8))) float2 {
  float x, y;
};
struct __attribute__((aligned(16))) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

using std::max;
using std::min;

namespace emu {
void register_static_shared(void* p, size_t bytes);
// A `__shared__ X name;` of the kernel (rewritten by __init__.py): one object for the CTA's
// fibers, filled with 0xff before each CTA.
template <typename X, int Id> X& static_shared() {
  static X x;
  static const bool once = (register_static_shared(&x, sizeof(X)), true);
  (void)once;
  return x;
}
}  // namespace emu
