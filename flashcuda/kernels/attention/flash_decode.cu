// Flash decoding: one query row per (batch entry, query head) over a KV cache, the keys split
// across CTAs (split-KV), fp32 partials combined by a second kernel. Memory-bound work: every
// byte of K and V is read once per KV head. Two ways to the scores and P V: tensor cores
// (FC_MMA, the default for head dims up to 128: a KV head's 1-8 query rows as rows of an
// m16n8k16 tile) and CUDA-core FMAs, a key's row over several lanes (the 256 bucket, and the
// A/B baseline; session 44's ncu found that loop issue-bound on the H200).
//
// | feature         | here                                                                       |
// |-----------------|----------------------------------------------------------------------------|
// | dtypes          | fp16, bf16 storage (FC_DTYPE); fp32 compute, fp32 partials                 |
// | head dim        | any multiple of 8 up to FC_HEAD_DIM (64, 128, 256): 16-byte rows per lane   |
// | GQA / MQA       | a KV head's query group (FC_ROWS rows per CTA) reads the keys once         |
// | key span        | positions [seqstart[b], seqused[b]) of sequence b (device tensors;        |
// |                 | defaults 0 and seqlen_k): left padding and ragged lengths                  |
// | cache layout    | sequence b's keys in cache row cache_rows[b] (default b), or paged        |
// |                 | (FC_PAGED): position p at page block_table[b][p / page_size], row p % it  |
// | query rows      | 1 to 16 per sequence (entries E = B x Sq), causal or seeing every key      |
// | strides         | any (batch, row, head) strides in elements, multiples of 8; unit last      |
// | outputs         | splits == 1: out (E, H, D) in q's dtype and lse (E, H) fp32, natural;      |
// |                 | splits > 1: o_part (S, E, H, D) fp32 normalised, lse_part (S, E, H), then  |
// |                 | FC_STAGE 1 (the combine) writes out and lse                                |
//
// Several query rows per sequence (Sq > 1: speculative decoding's drafts, a short chunk) are
// entries of their own, b * Sq + i, each over its own span (causal: row i ends Sq - 1 - i
// positions before the sequence's end); their keys are read once per row (mostly from L2).
//
// FC_STAGE 0 (split): grid (splits, nheads_kv * row_blocks, entries), 128 threads. A CTA owns
// positions [split * chunk, (split + 1) * chunk) ∩ [start, end) of one KV head for FC_ROWS
// query heads of its group. A key's row of K (and of V) is read by kLanes lanes, 8 elements (16 bytes) each;
// a warp holds 32 / kLanes keys at once (its slots), the CTA kSlots = 4 * 32 / kLanes; each
// slot runs its own online softmax over the keys it meets (kUnroll per step, loads first).
// At the end the slots' (m, l, acc) meet in shared memory: M = max m, L = sum l 2^(m - M),
// out = sum acc 2^(m - M) / L. A CTA with no key writes out 0 and lse -inf (every row that
// sees no key does: online_softmax.cuh).
//
// How a step's K / V rows reach the registers (FC_STAGES):
//   0   each lane's loads go straight to registers at the step's start (ld.global.nc); the
//       next step's loads are issued only after this step's math, so a CTA waits out one load
//       latency per step (two where ptxas sinks V's loads below the dots to save registers).
//   N   an N-stage cp.async pipeline in dynamic shared memory: the copies of step i + N - 1 are
//       issued before step i's math, so N - 1 steps of K / V are in flight per CTA. Each lane
//       copies exactly the 16-byte pieces it later reads (no barrier: cp.async.wait_group makes
//       a thread's own copies visible to it); keys past the piece's end arrive as zeros.
//
// FC_MMA (with a pipeline; fwd_decode's default up to d128): each warp takes 16 keys of a step (the
// CTA 64), its K / V tiles copied by its own lanes into swizzled shared tiles (sm80.cuh's
// SwizzledTile); the scores S = Q K^T by mma.sync m16n8k16 with the CTA's query rows as the A
// operand's rows 0 .. FC_ROWS - 1 (the rest zero), K^T by ldmatrix; the online softmax on S's C
// fragments (a row's 16 scores over the 4 lanes of a quad); P as the A operand of O += P V (V by
// ldmatrix.trans). The 4 warps are the slots of the meeting at the end. Far fewer instructions per
// key than the lanes' FMAs and shuffles: ncu (session 45, H100, 1 x 64k d128) has the step at 17%
// of issue slots and 87% of DRAM bandwidth, where the lanes' loop is issue-bound.
//
// FC_STAGE 1 (combine): grid (entries * nheads), 128 threads: lse = log sum_s exp(lse_s),
// out = sum_s exp(lse_s - lse) o_s, rounded once to q's dtype (how, by FC_COMBINE below).
//
// How the combine meets the split when splits > 1 (FC_COMBINE): 0 it is launched after the
// split kernel; 1 (sm_90) it is the split kernel's programmatic dependent: each split CTA
// signals griddepcontrol.launch_dependents at its start, so the combine grid is launched while
// the split runs and its CTAs take the SMs the split's CTAs leave; griddepcontrol.wait holds
// them until the split grid has completed, its writes visible. Either way the combine is
// CTA-wide (combine_row). (Session 45 retired a per-thread combine and a fused one, where each
// tile's last CTA combined: docs/perf-notes.md.)
#include "attention/online_softmax.cuh"
#include "common/sm80.cuh"
#include "common/types.cuh"

