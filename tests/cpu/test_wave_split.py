"""The last-wave split's host side (flashcuda/ops/wave_split.py): the query blocks a key block's
CTA walks (KeyBlockSteps::n_m of mask.cuh, against the visibility rule itself) and the plan of
MAIN's CTAs and the pieces (every step of every tail item in exactly one piece)."""

from __future__ import annotations

import numpy as np
import pytest

from flashcuda.ops import wave_split
from flashcuda.ops.call import kernel_windows

SHAPES = [(1, 1), (17, 143), (143, 17), (128, 128), (300, 257), (1023, 128), (128, 1023),
          (2048, 2048)]
WINDOWS = [(None, None), (None, 0), (100, 20), (0, None), (5, -3)]


def _brute_query_blocks(sq, sk, wl, wr, block_m, block_n, key_block):
    """Query blocks holding a row that sees a key of the block, by the rule of DESIGN.md §3."""
    rows = np.arange(sq)[:, None]
    keys = np.arange(key_block * block_n, min((key_block + 1) * block_n, sk))[None, :]
    d = keys - rows - (sk - sq)
    seen = ((d <= wr) & (d >= -wl)).any(axis=1)
    return len(set(np.flatnonzero(seen) // block_m))


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("sq,sk", SHAPES, ids=str)
def test_query_blocks_match_the_visibility_rule(sq, sk, window):
    wl, wr = (int(w) for w in kernel_windows(sq, sk, *window))
    for block_m in (64, 80, 128):
        for key_block in range(-(-sk // 128)):
            assert wave_split.query_blocks(sq, sk, wl, wr, block_m, 128, key_block) == \
                _brute_query_blocks(sq, sk, wl, wr, block_m, 128, key_block)


def _check_cover(plan, total, steps_of, sms):
    tail = plan.first_main
    assert tail == (total if total < sms else total % sms) and plan.total == total
    assert plan.main_ctas == total - tail and plan.main_ctas % sms == 0  # whole waves
    assert len(plan.pieces) <= sms  # all pieces on the SMs at once
    assert plan.slots == tail
    for item in range(tail):
        runs = [(a, b) for i, a, b, s in plan.pieces if s == item and i == item]
        assert len(runs) == len([p for p in plan.pieces if p[3] == item])
        assert runs[0][0] == 0 and runs[-1][1] == steps_of(item)
        assert all(b > a for a, b in runs) or steps_of(item) == 0  # no empty piece
        assert all(runs[k][1] == runs[k + 1][0] for k in range(len(runs) - 1))


@pytest.mark.parametrize("total,sms", [(4096, 132), (4100, 132), (16, 132), (133, 132),
                                       (2048 + 66, 132), (7, 3), (40, 7)])
def test_plan_covers_each_tail_item_once(total, sms):
    for steps_of in (lambda i: 16, lambda i: 1 + i % 16, lambda i: 3 * (i % 5)):
        plan = wave_split.plan(total, steps_of, sms)
        tail = total if total < sms else total % sms
        tail_steps = [steps_of(i) for i in range(tail)]
        if tail == 0 or sms // tail < 2 or max(tail_steps) < 2:
            assert plan is None
            continue
        _check_cover(plan, total, steps_of, sms)


def test_plan_pieces_at_the_sweep_points():
    """d64 at 32 x 512 x 32, 16 x 1k, 8 x 2k: 4096 items, 4 over 31 waves of 132 (the first
    four), each cut into min(n, 33) pieces of its n = 4 / 8 / 16 steps."""
    for n in (4, 8, 16):
        plan = wave_split.plan(4096, lambda i, n=n: n, 132)
        assert plan.first_main == 4 and plan.main_ctas == 4092 and len(plan.pieces) == 4 * n
        assert {b - a for _, a, b, _ in plan.pieces} == {1}
    assert wave_split.plan(132 * 31, lambda i: 16, 132) is None  # whole waves
    assert wave_split.plan(4092 + 70, lambda i: 16, 132) is None  # 70 left: one piece each
    assert wave_split.plan(4096, lambda i: 1, 132) is None  # one step: nothing to cut
    assert wave_split.plan(4096, lambda i: 8, 132, min_steps=16) is None  # the host's threshold
    assert wave_split.plan(4096, lambda i: 16, 132, min_steps=16).slots == 4
    with pytest.raises(ValueError, match="sms"):
        wave_split.plan(10, lambda i: 4, 0)
