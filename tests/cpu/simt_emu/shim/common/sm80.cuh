// Host stand-in of flashcuda/kernels/common/sm80.cuh for the emulator (tests/cpu/simt_emu): the
// cp.async group and the shared-window address only (the tensor-core parts are not emulated).
#pragma once
#include "common/types.cuh"

inline uint32_t shared_address(const void* p) { return emu::shared_offset(p); }
inline void cp_async_16(uint32_t dst, const void* src, bool valid) {
  emu::cp_async(dst, src, 16, valid ? 16 : 0);
}
inline void cp_async_commit() { emu::cp_async_commit(); }
template <int N> inline void cp_async_wait() { emu::cp_async_wait(N); }