using T = dtype_of<FC_DTYPE>::type;
static_assert(sizeof(T) == 2, "the decode kernels take 16-bit storage");
constexpr int kThreads = 128;
#ifndef FC_COMBINE
#define FC_COMBINE 0
#endif
static_assert(FC_COMBINE == 0 || FC_COMBINE == 1, "FC_COMBINE: 0 after the split, 1 dependent");
// How the combine's threads walk a row's pieces (combine_row): 0 one thread per column, each over
// every piece (A/B); 1 column quads x groups of pieces (the host's default since session 47,
// fwd_decode.COMBINE_QUADS: d64 with one KV head 29.1 -> 18.1 us at 1 x 64k keys on the H200).
#ifndef FC_COMBINE_QUADS
#define FC_COMBINE_QUADS 0
#endif

// The CTA-wide combine's shared memory: each piece's weight exp(lse_s - max) and the warps'
// partial max / sum. Pieces per row: at most kMaxSplits (fwd_decode.MAX_SPLITS), one per thread.
constexpr int kMaxSplits = kThreads;
struct CombineSmem {
  float w[kMaxSplits];
  float red[kThreads / 32];
#if FC_COMBINE_QUADS
  float4 acc[kThreads];  // each thread's 4 columns summed over its share of the pieces
#endif
};

// The combine of one (entry, head) row bh = entry * nheads + head from the splits' partials:
// lse[bh] = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) o_s rounded once, at
// out[entry * o_batch_stride + head * o_head_stride + col]. Thread s takes piece s's lse (the
// max and the sum reduced over the CTA, the weights parked in shared memory); then thread c sums
// column c over the pieces (their loads independent of one another: a round of latency per 8
// pieces). With FC_COMBINE_QUADS the CTA is head_dim / 4 column quads x groups instead: thread t
// sums quad t % quads over pieces g, g + groups, ... (g = t / quads; 16-byte loads, all
// independent, so a row's partials arrive in a round or two: d64 with one KV head has 128 pieces
// and 64 busy threads otherwise), and the groups' sums meet in shared memory in group order
// (deterministic). head_dim a multiple of 4 up to 4 * kThreads. Every thread of the CTA calls it
// (barriers inside).
__device__ __forceinline__ void combine_row(CombineSmem& cs, const float* __restrict__ o_part,
                                            const float* __restrict__ lse_part,
                                            T* __restrict__ out, float* __restrict__ lse,
                                            int bh, int entry, int head, int64_t o_batch_stride,
                                            int64_t o_head_stride, int64_t stride, int head_dim,
                                            int splits) {
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const float x = t < splits ? lse_part[t * stride + bh] : neg_inf();
  float m = x;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (lane == 0) cs.red[warp] = m;
  __syncthreads();
  m = cs.red[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, cs.red[w]);
  const float ref = m == neg_inf() ? 0.f : m;
  const float wt = t < splits ? fast_exp2((x - ref) * kLog2e) : 0.f;
  float l = wt;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) l += __shfl_xor_sync(0xffffffffu, l, off);
  __syncthreads();  // (every thread has read the maxima)
  if (lane == 0) cs.red[warp] = l;
  if (t < splits) cs.w[t] = wt;
  __syncthreads();
  l = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) l += cs.red[w];
  const float inv = l > 0.f ? 1.f / l : 0.f;
  if (t == 0) lse[bh] = l > 0.f ? ref + fast_log2(l) * kLn2 : neg_inf();
