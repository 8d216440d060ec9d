// Rung 10 (naive attention): row softmax, max-subtracted, fp32 arithmetic in any storage dtype:
//     out[r, j] = exp(x[r, j] - m_r) / sum_{j' < limit_r} exp(x[r, j'] - m_r)   for j < limit_r
//     out[r, j] = 0                                                                for j >= limit_r
// limit_r = clamp(r % period + offset, 0, cols). Plain softmax: period = 1, offset = cols. Causal
// (FlashAttention's bottom-right alignment, DESIGN.md §3): row r is query i = r % seqlen_q, which
// sees keys j <= i + cols - seqlen_q, so period = seqlen_q, offset = cols - seqlen_q + 1. Masked
// entries are never read, so NaN there cannot leak in.
//
// A row whose visible scores are all -inf (or that sees none) has max -inf: it is written as zeros,
// never exp(-inf - -inf) = NaN. A NaN among the visible scores makes the row NaN (the max ignores
// it; the sum does not), as in torch, unless every other visible score is -inf: the max is then
// -inf and the row zeros.
//
// | storage     | exp of x - m                                 | error of one exp (relative)      |
// |-------------|----------------------------------------------|----------------------------------|
// | fp32        | expf (the rung is checked at fp32 precision) | 2 ulp                            |
// | fp16, bf16  | ex2.approx.ftz((x - m) * log2 e): FADD,      | 2^-22 + |x - m| 2^-24: < 2^-19   |
// |             | FMUL, MUFU instead of expf's ~9              | for |x - m| <= 16, 2^-17 at 100  |
// The 16-bit error stays under 1/30 of the output's rounding (2^-12 fp16, 2^-9 bf16): MUFU.EX2 is
// within 2 ulp, x - m of two 16-bit values is exact in fp32 unless they are 2^13 apart in
// magnitude (then it rounds at 2^-24 relative), and the product rounds at 2^-24 relative, i.e.
// at |x - m| 2^-24 in the result. (Folding m into one FFMA, x log2 e - m log2 e, would add
// |m| 2^-24: 8 fp16 ulps for scores near 65504.) ftz only flushes results below 2^-126, which bf16
// could hold as subnormals: an absolute error under 1.2e-38.
//
// A team of threads per row (rowwise.cuh: the block, or one warp per row and 8 rows per block
// for rows of <= 32 x kRowVectors vectors), grid-stride over rows; two specialisations
// (FC_IN_REGISTERS), chosen by the host (_kernels.softmax_plan) for the whole tensor:
//   in registers  (1) every member loads its (at most kRowVectors) 16-byte vectors of the row at
//                 once and keeps them: max, sum of exp, write of exp * (1 / sum) all from
//                 registers. One DRAM read, one write, one memory latency per row. For rows of at
//                 most team.size x kRowVectors vectors (4096 fp32 / 8192 fp16/bf16 elements with
//                 256 threads) with out at x's offset within 16 bytes: true of every row of such a
//                 tensor (each row start moves both pointers by r * cols elements).
//   online        (0) any row: pass 1 keeps a running (max, sum) per thread (RowMaxSum), the team
//                 merges them, pass 2 re-reads the row (mostly from L2) and writes it: 2 reads
//                 instead of the 3 (max, sum, write) of a plain two-reduction softmax.
// Two kernels rather than a per-row branch: one kernel holding both paths took the registers of
// both (bf16 78 vs 62 for the register path alone, fp32 74 vs 58), i.e. fewer blocks per SM.
//
// Why the 16-bit register path is shaped so (docs/perf-notes.md, "16-bit softmax and
// transpose"): at 1c7ff43 bf16 reached 63% of the copy bandwidth, issue-bound rather than
// memory-bound: ~37 SASS instructions per element with the row setup (expf ~9 twice, unpacking
// with PRMTs in three passes, a 64-bit modulo per row), and bf16 retires twice the elements per
// second of fp32 at the same bandwidth. Now ~20: packed max (~0.5), then per exp pass unpack 1 +
// x - m 1 + * log2 e 1 + MUFU 1, sum 1 / scale 1 + pack 0.5, and the per-row setup.
// exp is computed twice rather than kept: fp32 copies of a 16-bit row would take 91 registers
// instead of 62 (5 blocks of 128 threads per SM instead of 8: 40 instead of 64 KB in flight).
//
// `out` may be `x` (in place): every element is read and written by the same thread, and all
// reads of a row feed the team's max before the first write of that row.
#include "attention/online_softmax.cuh"  // fast_exp2, kLog2e: the flash kernels' exp2
#include "common/reduce.cuh"
#include "common/types.cuh"
#include "ladder/rowwise.cuh"
#include "ladder/vec.cuh"

using T = dtype_of<FC_DTYPE>::type;

