"""FC_DECODE_AHEAD in flash_fwd_sm90.cu (session 15; the default since session 17,
FLASHCUDA_SM90_FWD_DECODE_AHEAD=0 the A/B variant without it): a consumer decodes its next work
tile (Schedule::block) between the issue of its last P V and the wait for it, instead of at the
top of the next work tile. Here: the switch, that it builds clean at dispatch's tiles and is
precompiled, and that the divisions sit where they are meant to (seen in the build that divides,
FLASHCUDA_SM90_FWD_FAST_DIV=0: its four 32-bit divisions are visible in the SASS as I2F.RP; the
default's multiply-highs are not told apart from other arithmetic)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import FWD_DISPATCH_CASES as CASES
from .sm90_compile import clean_sass


@pytest.mark.parametrize("head_dim,windowed,seqlen", CASES)
def test_decode_ahead_switch(monkeypatch, head_dim, windowed, seqlen):
    monkeypatch.delenv(fwd_sm90.DECODE_AHEAD_ENV, raising=False)
    names = {c.name for c in fwd_sm90.configs()}  # (configs() follows the env: unset here)
    ahead = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    assert ahead.decode_ahead and dict(ahead.spec().defines)["FC_DECODE_AHEAD"] == "1"
    monkeypatch.setenv(fwd_sm90.DECODE_AHEAD_ENV, "0")
    after = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    assert after == dataclasses.replace(ahead, decode_ahead=False)
    assert "FC_DECODE_AHEAD" not in dict(after.spec().defines)
    assert {ahead.name, after.name} <= names
    monkeypatch.setenv(fwd_sm90.DECODE_AHEAD_ENV, "yes")
    with pytest.raises(ValueError, match=fwd_sm90.DECODE_AHEAD_ENV):
        fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)


@pytest.mark.parametrize("head_dim,windowed,seqlen", CASES)
def test_decode_ahead_builds_clean_with_the_decode_under_the_last_p_v(monkeypatch, head_dim,
                                                                     windowed, seqlen, tmp_path):
    monkeypatch.delenv(fwd_sm90.DECODE_AHEAD_ENV, raising=False)
    names = {c.name for c in fwd_sm90.configs()}
    # the ping-pong pipeline (the turns' BAR.ARV mark where the decode goes), also for the d64
    # windowed 128-row tiles, which dispatch runs without it since session 28
    monkeypatch.setenv(fwd_sm90.PINGPONG_ENV, "1")
    monkeypatch.setenv(fwd_sm90.FAST_DIV_ENV, "0")
    ahead = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    assert ahead.decode_ahead and ahead.name in names  # precompiled (the A/B variant)
    # the kernel without the boundary's parts decodes at the top (with only decode_ahead off
    # d64's masked-V kernels spill 4 bytes; that build is never dispatched)
    for env, value in fwd_sm90.OFF_SWITCHES.items():
        monkeypatch.setenv(env, value)
    after = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    assert not (after.decode_ahead or after.fast_div) and after.name in names
    assert _divisions_under_a_p_v(clean_sass(ahead, tmp_path)) >= 3
    assert _divisions_under_a_p_v(clean_sass(after, tmp_path)) == 0


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