#if FC_COMBINE_QUADS
  const int quads = head_dim / 4, groups = kThreads / quads, quad = t % quads, g = t / quads;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (g < groups) {
    const float* o = o_part + static_cast<int64_t>(bh) * head_dim + 4 * quad;
#pragma unroll 8
    for (int s = g; s < splits; s += groups) {
      const float4 v = *reinterpret_cast<const float4*>(o + s * stride * head_dim);
      const float w = cs.w[s];
      acc.x = fmaf(w, v.x, acc.x);
      acc.y = fmaf(w, v.y, acc.y);
      acc.z = fmaf(w, v.z, acc.z);
      acc.w = fmaf(w, v.w, acc.w);
    }
  }
  cs.acc[t] = acc;
  __syncthreads();
  const float* sums = reinterpret_cast<const float*>(cs.acc);  // [group][quad][4]
  for (int col = t; col < head_dim; col += kThreads) {
    float val = 0.f;
    for (int i = 0; i < groups; ++i) val += sums[i * head_dim + col];
    out[entry * o_batch_stride + head * o_head_stride + col] = from_float<T>(val * inv);
  }
#else
  for (int col = t; col < head_dim; col += kThreads) {
    const float* o = o_part + static_cast<int64_t>(bh) * head_dim + col;
    float val = 0.f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s)
      val = fmaf(cs.w[s], o[s * stride * head_dim], val);
    out[entry * o_batch_stride + head * o_head_stride + col] = from_float<T>(val * inv);
  }
#endif
}

#if FC_STAGE == 0

constexpr int kHeadDim = FC_HEAD_DIM;   // largest head dim of this specialisation
constexpr int kRows = FC_ROWS;          // query heads (rows) per CTA, of one KV head's group
constexpr int kUnroll = FC_UNROLL;      // keys per slot per step (their loads issued together)
constexpr int kLanes = kHeadDim / 8;    // lanes per key: 8 elements (16 bytes) each
constexpr int kSlotsPerWarp = 32 / kLanes;
#ifndef FC_MMA
#define FC_MMA 0
#endif
// FC_MMA: the scores and P V on tensor cores, each warp a slot of its own (16 keys a step)
constexpr int kSlots = FC_MMA ? kThreads / 32 : (kThreads / 32) * kSlotsPerWarp;
constexpr int kMmaKeys = 16;  // keys per warp per step with FC_MMA (one k16 step of P V)
constexpr int kStep = FC_MMA ? kSlots * kMmaKeys : kSlots * kUnroll;  // keys per CTA per step
constexpr int kStages = FC_STAGES;      // 0: loads to registers; N: N-stage cp.async pipeline
static_assert(kLanes >= 1 && kLanes <= 32 && 32 % kLanes == 0, "a key's lanes within a warp");
static_assert(kStages == 0 || kStages >= 2, "a pipeline has at least two stages");
static_assert(!FC_MMA || kStages >= 2, "FC_MMA reads K / V from the cp.async stages");

struct Vec8 {
  float x[8];
};

// 8 16-bit values held raw (one uint4, as read from shared memory) -> 8 floats.
__device__ __forceinline__ Vec8 unpack8(uint4 raw) {
  const Float2 a = unpack2<T>(raw.x), b = unpack2<T>(raw.y), c = unpack2<T>(raw.z),
               d = unpack2<T>(raw.w);
  return Vec8{{a.lo, a.hi, b.lo, b.hi, c.lo, c.hi, d.lo, d.hi}};
}

// 8 consecutive 16-bit values (16 bytes, 16-byte aligned) -> 8 floats; zeros when !valid.
__device__ __forceinline__ Vec8 load8(const T* p, bool valid) {
  uint4 raw = make_uint4(0u, 0u, 0u, 0u);
  if (valid) raw = __ldg(reinterpret_cast<const uint4*>(p));
  return unpack8(raw);
}

