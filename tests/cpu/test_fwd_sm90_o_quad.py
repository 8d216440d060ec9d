"""FC_O_QUAD (flash_fwd_sm90.cu): the forward's O epilogue in 16-byte stores after a transpose
within each quad (store_row_v4, common/sm90.cuh), as the backward's dK / dV epilogue
(FC_DKV_QUAD). On by default at d128 and for d64's 192-row tiles (fwd_sm90.O_QUAD, measured on
the H200 in session 14); FLASHCUDA_SM90_FWD_DEFINES=FC_O_QUAD=0 / 1 overrides it (A/B). Since
session 17 O goes out by a TMA store by default (FC_O_TMA); these stores are the A/B variant's
(FLASHCUDA_SM90_FWD_O_TMA=0)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import clean_sass


def test_o_quad_defaults_follow_the_measurement():
    for head_dim, windowed, seqlen, quad in ((128, False, 4096, True), (128, True, 1024, True),
                                             (64, False, 4096, True),  # 192-row tiles
                                             (64, True, 1024, False)):  # 128-row tiles
        cfg = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
        assert (cfg.block_m == 192) == (head_dim == 64 and not windowed)
        assert ("FC_O_QUAD" in dict(cfg.spec().defines)) == quad, cfg.name


@pytest.mark.parametrize("head_dim,windowed", [(64, False), (64, True), (128, False), (128, True)])
def test_o_quad_stores_o_in_16_byte_chunks(head_dim, windowed, tmp_path):
    default = dataclasses.replace(fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, 4096),
                                  o_tma=False)
    plain = dataclasses.replace(default, defines=(("FC_O_QUAD", 0),))
    quad = dataclasses.replace(default, defines=(("FC_O_QUAD", 1),))
    assert quad.name == default.name + "_fc_o_quad1"
    plain_sass, vec = clean_sass(plain, tmp_path), clean_sass(quad, tmp_path)
    # per lane and work tile: 2 rows x head_dim / 8 pairs in 4-byte stores, or 2 rows x
    # head_dim / 32 chunks in 16-byte ones; lse's two 4-byte stores stay in both
    assert len(re.findall(r"STG\.E\.128 ", plain_sass)) == 0
    assert len(re.findall(r"STG\.E\.128 ", vec)) == 2 * head_dim // 32
    assert len(re.findall(r"STG\.E ", plain_sass)) == 2 * head_dim // 8 + 2
    assert len(re.findall(r"STG\.E ", vec)) == 2
    # the default build is the measured one: quad stores exactly where O_QUAD says
    quad_default = default.block_m in fwd_sm90.O_QUAD.get(head_dim, ())
    assert (len(re.findall(r"STG\.E\.128 ", clean_sass(default, tmp_path)))
            == (2 * head_dim // 32 if quad_default else 0))
