// masked_visits (mask.cuh) exposed for testing: the GPU lane holds it against tile_needs_mask,
// tile by tile (flashcuda/ops/mask_check.py, tests/gpu/test_mask.py).
//
// One thread per case. Case c is 6 ints: seqlen_q, seqlen_k, window_left, window_right (the
// kernel-side windows, unbounded sides already replaced as the host does), row0, rows. For each
// tile width cols in {64, 128, 176} and every key tile n in [0, n_last] with n_last =
// ceil(seqlen_k / cols) + 1 (one tile past seqlen_k), the thread compares
// tile_needs_mask(row0, rows, n * cols, cols) with masked_visits(...)(n_last - n) and writes the
// number of disagreements to mismatches[c].
//
// fragment_bits_test: fragment_bits (mask.cuh) for (lo, hi) pairs, at 8 and 16 column pairs per
// lane (64-column tiles, and the sm90 forward's 128-key tiles), for the tests
// to hold against the columns a lane holds (tests/gpu/test_mask.py).
#include "attention/mask.cuh"
#include "common/types.cuh"

constexpr int kThreads = 128;

template <int kCols>
__device__ int count_mismatches(const Mask& mask, int row0, int rows) {
  const int n_last = (mask.seqlen_k + kCols - 1) / kCols + 1;
  const MaskedVisits visits = masked_visits(mask, row0, rows, n_last, kCols);
  int bad = 0;
  for (int n = 0; n <= n_last; ++n)
    bad += mask.tile_needs_mask(row0, rows, n * kCols, kCols) != visits(n_last - n);
  return bad;
}

extern "C" __global__ void __launch_bounds__(kThreads)
mask_test(const int* __restrict__ cases, int* __restrict__ mismatches, int count) {
  const int c = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (c >= count) return;
  const int* p = cases + 6 * c;
  const Mask mask{p[0], p[1], p[2], p[3]};
  mismatches[c] = count_mismatches<64>(mask, p[4], p[5]) + count_mismatches<128>(mask, p[4], p[5]) +
                  count_mismatches<176>(mask, p[4], p[5]);
}

extern "C" __global__ void __launch_bounds__(kThreads)
fragment_bits_test(const int* __restrict__ bounds, uint32_t* __restrict__ bits, int count) {
  const int c = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (c >= count) return;
  bits[2 * c] = fragment_bits<8>(bounds[2 * c], bounds[2 * c + 1]);
  bits[2 * c + 1] = fragment_bits<16>(bounds[2 * c], bounds[2 * c + 1]);
}