// Sum over the kLanes lanes of one key (consecutive lanes of a warp): every lane gets it.
__device__ __forceinline__ float key_sum(float x) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// One step's math for this lane's slot: the kUnroll keys' scores against each row, the online
// softmax update, the P V accumulation. valid[u]: key u is below the piece's end.
__device__ __forceinline__ void step_math(const float (&qf)[kRows][8], const Vec8 (&kx)[kUnroll],
                                          const Vec8 (&vx)[kUnroll], const bool (&valid)[kUnroll],
                                          float (&acc)[kRows][8], OnlineSoftmax (&state)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float s[kUnroll];
    float tile_max = neg_inf();
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) dot = fmaf(qf[r][i], kx[u].x[i], dot);
      dot = key_sum(dot);
      s[u] = valid[u] ? dot : neg_inf();
      tile_max = fmaxf(tile_max, s[u]);
    }
    const float corr = state[r].update(tile_max);
    const float ref = state[r].ref();
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[r][i] *= corr;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const float p = fast_exp2(s[u] - ref);
      sum += p;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(p, vx[u].x[i], acc[r][i]);
    }
    state[r].add(sum);
  }
}

// Where position p's 16 bytes for this lane live in K (or V) of one entry and KV head: row p of
// the entry's cache row, or (FC_PAGED) row p % page_size of page block_table[b][p / page_size].
struct KvRows {
  const T* base;  // position 0's row (unpaged) / page 0's row 0 (paged), at this head and lane
  int64_t row_stride;
#if FC_PAGED
  const int* pages;  // the entry's row of the block table
  int64_t page_stride;
  int page_size;
#endif

  // (p must be a position the entry has: paged, its block table entry is read)
  __device__ __forceinline__ const T* at(int p) const {
#if FC_PAGED
    const int blk = p / page_size;
    return base + pages[blk] * page_stride + (p - blk * page_size) * row_stride;
#else
    return base + p * row_stride;
#endif
  }

  // at(p) in two parts, for K and V of one position to share the page lookup (FC_MMA's copies;
  // the lanes' step keeps at(p): its compiled code is the one the GPU runs proved)
#if FC_PAGED
  struct Place {
    int page, row;
  };
  __device__ __forceinline__ Place place(int p) const {
    const int blk = p / page_size;
    return {pages[blk], p - blk * page_size};
  }
  __device__ __forceinline__ const T* at(Place x) const {
    return base + x.page * page_stride + x.row * row_stride;
  }
#else
  struct Place {
    int row;
  };
  __device__ __forceinline__ Place place(int p) const { return {p}; }
  __device__ __forceinline__ const T* at(Place x) const { return base + x.row * row_stride; }
#endif
};

struct SplitSmem {
  float m[kSlots][kRows];
  float l[kSlots][kRows];
  float acc[kSlots][kRows][kHeadDim];
  float row_m[kRows];
  float row_inv[kRows];
};

#if FC_MMA
using KvTile = SwizzledTile<kMmaKeys, kHeadDim>;  // one warp's K (or V) rows of a step
constexpr int kDSteps = kHeadDim / 16;  // k16 steps of Q K^T
constexpr int kDTiles = kHeadDim / 8;   // n8 tiles of O
static_assert(kRows <= 8, "FC_MMA: the query rows are rows 0-7 of the A operand (lane / 4)");

