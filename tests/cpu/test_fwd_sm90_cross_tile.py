"""FLASHCUDA_SM90_FWD_DEFINES=FC_CROSS_TILE=1 (flash_fwd_sm90.cu; an A/B variant, session 16, first
run on the H200 in session 17: no gain over the default boundary): a consumer warpgroup issues
the next work tile's first S with the current one's last P V. It needs the second Q buffer, so
the host builds it only where two fit and turns decode_ahead off beside it (the loop decodes
ahead on its own); configs() lists it with the rest of the default boundary."""

from __future__ import annotations

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import FWD_DISPATCH_CASES as CASES


@pytest.mark.parametrize("head_dim,windowed,seqlen", CASES)
def test_cross_tile_only_with_two_q_buffers(monkeypatch, head_dim, windowed, seqlen):
    monkeypatch.setenv(fwd_sm90.DEFINES_ENV, "FC_CROSS_TILE=1,FC_DECODE_AHEAD=1")
    cfg = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    defines = dict(cfg.defines)
    if cfg.q_stages == 2:  # (decode_ahead off, FC_DECODE_AHEAD dropped: it decodes ahead)
        assert defines == {"FC_CROSS_TILE": 1} and not cfg.decode_ahead
    else:  # d128's masked-V kernels: no room for the second Q tile, so the default boundary
        assert (head_dim, windowed) == (128, True)
        assert defines == {"FC_DECODE_AHEAD": 1} and cfg.decode_ahead
    monkeypatch.setenv(fwd_sm90.Q_STAGES_ENV, "1")
    one = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    assert "FC_CROSS_TILE" not in dict(one.defines)


def test_cross_tile_variants_precompiled():
    cross = [c for c in fwd_sm90.configs() if ("FC_CROSS_TILE", 1) in c.defines]
    assert cross and all(c.q_stages == 2 and c.fast_div and not c.decode_ahead for c in cross)
    # every dispatched tile shape but d128's masked-V one, both dtypes, plain and snake order
    shapes = {(c.head_dim, c.block_m, c.masked_v) for c in cross}
    assert shapes == {(64, 192, False), (64, 128, False), (64, 128, True), (64, 192, True),
                      (128, 128, False)}
