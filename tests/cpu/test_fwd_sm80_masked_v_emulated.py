"""fwd_sm80's masked-V slow path (FC_MASKED_V, flash_fwd_sm80.cu), emulated lane by lane on the
CPU: the bit table v_tile_take_nonfinite builds (kind, column, key) and the NaN / +-Inf that
FwdCta::put_back_nonfinite puts on each thread's O fragments (rows g, g + 8 of each m16 tile of
its warp; columns 8 dt + 2 t, + 1), against an independent rule: O element (row i, column c) of
the tile becomes NaN if a key row i sees (mask.cuh) holds NaN in column c, or +Inf and -Inf;
else +-Inf if one holds it; else it keeps the GEMM's value. Every formula below mirrors a line
of the .cu; the GPU tests (tests/gpu/test_fwd_sm80.py -k masked_v) run the kernel itself.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from .mask_model import Mask


def take_nonfinite(v_tile, head_dim, block_n):
    """v_tile_take_nonfinite: the table (3 kinds x columns x block_n / 32 words)."""
    words = block_n // 32
    table = np.zeros(3 * head_dim * words, dtype=np.uint32)
    for row in range(block_n):
        for col in range(head_dim):
            x = v_tile[row, col]
            if math.isfinite(x):
                continue
            kind = 0 if math.isnan(x) else (2 if x < 0 else 1)
            table[(kind * head_dim + col) * words + row // 32] |= np.uint32(1 << (row % 32))
    return table


def put_back(table, mask, m0, n0, block_m, block_n, head_dim, warps=4):
    """put_back_nonfinite for every lane: {(row, col): 'nan' | 'inf' | '-inf'} (untouched
    elements absent), and every (row, col) an O fragment holds, once each."""
    words = block_n // 32
    warp_rows = block_m // warps
    out, covered = {}, []
    for warp in range(warps):
        for lane in range(32):
            row0 = m0 + warp * warp_rows + lane // 4
            t = lane % 4
            for mt in range(warp_rows // 16):
                for h in range(2):
                    i = row0 + mt * 16 + h * 8
                    lo = max(mask.key_begin(i) - n0, 0)
                    hi = min(mask.key_end(i + 1) - n0, block_n)
                    seen = []
                    for w in range(words):
                        a, b = max(lo - 32 * w, 0), min(hi - 32 * w, 32)
                        seen.append(0 if a >= b else ((0 if b == 32 else (1 << b)) - (1 << a))
                                    & 0xFFFFFFFF)
                    for dt in range(head_dim // 8):
                        for e in range(2):
                            c = 8 * dt + 2 * t + e
                            bits = [[int(table[(kind * head_dim + c) * words + w])
                                     for w in range(words)] for kind in range(3)]
                            nan = pinf = ninf = 0
                            for w in range(words):
                                nan |= bits[0][w] & seen[w]
                                pinf |= bits[1][w] & seen[w]
                                ninf |= bits[2][w] & seen[w]
                            covered.append((i, c))
                            if nan or (pinf and ninf):
                                out[(i, c)] = "nan"
                            elif pinf:
                                out[(i, c)] = "inf"
                            elif ninf:
                                out[(i, c)] = "-inf"
    return out, covered


def expected(v_tile, mask, m0, n0, block_m, block_n, head_dim):
    """The rule, from mask.visible and the values alone."""
    out = {}
    for i in range(m0, m0 + block_m):
        for c in range(head_dim):
            vals = [v_tile[j, c] for j in range(block_n) if mask.visible(i, n0 + j)]
            bad = [x for x in vals if not math.isfinite(x)]
            if any(math.isnan(x) for x in bad) or (math.inf in bad and -math.inf in bad):
                out[(i, c)] = "nan"
            elif math.inf in bad:
                out[(i, c)] = "inf"
            elif -math.inf in bad:
                out[(i, c)] = "-inf"
    return out


CASES = [  # (block_m, block_n, head_dim, seqlen_q, seqlen_k, wl, wr, m0, n0)
    (128, 128, 64, 256, 256, 10**6, 0, 128, 128),    # causal diagonal, d64 tiles
    (128, 64, 128, 256, 256, 10**6, 0, 128, 192),    # causal, d128 tiles, the last key tile
    (128, 64, 128, 256, 256, 10**6, 0, 128, 128),    # causal, rows 128..191 see all of it
    (128, 64, 128, 300, 517, 37, 5, 128, 320),       # sliding window, seqlen_q < seqlen_k
    (128, 128, 64, 200, 150, 10**6, 0, 128, 0),      # bottom-right causal, keys past seqlen_k
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("seed", [0, 1])
def test_put_back_matches_the_rule(case, seed):
    block_m, block_n, d, sq, sk, wl, wr, m0, n0 = case
    mask = Mask(sq, sk, wl, wr)
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((block_n, d))
    picks = rng.integers(0, block_n * d, size=40)
    for n, flat in enumerate(picks):
        v[flat // d, flat % d] = (math.nan, math.inf, -math.inf)[n % 3]
    v[block_n - 1, 5] = math.nan  # the tile's last key: bit 31 of the last word
    v[0, 6], v[0 + 1, 6] = math.inf, -math.inf  # both infinities in one column
    got, covered = put_back(take_nonfinite(v, d, block_n), mask, m0, n0, block_m, block_n, d)
    assert sorted(covered) == sorted((i, c) for i in range(m0, m0 + block_m) for c in range(d)), \
        "the O fragments must cover the block's (row, column) pairs exactly once"
    want = expected(v, mask, m0, n0, block_m, block_n, d)
    assert got == want
    assert want, "the case must put something back"