// FC_MMA's main loop for this warp (header comment): keys key0 + 16 * warp .. + 15 of each step
// [key_begin, key_end), through a kStages-deep cp.async pipeline of this warp's own tiles. `qrow0`:
// the CTA's first query row (head0), `q_head_stride` between its rows. Leaves the warp's slot
// in `sm`: (m, l) per row and its O columns (unnormalised), as the lanes' slots do. `base`: the
// stages' shared address (128-byte aligned).
__device__ __forceinline__ void mma_loop(const T* qrow0, int64_t q_head_stride, int rows,
                                         int head_dim, const KvRows krows, const KvRows vrows,
                                         int key_begin, int key_end, float scale_log2, int warp,
                                         int lane, uint32_t base, SplitSmem& sm) {
  const int g = lane / 4, t = lane % 4;  // C fragment: row g (and g + 8: padding), keys 2t, 2t + 1
  // Q as the A operand, rows g < rows (the others and rows 8-15 zero): a0a1 (k 2t), a4a5 (k 8 + 2t)
  uint32_t qa[kDSteps][2];
  const T* qrow = qrow0 + min(g, rows - 1) * q_head_stride;
#pragma unroll
  for (int ks = 0; ks < kDSteps; ++ks)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = 16 * ks + 8 * h + 2 * t;
      qa[ks][h] = g < rows && col < head_dim ? *reinterpret_cast<const uint32_t*>(qrow + col) : 0u;
    }
  float o[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] = 0.f;
  OnlineSoftmax state;  // row g's, the same in the quad's 4 lanes (l: this lane's keys only)
  state.init();

  auto tile = [&](int stage, int kv) {  // this warp's K (0) or V (1) tile of a stage
    return base + static_cast<uint32_t>(((stage * (kThreads / 32) + warp) * 2 + kv) *
                                        KvTile::kBytes);
  };
  const int steps = key_end > key_begin ? (key_end - key_begin + kStep - 1) / kStep : 0;
  auto issue = [&](int step) {  // 16 keys x kHeadDim / 8 chunks of K and of V, lane + 32 j
    const int key0 = key_begin + step * kStep + warp * kMmaKeys;
    const uint32_t kt = tile(step % kStages, 0), vt = tile(step % kStages, 1);
#pragma unroll
    for (int j = 0; j < KvTile::kChunks / 32; ++j) {
      const int e = lane + 32 * j;
      const int r = e / KvTile::kChunksPerRow, c = e % KvTile::kChunksPerRow;
      const int key = key0 + r;
      const int at = key < key_end ? key : key_begin;  // (src-size 0 zero-fills past the end)
      const bool ok = key < key_end && 8 * c < head_dim;
      const KvRows::Place x = krows.place(at);  // (K and V share one page lookup per key)
      cp_async_16(kt + KvTile::offset(r, c), krows.at(x) + 8 * c, ok);
      cp_async_16(vt + KvTile::offset(r, c), vrows.at(x) + 8 * c, ok);
    }
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();
  }
  // ldmatrix lanes (flash_fwd_sm80.cu's roles): K as B of Q K^T, V as B of P V (transposed)
  const int k_row = (lane & 7) + ((lane >> 4) << 3), k_chunk = (lane >> 3) & 1;
  const int v_row = lane & 15, v_chunk = lane >> 4;
#pragma unroll 1
  for (int it = 0; it < steps; ++it) {
    __syncwarp();  // every lane is past its reads of the stage the next copies overwrite
    if (it + kStages - 1 < steps) issue(it + kStages - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncwarp();  // the lanes' copies of this step seen by the warp
    const uint32_t k_lane = KvTile::lane_address(tile(it % kStages, 0), k_row, k_chunk);
    const uint32_t v_lane = KvTile::lane_address(tile(it % kStages, 1), v_row, v_chunk);
    float sc[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kDSteps; ++ks) {
      const uint32_t a[4] = {qa[ks][0], 0u, qa[ks][1], 0u};
      uint32_t bk[4];
      ldmatrix_x4(bk, KvTile::at(k_lane, 0, 2 * ks));
      mma_16816<T>(sc[0], a, bk[0], bk[1]);
      mma_16816<T>(sc[1], a, bk[2], bk[3]);
    }
    // keys past the piece's end (their K rows zero-filled) hide; the row max over the quad
    const int kb = key_begin + it * kStep + warp * kMmaKeys + 2 * t;
    float mx = neg_inf();
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        if (kb + 8 * nt + c >= key_end) sc[nt][c] = neg_inf();
        mx = fmaxf(mx, sc[nt][c]);
      }
    mx = quad_max(mx);
    const float corr = state.update(mx * scale_log2);  // (scale_log2 > 0: the max commutes)
    const float ref = state.ref();
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      o[dt][0] *= corr;
      o[dt][1] *= corr;
    }
    float p[2][2], sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        p[nt][c] = fast_exp2(fmaf(sc[nt][c], scale_log2, -ref));
        sum += p[nt][c];
      }
    state.add(sum);
    // P (rows g; keys 2t, 2t + 1 | 8 + 2t, 9 + 2t) as the A operand of P V
    const uint32_t a[4] = {pack2<T>(p[0][0], p[0][1]), 0u, pack2<T>(p[1][0], p[1][1]), 0u};
