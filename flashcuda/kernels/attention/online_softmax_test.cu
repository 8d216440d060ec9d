// OnlineSoftmax (online_softmax.cuh) exposed for testing: the GPU lane checks the struct itself,
// on the GPU, against a float64 softmax (flashcuda/ops/softmax_state.py, tests/gpu/test_simt.py).
//
// One thread per row. The row's log2-domain scores stream through update / add tile by tile
// (`tile` keys at a time), carrying an accumulator of weighted values exactly as the flash loop
// carries its output row: acc = acc * corr + sum_j p_j v_j. The same keys are also streamed as two
// halves with separate states, which are then merge()d, as split-KV combines partial results.
#include "attention/online_softmax.cuh"
#include "common/types.cuh"

constexpr int kThreads = 128;

// Stream keys [begin, end) of one row into (state, acc), `tile` keys at a time.
__device__ void stream_keys(OnlineSoftmax& state, float& acc, const float* __restrict__ s,
                            const float* __restrict__ v, int begin, int end, int tile) {
  for (int j0 = begin; j0 < end; j0 += tile) {
    const int j1 = min(j0 + tile, end);
    float tile_max = neg_inf();
    for (int j = j0; j < j1; ++j) tile_max = fmaxf(tile_max, s[j]);
    acc *= state.update(tile_max);
    float tile_sum = 0.f;
    for (int j = j0; j < j1; ++j) {
      const float p = fast_exp2(s[j] - state.ref());
      tile_sum += p;
      acc = fmaf(p, v[j], acc);
    }
    state.add(tile_sum);
  }
}

extern "C" __global__ void __launch_bounds__(kThreads) FC_KERNEL_NAME(
    const float* __restrict__ scores,  // [rows, n] log2-domain scores; -inf = masked
    const float* __restrict__ values,  // [rows, n]
    float* __restrict__ result,        // [rows, 6]: m, l, lse, out, merged lse, merged out
    int rows, int n, int tile) {
  const int row = blockIdx.x * kThreads + threadIdx.x;
  if (row >= rows) return;
  const float* s = scores + static_cast<int64_t>(row) * n;
  const float* v = values + static_cast<int64_t>(row) * n;
  float* r = result + static_cast<int64_t>(row) * 6;

  OnlineSoftmax whole;
  whole.init();
  float acc = 0.f;
  stream_keys(whole, acc, s, v, 0, n, tile);
  r[0] = whole.m;
  r[1] = whole.l;
  r[2] = whole.lse();
  r[3] = acc * whole.inv_sum();

  const int half = n / 2;
  OnlineSoftmax first, second;
  first.init();
  second.init();
  float acc_first = 0.f, acc_second = 0.f;
  stream_keys(first, acc_first, s, v, 0, half, tile);
  stream_keys(second, acc_second, s, v, half, n, tile);
  const OnlineSoftmax::Factors f = first.merge(second);
  const float merged = acc_first * f.self + acc_second * f.other;
  r[4] = first.lse();
  r[5] = merged * first.inv_sum();
}
