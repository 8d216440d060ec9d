// Host stand-in of flashcuda/kernels/common/smem.cuh for the emulator (tests/cpu/simt_emu):
// shared-memory words by shared-window address, through the runtime's window.
#pragma once
#include "common/types.cuh"

struct __align__(16) Bytes16 { uint32_t x, y, z, w; };

inline void store_shared_2(uint32_t addr, uint16_t v) { std::memcpy(emu::shared_at(addr, 2), &v, 2); }
inline uint32_t load_shared_32(uint32_t addr) {
  uint32_t v;
  std::memcpy(&v, emu::shared_at(addr, 4), 4);
  return v;
}
inline void store_shared_32(uint32_t addr, uint32_t v) { std::memcpy(emu::shared_at(addr, 4), &v, 4); }
inline void or_shared_32(uint32_t addr, uint32_t v) {
  store_shared_32(addr, load_shared_32(addr) | v);  // (fibers run one at a time: atomic)
}
inline Bytes16 load_shared_16(uint32_t addr) {
  Bytes16 v;
  std::memcpy(&v, emu::shared_at(addr, 16), 16);
  return v;
}
inline void store_shared_16(uint32_t addr, const Bytes16& v) {
  std::memcpy(emu::shared_at(addr, 16), &v, 16);
}