constexpr int N = Vec16<T>::N;               // elements per 16-byte vector
constexpr int kRowVectors = FC_ROW_VECTORS;  // _kernels.py: ROW_VECTORS_PER_THREAD
constexpr bool kInRegisters = FC_IN_REGISTERS;  // _kernels.py: softmax_plan

// exp(x - m) at the precision the storage dtype needs (table above).
__device__ __forceinline__ float exp_shifted(float x, float m) {
  if constexpr (sizeof(T) == 2) {
    return fast_exp2((x - m) * kLog2e);
  } else {
    return expf(x - m);
  }
}

// A 16-byte vector is handled as 4 32-bit words: one fp32 element, or two fp16/bf16 elements
// (element 2i in the low half of word i), the operands of the packed conversions and maxes. Loading
// words rather than Vec16<T> keeps each pair in one register: with 16-bit fields the compiler
// split and re-merged every pair (PRMT + shift per element, 3 instructions per packed store).
using Words = Vec16<uint32_t>;

// Templates only so that `if constexpr` discards the branch of the other storage width.
template <typename U> __device__ __forceinline__ void unpack(const Words& a, float (&f)[N]) {
  if constexpr (sizeof(U) == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const Float2 p = unpack2<U>(a.v[i]);
      f[2 * i] = p.lo;
      f[2 * i + 1] = p.hi;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = __uint_as_float(a.v[i]);
  }
}

template <typename U> __device__ __forceinline__ Words pack(const float (&f)[N], float scale) {
  Words a;
  if constexpr (sizeof(U) == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a.v[i] = pack2<U>(f[2 * i] * scale, f[2 * i + 1] * scale);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) a.v[i] = __float_as_uint(f[i] * scale);
  }
  return a;
}

// max over a vector: for fp16/bf16 on the packed words (max.bf16x2: exact, NaN loses like fmaxf),
// 3 packed maxes and one unpack instead of 8 conversions and 8 fmaxf.
template <typename U> __device__ __forceinline__ float vec_max(const Words& a) {
  if constexpr (sizeof(U) == 2) {
    const Float2 p = unpack2<U>(max2<U>(max2<U>(a.v[0], a.v[1]), max2<U>(a.v[2], a.v[3])));
    return fmaxf(p.lo, p.hi);
  } else {
    return fmaxf(fmaxf(__uint_as_float(a.v[0]), __uint_as_float(a.v[1])),
                 fmaxf(__uint_as_float(a.v[2]), __uint_as_float(a.v[3])));
  }
}

// Running (max, sum of exp(x - max)) of one thread's share of a row, in the natural domain.
// (The flash kernels' OnlineSoftmax works on log2-domain scores, x * log2 e rounded first; here
// x - m is formed before any rounding, so the result is exact to the storage rounding for any
// finite scores.) Guards, once: until a finite or +inf value arrives m = -inf and the reference
// is 0, so -inf contributes exp(-inf) = 0, never exp(-inf + inf) = NaN; a NaN contributes NaN.
struct RowMaxSum {
  float m = neg_inf();
  float s = 0.f;

  __device__ __forceinline__ float ref() const { return m == neg_inf() ? 0.f : m; }
  // Raise the max to at least `v` (the max of the next few elements); rescale the sum.
  __device__ __forceinline__ void raise(float v) {
    if (v > m) {  // false for NaN; m = -inf gives exp(-inf) = 0: the sum so far was 0 (or NaN)
      s *= exp_shifted(m, v);
      m = v;
    }
  }
  __device__ __forceinline__ void add(float x) { s += exp_shifted(x, ref()); }
  // The team's (max, sum): every member gets them. max = -inf: nothing visible but -inf (or NaN).
  __device__ __forceinline__ void merge(const RowTeam& team) {
    const float row_m = team.max(m);
    s = team.sum(m == row_m ? s : s * exp_shifted(m, row_m));
    m = row_m;
  }
};

__device__ __forceinline__ void write_zeros(T* orow, int64_t from, int64_t cols, const RowTeam& team) {
  for (int64_t j = from + team.rank; j < cols; j += team.size) orow[j] = from_float<T>(0.f);
}