#pragma unroll
    for (int dp = 0; dp < kDTiles / 2; ++dp) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, KvTile::at(v_lane, 0, 2 * dp));
      mma_16816<T>(o[2 * dp], a, bv[0], bv[1]);
      mma_16816<T>(o[2 * dp + 1], a, bv[2], bv[3]);
    }
  }
  cp_async_wait<0>();  // (only empty groups can remain)
  const float l = quad_sum(state.l);
  __syncthreads();  // every warp is past its reads of the stages SplitSmem overlays
  if (g < kRows) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = 8 * dt + 2 * t + c;
        if (col < head_dim) sm.acc[warp][g][col] = o[dt][c];
      }
    if (t == 0) {
      sm.m[warp][g] = state.m;
      sm.l[warp][g] = l;
    }
  }
}
#endif

// FC_MMA: 3 CTAs per SM by registers, as its 64 KB of stages at d128 allow (sm_90 unpaged; the
// paged kernels and sm_80's would spill there: 2)
#if FC_MMA && __CUDA_ARCH__ >= 900 && !FC_PAGED
constexpr int kMinBlocks = 3;
#elif FC_MMA
constexpr int kMinBlocks = 2;
#else
constexpr int kMinBlocks = 1;
#endif
extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocks) FC_KERNEL_NAME(
    const T* __restrict__ q,       // [B, Sq, H, D]
    const T* __restrict__ k,       // [B_cache, Sk, Hkv, D], or [pages, page_size, Hkv, D]
    const T* __restrict__ v,       // likewise
    T* __restrict__ out,           // [E, H, D] (entries E = B x Sq)  (splits == 1)
    float* __restrict__ lse,       // [E, H] contiguous      (splits == 1)
    float* __restrict__ o_part,    // [S, E, H, D] contiguous (splits > 1)
    float* __restrict__ lse_part,  // [S, E, H] contiguous    (splits > 1)
    const int* __restrict__ seqused,      // [B] end position per entry, or null: seqlen_k each
    const int* __restrict__ seqstart,     // [B] first position per entry, or null: 0 each
    const int* __restrict__ cache_rows,   // [B] entry b's cache row, or null: b (unpaged)
    const int* __restrict__ block_table,  // [B, >= seqlen_k / page_size] pages (FC_PAGED)
    int64_t q_batch_stride, int64_t q_row_stride, int64_t q_head_stride,
    int64_t k_batch_stride, int64_t k_row_stride, int64_t k_head_stride,  // batch: page (paged)
    int64_t v_batch_stride, int64_t v_row_stride, int64_t v_head_stride,
    int64_t o_batch_stride, int64_t o_head_stride,  // batch: per entry (out's row stride)
    int64_t table_batch_stride, int page_size,  // (FC_PAGED)
    int batch,     // entries E = B x Sq: query row i of sequence b is entry b * Sq + i
    int seqlen_q,  // Sq: query rows per sequence, the last Sq positions (bottom-right)
    int causal,    // 1: row i sees positions below end - (Sq - 1 - i); 0: all below end
    int seqlen_k,  // positions per sequence (paged: the block table's blocks x page_size)
    int nheads, int nheads_kv, int head_dim, int splits, int chunk,
    float scale_log2) {
#if FC_STAGES == 0
  __shared__ SplitSmem sm_static;
  SplitSmem& sm = sm_static;
#elif FC_MMA
  // [kStages][warp][K, V] swizzled 16 x kHeadDim tiles (128-byte aligned: SwizzledTile::at's XOR);
  // after the keys, the same bytes hold SplitSmem (the host sizes it for the larger of the two)
  extern __shared__ __align__(128) uint4 stage_buf[];
  SplitSmem& sm = *reinterpret_cast<SplitSmem*>(stage_buf);
#else
  // [kStages][kUnroll][K, V][kThreads] 16-byte pieces, thread t's at t (a warp's contiguous);
  // after the keys, the same bytes hold SplitSmem (the host sizes it for the larger of the two)
  extern __shared__ __align__(16) uint4 stage_buf[];
  SplitSmem& sm = *reinterpret_cast<SplitSmem*>(stage_buf);
#endif
#if FC_COMBINE == 1 && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const int split = blockIdx.x;
  const int group = nheads / nheads_kv;
  const int row_blocks = (group + kRows - 1) / kRows;
  const int kv_head = blockIdx.y / row_blocks;
  const int head0 = kv_head * group + (blockIdx.y % row_blocks) * kRows;
  const int rows = min(kRows, kv_head * group + group - head0);
  const int entry = blockIdx.z;  // (writes: out / lse / partials of this entry)
  const int b = entry / seqlen_q, qi = entry % seqlen_q;  // sequence, query row in it

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = warp * kSlotsPerWarp + lane / kLanes;
  const int sub = lane % kLanes;         // this lane's 8 elements: [8 sub, 8 sub + 8)
  const bool has_cols = 8 * sub < head_dim;

  int end = seqused != nullptr ? seqused[b] : seqlen_k;
  end = max(0, min(end, seqlen_k));
  if (causal) end = max(0, end - (seqlen_q - 1 - qi));
  const int start = seqstart != nullptr ? max(0, min(seqstart[b], end)) : 0;
  const int key_begin = max(split * chunk, start);
  const int key_end = min(split * chunk + chunk, end);

  // This lane's part of each query row, pre-scaled into the log2 domain.
  float qf[kRows][8];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const Vec8 x = load8(q + b * q_batch_stride + qi * q_row_stride +
                             (head0 + min(r, rows - 1)) * q_head_stride + 8 * sub,
                         has_cols);
#pragma unroll
    for (int i = 0; i < 8; ++i) qf[r][i] = x.x[i] * scale_log2;
  }
  float acc[kRows][8];
  OnlineSoftmax state[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    state[r].init();
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[r][i] = 0.f;
  }

  // A key past the piece's end reads nothing, but its address is that of key_begin (a position
  // the entry has whenever there is a step: paged, its table entry exists).
