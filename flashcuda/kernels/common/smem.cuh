// Shared-memory word access by 32-bit shared-window address (what ld.shared / st.shared take):
// 2 (stores), 4 (and or-ing one in) and 16 bytes. Used by the sm80 building blocks and by the
// Hopper kernels' generic reads and writes of tiles that TMA or wgmma also touch.
#pragma once

#include "common/types.cuh"

struct __align__(16) Bytes16 { uint32_t x, y, z, w; };

__device__ __forceinline__ void store_shared_2(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_shared_32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void store_shared_32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// v or-ed into the word (relaxed; an mbarrier arrival after it publishes it)
__device__ __forceinline__ void or_shared_32(uint32_t addr, uint32_t v) {
  asm volatile("red.shared.or.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ Bytes16 load_shared_16(uint32_t addr) {
  Bytes16 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ void store_shared_16(uint32_t addr, const Bytes16& v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}
