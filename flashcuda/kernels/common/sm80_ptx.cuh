// The sm80 (Ampere+) PTX instructions as functions: the only place sm80 kernels meet PTX (the
// host emulator, tests/cpu/simt_emu, has its own forms of exactly these).
//
//   cp_async_16 / cp_async_commit / cp_async_wait<N>   global -> shared, 16 bytes, zero-fill option
//   ldmatrix_x4 / ldmatrix_x4_trans                      shared -> mma fragments
//   mma_16816<T>                                         D += A B, m16n8k16, fp16/bf16 in, fp32 acc
//   shared_address / store_global_16                     shared-window address, 16-byte store
//
// Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with
// g = lane / 4 and t = lane % 4:
//   A (16x16, row-major), 4 regs of 2 x 16 bit:  a0 (g, 2t..2t+1)   a1 (g+8, 2t..2t+1)
//                                                a2 (g, 2t+8..+9)   a3 (g+8, 2t+8..+9)
//   B (16x8, k x n), 2 regs:                     b0 (k = 2t..2t+1, n = g)   b1 (k = 2t+8..+9, n = g)
//   C/D (16x8, fp32), 4 floats:                  c0, c1 (g, 2t..2t+1)   c2, c3 (g+8, 2t..2t+1)
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; register i receives matrix i
// with lane holding row lane/4, columns 2(lane%4)..+1 (.trans: the transposed matrix, i.e. column
// lane/4, rows 2(lane%4)..+1 of the stored one).
#pragma once
#include "common/types.cuh"
#include "common/smem.cuh"

// ---- addresses ---------------------------------------------------------------------------------

// 32-bit shared-window address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- cp.async ----------------------------------------------------------------------------------

// Copy 16 bytes global -> shared asynchronously, bypassing L1 (.cg). When `valid` is false nothing
// is read (src-size 0) and the 16 destination bytes are zero-filled; `src` must still be a legal
// address, so callers pass a known in-bounds one. kL2Line: with the .L2::128B hint (the whole
// 128-byte line fetched into L2); the backward's copies go without it.
template <bool kL2Line = true>
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  if constexpr (kL2Line) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
  }
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N committed groups of this thread are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- shared memory loads / stores --------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void store_global_16(void* p, const Bytes16& v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// ---- tensor cores ------------------------------------------------------------------------------

// d += a * b for one m16n8k16 tile, fp32 accumulators (layouts in the header comment).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<half_t>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<bf16_t>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
