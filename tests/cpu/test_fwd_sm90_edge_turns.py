"""FC_EDGE_TURNS=0 (flash_fwd_sm90.cu; an A/B knob through FLASHCUDA_SM90_FWD_DEFINES, session 12,
not yet run on a GPU): a work tile's first S and its last P V issued without a ping-pong turn
(FlashAttention 4's Hopper forward). Both consumer warpgroups of a work tile skip the same two
turns, so the protocol's counts stay matched (test_fwd_sm90_compile.py's model check holds for
any equal number of turns per warpgroup).

On the CPU lane: the variant builds clean at every dispatched tile, and its SASS has exactly two
fewer named-barrier syncs and arrivals than the default kernel's (the first tile's and the
drain's turn; the loop's stay)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import clean_sass


@pytest.mark.parametrize("head_dim,block_m,block_n,windowed",
                         [(128, 128, 176, False), (128, 128, 128, True), (64, 192, 128, False),
                          (64, 128, 128, True)])
def test_edge_turns_off_drops_the_two_edge_turns(head_dim, block_m, block_n, windowed, tmp_path):
    base = fwd_sm90._config(torch.bfloat16, head_dim, block_m, block_n, windowed=windowed)
    assert base.pingpong
    var = dataclasses.replace(base, defines=(("FC_EDGE_TURNS", 0),))
    counts = []
    for cfg in (base, var):
        sass = clean_sass(cfg, tmp_path)
        counts.append((len(re.findall(r"\bBAR\.SYNC", sass)), len(re.findall(r"\bBAR\.ARV", sass))))
    (sync_d, arv_d), (sync_v, arv_v) = counts
    assert (sync_v, arv_v) == (sync_d - 2, arv_d - 2)
