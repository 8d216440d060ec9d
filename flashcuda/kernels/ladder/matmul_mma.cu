// Matrix rung, tensor-core variant: c = a @ b for fp16 / bf16 (FC_DTYPE 1 / 2), fp32 accumulation
// on the tensor cores through the warp-level mma.sync.m16n8k16 (sm80 and newer, Hopper included).
// a [M, K], b [K, N], c [M, N], contiguous row-major; any M, N, K (ragged tiles are zero-filled).
//
// Block tile 64 x 64 x 32, 4 warps as 2 x 2, each warp a 32 x 32 tile = 2 x 4 mma tiles (16 x 8),
// 32 fp32 accumulators per thread. This rung introduces the fragment layouts (PTX ISA, "Matrix
// Fragments for mma.m16n8k16", lane = 4 * group + quad):
//   A 16 x 16, row-major: reg0 = A[g][2q, 2q+1], reg1 = A[g+8][2q, 2q+1],
//                         reg2 = A[g][2q+8, 2q+9], reg3 = A[g+8][2q+8, 2q+9]
//   B 16 x 8, "col":      reg0 = B[2q, 2q+1][g],  reg1 = B[2q+8, 2q+9][g]   (two k, one n)
//   C 16 x 8, fp32:       c0, c1 = C[g][2q, 2q+1], c2, c3 = C[g+8][2q, 2q+1]
// (lower k / lower column in the low 16 bits). Operands are staged with plain 16-byte loads —
// no cp.async pipeline, no ldmatrix: those are the flash kernels' steps, measured there.
//
// Shared memory: As[64][32 + 8] (m, k) and Bs[32][64 + 8] (k, n), 16-bit. The 8-element pads keep
// rows 16-byte aligned and make the fragment reads conflict-free: an A read touches word
// 20 g + q (+ const) of a 20-word pitch -> 32 distinct banks; a B read touches word 36 (2q) + g / 2
// -> 16 distinct words, two lanes per word.
#include "common/types.cuh"
#include "ladder/vec.cuh"

using T = dtype_of<FC_DTYPE>::type;
static_assert(sizeof(T) == 2, "the tensor-core rung takes fp16 or bf16");

constexpr int BM = 64;
constexpr int BN = 64;
constexpr int BK = 32;
constexpr int kThreads = 128;
constexpr int kPad = 8;
constexpr int WM = 32;  // warp tile
constexpr int WN = 32;
constexpr int kMmaM = WM / 16;  // 2
constexpr int kMmaN = WN / 8;   // 4
constexpr int kChunk = 8;       // elements per 16-byte chunk

__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if FC_DTYPE == 1
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// dst[r][cc .. cc + 8) = src[(r0 + r) * ld + c0 + cc ..], zero past (r_end, c_end): one 16-byte
// load when the chunk is whole and aligned, else element by element.
template <int Rows, int Cols>
__device__ __forceinline__ void load_tile(T (*dst)[Cols + kPad], const T* src, int64_t ld,
                                          int64_t r0, int64_t c0, int64_t r_end, int64_t c_end,
                                          bool vec_ok) {
  constexpr int kChunksPerRow = Cols / kChunk;
  constexpr int kPerThread = Rows * kChunksPerRow / kThreads;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int chunk = threadIdx.x + i * kThreads;
    const int r = chunk / kChunksPerRow;
    const int cc = (chunk % kChunksPerRow) * kChunk;
    const int64_t gr = r0 + r, gc = c0 + cc;
    Vec16<T> v;
    if (vec_ok && gr < r_end && gc + kChunk <= c_end) {
      v = *reinterpret_cast<const Vec16<T>*>(src + gr * ld + gc);
    } else {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) {
        v.v[e] = (gr < r_end && gc + e < c_end) ? src[gr * ld + gc + e] : T{0};
      }
    }
    *reinterpret_cast<Vec16<T>*>(&dst[r][cc]) = v;
  }
}

__device__ __forceinline__ uint32_t ld_pair(const T* p) { return *reinterpret_cast<const uint32_t*>(p); }

