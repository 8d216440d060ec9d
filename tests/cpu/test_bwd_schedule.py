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


def _check(sched, total, items, steps_of, sms):
    """The schedule's CTAs run every item once, MAIN in whole waves; each split item's pieces
    cover its steps in order, none empty, all on the SMs at once."""
    r = total if total < sms else total % sms
    assert sched.total == total and sched.slots == r and len(sched.pieces) <= sms
    first = sched.table_first
    assert first <= max(0, total - sms)  # the exits start at least a wave before the end
    assert sched.entries[:r] == (-1,) * r and -1 not in sched.entries[r:]
    split = items[first:first + r]
    assert sorted(list(range(first)) + list(sched.entries[r:]) + split) == list(range(total))
    assert sched.main_items == total - r and sched.main_items % sms == 0  # whole waves
    for slot, item in enumerate(split):
        runs = [(a, b) for i, a, b, s in sched.pieces if s == slot]
        assert {i for i, _, _, s in sched.pieces if s == slot} == {item}
        assert runs[0][0] == 0 and runs[-1][1] == steps_of(item)
        assert all(b > a for a, b in runs) or steps_of(item) == 0  # (one empty piece: zeros)
        assert all(runs[k][1] == runs[k + 1][0] for k in range(len(runs) - 1))


@pytest.mark.parametrize("total,sms", [(4096, 132), (4100, 132), (16, 132), (133, 132),
                                       (2048 + 66, 132), (7, 3), (40, 7)])
def test_split_covers_each_item_once(total, sms):
    blocks = 4 if total % 4 == 0 else 1
    for kind in ("plain", "lpt"):
        items = bwd_schedule.order(total, blocks, kind, 8, causal=True)
        for steps_of in (lambda i: 16, lambda i: 1 + i % 16, lambda i: 3 * (i % 5)):
            sched = bwd_schedule.plan(total, blocks, kind, 8, True, steps_of, sms)
            r = total if total < sms else total % sms
            start = min(next((j for j, i in enumerate(items) if i != j), total),
                        max(0, total - sms))
            if r == 0 or sms // r < 2 or max(steps_of(i) for i in items[start:start + r]) < 2:
                assert sched is None or not sched.pieces
                continue
            _check(sched, total, items, steps_of, sms)


def test_split_at_the_sweep_points():
    """d64 at 32 x 512 x 32, 16 x 1k, 8 x 2k: 4096 items, 4 beside 31 waves of 132: the table's
    region is the last wave (from CTA 3964), its first four CTAs exit and their items run as
    min(n, 33) pieces of their n = 4 / 8 / 16 steps."""
    for n in (4, 8, 16):
        sched = bwd_schedule.plan(4096, 16, "plain", 8, False, lambda i, n=n: n, 132)
        assert sched.table_first == 4096 - 132 and sched.slots == 4
        assert sched.entries == (-1,) * 4 + tuple(range(3968, 4096))
        assert len(sched.pieces) == 4 * n and {b - a for _, a, b, _ in sched.pieces} == {1}
        assert [p[0] for p in sched.pieces[::n]] == [3964, 3965, 3966, 3967]
    assert bwd_schedule.plan(132 * 31, 16, "plain", 8, False, lambda i: 16, 132) is None
    assert bwd_schedule.plan(4092 + 70, 2, "plain", 8, False, lambda i: 16, 132) is None
    assert bwd_schedule.plan(4096, 16, "plain", 8, False, lambda i: 1, 132) is None
    assert bwd_schedule.plan(4096, 16, "plain", 8, False, lambda i: 16) is None  # no split
    lpt = bwd_schedule.plan(4096, 16, "lpt", 8, True, lambda i: 16 - i % 16)  # causal, no split
    assert lpt.table_first == 4096 - 8 * 16 + 1 and not lpt.pieces  # (its first item stays)
    assert list(lpt.entries) == bwd_schedule.order(4096, 16, "lpt", 8, True)[lpt.table_first:]
    with pytest.raises(ValueError, match="sms"):
        bwd_schedule.plan(10, 1, "plain", 8, False, lambda i: 4, 0)


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
