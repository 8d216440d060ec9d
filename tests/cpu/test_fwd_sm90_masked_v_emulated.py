"""fwd_sm90's masked-V slow path (FC_MASKED_V, flash_fwd_sm90.cu), emulated thread by thread on
the CPU: the clean copy (copy_clean_v: every NaN / Inf half replaced by 0) and the values
put_back_nonfinite adds into each thread's O elements (rows g, g + 8 of its warp's 16; columns
8j + 2t, + 1), reading the V stage through v_offset, against an independent rule: O element
(row i, column c) gains NaN if a key of the tile that row i sees (mask.cuh) holds NaN in column
c, or +Inf and -Inf; else +-Inf if one holds it; else nothing. The stage is laid out as TMA's
128B swizzle writes it (sm90.cuh: [rows][64] chunks of 128-byte rows, the 16-byte units of row r
permuted by XOR with r % 8), built here independently of v_offset. Every formula in the
emulation mirrors a line of the .cu; the GPU tests (tests/gpu/test_fwd_sm90.py -k masked_v) run
the kernel itself.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from .mask_model import Mask


def swizzled_stage(tile: np.ndarray) -> bytes:
    """The [block_n][head_dim] fp16 tile as TMA writes it with SWIZZLE_128B (sm90.cuh header)."""
    block_n, head_dim = tile.shape
    out = bytearray(block_n * head_dim * 2)
    raw = tile.astype(np.float16).view(np.uint16)
    for chunk in range(head_dim // 64):
        base = chunk * block_n * 128
        for r in range(block_n):
            for unit in range(8):
                src = raw[r, chunk * 64 + unit * 8: chunk * 64 + unit * 8 + 8].tobytes()
                dst = base + r * 128 + (unit ^ (r % 8)) * 16
                out[dst:dst + 16] = src
    return bytes(out)


def v_offset(key, d, block_n):  # flash_fwd_sm90.cu v_offset
    unit = (d % 64) // 8
    return (d // 64) * (block_n * 128) + key * 128 + ((unit ^ (key & 7)) * 16) + (d % 8) * 2


def half_nonfinite(h):
    return (h & 0x7C00) == 0x7C00


def half_special(h):
    return math.nan if h & 0x03FF else (-math.inf if h & 0x8000 else math.inf)


def clean_copy(stage: bytes) -> bytes:  # copy_clean_v (fp16)
    halves = np.frombuffer(stage, dtype=np.uint16).copy()
    halves[(halves & 0x7C00) == 0x7C00] = 0
    return halves.tobytes()


def put_back(stage: bytes, mask: Mask, m0: int, wg_row0: int, n0: int, block_n: int,
             head_dim: int, offset=v_offset, corr=lambda row: 1.0):
    """put_back_nonfinite for the 128 threads of one consumer warpgroup:
    {(row, col): added value} for every O element they hold (0.0 where nothing is added). As the
    .cu does, each thread walks the keys, then the column groups, adding each non-finite value,
    times its row's corr (the put-back runs after O's rescale), straight into its O element's
    slot (here: starting from 0.0)."""
    out = {}
    for warp in range(4):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            row0 = m0 + wg_row0 + warp * 16 + g
            mine = {}  # the thread's slot of the clean tile: O element index -> value
            for j in range(head_dim // 8):
                for h in range(2):
                    for e in range(2):
                        mine[4 * j + 2 * h + e] = 0.0
            lo = [max(mask.key_begin(row0 + 8 * h) - n0, 0) for h in range(2)]
            hi = [min(mask.key_end(row0 + 8 * h + 1) - n0, block_n) for h in range(2)]
            first, last = min(lo), max(hi)
            c = [corr(row0 + 8 * h) for h in range(2)]
            for key in range(first, last):
                for j in range(head_dim // 8):
                    at = offset(key, 8 * j + 2 * t, block_n)
                    w = int.from_bytes(stage[at:at + 4], "little")
                    if not (half_nonfinite(w & 0xFFFF) or half_nonfinite(w >> 16)):
                        continue
                    for e in range(2):
                        bits = (w >> 16) if e else (w & 0xFFFF)
                        if not half_nonfinite(bits):
                            continue
                        x = half_special(bits)
                        for h in range(2):
                            if lo[h] <= key < hi[h]:
                                mine[4 * j + 2 * h + e] += x * c[h]
            for j in range(head_dim // 8):
                for h in range(2):
                    for e in range(2):
                        at_o = (row0 + 8 * h, 8 * j + 2 * t + e)
                        assert at_o not in out, f"O element {at_o} held twice"
                        out[at_o] = mine[4 * j + 2 * h + e]
    return out


def rule(tile: np.ndarray, mask: Mask, row: int, col: int, n0: int) -> float:
    """What the rows' keys put into O (row, col): the IEEE rule on the seen non-finite values."""
    seen = [tile[k, col] for k in range(tile.shape[0])
            if mask.visible(row, n0 + k) and not math.isfinite(tile[k, col])]
    if any(math.isnan(x) for x in seen) or (math.inf in seen and -math.inf in seen):
        return math.nan
    if math.inf in seen:
        return math.inf
    if -math.inf in seen:
        return -math.inf
    return 0.0


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == b


