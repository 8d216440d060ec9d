"""The step counter of flash_bwd_sm90.cu's consumers (session 17; the A/B form with a division,
FC_STEP_COUNTERS=0, removed in session 39): the consumers walk their steps' query block with a
counter instead of a division by the runtime number of query blocks in every step (and since
session 39 they keep no query head: only the producer and the dQ writer address by it). Here:
counters equal the division's quotient and remainder (the update the .cu's loop makes, in
Python), and the consumers' loop of the default kernels holds no 32-bit division."""

from __future__ import annotations

import re

import pytest
import torch

from flashcuda.ops import bwd_sm90

from .sm90_compile import clean_sass
from .test_bwd_sm90_compile import _gemm_region


@pytest.mark.parametrize("n_m,group", [(1, 1), (1, 8), (3, 1), (7, 4), (33, 2)])
def test_counters_walk_the_steps_as_the_division(n_m, group):
    g = mi = 0
    for it in range(n_m * group):
        assert (g, mi) == (it // n_m, it % n_m)
        mi += 1
        if mi == n_m:
            mi, g = 0, g + 1


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_consumers_loop_holds_no_division(dtype, head_dim, tmp_path):
    sass = clean_sass(bwd_sm90.select_config(dtype, head_dim), tmp_path)
    assert re.search(r"I2F\S*\.RP", sass)  # (the producer and the dQ writer still divide)
    assert not any(re.match(r"I2F\S*\.RP", op) for op in _gemm_region(sass))
