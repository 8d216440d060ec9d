"""FC_O_QUAD=1 (flash_fwd_sm90.cu; an A/B knob through FLASHCUDA_SM90_FWD_DEFINES, session 13,
not yet run on a GPU): the forward's O epilogue in 16-byte stores after a transpose within each
quad (store_row_v4, common/sm90.cuh), as the backward's dK / dV epilogue (FC_DKV_QUAD)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import clean_sass


@pytest.mark.parametrize("head_dim,windowed", [(64, False), (128, False), (128, True)])
def test_o_quad_stores_o_in_16_byte_chunks(head_dim, windowed, tmp_path):
    base = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, 4096)
    quad = dataclasses.replace(base, defines=(("FC_O_QUAD", 1),))
    assert quad.name == base.name + "_fc_o_quad1"
    plain, vec = clean_sass(base, tmp_path), clean_sass(quad, tmp_path)
    # per lane and work tile: 2 rows x head_dim / 8 pairs in 4-byte stores, or 2 rows x
    # head_dim / 32 chunks in 16-byte ones; lse's two 4-byte stores stay in both
    assert len(re.findall(r"STG\.E\.128 ", plain)) == 0
    assert len(re.findall(r"STG\.E\.128 ", vec)) == 2 * head_dim // 32
    assert len(re.findall(r"STG\.E ", plain)) == 2 * head_dim // 8 + 2
    assert len(re.findall(r"STG\.E ", vec)) == 2
