// Host stand-in of flashcuda/kernels/common/sm80_ptx.cuh for the emulator (tests/cpu/simt_emu):
// the same functions, each PTX instruction done by the runtime (cp.async groups; ldmatrix and
// mma.sync as warp-collective exchanges in the PTX ISA's fragment layouts).
#pragma once
#include "common/types.cuh"
#include "common/smem.cuh"

inline uint32_t shared_address(const void* p) { return emu::shared_offset(p); }

template <bool kL2Line = true> inline void cp_async_16(uint32_t dst, const void* src, bool valid) {
  emu::cp_async(dst, src, 16, valid ? 16 : 0);
}
inline void cp_async_commit() { emu::cp_async_commit(); }
template <int N> inline void cp_async_wait() { emu::cp_async_wait(N); }

inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { emu::ldmatrix_x4(r, addr, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { emu::ldmatrix_x4(r, addr, true); }

inline void store_global_16(void* p, const Bytes16& v) { std::memcpy(p, &v, 16); }

template <typename T> inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  emu::mma_16816(d, a, b0, b1, std::is_same_v<T, bf16_t>);
}
