// The tensor-core backward's (flash_bwd_sm80.cu) names for common/sm80_ptx.cuh's instructions:
// mma.sync m16n8k16, ldmatrix (plain and .trans), cp.async with zero fill and no L2 line hint
// (fp32 global reductions: common/reduce.cuh).
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
#include "common/sm80_ptx.cuh"

namespace bwd80 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return shared_address(p); }

using ::ldmatrix_x4;
using ::ldmatrix_x4_trans;

// c += a * b, fp32 accumulate, 16-bit inputs of type T (half_t or bf16_t).
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  mma_16816<T>(c, a, b0, b1);
}

// 16-byte global -> shared copy; when `valid` is false nothing is read and the 16 bytes are zeroed
// (src-size 0), so ragged rows and padded head dims arrive as zeros. (No L2 line hint.)
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  ::cp_async_16<false>(dst, src, valid);
}

using ::cp_async_commit;
using ::cp_async_wait;

// 16-byte shared/global accesses.
struct alignas(16) Vec16 { uint32_t x, y, z, w; };

}  // namespace bwd80
