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


def verdict_cases(seed: int, count: int) -> list[tuple[int, ...]]:
    """Cases for block_verdicts (mask_check.VERDICT_FIELDS): the window kinds of _cases, query
    blocks and warp key ranges around the diagonal (where the verdicts change block by block),
    past seqlen_k and far from the band, 8 or 16 blocks."""
    rng = random.Random(seed)
    out = []
    for sq, sk, wl, wr, row0, _ in _cases(seed, count):
        if rng.random() < 0.1:  # an empty band (wr < -wl): no row sees a key
            big = sq + sk
            wl = min(rng.randint(0, 200), big)
            wr = max(-wl - rng.randint(1, 64), -big)
        q0 = row0
        diag = q0 + sk - sq  # the key on the diagonal of row q0
        k0 = rng.choice((diag + rng.randint(-160, 160), 16 * rng.randint(0, sk // 16 + 2),
                         rng.randint(-200, sk + 200) if rng.random() < 0.2 else diag))
        k0 = max(k0, 0)
        out.append((sq, sk, wl, wr, q0, k0, rng.choice((8, 16))))
    return out


def verdicts_expected(case: tuple[int, ...]) -> tuple[int, int]:
    """(hidden, whole) bits by testing every (query, key) pair of every block, as mask.cuh's
    `visible` does: key < seqlen_k and -window_left <= key - query - shift <= window_right."""
    sq, sk, wl, wr, q0, k0, nj = case
    hidden = whole = 0
    for j in range(nj):
        seen = [k < sk and -wl <= k - q - (sk - sq) <= wr
                for q in range(q0 + 8 * j, q0 + 8 * j + 8) for k in range(k0, k0 + 16)]
        hidden |= (not any(seen)) << j
        whole |= all(seen) << j
    return hidden, whole


def check_verdicts(cases: list[tuple[int, ...]], got: torch.Tensor) -> None:
    kinds = {"hidden": 0, "whole": 0, "mixed": 0, "empty band": 0}
    for case, row in zip(cases, got.tolist(), strict=True):
        want = verdicts_expected(case)
        assert tuple(row) == want, (
            f"block_verdicts{dict(zip(mask_check.VERDICT_FIELDS, case, strict=True))} = "
            f"(hidden {row[0]:#x}, whole {row[1]:#x}), want ({want[0]:#x}, {want[1]:#x})")
        mixed = ((1 << case[6]) - 1) & ~(want[0] | want[1])
        kinds["hidden"] += want[0] != 0
        kinds["whole"] += want[1] != 0
        kinds["mixed"] += mixed != 0
        kinds["empty band"] += case[3] < -case[2] and case[5] < case[1]
    assert all(n > len(cases) // 20 for n in kinds.values()), f"a verdict is rarely drawn: {kinds}"


@pytest.mark.parametrize("seed", [0, 1])
def test_block_verdicts_match_every_pair(seed):
    """mask.cuh's block_verdicts (the sm90 backward's FC_MASK_BLOCKS: which blocks of 8 queries
    a warp's 16 keys see wholly or not at all) against `visible` tested pair by pair."""
    cases = verdict_cases(seed, 1500)
    got = mask_check.block_verdicts(torch.tensor(cases, dtype=torch.int32, device="cuda"))
    check_verdicts(cases, got.cpu())


def hidden_expected(case: tuple[int, ...]) -> tuple[int, int, int]:
    """(query blocks, key blocks, key blocks straddling seqlen_k) by testing every pair:
    hidden_query_blocks<16, 64> and hidden_key_blocks<16, 64>'s rules (see mask.cuh)."""
    sq, sk, wl, wr, q0, k0, nj = case

    def seen(q, k):
        return k < sk and -wl <= k - q - (sk - sq) <= wr

    qb = sum(1 << j for j in range(nj)
             if not any(seen(q, k) for q in range(q0 + 16 * j, q0 + 16 * j + 16)
                        for k in range(k0, k0 + 64)))
    kb = sum(1 << j for j in range(nj)
             if not any(seen(q, k) for q in range(q0, q0 + 64)
                        for k in range(k0 + 16 * j, k0 + 16 * j + 16)))
    straddle = sum(1 << j for j in range(nj) if k0 + 16 * j < sk < k0 + 16 * j + 16)
    return qb, kb, straddle


def check_hidden(cases: list[tuple[int, ...]], got: torch.Tensor) -> None:
    drawn = {"query": 0, "key": 0, "key, left": 0, "empty band": 0}
    for case, (qb, kb) in zip(cases, got.tolist(), strict=True):
        want_q, want_k, straddle = hidden_expected(case)
        where = dict(zip(mask_check.VERDICT_FIELDS, case, strict=True))
        assert qb == want_q, f"hidden_query_blocks{where} = {qb:#x}, want {want_q:#x}"
        # exact but for a block straddling seqlen_k, which may stay clear (never set wrongly)
        assert kb & ~want_k == 0, f"hidden_key_blocks{where} = {kb:#x} marks a seen block"
        assert (want_k & ~straddle) == (kb & ~straddle), \
            f"hidden_key_blocks{where} = {kb:#x}, want {want_k:#x}"
        drawn["query"] += 0 < want_q < (1 << case[6]) - 1
        drawn["key"] += 0 < want_k < (1 << case[6]) - 1
        drawn["key, left"] += want_k & 1 and not want_k >> 7 & 1 and want_k != straddle
        drawn["empty band"] += case[3] < -case[2] and case[5] < case[1]
    assert all(n > len(cases) // 50 for n in drawn.values()), f"partly hidden rarely drawn: {drawn}"


def hidden_cases(seed: int, count: int) -> list[tuple[int, ...]]:
    """verdict_cases' windows with 8 blocks (a 128-row step, a 128-key block), most with k0 near
    one of the band's edges for row q0 (where 64-key / 64-query ranges are partly hidden)."""
    rng = random.Random(seed + 100)
    out = []
    for sq, sk, wl, wr, q0, k0, _ in verdict_cases(seed + 100, count):
        near = rng.random()
        if near < 0.35:  # the right edge (the diagonal's side)
            k0 = max(0, q0 + sk - sq + rng.randint(-64, 160))
        elif near < 0.8 and wl < sq + sk:  # the left edge of a bounded window
            k0 = max(0, q0 + sk - sq - wl + rng.randint(-192, 64))
        out.append((sq, sk, wl, wr, q0, k0, 8))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_hidden_blocks_match_every_pair(seed):
    """mask.cuh's hidden_query_blocks / hidden_key_blocks (FC_MASK_SKIP: the k16 steps of the
    backward's GEMMs a masked step may leave out) against `visible`, pair by pair."""
    cases = hidden_cases(seed, 600)
    got = mask_check.hidden_blocks(torch.tensor(cases, dtype=torch.int32, device="cuda"))
    check_hidden(cases, got.cpu())