#if FC_PAGED
  const int* pages = block_table + b * table_batch_stride;
  const KvRows krows{k + kv_head * k_head_stride + 8 * sub, k_row_stride, pages, k_batch_stride,
                     page_size};
  const KvRows vrows{v + kv_head * v_head_stride + 8 * sub, v_row_stride, pages, v_batch_stride,
                     page_size};
#else
  const int row = cache_rows != nullptr ? cache_rows[b] : b;
  const KvRows krows{k + row * k_batch_stride + kv_head * k_head_stride + 8 * sub, k_row_stride};
  const KvRows vrows{v + row * v_batch_stride + kv_head * v_head_stride + 8 * sub, v_row_stride};
#endif
#if FC_MMA
  KvRows kwhole = krows, vwhole = vrows;  // (whole rows: mma_loop's lanes copy every column)
  kwhole.base -= 8 * sub;
  vwhole.base -= 8 * sub;
  mma_loop(q + b * q_batch_stride + qi * q_row_stride + head0 * q_head_stride, q_head_stride,
           rows, head_dim, kwhole, vwhole, key_begin, key_end, scale_log2, warp, lane,
           shared_address(stage_buf), sm);
#elif FC_STAGES == 0
#pragma unroll 1
  for (int key0 = key_begin; key0 < key_end; key0 += kStep) {
    Vec8 kx[kUnroll], vx[kUnroll];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int key = key0 + u * kSlots + slot;
      valid[u] = key < key_end;
      kx[u] = load8(krows.at(valid[u] ? key : key_begin), valid[u] && has_cols);
      vx[u] = load8(vrows.at(valid[u] ? key : key_begin), valid[u] && has_cols);
    }
    step_math(qf, kx, vx, valid, acc, state);
  }
#else
  const int steps = key_end > key_begin ? (key_end - key_begin + kStep - 1) / kStep : 0;
  auto issue = [&](int step) {
    const int key0 = key_begin + step * kStep;
    uint4* dst = stage_buf + (step % kStages) * kUnroll * 2 * kThreads + threadIdx.x;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int key = key0 + u * kSlots + slot;
      const int at = key < key_end ? key : key_begin;  // (src-size 0 zero-fills past the end)
      const bool ok = key < key_end && has_cols;
      cp_async_16(shared_address(dst + (2 * u) * kThreads), krows.at(at), ok);
      cp_async_16(shared_address(dst + (2 * u + 1) * kThreads), vrows.at(at), ok);
    }
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();  // (an empty group where there is no step: the count stays uniform)
  }
