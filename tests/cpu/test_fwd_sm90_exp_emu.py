"""FC_EXP_EMU (flash_fwd_sm90.cu; an A/B knob through FLASHCUDA_SM90_FWD_DEFINES, session 14,
not yet run on a GPU): k of a tile's column groups take their exp2s on the FMA pipe
(exp2_fma) instead of MUFU. Here: exp2_fma's arithmetic, repeated in numpy float32 with the
.cu's own constants, against float64 2^x; and the kernels that build with it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import clean_sass

SOURCE = Path(fwd_sm90.__file__).parents[1] / "kernels" / "attention" / "flash_fwd_sm90.cu"


def _exp2_fma_constants():
    body = SOURCE.read_text().split("float exp2_fma(float x) {", 1)[1].split("\n}", 1)[0]
    coeffs = [float(c) for c in re.findall(r"fmaf\(\w+, f, ([-0-9.e]+)f\)", body)]
    first = re.search(r"fmaf\(([-0-9.e]+)f, f, ([-0-9.e]+)f\)", body)
    assert "max.NaN.f32 %0, %0, 0fC2FE0000" in body  # clamp at -127 (0xC2FE0000), NaN kept
    assert "12582912.f" in body and "0x3f800000" in body
    return [float(first.group(1)), float(first.group(2))] + coeffs  # highest degree first


def exp2_fma(x: np.ndarray) -> np.ndarray:
    """The kernel's exp2_fma in float32 (fma as a float64 product and sum, rounded once)."""
    c = [np.float32(v) for v in _exp2_fma_constants()]
    f32 = np.float32
    x = np.where(np.isnan(x), x, np.maximum(x, f32(-127))).astype(f32)
    magic = f32(12582912.0)
    t = (x + magic).astype(f32)
    f = (x - (t - magic).astype(f32)).astype(f32)

    def fma(a, b, d):
        return (a.astype(np.float64) * b.astype(np.float64) + np.float64(d)).astype(f32)

    p = fma(np.full_like(f, c[0]), f, c[1])
    for coeff in c[2:]:
        p = fma(p, f, coeff)
    with np.errstate(over="ignore"):
        bits = ((t.view(np.int32).astype(np.int64) << 23) + 0x3F800000) & 0xFFFFFFFF
    scale = bits.astype(np.uint32).view(f32)
    with np.errstate(invalid="ignore"):
        return (p * scale).astype(f32)


def test_exp2_fma_matches_exp2():
    assert len(_exp2_fma_constants()) == 5 and _exp2_fma_constants()[-1] == 1.0  # degree 4
    x = np.concatenate([np.linspace(-125, 0.5, 400_001), -np.geomspace(1e-8, 1, 10_001)])
    x = x.astype(np.float32)
    got = exp2_fma(x).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() < 4e-6, rel.max()  # far below bf16 / fp16 rounding (2^-9, 2^-12)


def test_exp2_fma_edges():
    x = np.array([-np.inf, -1e30, -200, -127, -126.5, 0.0, np.nan], dtype=np.float32)
    got = exp2_fma(x)
    assert got[0] == 0 and got[1] == 0 and got[2] == 0 and got[3] == 0  # as ex2.approx.ftz
    assert 0 <= got[4] < 2.0 ** -125  # at most a tiny subnormal-range value, never large
    assert abs(got[5] - 1) < 4e-6
    assert np.isnan(got[6])  # a NaN score stays NaN (it reaches the row's output)


@pytest.mark.parametrize("head_dim,windowed,seqlen", [(64, False, 16384), (64, True, 1024),
                                                     (128, False, 4096), (128, True, 1024)])
def test_exp_emu_builds_and_moves_exp2s_off_mufu(head_dim, windowed, seqlen, tmp_path):
    base = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    assert "FC_EXP_EMU" not in dict(base.spec().defines)  # not a default
    mufu = lambda sass: len(re.findall(r"MUFU\.EX2", sass))  # noqa: E731
    plain = mufu(clean_sass(base, tmp_path))
    emu = mufu(clean_sass(dataclasses.replace(base, defines=(("FC_EXP_EMU", 4),)), tmp_path))
    # a quarter of the column groups' exp2s leave MUFU (the rescale's two corrections stay)
    assert emu < plain and (plain - emu) * 4 >= plain - 16
