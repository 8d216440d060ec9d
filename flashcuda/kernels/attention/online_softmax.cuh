// Online (streaming) softmax state of one query row: the exact softmax over keys seen tile by tile.
//
// Scores enter in the log2 domain, already multiplied by softmax_scale * log2(e), so each
// probability is one exp2 (one FFMA folded into the score scaling, as FA2 does):
//     p_j = exp2(s_j - m),  m = running max,  l = running sum of p_j (w.r.t. the current m).
// Per key tile:    corr = state.update(tile_max);  acc *= corr;  p = exp2(s - state.ref());
//                  state.add(rowsum(p));  acc += p V
// At the end:      out = acc * state.inv_sum();  lse = state.lse()   (natural log)
//
// The guards live here, once: a row that has seen only -inf scores keeps m = -inf, uses 0 as its
// reference (so exp2(-inf - 0) = 0, never exp2(-inf + inf) = NaN), finishes with out = 0 and
// lse = -inf.
#pragma once
#include "common/types.cuh"

// exp2 / log2 of the softmax. 16-bit kernels take the MUFU approximations (relative error about
// 2^-22, far below bf16/fp16 rounding). fp32 kernels (FC_DTYPE 0) take the accurate exp2f /
// log2f: there the approximation alone, summed over thousands of keys in a backward reduction,
// measured above 3x PyTorch's own fp32 error (DESIGN.md section 7's rule). The host emulator
// (tests/cpu/simt_emu, FC_HOST_EMULATION) has no PTX: the accurate forms there.
#if (defined(FC_DTYPE) && FC_DTYPE == 0) || defined(FC_HOST_EMULATION)
#define FC_ACCURATE_EXP 1
#else
#define FC_ACCURATE_EXP 0
#endif

__device__ __forceinline__ float fast_exp2(float x) {
#if FC_ACCURATE_EXP
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

__device__ __forceinline__ float fast_log2(float x) {
#if FC_ACCURATE_EXP
  return log2f(x);
#else
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct OnlineSoftmax {
  float m;  // running max of scaled log2-domain scores; -inf until a visible score arrives
  float l;  // running sum of exp2(s - m)

  __device__ __forceinline__ void init() {
    m = neg_inf();
    l = 0.f;
  }

  // The value subtracted from scores before exp2.
  __device__ __forceinline__ float ref() const { return m == neg_inf() ? 0.f : m; }

  // Take a new tile's row max; rescale l; return the factor the output accumulator must be
  // multiplied by: exp2(m_old - m_new) (1 when nothing changed, 0 when m_old was -inf).
  __device__ __forceinline__ float update(float tile_max) {
    const float m_new = fmaxf(m, tile_max);
    const float corr = (m_new == neg_inf()) ? 1.f : fast_exp2(m - m_new);
    l *= corr;
    m = m_new;
    return corr;
  }

  __device__ __forceinline__ void add(float tile_sum) { l += tile_sum; }

  // Deferred normalisation: multiply the accumulator once by this (0 for an empty row).
  __device__ __forceinline__ float inv_sum() const { return l > 0.f ? 1.f / l : 0.f; }

  // Natural-log log-sum-exp of the scaled scores; -inf for a row that saw no key.
  __device__ __forceinline__ float lse() const {
    return l > 0.f ? m * kLn2 + fast_log2(l) * kLn2 : neg_inf();
  }

  // Fold `other` (the same row over a disjoint key set) into this state. Returns the factors the
  // two accumulators must be scaled by before they are added: acc = acc * f.x + other_acc * f.y.
  struct Factors { float self, other; };
  __device__ __forceinline__ Factors merge(const OnlineSoftmax& other) {
    const float m_new = fmaxf(m, other.m);
    if (m_new == neg_inf()) return {1.f, 0.f};
    const Factors f{fast_exp2(m - m_new), fast_exp2(other.m - m_new)};
    l = l * f.self + other.l * f.other;
    m = m_new;
    return f;
  }
};
