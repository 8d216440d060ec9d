"""FC_EXP_SPLIT (flash_fwd_sm90.cu's Consumer::softmax / softmax_tail; an A/B knob through
FLASHCUDA_SM90_FWD_DEFINES, session 12, not yet run on a GPU): the exp2s of a tile's column
groups from k on move after the previous P V's wait, where they can hide the rescale and the
packing (FlashAttention 4's Hopper forward schedules them so).

On the CPU lane: the variant builds clean for every head dim and tile the forward dispatches, and
at d128 its SASS has the placement the knob is for — in the steady-state loop (S wait ... P V
wait) every MUFU.EX2 of the unsplit kernel comes before the P V wait, while with k = 6 the later
groups' come after it, the earlier ones' before. The oracle tests and the timing are the GPU lane's.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import clean_sass


def _loop_exp2s(sass: str) -> tuple[int, int]:
    """(MUFU.EX2 between the loop's S wait and its P V wait, MUFU.EX2 after that P V wait and
    before the next HGMMA): the loop is the part after the first `DEPBAR.LE gsb0, 0x1` (the S
    wait of a step with a P V in flight; the first key tile waits with 0x0)."""
    body = sass[sass.index("WARPGROUP.DEPBAR.LE gsb0, 0x1"):]
    wait = body.index("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    after = body[wait:]
    nxt = after.find("HGMMA")
    return body[:wait].count("MUFU.EX2"), after[:nxt if nxt > 0 else None].count("MUFU.EX2")


@pytest.mark.parametrize("block_n", [176, 128])
def test_exp_split_moves_exp2s_after_the_pv_wait_at_d128(block_n, tmp_path):
    split = fwd_sm90._config(torch.bfloat16, 128, 128, block_n)
    assert 128 in fwd_sm90.SOFTMAX_IN_ARMS and fwd_sm90.EXP_SPLIT[128] == 6  # d128's default
    assert dict(split.spec().defines)["FC_EXP_SPLIT"] == "6"
    base = dataclasses.replace(split, defines=(("FC_EXP_SPLIT", 0),))  # every exp2 before the wait
    assert base.name == split.name + "_fc_exp_split0"
    before_d, after_d = _loop_exp2s(clean_sass(base, tmp_path))
    before_s, after_s = _loop_exp2s(clean_sass(split, tmp_path))
    per_thread = 4 * (block_n // 8)  # exp2s of one tile per thread (two rows, 2 per group)
    assert after_d == 0 and before_d >= per_thread
    # the later groups' exp2s follow the wait (ptxas may keep a few of them before it)
    assert after_s >= per_thread // 4
    assert before_s < before_d


@pytest.mark.parametrize("block_m", [192, 128])
def test_exp_split_builds_clean_at_d64(block_m, tmp_path):
    """d64 keeps the softmax out of the mask arms, so ptxas already waits for the P V before the
    exp2s there (perf-notes, session 9); the knob must still build clean."""
    base = fwd_sm90._config(torch.bfloat16, 64, block_m, 128)
    assert "FC_EXP_SPLIT" not in dict(base.spec().defines)  # not d64's default (noise, session 13)
    clean_sass(dataclasses.replace(base, defines=(("FC_EXP_SPLIT", 8),)), tmp_path)


def test_exp_split_out_of_range_fails_to_compile():
    base = fwd_sm90._config(torch.bfloat16, 128, 128, 128)
    bad = dataclasses.replace(base, defines=(("FC_EXP_SPLIT", 17),))  # 16 groups at 128 keys
    from flashcuda.jit import CompileError, compile_spec

    with pytest.raises(CompileError, match=re.escape("FC_EXP_SPLIT")):
        compile_spec(bad.spec(), "sm_90a")
