"""masked_visits (mask.cuh: which key tiles of a work tile need the mask, decided once per work
tile) against tile_needs_mask (the per-tile rule), tile by tile, on the GPU (mask_test.cu).

The sm90 forward decides masking through masked_visits; a tile it wrongly leaves unmasked would
let a row see keys outside its band (the oracle tests would catch that only at the shapes they
draw), a tile it wrongly masks would only cost time. Here the two rules must agree on every key
tile of widths 64, 128 and 176 (and one tile past seqlen_k) for every drawn case: seqlens around
the tile sizes and random, causal / sliding / unbounded / negative windows as the host passes
them (call.kernel_windows), warpgroup row ranges of 64, 128 and 192 rows at tile-aligned and odd
starts, inside and past seqlen_q.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashcuda.ops import mask_check
from flashcuda.ops.call import kernel_windows

pytestmark = pytest.mark.gpu

EDGES = (0, 1, 2, 63, 64, 65, 127, 128, 129, 175, 176, 177, 191, 192, 193, 1000, 4097)


def _cases(seed: int, count: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        sq = rng.choice(EDGES) if rng.random() < 0.5 else rng.randint(1, 9000)
        sk = rng.choice(EDGES) if rng.random() < 0.5 else rng.randint(1, 9000)
        kind = rng.choice(("causal", "full", "sliding", "left", "right", "sdpa_causal", "wild"))
        left, right = {
            "causal": (None, 0),
            "full": (None, None),
            "sliding": (rng.randint(0, 700), rng.randint(0, 300)),
            "left": (rng.randint(0, 2000), None),
            "right": (None, rng.randint(0, 2000)),
            "sdpa_causal": (None, sq - sk),  # top-left causal: may be negative
            "wild": (rng.randint(-50, 5000), rng.randint(-5000, 5000)),
        }[kind]
        if left is not None and left < 0:
            left = None
        wl, wr = kernel_windows(sq, sk, left, right)
        rows = rng.choice((64, 128, 192))
        row0 = rng.choice((0, 64 * rng.randint(0, sq // 64 + 2), rng.randint(0, sq + 200)))
        out.append((sq, sk, int(wl), int(wr), row0, rows))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_visits_agree_with_tile_needs_mask(seed):
    cases = _cases(seed, 4000)
    got = mask_check.mismatches(torch.tensor(cases, dtype=torch.int32, device="cuda")).cpu()
    assert (got >= 0).all(), "the kernel did not write every case"
    bad = [(c, int(n)) for c, n in zip(cases, got.tolist(), strict=True) if n]
    assert not bad, (f"{len(bad)} of {len(cases)} cases disagree, e.g. "
                     f"{dict(zip(mask_check.FIELDS, bad[0][0], strict=True))}: {bad[0][1]} tiles")


def test_every_window_kind_is_drawn():
    """The draw covers negative right windows, rows past seqlen_q and seqlens at a tile edge."""
    cases = _cases(0, 4000)
    assert any(c[3] < 0 for c in cases)
    assert any(c[4] >= c[0] for c in cases)
    assert any(c[1] in (127, 128, 129) for c in cases)


@pytest.mark.parametrize("seed", [0, 1])
def test_fragment_bits_mark_the_lane_columns_inside_the_bounds(seed):
    """mask.cuh's fragment_bits (FC_MASK_BITS in the sm90 forward) against the columns a lane
    holds, 8j + c, tested one by one: bounds around every column, empty and reversed ranges,
    and far outside the tile (the windows' unbounded sides reach seqlen_q + seqlen_k)."""
    rng = random.Random(seed)
    near = list(range(-3, 132))
    far = [-(1 << 30), -100000, -129, 129, 200, 100000, 1 << 30]
    bounds = [(lo, hi) for lo in near[::3] for hi in near[1::3]]
    bounds += [(rng.choice(near + far), rng.choice(near + far)) for _ in range(3000)]
    got = mask_check.fragment_bits(torch.tensor(bounds, dtype=torch.int32, device="cuda")).cpu()
    for (lo, hi), row in zip(bounds, got.tolist(), strict=True):
        for pairs, value in zip((8, 16), row, strict=True):
            want = sum(1 << (2 * j + c) for j in range(pairs) for c in range(2)
                       if lo <= 8 * j + c < hi)
            assert value == want, f"fragment_bits<{pairs}>({lo}, {hi}) = {value:#x}, want {want:#x}"
