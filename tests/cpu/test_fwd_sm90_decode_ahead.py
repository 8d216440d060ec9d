"""The decode ahead in flash_fwd_sm90.cu (session 15; the default since session 17, in every kernel
since session 39, when its A/B switch FLASHCUDA_SM90_FWD_DECODE_AHEAD went): a consumer decodes
its next work tile (Schedule::block) between the issue of its last P V and the wait for it,
instead of at the top of the next work tile. Here: the decode's multiply-highs by the host's
magic numbers (fast_quo's umulhi, UIMAD.WIDE.U32 on the uniform datapath) sit under a P V in the
ping-pong kernels of dispatch's tiles, and nowhere in the other key tiles' bodies."""

from __future__ import annotations

import re

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import FWD_DISPATCH_CASES as CASES
from .sm90_compile import clean_sass


@pytest.mark.parametrize("head_dim,windowed,seqlen", CASES)
def test_the_decode_runs_under_the_last_p_v(monkeypatch, head_dim, windowed, seqlen, tmp_path):
    names = {c.name for c in fwd_sm90.configs()}
    # the ping-pong pipeline (the turns' BAR.ARV mark where the decode goes), also for the d64
    # windowed 128-row tiles, which dispatch runs without it since session 28
    monkeypatch.setenv(fwd_sm90.PINGPONG_ENV, "1")
    cfg = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    assert cfg.name in names  # precompiled
    spans = _multiply_highs_under_a_p_v(clean_sass(cfg, tmp_path))
    # one span holds the decode: three or more multiply-highs (the quotients of the plain order,
    # a quotient and its remainder sharing one; the sections' take more, on their own branch);
    # the other P Vs (the key tiles' loop bodies) hold none
    assert max(spans) >= 3 and sum(n > 0 for n in spans) == 1, spans


def _multiply_highs_under_a_p_v(sass: str) -> list[int]:
    """UIMAD.WIDE.U32 (one per magic-number quotient) between each turn's end right after a GEMM
    issue (BAR.ARV within 3 instructions of an HGMMA) and the next wait for every wgmma
    (WARPGROUP.DEPBAR.LE gsb0, 0x0)."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
    arrives = [i for i, ln in enumerate(lines)
               if "BAR.ARV" in ln and any("HGMMA" in x for x in lines[max(0, i - 3):i])]
    waits = [i for i, ln in enumerate(lines) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in ln]
    spans = [(a, min(w for w in waits if w > a)) for a in arrives if any(w > a for w in waits)]
    return [sum("UIMAD.WIDE.U32" in ln for ln in lines[a:w]) for a, w in spans]
