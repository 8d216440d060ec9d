"""FC_LEAN_STEP (flash_fwd_sm90.cu; an A/B knob through FLASHCUDA_SM90_FWD_DEFINES, session
48; on an H100 +1% at d64 without a mask, inside the spread, perf-notes): the ring's stage /
parity arithmetic unsigned and the P V descriptors advanced by one 64-bit add, two exact
rewrites that shorten the consumers' steady key-tile loop (ncu, session 48: 436 instructions
per warp and key tile at d64 against FA4's 413).

On the CPU lane: the variant builds clean at the tiles the forward dispatches for d64 / d128
(with and without a window), and in the unwindowed kernels its steady loop, counted as
scripts/sass_loop.py counts it, runs at least 8 instructions fewer per unmasked key tile
than the default's, with its 12 HGMMA and its MUFU.EX2 count unchanged. The oracle tests and the
timing are the GPU lane's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashcuda.ops import fwd_sm90

from . import script_module
from .sm90_compile import clean_sass

LEAN = (("FC_LEAN_STEP", 1),)


def _per_step(sass: str) -> tuple[int, int, int]:
    """(instructions per unmasked key tile, HGMMA, MUFU.EX2) of the steady loop."""
    loop_mod = script_module.load("sass_loop")
    loop = loop_mod.find_loop(sass)
    body = loop.instructions
    return (loop.per_step, sum("HGMMA" in s for s in body), sum("MUFU.EX2" in s for s in body))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_lean_step_shortens_the_steady_loop(head_dim, tmp_path):
    base = fwd_sm90.select_config(torch.bfloat16, head_dim, False, 8192)
    assert "FC_LEAN_STEP" not in dict(base.spec().defines)  # not a default
    lean = dataclasses.replace(base, defines=LEAN)
    assert lean.name == base.name + "_fc_lean_step1"
    steps, hgmma, exp2 = _per_step(clean_sass(base, tmp_path))
    lean_steps, lean_hgmma, lean_exp2 = _per_step(clean_sass(lean, tmp_path))
    assert (lean_hgmma, lean_exp2) == (hgmma, exp2)
    assert lean_steps <= steps - 8, (steps, lean_steps)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen", [1024, 16384])
def test_lean_step_builds_clean_with_a_window(head_dim, seqlen, tmp_path):
    base = fwd_sm90.select_config(torch.bfloat16, head_dim, True, seqlen)
    clean_sass(dataclasses.replace(base, defines=LEAN), tmp_path)
