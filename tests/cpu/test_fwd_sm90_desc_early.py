"""FC_DESC_EARLY (flash_fwd_sm90.cu's attend_key_tile; an A/B knob through
FLASHCUDA_SM90_FWD_DEFINES, session 25, not yet run on a GPU): with ping-pong, a step's K and V
wgmma descriptors are stage 0's advanced by the stage's offset, and Q's is made once per work
tile, instead of being rebuilt from the shared-memory base after the turn's barrier.

On the CPU lane: the variant builds clean for every kind of tiles the forward dispatches, and in
the d128 kernel without a mask the steady-state step issues its first wgmma fewer instructions
after the turn's BAR.SYNC (27 in the default's SASS at d75289f, 17 with the knob; FA4's kernel:
11) — the point of the knob. The oracle tests and the timing are the GPU lane's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import FWD_DISPATCH_CASES, clean_sass


def _turn_gaps(sass: str) -> list[int]:
    """Instructions between each consumer turn's BAR.SYNC (a register-named barrier) and the
    first HGMMA after it."""
    lines = [ln for ln in sass.splitlines() if "/*" in ln and "*/" in ln and ";" in ln]
    gaps = []
    for i, ln in enumerate(lines):
        if "BAR.SYNC.DEFER_BLOCKING R" in ln:
            j = next((k for k in range(i + 1, min(i + 80, len(lines))) if "HGMMA" in lines[k]),
                     None)
            if j is not None:
                gaps.append(j - i - 1)
    return gaps


@pytest.mark.parametrize("head_dim,windowed,seqlen", FWD_DISPATCH_CASES)
def test_desc_early_builds(head_dim, windowed, seqlen, tmp_path):
    base = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    assert "FC_DESC_EARLY" not in dict(base.spec().defines)  # not a default
    clean_sass(dataclasses.replace(base, defines=(("FC_DESC_EARLY", 1),)), tmp_path)


def test_desc_early_shortens_the_turn(tmp_path):
    base = fwd_sm90.select_config(torch.bfloat16, 128, False, 16384)
    plain = _turn_gaps(clean_sass(base, tmp_path))
    early = _turn_gaps(clean_sass(dataclasses.replace(base, defines=(("FC_DESC_EARLY", 1),)),
                                  tmp_path))
    assert plain and len(early) == len(plain)
    # the steady-state step's turn (the longest gap of the default) is shorter (27 -> 17 under
    # NVRTC 13.5; how much is ptxas's scheduling, which versions may move)
    assert max(early) < max(plain), (plain, early)
