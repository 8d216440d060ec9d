"""FC_STEP_COUNTERS (flash_bwd_sm90.cu; 1, the default since session 18, proven on the H200 by the
backward's GPU tests under it): the consumers walk their steps' (query head, query block) with
two counters instead of a division by the runtime number of query blocks in every step
(FLASHCUDA_SM90_BWD_DEFINES=FC_STEP_COUNTERS=0, the A/B variant). Here: the counters equal the
division's quotient and remainder (the .cu's update, in Python), and the default builds clean
with that one division fewer in its SASS than the variant."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashcuda.ops import bwd_sm90

from .sm90_compile import clean_sass


@pytest.mark.parametrize("n_m,group", [(1, 1), (1, 8), (3, 1), (7, 4), (33, 2)])
def test_counters_walk_the_steps_as_the_division(n_m, group):
    g = mi = 0
    for it in range(n_m * group):
        assert (g, mi) == (it // n_m, it % n_m)
        mi += 1
        if mi == n_m:
            mi, g = 0, g + 1


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_step_counters_build_clean_with_one_division_fewer(dtype, head_dim, tmp_path):
    counters = bwd_sm90.select_config(dtype, head_dim)
    division = dataclasses.replace(counters,
                                   defines=counters.defines + (("FC_STEP_COUNTERS", 0),))
    divisions = lambda cfg: len(re.findall(r"I2F\S*\.RP", clean_sass(cfg, tmp_path)))  # noqa: E731
    assert divisions(counters) == divisions(division) - 1