CASES = [  # (seqlen_q, seqlen_k, window_left, window_right, m0, wg_row0, n0, head_dim)
    (256, 256, 10**9, 0, 128, 64, 128, 128),    # causal diagonal, second warpgroup
    (256, 256, 10**9, 0, 128, 0, 128, 64),      # causal diagonal, first warpgroup, d64
    (300, 517, 37, 5, 128, 64, 256, 128),       # a window's two edges, seqlen_q != seqlen_k
    (200, 330, 10**9, 0, 128, 0, 256, 64),      # keys past seqlen_k in the tile
]


@pytest.mark.parametrize("case", CASES, ids=["causal-wg1-d128", "causal-wg0-d64",
                                            "window-d128", "past-seqlen-k-d64"])
def test_put_back_matches_the_rule(case):
    sq, sk, wl, wr, m0, wg_row0, n0, head_dim = case
    block_n = 128
    mask = Mask(sq, sk, wl, wr)
    rng = np.random.default_rng(sum(case) % 1000)
    tile = rng.standard_normal((block_n, head_dim)).astype(np.float16).astype(np.float64)
    for _ in range(40):  # non-finite values anywhere, incl. both chunks and bit 7 of the key
        k, c = int(rng.integers(block_n)), int(rng.integers(head_dim))
        tile[k, c] = [math.nan, math.inf, -math.inf][int(rng.integers(3))]
    tile[71, 3], tile[72, 3] = math.inf, -math.inf  # +Inf and -Inf in one column
    stage = swizzled_stage(tile)
    # the next tile's correction of each row: mostly in (0, 1], some rows 1 and some 0 (a later
    # tile's maximum so far above that 2^(m_old - m_new) underflowed: Inf x 0 is NaN, as (O + x) x 0)
    corrs = {r: [0.0, 1.0, float(rng.uniform(1e-30, 1.0))][r % 3] for r in range(sq + 64)}
    got = put_back(stage, mask, m0, wg_row0, n0, block_n, head_dim, corr=corrs.__getitem__)
    assert len(got) == 64 * head_dim
    assert any(not same(x, 0.0) for x in got.values()), "the case puts nothing back"
    assert any(same(x, 0.0) for x in got.values()), "the case leaves nothing untouched"
    for (row, col), x in got.items():
        want = rule(tile, mask, row, col, n0) * corrs[row]  # (O + x) corr, IEEE
        if rule(tile, mask, row, col, n0) == 0.0:
            want = 0.0  # nothing put back: the slot keeps O corr (here 0.0)
        assert same(x, want), f"O ({row}, {col}): added {x}, the rule says {want}"


def test_clean_copy_zeroes_exactly_the_nonfinite_values():
    rng = np.random.default_rng(5)
    tile = rng.standard_normal((128, 128)).astype(np.float16).astype(np.float64)
    tile[3, 70], tile[100, 5], tile[7, 127] = math.nan, math.inf, -math.inf
    clean = np.frombuffer(clean_copy(swizzled_stage(tile)), dtype=np.uint16)
    want = tile.copy()
    want[~np.isfinite(want)] = 0.0
    assert clean.tobytes() == swizzled_stage(want)


def test_the_emulation_catches_a_wrong_swizzle():
    """v_offset without the XOR (a plain row-major chunk) must fail the rule somewhere."""
    sq, sk, wl, wr, m0, wg_row0, n0, head_dim = CASES[0]
    mask = Mask(sq, sk, wl, wr)
    tile = np.ones((128, head_dim))
    tile[70, 11] = math.nan  # key n0 + 70 = 198 (tile row 70: 70 % 8 = 6, so the XOR moves it)
    stage = swizzled_stage(tile)

    def unswizzled(key, d, block_n):
        return (d // 64) * (block_n * 128) + key * 128 + (d % 64) * 2

    got = put_back(stage, mask, m0, wg_row0, n0, 128, head_dim, offset=unswizzled)
    assert any(not same(x, rule(tile, mask, r, c, n0)) for (r, c), x in got.items())
