// sm80 PTX wrappers used by the tensor-core backward (flash_bwd_sm80.cu): mma.sync m16n8k16,
// ldmatrix (plain and .trans), cp.async with zero fill (fp32 global reductions: common/reduce.cuh).
//
// Kept apart from common/sm80.cuh (written in parallel for the forward) so the two could land
// independently; the wrappers are meant to be deduplicated into common/sm80.cuh later.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 * g + t:
//   A 16x16 (4 x b32):  a[0] = (row g,   cols 2t..2t+1)   a[1] = (row g+8, cols 2t..2t+1)
//                       a[2] = (row g,   cols 2t+8..+9)   a[3] = (row g+8, cols 2t+8..+9)
//   B 16x8  (2 x b32):  b[0] = (rows 2t..2t+1, col g)     b[1] = (rows 2t+8..+9, col g)
//   C 16x8  (4 x f32):  c[0..1] = (row g, cols 2t..2t+1) c[2..3] = (row g+8, cols 2t..2t+1)
// ldmatrix.x4: lanes 8j..8j+7 give the row addresses of 8x8 matrix j, which lands in register j;
// without .trans lane (g, t) receives row g, cols 2t..2t+1; with .trans rows 2t..2t+1 of col g.
#pragma once
#include "common/types.cuh"
#include "common/reduce.cuh"  // red_add_f32x2 / red_add_f32x4

namespace bwd80 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a * b, fp32 accumulate, 16-bit inputs of type T (half_t or bf16_t).
template <typename T> struct Mma;

template <> struct Mma<half_t> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <> struct Mma<bf16_t> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  Mma<T>::run(c, a, b0, b1);
}

// 16-byte global -> shared copy; when `valid` is false nothing is read and the 16 bytes are zeroed
// (src-size 0), so ragged rows and padded head dims arrive as zeros.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// 16-byte shared/global accesses.
struct alignas(16) Vec16 { uint32_t x, y, z, w; };

}  // namespace bwd80