// The row held in registers: v[k] is vector rank + k * size of the 16-byte-aligned part
// (s.nvec <= size * kRowVectors). The scalar head [0, head) and tail [tail, limit) have fewer
// than N <= 8 elements each, so each member holds at most one of each (xh, xt).
__device__ __forceinline__ void softmax_row_registers(const T* xr, T* orow, int64_t limit,
                                                      int64_t cols, Split16 s, const RowTeam& team) {
  const Words* xv = reinterpret_cast<const Words*>(xr + s.head);
  Words* ov = reinterpret_cast<Words*>(orow + s.head);
  const int64_t jh = team.rank;
  const int64_t jt = s.head + s.nvec * N + team.rank;
  const bool has_h = jh < s.head;
  const bool has_t = jt < limit;
  auto mine = [&](int k) { return team.rank + static_cast<int64_t>(k) * team.size < s.nvec; };

  Words v[kRowVectors];
#pragma unroll
  for (int k = 0; k < kRowVectors; ++k) {  // independent loads: all in flight together
    if (mine(k)) v[k] = xv[team.rank + static_cast<int64_t>(k) * team.size];
  }
  const float xh = has_h ? to_float(xr[jh]) : neg_inf();
  const float xt = has_t ? to_float(xr[jt]) : neg_inf();

  float m = fmaxf(xh, xt);
#pragma unroll
  for (int k = 0; k < kRowVectors; ++k) {
    if (mine(k)) m = fmaxf(m, vec_max<T>(v[k]));
  }
  m = team.max(m);
  if (m == neg_inf()) {  // team-uniform: every member holds the same reduced max
    write_zeros(orow, 0, cols, team);
    return;
  }

  // exp is computed twice (sum, then write) rather than kept: fp32 copies of a 16-bit row double
  // its registers (91 instead of 62 for bf16, 5 blocks of 128 per SM instead of 8: 40 instead of
  // 64 KB in flight), and the 16-bit exp is 3 instructions.
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < kRowVectors; ++k) {
    if (mine(k)) {
      float f[N];
      unpack<T>(v[k], f);
#pragma unroll
      for (int i = 0; i < N; ++i) sum += exp_shifted(f[i], m);
    }
  }
  const float eh = exp_shifted(xh, m);  // 0 for an absent head / tail element (x = -inf)
  const float et = exp_shifted(xt, m);
  sum = team.sum(sum + (eh + et));

  const float inv = 1.f / sum;
#pragma unroll
  for (int k = 0; k < kRowVectors; ++k) {
    if (mine(k)) {
      float f[N];
      unpack<T>(v[k], f);
#pragma unroll
      for (int i = 0; i < N; ++i) f[i] = exp_shifted(f[i], m);
      ov[team.rank + static_cast<int64_t>(k) * team.size] = pack<T>(f, inv);
    }
  }
  if (has_h) orow[jh] = from_float<T>(eh * inv);
  if (has_t) orow[jt] = from_float<T>(et * inv);
  write_zeros(orow, limit, cols, team);
}

// Any row: an online pass for (max, sum), then a pass that re-reads the row and writes it.
__device__ __forceinline__ void softmax_row_online(const T* xr, T* orow, int64_t limit,
                                                   int64_t cols, const RowTeam& team) {
  RowMaxSum st;
  const Split16 s = split16(xr, limit);
  const int64_t tail = s.head + s.nvec * N;
  for (int64_t j = team.rank; j < s.head; j += team.size) {
    const float x = to_float(xr[j]);
    st.raise(x);
    st.add(x);
  }
  const Words* xv = reinterpret_cast<const Words*>(xr + s.head);
  for_strided<4>(
      team.rank, team.size, s.nvec, [&](int64_t i) { return xv[i]; },
      [&](int64_t, const Words& a) {
        float f[N];
        unpack<T>(a, f);
        st.raise(vec_max<T>(a));  // once per vector: the rescale is rare after the first few
#pragma unroll
        for (int i = 0; i < N; ++i) st.add(f[i]);
      });
  for (int64_t j = tail + team.rank; j < limit; j += team.size) {
    const float x = to_float(xr[j]);
    st.raise(x);
    st.add(x);
  }
  st.merge(team);
  if (st.m == neg_inf()) {  // team-uniform
    write_zeros(orow, 0, cols, team);
    return;
  }
  const float m = st.m;
  const float inv = 1.f / st.s;
  row_map(xr, orow, limit, team, [&](float x) { return exp_shifted(x, m) * inv; });
  write_zeros(orow, limit, cols, team);
}

// Block (threads, 1): the block per row; block (32, rows_per_block): a warp per row.
extern "C" __global__ void __launch_bounds__(256) FC_KERNEL_NAME(const T* x,  // [rows, cols]
                                                                 T* out,      // [rows, cols], may be x
                                                                 int64_t rows, int64_t cols,
                                                                 int64_t period, int64_t offset) {
  __shared__ float scratch[32];
  const RowTeam team = RowTeam::of_launch(scratch);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; r < rows; r += step) {
    int64_t limit = (period == 1 ? 0 : r % period) + offset;  // no 64-bit division per plain row
    limit = limit < 0 ? 0 : (limit > cols ? cols : limit);
    const T* xr = x + r * cols;
    T* orow = out + r * cols;
    if constexpr (kInRegisters) {
      softmax_row_registers(xr, orow, limit, cols, split16(xr, limit), team);
    } else {
      softmax_row_online(xr, orow, limit, cols, team);
    }
  }
}
