"""FC_PROBS_EMU (flash_bwd_sm90.cu's probs; Sm90BwdConfig.probs_emu, the d64 default k = 2 since
session 25, bwd_sm90.PROBS_EMU): k of P^T's column blocks after the dP^T wait take their exp2s
on the FMA pipe (exp2_fma) instead of MUFU. Here: exp2_fma's arithmetic, repeated in numpy
float32 with the .cu's own constants, against float64 2^x over the arguments P^T sees; its
edges; and the kernels that build with it (clean, fewer MUFU.EX2, the right number of them
moved). The oracle tests of its kernels are the GPU lane's (test_bwd_sm90's default kernels at
d64)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from flashcuda.ops import bwd_sm90

from .sm90_compile import clean_sass

SOURCE = Path(bwd_sm90.__file__).parents[1] / "kernels" / "attention" / "flash_bwd_sm90.cu"


def _exp2_fma_body() -> str:
    return SOURCE.read_text().split("float exp2_fma(float x) {", 1)[1].split("\n}", 1)[0]


def _constants() -> list[float]:
    """The cubic's coefficients, highest degree first, as the .cu writes them."""
    body = _exp2_fma_body()
    first = re.search(r"fmaf\(([-0-9.e]+)f, f, ([-0-9.e]+)f\)", body)
    rest = [float(c) for c in re.findall(r"fmaf\(p, f, ([-0-9.e]+)f\)", body)]
    return [float(first.group(1)), float(first.group(2))] + rest


def exp2_fma(x: np.ndarray) -> np.ndarray:
    """The kernel's exp2_fma in float32 (an fma as a float64 product and sum rounded once,
    exact for float32 operands; the integer add in int32 with wrap-around)."""
    body = _exp2_fma_body()
    assert "max.NaN.f32 %0, %0, 0fC2FA0000" in body  # clamp at -125 (0xC2FA0000), NaN kept
    assert "12582912.f" in body and "<< 23" in body
    c = [np.float32(v) for v in _constants()]
    f32 = np.float32
    x = np.where(np.isnan(x), x, np.maximum(x, f32(-125))).astype(f32)
    magic = f32(12582912.0)
    t = (x + magic).astype(f32)
    f = (x - (t - magic).astype(f32)).astype(f32)

    def fma(a, b, d):
        return (a.astype(np.float64) * b.astype(np.float64) + np.float64(d)).astype(f32)

    p = fma(np.full_like(f, c[0]), f, c[1])
    for coeff in c[2:]:
        p = fma(p, f, coeff)
    with np.errstate(over="ignore"):
        bits = (p.view(np.int32).astype(np.int64) + (t.view(np.int32).astype(np.int64) << 23))
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(f32)


def test_exp2_fma_matches_exp2_where_probs_uses_it():
    assert len(_constants()) == 4  # a cubic
    # P^T's arguments: a score less its row's log-sum-exp, <= 0 up to rounding; the clamp at -125
    x = np.concatenate([np.linspace(-125, 0.5, 400_001), -np.geomspace(1e-8, 1, 10_001)])
    x = x.astype(np.float32)
    got = exp2_fma(x).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1)
    # 7.7e-5 by the fit (the comment in the .cu): under a fifth of fp16's half-ulp (2^-11), a
    # twenty-fifth of bf16's (2^-9), the roundings P^T and dS^T take next
    assert rel.max() < 8e-5, rel.max()
    assert rel.max() > 1e-6  # (the check measures the cubic, not MUFU's 2-ulp exp2)


def test_exp2_fma_edges():
    x = np.array([-np.inf, -1e30, -200, -125.5, 0.0, -0.5, 0.5, np.nan], dtype=np.float32)
    got = exp2_fma(x)
    # below the clamp: 2^-125 within the cubic's error (a normal number; P^T's masked elements
    # are zeroed after it, and an unmasked one this small rounds to 0 in fp16)
    assert np.all(np.abs(got[:4].astype(np.float64) / 2.0 ** -125 - 1) < 8e-5)
    assert abs(got[4] - 1) < 8e-5 and abs(got[5] / 2 ** -0.5 - 1) < 8e-5
    assert abs(got[6] / 2 ** 0.5 - 1) < 8e-5
    assert np.isnan(got[7])  # a NaN score stays NaN (it reaches the gradients)


def test_probs_emu_is_the_d64_default_only():
    d64, d128 = (bwd_sm90.select_config(torch.bfloat16, d) for d in (64, 128))
    assert d64.probs_emu == bwd_sm90.PROBS_EMU[64] == 2 and d128.probs_emu == 0
    assert dict(d64.spec().defines)["FC_PROBS_EMU"] == "2" and d64.name.endswith("_pe4_em2")
    assert "FC_PROBS_EMU" not in dict(d128.spec().defines)
    # only beside the P^T split: there must be blocks after the dP^T wait to move
    with pytest.raises(ValueError, match="probs_emu"):
        dataclasses.replace(d64, probs_early=None)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("k", [2, 4])
def test_probs_emu_builds_and_moves_exp2s_off_mufu(head_dim, k, tmp_path):
    base = dataclasses.replace(bwd_sm90.select_config(torch.bfloat16, head_dim), probs_emu=0)
    assert "FC_PROBS_EMU" not in dict(base.spec().defines)
    mufu = lambda sass: len(re.findall(r"MUFU\.EX2", sass))  # noqa: E731
    plain = mufu(clean_sass(base, tmp_path))
    emu = mufu(clean_sass(dataclasses.replace(base, probs_emu=k), tmp_path))
    # k column blocks of 4 elements a thread, in both of probs' forms (masked and not)
    assert plain - emu == 2 * 4 * k, (plain, emu)
