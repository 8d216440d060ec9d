"""FC_DECODE_AHEAD=1 (flash_fwd_sm90.cu; an A/B variant through FLASHCUDA_SM90_FWD_DEFINES, session
15, not yet run on a GPU): a consumer decodes its next work tile (Schedule::block, four 32-bit
divisions by runtime values) between the issue of its last P V and the wait for it, instead of
at the top of the next work tile. Here: it builds clean at dispatch's tiles, is precompiled, and
the divisions sit where they are meant to."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import FWD_DISPATCH_CASES as CASES
from .sm90_compile import clean_sass

AHEAD = (("FC_DECODE_AHEAD", 1),)


@pytest.mark.parametrize("head_dim,windowed,seqlen", CASES)
def test_decode_ahead_builds_clean_with_the_decode_under_the_last_p_v(head_dim, windowed, seqlen,
                                                                     tmp_path):
    base = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    ahead = dataclasses.replace(base, defines=AHEAD)
    assert ahead in fwd_sm90.configs()  # precompiled with dispatch's tiles
    assert _divisions_under_a_p_v(clean_sass(ahead, tmp_path)) >= 3
    assert _divisions_under_a_p_v(clean_sass(base, tmp_path)) == 0  # the default decodes at the top


def _divisions_under_a_p_v(sass: str) -> int:
    """Most divisions (I2F.RP, one per 32-bit division) between a turn's end right after a GEMM
    issue (BAR.ARV within 3 instructions of an HGMMA) and the next wait for every wgmma
    (WARPGROUP.DEPBAR.LE gsb0, 0x0)."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
    arrives = [i for i, ln in enumerate(lines)
               if "BAR.ARV" in ln and any("HGMMA" in x for x in lines[max(0, i - 3):i])]
    waits = [i for i, ln in enumerate(lines) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in ln]
    spans = [(a, min(w for w in waits if w > a)) for a in arrives if any(w > a for w in waits)]
    return max((sum("I2F.RP" in ln for ln in lines[a:w]) for a, w in spans), default=0)
