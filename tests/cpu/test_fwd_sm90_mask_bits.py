"""FC_MASK_BITS (flash_fwd_sm90.cu; the host's default for the windowed kernels since session 18,
fwd_sm90.MASK_BITS, proven on the H200 by the forward's GPU tests under it and
tests/gpu/test_mask.py's fragment_bits test): a masked tile's scores test one bit of a per-row
mask of the lane's columns instead of two compares each (FLASHCUDA_SM90_FWD_DEFINES=
FC_MASK_BITS=0, the A/B variant). Here: the default windowed kernels build with R2P and fewer
instructions than the variant; the unwindowed kernels (ragged edges only, not measured with
it) and the 176-key A/B tile (44 columns per row: more than the mask's 32 bits) build the
compares."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import clean_sass


def _count(sass: str, op: str) -> int:
    return len(re.findall(rf"\b{re.escape(op)}\b", sass))


@pytest.mark.parametrize("head_dim,seqlen", [(64, 1024), (128, 1024), (64, 16384)])
def test_mask_bits_build_with_r2p_and_fewer_instructions(head_dim, seqlen, tmp_path):
    bits = fwd_sm90.select_config(torch.bfloat16, head_dim, True, seqlen)
    compares = dataclasses.replace(bits, defines=tuple(bits.defines) + (("FC_MASK_BITS", 0),))
    with_bits, without = clean_sass(bits, tmp_path), clean_sass(compares, tmp_path)
    assert _count(with_bits, "R2P") > 0 and _count(without, "R2P") == 0
    assert len(with_bits.splitlines()) < len(without.splitlines())


def test_unwindowed_and_wide_tiles_keep_the_compares(tmp_path):
    wide = next(c for c in fwd_sm90.configs() if c.block_n > 128)
    unwindowed = fwd_sm90.select_config(torch.bfloat16, 128, False, 4096)
    for cfg in (wide, unwindowed):
        assert _count(clean_sass(cfg, tmp_path), "R2P") == 0, cfg.name
