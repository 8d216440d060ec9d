"""The sm90 backward's schedule (flashcuda/ops/bwd_schedule.py): the query blocks a key block's
CTA walks (KeyBlockSteps::n_m of mask.cuh, against the visibility rule itself), MAIN's orders
and the last-wave split (every step of every tail item in exactly one piece)."""

from __future__ import annotations

import numpy as np
import pytest

from flashcuda.ops import bwd_schedule
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
            assert bwd_schedule.query_blocks(sq, sk, wl, wr, block_m, 128, key_block) == \
                _brute_query_blocks(sq, sk, wl, wr, block_m, 128, key_block)


def _check_cover(plan, items, steps_of, sms):
    total = len(items)
    tail = total if total < sms else total % sms
    assert plan.slots == tail and plan.total == total
    assert plan.main == tuple(items[tail:]) and len(plan.main) % sms == 0  # whole waves
    assert len(plan.pieces) <= sms  # all pieces on the SMs at once
    for slot, item in enumerate(items[:tail]):
        runs = [(a, b) for i, a, b, s in plan.pieces if s == slot]
        assert {i for i, _, _, s in plan.pieces if s == slot} == {item}
        assert runs[0][0] == 0 and runs[-1][1] == steps_of(item)
        assert all(b > a for a, b in runs) or steps_of(item) == 0  # no empty piece
        assert all(runs[k][1] == runs[k + 1][0] for k in range(len(runs) - 1))


@pytest.mark.parametrize("total,sms", [(4096, 132), (4100, 132), (16, 132), (133, 132),
                                       (2048 + 66, 132), (7, 3), (40, 7)])
def test_split_covers_each_tail_item_once(total, sms):
    for items in (list(range(total)), list(range(total))[::-1]):
        for steps_of in (lambda i: 16, lambda i: 1 + i % 16, lambda i: 3 * (i % 5)):
            plan = bwd_schedule.split_last_wave(items, steps_of, sms)
            tail = total if total < sms else total % sms
            tail_steps = [steps_of(i) for i in items[:tail]]
            if tail == 0 or sms // tail < 2 or max(tail_steps) < 2:
                assert plan is None
                continue
            _check_cover(plan, items, steps_of, sms)


def test_split_at_the_sweep_points():
    """d64 at 32 x 512 x 32, 16 x 1k, 8 x 2k: 4096 items, 4 beside 31 waves of 132 (the first
    four of the order), each cut into min(n, 33) pieces of its n = 4 / 8 / 16 steps."""
    items = list(range(4096))
    for n in (4, 8, 16):
        plan = bwd_schedule.split_last_wave(items, lambda i, n=n: n, 132)
        assert plan.slots == 4 and len(plan.main) == 4092 and len(plan.pieces) == 4 * n
        assert {b - a for _, a, b, _ in plan.pieces} == {1}
    assert bwd_schedule.split_last_wave(items[:132 * 31], lambda i: 16, 132) is None
    assert bwd_schedule.split_last_wave(list(range(4092 + 70)), lambda i: 16, 132) is None
    assert bwd_schedule.split_last_wave(items, lambda i: 1, 132) is None  # nothing to cut
    with pytest.raises(ValueError, match="sms"):
        bwd_schedule.split_last_wave(items[:10], lambda i: 4, 0)


@pytest.mark.parametrize("blocks,pairs,tail", [(16, 256, 8), (4, 1024, 8), (6, 3, 8), (5, 7, 2)])
def test_order_lpt_runs_the_tail_longest_first(blocks, pairs, tail):
    """lpt: a permutation of the items; the pairs before the tail in grid order; the tail's
    items key block by key block (block 0 of each of its pairs first), pairs in order within a
    key block — block_order.cuh's FC_LPT_TAIL order. plain (and lpt without a causal mask): the
    grid's order."""
    total = blocks * pairs
    got = bwd_schedule.order(total, blocks, "lpt", tail, causal=True)
    assert sorted(got) == list(range(total))
    first = (pairs - min(tail, pairs)) * blocks
    assert got[:first] == list(range(first))
    keys = [(i % blocks, i // blocks) for i in got[first:]]
    assert keys == sorted(keys)
    for kind, causal in (("plain", True), ("lpt", False)):
        assert bwd_schedule.order(total, blocks, kind, tail, causal) == list(range(total))
    assert [bwd_schedule.item_coords(i, blocks, 3) for i in (0, blocks, 3 * blocks + 2)] == [
        (0, 0, 0), (0, 1, 0), (2, 0, 1)]
    with pytest.raises(ValueError, match="kind"):
        bwd_schedule.order(total, blocks, "random", tail, True)
