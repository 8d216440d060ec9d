"""FC_STEP_COUNTERS=1 (flash_bwd_sm90.cu; an A/B variant through FLASHCUDA_SM90_BWD_DEFINES,
session 17, not yet run on a GPU): the consumers walk their steps' (query head, query block)
with two counters instead of a division by the runtime number of query blocks in every step.
Here: the counters equal the division's quotient and remainder (the .cu's update, in Python),
and the variant builds clean with that one division fewer in its SASS."""

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
    base = bwd_sm90.select_config(dtype, head_dim)
    counters = dataclasses.replace(base, defines=base.defines + (("FC_STEP_COUNTERS", 1),))
    divisions = lambda cfg: len(re.findall(r"I2F\S*\.RP", clean_sass(cfg, tmp_path)))  # noqa: E731
    assert divisions(counters) == divisions(base) - 1