#pragma unroll 1
  for (int it = 0; it < steps; ++it) {
    // stage (it - 1) % kStages was this thread's last read: its next copies may start
    if (it + kStages - 1 < steps) issue(it + kStages - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // step it's group (and every older one) has landed
    const uint4* src = stage_buf + (it % kStages) * kUnroll * 2 * kThreads + threadIdx.x;
    const int key0 = key_begin + it * kStep;
    Vec8 kx[kUnroll], vx[kUnroll];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      valid[u] = key0 + u * kSlots + slot < key_end;
      kx[u] = unpack8(src[(2 * u) * kThreads]);
      vx[u] = unpack8(src[(2 * u + 1) * kThreads]);
    }
    step_math(qf, kx, vx, valid, acc, state);
  }
  cp_async_wait<0>();  // (only empty groups can remain)
  __syncthreads();     // every thread is past its last read of the stages SplitSmem overlays
#endif

  // The slots meet: each lane parks its acc columns, lane 0 of a key its (m, l) (FC_MMA:
  // mma_loop parked them already).
#pragma unroll
  for (int r = 0; r < (FC_MMA ? 0 : kRows); ++r) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (has_cols) sm.acc[slot][r][8 * sub + i] = acc[r][i];
    if (sub == 0) {
      sm.m[slot][r] = state[r].m;
      sm.l[slot][r] = state[r].l;
    }
  }
  __syncthreads();
  if (threadIdx.x < kRows) {
    const int r = threadIdx.x;
    float m = neg_inf();
    for (int s = 0; s < kSlots; ++s) m = fmaxf(m, sm.m[s][r]);
    const float ref = m == neg_inf() ? 0.f : m;
    float l = 0.f;
    for (int s = 0; s < kSlots; ++s) l += sm.l[s][r] * fast_exp2(sm.m[s][r] - ref);
    sm.row_m[r] = m;
    sm.row_inv[r] = l > 0.f ? 1.f / l : 0.f;
    if (r < rows) {
      const float row_lse = l > 0.f ? m * kLn2 + fast_log2(l) * kLn2 : neg_inf();
      const int64_t at = static_cast<int64_t>(entry) * nheads + head0 + r;
      if (splits == 1) lse[at] = row_lse;
      else lse_part[static_cast<int64_t>(split) * batch * nheads + at] = row_lse;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kRows * head_dim; e += kThreads) {
    const int r = e / head_dim, col = e % head_dim;
    if (r >= rows) break;
    const float m = sm.row_m[r];
    const float ref = m == neg_inf() ? 0.f : m;
    float val = 0.f;
    for (int s = 0; s < kSlots; ++s) val += sm.acc[s][r][col] * fast_exp2(sm.m[s][r] - ref);
    val *= sm.row_inv[r];
    const int head = head0 + r;
    if (splits == 1)
      out[entry * o_batch_stride + head * o_head_stride + col] = from_float<T>(val);
    else
      o_part[((static_cast<int64_t>(split) * batch + entry) * nheads + head) * head_dim + col] =
          val;
  }
}

#else  // FC_STAGE == 1: the combine

extern "C" __global__ void __launch_bounds__(kThreads) FC_KERNEL_NAME(
    const float* __restrict__ o_part,    // [S, E, H, D]
    const float* __restrict__ lse_part,  // [S, E, H]
    T* __restrict__ out,                 // [E, H, D] at o_batch_stride per entry
    float* __restrict__ lse,             // [E, H] contiguous
    int64_t o_batch_stride, int64_t o_head_stride,
    int batch, int nheads, int head_dim, int splits) {  // batch: entries E
#if FC_COMBINE == 1 && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the split grid done, its writes seen
#endif
  const int bh = blockIdx.x;  // entry * nheads + head
  const int b = bh / nheads, head = bh % nheads;
  __shared__ CombineSmem cs;
  combine_row(cs, o_part, lse_part, out, lse, bh, b, head, o_batch_stride, o_head_stride,
              static_cast<int64_t>(batch) * nheads, head_dim, splits);
}

#endif
