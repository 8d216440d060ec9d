// Matrix rung (matmul) and the naive-attention GEMMs (scores = scale * Q K^T, O = P V): one
// shared-memory tiled SIMT GEMM over a batch of strided matrices, accumulated in fp32.
//
//     c[z][m, n] = alpha * sum_k a[z][m, k] * b[z][k, n],    z = (batch ib, head ih)
//
// Every operand is addressed through element strides, so Q K^T reads K transposed in place and
// the heads of (B, S, H, D) tensors are used without copies; b's head is ih / b_group (grouped-
// query attention). Operand dtypes FC_TA, FC_TB and the output dtype FC_TC are dtype codes
// (types.cuh): scores read fp16 Q, K and write fp32; P V reads fp32 P, fp16 V and writes fp16.
//
// Block tile 64 x 64 x 16, 256 threads, each thread a 4 x 4 register tile. Operand tiles are
// staged in shared memory as fp32, k-major (As[k][m], Bs[k][n]), so the inner loop reads one
// float4 of A and one of B per 16 FMAs. A global tile is read with consecutive threads along
// whichever of the operand's two strides is 1 (coalesced for either layout); elements past M, N
// or K read as 0. The grid strides over (z, m-tile, n-tile), n fastest, so blocks that run
// together share their A rows in L2.
#include "common/types.cuh"

using TA = dtype_of<FC_TA>::type;
using TB = dtype_of<FC_TB>::type;
using TC = dtype_of<FC_TC>::type;

constexpr int BM = 64;
constexpr int BN = 64;
constexpr int BK = 16;
constexpr int TM = 4;
constexpr int TN = 4;
constexpr int kThreads = (BM / TM) * (BN / TN);  // 256
constexpr int kPad = 4;  // keeps every row 16-byte aligned for the float4 reads
static_assert(BM * BK % kThreads == 0 && BN * BK % kThreads == 0, "tile loads must divide evenly");

struct __align__(16) F4 {
  float v[4];
};

template <int Rows, int Cols, typename T>
__device__ __forceinline__ void load_tile_kmajor(float (*dst)[Cols + kPad],  // [BK][Cols]
                                                 const T* src, int64_t s_rc, int64_t s_k,
                                                 int64_t rc0, int64_t k0, int64_t rc_end, int64_t k_end) {
  // dst[k][rc] = src[(rc0 + rc) * s_rc + (k0 + k) * s_k]; Rows == BK is the k extent.
  const int t = threadIdx.x;
  constexpr int kLoads = Rows * Cols / kThreads;
  if (s_k == 1) {  // consecutive threads walk k
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int k = t % Rows;
      const int rc = t / Rows + i * (kThreads / Rows);
      const int64_t gr = rc0 + rc, gk = k0 + k;
      dst[k][rc] = (gr < rc_end && gk < k_end) ? to_float(src[gr * s_rc + gk]) : 0.f;
    }
  } else {  // consecutive threads walk m (or n)
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int rc = t % Cols;
      const int k = t / Cols + i * (kThreads / Cols);
      const int64_t gr = rc0 + rc, gk = k0 + k;
      dst[k][rc] = (gr < rc_end && gk < k_end) ? to_float(src[gr * s_rc + gk * s_k]) : 0.f;
    }
  }
}

template <int N> struct __align__(N * sizeof(TC)) OutVec {
  TC v[N];
};

// Occupancy floor of 3 blocks (24 warps) per SM caps registers at 80. Without it, NVRTC 13.0's
// ptxas picks 64 registers for sm_80 and spills 8 bytes in the 16-bit variants; with a floor of
// 1 it takes 116-121 registers (2 blocks per SM).
constexpr int kMinBlocksPerSm = 3;

extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) FC_KERNEL_NAME(
    const TA* __restrict__ a,  // [batch, heads][M, K] through the strides below
    const TB* __restrict__ b,  // [batch, heads / b_group][K, N]
    TC* __restrict__ c,        // [batch, heads][M, N]
    int64_t M, int64_t N, int64_t K,
    int64_t a_sm, int64_t a_sk, int64_t b_sk, int64_t b_sn, int64_t c_sm, int64_t c_sn,
    int64_t a_sb, int64_t a_sh, int64_t b_sb, int64_t b_sh, int64_t c_sb, int64_t c_sh,
    int64_t batch, int64_t heads, int64_t b_group, float alpha) {
  __shared__ __align__(16) float As[BK][BM + kPad];
  __shared__ __align__(16) float Bs[BK][BN + kPad];

  const int tx = threadIdx.x % (BN / TN);  // column group: columns tx * TN .. + TN
  const int ty = threadIdx.x / (BN / TN);  // row group: rows ty * TM .. + TM
  const int64_t tiles_m = (M + BM - 1) / BM;
  const int64_t tiles_n = (N + BN - 1) / BN;
  const int64_t per_z = tiles_m * tiles_n;
  const int64_t total = batch * heads * per_z;

  for (int64_t tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const int64_t z = tile / per_z;
    const int64_t rem = tile % per_z;
    const int64_t m0 = (rem / tiles_n) * BM;
    const int64_t n0 = (rem % tiles_n) * BN;
    const int64_t ib = z / heads, ih = z % heads;
    const TA* A = a + ib * a_sb + ih * a_sh;
    const TB* B = b + ib * b_sb + (ih / b_group) * b_sh;
    TC* C = c + ib * c_sb + ih * c_sh;

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;

    for (int64_t k0 = 0; k0 < K; k0 += BK) {
      load_tile_kmajor<BK, BM>(As, A, a_sm, a_sk, m0, k0, M, K);
      load_tile_kmajor<BK, BN>(Bs, B, b_sn, b_sk, n0, k0, N, K);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < BK; ++kk) {
        const F4 av = *reinterpret_cast<const F4*>(&As[kk][ty * TM]);
        const F4 bv = *reinterpret_cast<const F4*>(&Bs[kk][tx * TN]);
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(av.v[i], bv.v[j], acc[i][j]);
      }
      __syncthreads();  // the next k-tile overwrites As, Bs
    }

    // Epilogue: TN consecutive outputs per row as one vector store where they are contiguous,
    // in range and aligned (the usual case); scalar stores at ragged edges.
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const int64_t m = m0 + ty * TM + i;
      if (m >= M) continue;
      const int64_t n = n0 + tx * TN;
      TC* dst = C + m * c_sm + n * c_sn;
      const bool vec = c_sn == 1 && n + TN <= N &&
                       (reinterpret_cast<uint64_t>(dst) % (TN * sizeof(TC))) == 0;
      if (vec) {
        OutVec<TN> o;
#pragma unroll
        for (int j = 0; j < TN; ++j) o.v[j] = from_float<TC>(alpha * acc[i][j]);
        *reinterpret_cast<OutVec<TN>*>(dst) = o;
      } else {
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          if (n + j < N) dst[j * c_sn] = from_float<TC>(alpha * acc[i][j]);
        }
      }
    }
  }
}