__device__ __forceinline__ uint32_t pack_pair(T lo, T hi) {
  return static_cast<uint32_t>(lo.bits) | (static_cast<uint32_t>(hi.bits) << 16);
}

extern "C" __global__ void __launch_bounds__(kThreads) FC_KERNEL_NAME(const T* __restrict__ a,  // [M, K]
                                                                      const T* __restrict__ b,  // [K, N]
                                                                      T* __restrict__ c,        // [M, N]
                                                                      int64_t M, int64_t N, int64_t K) {
  __shared__ __align__(16) T As[BM][BK + kPad];
  __shared__ __align__(16) T Bs[BK][BN + kPad];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;  // group: row of A / C, column of B
  const int q = lane % 4;  // quad lane: pair of k (A, B) or of columns (C)
  const int wm = (warp / (BN / WN)) * WM;
  const int wn = (warp % (BN / WN)) * WN;
  const bool a_vec = K % kChunk == 0 && offset16(a) == 0;
  const bool b_vec = N % kChunk == 0 && offset16(b) == 0;
  const bool c_pair = N % 2 == 0 && (reinterpret_cast<uint64_t>(c) & 3) == 0;

  const int64_t tiles_n = (N + BN - 1) / BN;
  const int64_t total = ((M + BM - 1) / BM) * tiles_n;
  for (int64_t tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const int64_t m0 = (tile / tiles_n) * BM;
    const int64_t n0 = (tile % tiles_n) * BN;

    float acc[kMmaM][kMmaN][4];
#pragma unroll
    for (int i = 0; i < kMmaM; ++i)
#pragma unroll
      for (int j = 0; j < kMmaN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    for (int64_t k0 = 0; k0 < K; k0 += BK) {
      load_tile<BM, BK>(As, a, K, m0, k0, M, K, a_vec);
      load_tile<BK, BN>(Bs, b, N, k0, n0, K, N, b_vec);
      __syncthreads();
#pragma unroll
      for (int kb = 0; kb < BK; kb += 16) {
        uint32_t af[kMmaM][4];
        uint32_t bf[kMmaN][2];
#pragma unroll
        for (int i = 0; i < kMmaM; ++i) {
          const int r = wm + i * 16 + g;
          af[i][0] = ld_pair(&As[r][kb + 2 * q]);
          af[i][1] = ld_pair(&As[r + 8][kb + 2 * q]);
          af[i][2] = ld_pair(&As[r][kb + 2 * q + 8]);
          af[i][3] = ld_pair(&As[r + 8][kb + 2 * q + 8]);
        }
#pragma unroll
        for (int j = 0; j < kMmaN; ++j) {
          const int n = wn + j * 8 + g;
          bf[j][0] = pack_pair(Bs[kb + 2 * q][n], Bs[kb + 2 * q + 1][n]);
          bf[j][1] = pack_pair(Bs[kb + 2 * q + 8][n], Bs[kb + 2 * q + 9][n]);
        }
#pragma unroll
        for (int i = 0; i < kMmaM; ++i)
#pragma unroll
          for (int j = 0; j < kMmaN; ++j) mma_m16n8k16(acc[i][j], af[i], bf[j]);
      }
      __syncthreads();  // the next k-tile overwrites As, Bs
    }

#pragma unroll
    for (int i = 0; i < kMmaM; ++i) {
#pragma unroll
      for (int j = 0; j < kMmaN; ++j) {
        const int64_t col = n0 + wn + j * 8 + 2 * q;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows g and g + 8
          const int64_t row = m0 + wm + i * 16 + g + 8 * h;
          if (row >= M) continue;
          const float lo = acc[i][j][2 * h], hi = acc[i][j][2 * h + 1];
          T* dst = c + row * N + col;
          if (c_pair && col + 1 < N) {
            *reinterpret_cast<uint32_t*>(dst) = pack2<T>(lo, hi);
          } else {
            if (col < N) dst[0] = from_float<T>(lo);
            if (col + 1 < N) dst[1] = from_float<T>(hi);
          }
        }
      }
    }
  }
}
